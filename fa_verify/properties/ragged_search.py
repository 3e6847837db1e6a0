"""Searching for a counterexample to a ragged property on a ragged backend, with Hypothesis.

`search_ragged(backend, prop, selection)` draws ragged batches within what the backend runs (its
layout, dtypes, per-sequence `Limits`, variants, page sizes, splits; `strategies.ragged_problems`),
judges each with the property and returns a `PropertyOutcome` as `search_property` does: passed,
failed with the minimal counterexample Hypothesis shrank to (and its reproducer script), or not
applicable. A target that
raises fails the example; other fa_verify errors (setup, misuse) are raised.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import replace

from hypothesis import Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from fa_verify.backends.ragged_base import RaggedBackend
from fa_verify.errors import BackendOutputError, FaVerifyError, InvalidArgumentError, KernelRunError
from fa_verify.limits import Limits, _layout
from fa_verify.profiles import RELAXED_HEALTH_CHECKS
from fa_verify.properties._result import NOT_APPLICABLE, PASSED
from fa_verify.properties.registry import get_ragged_property
from fa_verify.properties.search import PropertyOutcome, _target_failure, _write_reproducer
from fa_verify.properties.selection import Selection
from fa_verify.ragged import PageLayout, RaggedProblem
from fa_verify.strategies import Shape, make_problem, ragged_problems
from fa_verify.strategies._variants import DEFAULT_TILE


class _Failed(Exception):
    """Raised inside Hypothesis' test for a failing example, so that it shrinks it."""


def search_ragged(backend: RaggedBackend, prop, selection: Selection = Selection(), *,
                  tile: int = DEFAULT_TILE, repro_dir=None) -> PropertyOutcome:
    """Search `prop` (a ragged Property, its name or check) on `backend`; `tile` is the key tile
    whose edges lengths and windows straddle; the selection's dtypes, causal modes, examples,
    seed, shrinking and max_seq (the longest sequence) apply. A failing example's reproducer
    is written into the folder `repro_dir` (none when None), as `search_property` does."""
    if not isinstance(backend, RaggedBackend):
        raise InvalidArgumentError(f"backend={backend!r} must be a RaggedBackend (a varlen or paged target)")
    prop = get_ragged_property(prop)
    outcome = PropertyOutcome(property=prop.name, backend=backend.name)
    if backend.judged_under.declared:
        outcome.judged_under = backend.judged_under.describe()
    reason = _not_applicable(prop, backend, selection)
    if reason:
        outcome.status, outcome.reason = NOT_APPLICABLE, reason
        return outcome
    dtypes = tuple(d for d in selection.dtypes if d in backend.dtypes)
    limits = replace(backend.limits, causal=tuple(c for c in backend.limits.causal if c in selection.causal))
    limits = _probed_head_dims(backend, limits, dtypes[0])
    if limits.head_dims == ():
        outcome.status, outcome.reason = NOT_APPLICABLE, f"{backend.name} runs no head dim from 1 to 256"
        return outcome
    strategy = ragged_problems(backend.layout, dtypes, limits,
                               backend.features, backend.page_sizes, backend.splits, tile, max_seq=selection.max_seq)
    start, reasons, ratios, notes, found = time.perf_counter(), [], [], set(), []

    def judge(problem, seed):
        reason = backend.supports(problem)
        if reason is not None:  # outside what the strategy knows of the target (its own supports())
            reasons.append(reason)
            return
        try:
            result = prop(backend, problem, seed)
        except (BackendOutputError, KernelRunError) as exc:
            result = _target_failure(prop, problem, exc)
        except FaVerifyError:
            raise  # setup or misuse
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever the target raises is a finding
            result = _target_failure(prop, problem, exc)
        if not result.applicable:
            reasons.append(result.detail)
            return
        outcome.examples += 1
        if result.worst_ratio is not None:
            ratios.append(result.worst_ratio)
        if result.note:
            notes.add(result.note)
        if result.failed:
            if outcome.examples_to_failure is None:
                outcome.examples_to_failure = outcome.examples
            found[:] = [(problem, seed, replace(result, seed=seed) if prop.seeded else result)]
            raise _Failed(result.detail)

    phases = tuple(p for p in Phase if p is not Phase.explain and (selection.shrink or p is not Phase.shrink))
    test = given(problem=strategy, seed=st.integers(0, 2 ** 16))(judge)
    test = settings(max_examples=selection.max_examples, deadline=None, database=None, phases=phases,
                    suppress_health_check=RELAXED_HEALTH_CHECKS, print_blob=False, verbosity=Verbosity.quiet)(test)
    if selection.seed is not None:
        test = hypothesis_seed(selection.seed)(test)
    try:
        test()
    except _Failed:
        outcome.status = "failed"
        outcome.problem, outcome.seed, outcome.failure = found[0]
        if repro_dir is not None:
            _write_reproducer(outcome, backend, prop, repro_dir, selection.seed)
    outcome.seconds = time.perf_counter() - start
    outcome.worst_ratio = max(ratios, default=None)
    outcome.notes = tuple(sorted(notes))
    if outcome.status == PASSED and outcome.examples == 0:
        outcome.status, outcome.reason = NOT_APPLICABLE, reasons[0] if reasons else "no example was drawn"
    return outcome


#: Head dims probed through `supports` when a target declares none (once per target).
_PROBED_HEAD_DIMS = range(1, 257)
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probed_head_dims(backend: RaggedBackend, limits: Limits, dtype: str) -> Limits:
    """`limits` with the head dims the target's `supports` accepts, probed with one tiny sequence,
    when it declares none and does not accept every one."""
    if limits.head_dims is not None:
        return limits
    probed = _PROBES.setdefault(backend, {})
    if (limits, dtype) not in probed:
        probed[limits, dtype] = _supported_head_dims(backend, limits, dtype)
    dims = probed[limits, dtype]
    return limits if len(dims) == len(_PROBED_HEAD_DIMS) else replace(limits, head_dims=dims)


def _supported_head_dims(backend: RaggedBackend, limits: Limits, dtype: str) -> tuple:
    heads, kv_heads = _layout(1, 1, limits.heads, limits.group_sizes)
    dims = []
    for d in _PROBED_HEAD_DIMS:
        seq = make_problem("normal", Shape(1, heads, kv_heads, limits.seq_lo, limits.seq_lo, d), dtype, 0,
                           causal=limits.causal[0])
        pages = PageLayout.contiguous([seq.nk], (backend.page_sizes or (1,))[0]) if backend.layout == "paged" else None
        if backend.supports(RaggedProblem((seq,), backend.layout, pages=pages)) is None:
            dims.append(d)
    return tuple(dims)


def _not_applicable(prop, backend: RaggedBackend, selection: Selection) -> str | None:
    reason = prop.target_reason(backend) if prop.target_reason else None
    if reason:
        return reason
    if not set(selection.dtypes) & set(backend.dtypes):
        return f"none of the selected dtypes {list(selection.dtypes)} is run by {backend.name}"
    if not set(selection.causal) & set(backend.limits.causal):
        return f"the selection's causal modes are not among {backend.name}'s ({backend.limits.describe_causal()})"
    return None
