"""The reference oracle: attention of a problem with a rigorous per-element error bound.

Two paths, one contract (`Reference`):
- "certified" (default): float64 with an a-posteriori bound (free, from norms; the |Q||K|^T
  GEMM only for rows where that is too loose); rows the bound cannot certify to 1e-3 of
  fp32's unit roundoff are recomputed in mpmath;
- "mpmath": the definition, every row at `digits` decimal digits (slow: small problems).
"""

from __future__ import annotations

import numpy as np

from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle import mp_path
from fa_verify.oracle.bounds import U64
from fa_verify.oracle.certified import FALLBACK_THRESHOLD, certified_reference, mp_row_bounds
from fa_verify.oracle.result import Reference
from fa_verify.problem import AttentionProblem

METHODS = ("certified", "mpmath")

__all__ = ["FALLBACK_THRESHOLD", "METHODS", "Reference", "reference"]


def reference(problem: AttentionProblem, method: str = "certified",
              digits: int = mp_path.DEFAULT_DIGITS) -> Reference:
    """The reference output and LSE of `problem` with rigorous error bounds."""
    if not isinstance(problem, AttentionProblem):
        raise InvalidArgumentError(
            f"problem must be an AttentionProblem, got {type(problem).__name__}; build one from your arrays: "
            "AttentionProblem(q, k, v, causal=...) (arrays of the problem dtype) or AttentionProblem.from_float(q, k, "
            "v, 'fp16', ...); a varlen or paged batch: fa_verify.oracle.ragged.reference_ragged")
    if method == "certified":
        return certified_reference(problem, digits=digits)
    if method != "mpmath":
        raise InvalidArgumentError(f"method={method!r}; use one of {METHODS}")
    if not 15 <= digits <= 1000:
        raise InvalidArgumentError(f"digits={digits!r} must be between 15 and 1000")
    out, lse, row_scale = mp_path.mp_reference_arrays(problem, digits)
    B, H, Nq, _ = problem.out_shape
    rows = [(b, h, i) for b in range(B) for h in range(H) for i in range(Nq)]
    coefficient, lse_alpha = mp_row_bounds(problem, rows, digits)
    coefficient = coefficient.reshape(B, H, Nq)
    finite = np.isfinite(lse)
    lse_bound = np.where(finite, lse_alpha.reshape(B, H, Nq) + U64 * np.abs(np.where(finite, lse, 0)), 0.0)
    out_bound = coefficient[..., None] * row_scale + U64 * np.abs(out)
    return Reference(out=out, lse=lse, out_bound=out_bound, lse_bound=lse_bound,
                     row_scale=row_scale, method="mpmath", mpmath_rows=len(rows))
