"""What to draw for a property on a target: the problems it is meaningful on and the target runs.

A target's dtypes, head dims and causal alignments are probed once through `supports` (and one
tiny run says whether it returns an LSE); the strategy then draws only such problems, so that
a kernel with a few instantiated head dims is not drowned in rejected examples.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from hypothesis import strategies as st

from fa_verify import strategies as fst
from fa_verify.backends import Backend
from fa_verify.errors import BackendOutputError, FaVerifyError, KernelRunError
from fa_verify.problem import CAUSAL_ALIGNMENTS, AttentionProblem
from fa_verify.properties.registry import Property
from fa_verify.properties.selection import Selection

#: Edge cases run before the random search by the properties that ask for them, so that the
#: classes of bug they expose are always looked for: (B, H, Hkv, Nq, Nk, D) and a distribution.
EDGE_CASES = (
    ((1, 1, 1, 1, 1, 8), "normal"),               # a single query and key
    ((1, 2, 1, 5, 2, 16), "normal"),              # Nq > Nk: fully masked rows under bottom-right
    ((1, 2, 2, 3, 17, 16), "normal"),             # Nq < Nk
    ((2, 4, 2, 65, 63, 32), "fa3_outliers"),      # tile +- 1, GQA, outliers
    ((1, 3, 1, 13, 31, 96), "large_logits"),      # primes, MQA, D = 96, logits in the hundreds
    # 128 - 1 queries, 128 + 1 keys: the row max rises by 89 logits (beyond exp's fp32 range)
    # at key 64 and again at key 128, alone in the last tile of 64 or 128 keys
    ((1, 2, 1, 127, 129, 16), "normal+rise(step=89.0,every=64,start=64,count=2)"),
)
#: Head dims probed for support (a backend that runs all of them runs any D).
_PROBED_HEAD_DIMS = range(1, 257)


@dataclass(frozen=True)
class Capabilities:
    """What a target runs, probed through `supports` (and one tiny run for the LSE)."""

    name: str
    dtypes: tuple
    #: None: any head dim
    head_dims: tuple | None
    alignments: tuple
    returns_lse: bool


_CAPABILITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tiny(dtype, d=8, nq=2, nk=2, **kwargs) -> AttentionProblem:
    return fst.make_problem("normal", (1, 1, 1, nq, nk, d), dtype, 0, **kwargs)


def capabilities(backend: Backend) -> Capabilities:
    """Probe (once per backend object) the dtypes, head dims and alignments it supports."""
    if backend in _CAPABILITIES:
        return _CAPABILITIES[backend]
    dtype = backend.dtypes[0]
    dims = tuple(d for d in _PROBED_HEAD_DIMS if backend.supports(_tiny(dtype, d, 1, 1)) is None)
    d = dims[0] if dims else 8
    alignments = tuple(a for a in CAUSAL_ALIGNMENTS
                       if backend.supports(_tiny(dtype, d, 2, 3, causal=True, causal_alignment=a)) is None)
    try:
        returns_lse = backend.run(_tiny(dtype, d))[1] is not None
    except (BackendOutputError, KernelRunError):
        returns_lse = True  # a broken target: the examples will show how
    except FaVerifyError:
        raise  # setup or misuse
    except (Exception, SystemExit):  # noqa: BLE001 - whatever the target itself raises, the examples report
        returns_lse = True
    caps = Capabilities(name=backend.name, dtypes=tuple(backend.dtypes),
                        head_dims=None if len(dims) == len(_PROBED_HEAD_DIMS) else dims,
                        alignments=alignments, returns_lse=returns_lse)
    _CAPABILITIES[backend] = caps
    return caps


def _causal_modes(prop: Property, selection: Selection) -> tuple:
    wanted = {"any": (False, True), "causal": (True,), "non-causal": (False,)}[prop.masking]
    return tuple(c for c in selection.causal if c in wanted)


def edge_problems(prop: Property, backend: Backend, selection: Selection) -> list[AttentionProblem]:
    """The edge cases for the selected dtypes and causal modes that the target runs."""
    if not prop.edge_cases:
        return []
    causal = _causal_modes(prop, selection)
    modes = ([(False, "bottom-right")] * (False in causal)
             + [(True, a) for a in CAUSAL_ALIGNMENTS] * (True in causal))
    problems = [fst.make_problem(dist, shape, dtype, seed=0, causal=c, causal_alignment=a)
                for shape, dist in EDGE_CASES for dtype in selection.dtypes for c, a in modes]
    return [p for p in problems if backend.supports(p) is None]


def _large_shapes(head_dims):
    dims = [d for d in (head_dims or (16, 32, 64)) if 16 <= d <= 64] or [min(head_dims)]
    return st.builds(fst.Shape, batch=st.integers(1, 2), heads=st.just(4), kv_heads=st.sampled_from([1, 2, 4]),
                     nq=st.integers(32, 96), nk=st.integers(8, 96), head_dim=st.sampled_from(dims))


def problem_strategy(prop: Property, caps: Capabilities, selection: Selection):
    """Problems for `prop` that the target runs, or a reason string when there are none."""
    dtypes = [d for d in selection.dtypes if d in caps.dtypes]
    causal = _causal_modes(prop, selection)
    alignments = caps.alignments if True in causal else ()
    if not dtypes:
        return f"none of the selected dtypes {list(selection.dtypes)} is run by {caps.name}"
    if prop.needs_lse and not caps.returns_lse:
        return f"{caps.name} returns no LSE"
    if prop.needs_bottom_right and "bottom-right" not in caps.alignments:
        return f"needs bottom-right causal problems, which {caps.name} does not run"
    if not causal or (causal == (True,) and not alignments):
        return f"needs {prop.masking} problems, which the selection (--causal) or the target excludes"
    if prop.large:
        shapes = _large_shapes(caps.head_dims)
    else:
        shapes = fst.shapes(max_seq=selection.max_seq, max_work=selection.max_work,
                            typical_seq=selection.typical_seq,
                            **({} if caps.head_dims is None
                               else dict(max_head_dim=max(caps.head_dims), head_dims=caps.head_dims)))
    return fst.problems(shapes=shapes, dtypes=fst.dtypes(dtypes),
                        causal=fst.causal_modes(non_causal=False in causal, alignments=alignments))
