"""What to draw for a property on an FP8 target: `strategies.fp8_problems` in the FP8 formats and
causal modes the target runs (probed through `supports`), and fixed edge cases where FP8 bugs
live, run first: P's offset deciding every row (one dominant key, the rest 7.3 nats below) at
128, 129 and 256 keys with GQA; values at e4m3's 448 at 257 keys; per-tensor descales.

Paged batches of FP8 sequences (an FP8 KV cache, kind "paged-fp8") likewise:
`strategies.paged_fp8_problems` in the formats, causal modes and page sizes the target runs, and
edge cases at cache lengths 127 .. 385 with per-tensor and [B, Hkv] scales (`PAGED_EDGE_CASES`).
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import FP8_DTYPES
from fa_verify.fp8 import DESCALES, FP8Problem
from fa_verify.ragged import PageLayout, RaggedProblem
from fa_verify.strategies._fp8 import HEAD_DIMS, fp8_problems, make_fp8_problem
from fa_verify.strategies._ragged import PAGED_FP8_PAGE_SIZES, make_paged_fp8_problem, paged_fp8_problems

#: (B, H, Hkv, Nq, Nk, D), make_fp8_problem's options
EDGE_CASES = (
    ((2, 4, 2, 3, 128, 16), dict(offset_gap=7.3)),
    ((1, 3, 1, 5, 129, 16), dict(offset_gap=7.3, causal=True)),
    ((1, 2, 2, 2, 256, 32), dict(offset_gap=9.0)),
    ((2, 2, 1, 7, 257, 16), dict(spread="saturating")),
    ((2, 4, 2, 9, 64, 32), dict(per_tensor=True)),
)


def as_fp8(problem, backend=None) -> FP8Problem:
    """A probe: a dense problem's values as e4m3 with descales 0.75 / 1.25 / 1.75 ([B, Hkv])."""
    shape = (problem.batch, problem.kv_heads)
    descales = {name: np.full(shape, d, np.float32) for name, d in zip(DESCALES, (0.75, 1.25, 1.75))}
    fmt = next((d for d in getattr(backend, "dtypes", ()) if d in FP8_DTYPES), "e4m3")
    return FP8Problem.from_float(*(x.astype(np.float64) for x in (problem.q, problem.k, problem.v)), fmt,
                                 causal=problem.causal, **descales)


def _formats(backend, selection) -> list:
    chosen = [d for d in selection.dtypes if d in FP8_DTYPES] or list(FP8_DTYPES)
    return [d for d in backend.dtypes if d in chosen]


def _head_dims(backend) -> tuple:
    """The head dims to draw: the target's declared ones, else `HEAD_DIMS`."""
    declared = backend.limits.head_dims
    return tuple(sorted(declared)) if declared else HEAD_DIMS


def _causal_modes(prop, backend, selection, fmt) -> list:
    wanted = {"any": (False, True), "causal": (True,), "non-causal": (False,)}[prop.masking]
    n = backend.limits.nearest_seq(2) or 2  # a probe within the declared limits
    shape = (1, 1, 1, n, n, _head_dims(backend)[0])
    return [c for c in wanted if c in selection.causal
            and backend.supports(make_fp8_problem(shape, fmt, 0, causal=c)) is None]


def fp8_strategy(prop, backend, selection):
    formats = _formats(backend, selection)
    if not formats:
        return f"{backend.name} runs none of the FP8 formats {', '.join(FP8_DTYPES)} the selection allows"
    causal = _causal_modes(prop, backend, selection, formats[0])
    if not causal:
        return f"needs {prop.masking} problems, which the selection (--causal) or {backend.name} excludes"
    return fp8_problems(tuple(formats), tuple(causal), head_dims=_head_dims(backend)).filter(
        lambda p: backend.supports(p) is None)


