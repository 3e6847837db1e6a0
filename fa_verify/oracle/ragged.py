"""The reference and the error model of a ragged batch (varlen or paged KV), per sequence.

Sequence b of a `RaggedProblem` is exactly a dense problem with B = 1 (its own lengths and
diagonal offset), so its reference is `oracle.reference` of that problem and its bound
`error_model.error_bound` of it: the guarantees, the mpmath path and the convention for rows
without keys (out 0, LSE -inf, or the sink's logit) carry over unchanged. The arrays are also
given in the layout's shapes (varlen out [total_q, H, D], LSE [H, total_q]; paged out
[B, Nq, H, D], LSE [B, H, Nq]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.error_model import DEFAULT_LAMBDA, Bound, error_bound
from fa_verify.oracle import mp_path, reference
from fa_verify.oracle.result import Reference
from fa_verify.precision import PrecisionModel
from fa_verify.ragged import RaggedProblem


@dataclass(frozen=True, eq=False)
class RaggedReference:
    """Each sequence's `Reference`, and their arrays in the layout's shapes (float64)."""

    sequences: tuple
    out: np.ndarray
    lse: np.ndarray
    out_bound: np.ndarray
    lse_bound: np.ndarray


@dataclass(frozen=True, eq=False)
class RaggedBound:
    """Each sequence's error-model `Bound`, and its out / LSE bounds in the layout's shapes."""

    sequences: tuple
    out: np.ndarray
    lse: np.ndarray


def reference_ragged(problem: RaggedProblem, method: str = "certified",
                     digits: int = mp_path.DEFAULT_DIGITS) -> RaggedReference:
    """The reference output and LSE of every sequence, with rigorous bounds (`oracle.reference`)."""
    refs = tuple(reference(seq, method, digits) for seq in problem.sequences)
    out, lse = problem.join([(r.out, r.lse) for r in refs])
    out_bound, lse_bound = problem.join([(r.out_bound, r.lse_bound) for r in refs])
    return RaggedReference(refs, out, lse, out_bound, lse_bound)


def ragged_error_bound(problem: RaggedProblem, precision: PrecisionModel, ref: RaggedReference,
                       accumulation: str = "worst-case", lam: float = DEFAULT_LAMBDA) -> RaggedBound:
    """`error_model.error_bound` of every sequence (a split-KV combine's extra rescale included)."""
    bounds = tuple(error_bound(seq, precision, r, accumulation, lam)
                   for seq, r in zip(problem.sequences, ref.sequences))
    out, lse = problem.join([(b.out, b.lse) for b in bounds])
    return RaggedBound(bounds, out, lse)


__all__ = ["Bound", "RaggedBound", "RaggedReference", "Reference", "ragged_error_bound", "reference_ragged"]
