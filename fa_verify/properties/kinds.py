"""The kinds of attention problem, and what each brings to the one search.

A kind is data: a name (`problem.kind`, what `Backend.kinds` and `Property.kinds` list), how to
make a tiny dense problem one of its own (to probe what a target runs), the strategy of its
problems for a property on a target, and its fixed edge cases. Everything else — the backend
protocol, the property registry, the search, records, reproducers, the CLI, the plugin — is
written once and asks the problem itself (`parts`, `split`, `join`, `input_arrays`,
`unsupported_by`, `part_label`: see `fa_verify.problem.AttentionProblem`). Adding a kind means
adding its problem type, its oracle and error model, its strategies, its properties and a line
here (docs/architecture.md: "Adding a kind of problem").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hypothesis import strategies as st

from fa_verify.problem import AttentionProblem
from fa_verify.backward import BackwardProblem
from fa_verify.fp8 import FP8Problem
from fa_verify.properties import draw, draw_backward, draw_fp8, draw_ragged
from fa_verify.ragged import RaggedProblem


def _no_edge_cases(prop, backend, selection):
    return [], ()


@dataclass(frozen=True)
class Kind:
    name: str
    #: the problem's type (with its validation, `saved` / `from_saved`)
    problem_type: type
    #: (dense problem with B = 1, backend) -> the same problem as this kind (None: it is one)
    as_kind: Callable | None
    #: (property, backend, selection) -> a Hypothesis strategy of problems, or why there is none
    problems: Callable
    #: (property, backend, selection) -> (fixed problems run before the search, notes)
    edge_cases: Callable = _no_edge_cases


def _dense_problems(prop, backend, selection):
    return draw.problem_strategy(prop, draw.capabilities(backend), selection)


def _ragged(layout: str) -> Kind:
    as_kind = draw_ragged.as_batch(layout)
    return Kind(layout, RaggedProblem, as_kind, draw_ragged.batch_strategy(layout, as_kind))


KINDS = {kind.name: kind for kind in (
    Kind("dense", AttentionProblem, None, _dense_problems, draw.edge_problems),
    _ragged("varlen"),
    _ragged("paged"),
    Kind("backward", BackwardProblem, draw_backward.as_backward, draw_backward.backward_strategy,
         draw_backward.edge_problems),
    Kind("fp8", FP8Problem, draw_fp8.as_fp8, draw_fp8.fp8_strategy, draw_fp8.edge_problems),
    Kind("paged-fp8", RaggedProblem, draw_fp8.as_paged_fp8, draw_fp8.paged_fp8_strategy, draw_fp8.paged_edge_problems),
)}


def _common(prop, backend) -> list:
    return [KINDS[name] for name in backend.kinds if name in prop.kinds]


def kind_reason(prop, backend) -> str | None:
    """Why `prop` is about no kind of problem `backend` runs, or None."""
    if _common(prop, backend):
        return None
    return (f"a property of {' and '.join(prop.kinds)} problems; {backend.name} runs "
            f"{' and '.join(backend.kinds)} problems")


def problem_strategy(prop, backend, selection):
    """Problems of every kind both `prop` is about and `backend` runs, or why there are none."""
    reason = kind_reason(prop, backend)
    if reason:
        return reason
    common = _common(prop, backend)
    found = [kind.problems(prop, backend, selection) for kind in common]
    strategies = [s for s in found if not isinstance(s, str)]
    return st.one_of(strategies) if strategies else found[0]


def edge_problems(prop, backend, selection) -> tuple[list, tuple]:
    """The fixed edge cases of every common kind, and their notes."""
    problems, notes = [], []
    for kind in _common(prop, backend):
        if prop.edge_cases is not True and kind.name not in (prop.edge_cases or ()):
            continue
        found, said = kind.edge_cases(prop, backend, selection)
        problems += found
        notes += said
    return problems, tuple(notes)