def edge_problems(prop, backend, selection) -> tuple[list, tuple]:
    formats = _formats(backend, selection)
    found = [make_fp8_problem(shape, formats[i % len(formats)], i, **options)
             for i, (shape, options) in enumerate(EDGE_CASES)] if formats else []
    kept = [p for p in found if backend.supports(p) is None]
    notes = (f"{len(found) - len(kept)} FP8 edge cases outside what {backend.name} runs",) if len(kept) < len(found) else ()
    return kept, notes


#: (cache lengths, Nq, (H, Hkv), make_paged_fp8_problem's options)
PAGED_EDGE_CASES = (
    ((128, 129, 1), 1, (4, 2), dict(per_tensor=True)),
    ((255, 256, 257), 2, (2, 1), dict(offset_gap=7.3)),
    ((127, 384, 3), 1, (2, 2), dict(spread="saturating", causal=True)),
    ((385, 64), 4, (4, 1), dict(spread="subnormal", per_tensor=True)),
)


def as_paged_fp8(problem, backend=None) -> RaggedProblem:
    """A probe: `as_fp8`'s problem as a one-sequence paged batch (the target's first page size)."""
    page_size = (getattr(backend, "page_sizes", None) or PAGED_FP8_PAGE_SIZES)[0]
    return RaggedProblem((as_fp8(problem, backend),), "paged", pages=PageLayout.contiguous([problem.nk], page_size))


def _page_sizes(backend) -> tuple:
    return tuple(backend.page_sizes) if backend.page_sizes else PAGED_FP8_PAGE_SIZES


def _head_dims(backend) -> tuple:
    """The declared head dims (split_kv.cu: 64, 128), else small ones."""
    return tuple(backend.limits.head_dims) if backend.limits.head_dims else (8, 16, 32)


def _fitted(problem: RaggedProblem, backend) -> RaggedProblem:
    """The batch with q_descale 1 where only that keeps it within what `backend` runs (a function
    that takes no q_descale: `ragged_callable`); else as it is."""
    if backend.supports(problem) is None:
        return problem
    unit = problem.with_scales(q_descale=np.ones(1, np.float32))
    return unit if backend.supports(unit) is None else problem


def paged_fp8_strategy(prop, backend, selection):
    formats = _formats(backend, selection)
    if not formats:
        return f"{backend.name} runs none of the FP8 formats {', '.join(FP8_DTYPES)} the selection allows"
    wanted = {"any": (False, True), "causal": (True,), "non-causal": (False,)}[prop.masking]
    probe = lambda c: _fitted(make_paged_fp8_problem((3,), 2, formats[0], 0, page_size=_page_sizes(backend)[0],  # noqa: E731
                                                     head_dim=_head_dims(backend)[0], causal=c), backend)
    causal = [c for c in wanted if c in selection.causal and backend.supports(probe(c)) is None]
    if not causal:
        return f"needs {prop.masking} problems, which the selection (--causal) or {backend.name} excludes"
    return paged_fp8_problems(tuple(formats), tuple(causal), backend.page_sizes, backend.splits,
                              head_dims=_head_dims(backend)).map(
        lambda p: _fitted(p, backend)).filter(lambda p: backend.supports(p) is None)


def paged_edge_problems(prop, backend, selection) -> tuple[list, tuple]:
    formats = _formats(backend, selection)
    found = [_fitted(make_paged_fp8_problem(lengths, nq, formats[i % len(formats)], i, heads=heads,
                                            page_size=_page_sizes(backend)[i % len(_page_sizes(backend))],
                                            head_dim=_head_dims(backend)[i % len(_head_dims(backend))], **options),
                     backend)
             for i, (lengths, nq, heads, options) in enumerate(PAGED_EDGE_CASES)] if formats else []
    kept = [p for p in found if backend.supports(p) is None]
    notes = ((f"{len(found) - len(kept)} paged FP8 edge cases outside what {backend.name} runs",)
             if len(kept) < len(found) else ())
    return kept, notes
