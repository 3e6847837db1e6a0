"""The certified reference of an FP8 problem, from the dequantised true inputs.

Attention of the true inputs of one (batch, kv head) group is dense attention of the stored
values with the scale s dq dk, its output times dv (`fa_verify.fp8`):
    softmax(s (q dq)(k dk)^T) (v dv) = dv softmax((s dq dk) q k^T) v.
The stored values are exact in fp16, so each group is a dense problem the dense oracle answers
with its rigorous bound. What remains is bounded here:
* the group's scale is fl(fl(scale dq) dk) in float64, within gamma_n (n = 2 roundings, 3 when
  1/sqrt(D) is itself rounded) of s dq dk: every logit t_ij moves by at most
  delta_i = gamma_n max_j |t_ij|, so each probability by a factor within e^{+-2 delta_i}, the
  output by at most expm1(2 delta_i) times the row scale and the LSE by delta_i;
* the product out x dv, one float64 rounding (u |out|).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.oracle import reference
from fa_verify.oracle.bounds import U64, gamma
from fa_verify.oracle.result import Reference
from fa_verify.problem import AttentionProblem

#: Slack on the float64 arithmetic of the bound (|t|'s maximum, the exponentials).
_SLACK = 1 + 1e-9


@dataclass(frozen=True, eq=False)
class Group:
    """One (batch, kv head) of an FP8 problem as a dense problem of its stored values."""

    b: int
    kv_head: int
    #: query heads kv_head * G .. (kv_head + 1) * G - 1 of batch b
    heads: slice
    #: q [1, G, Nq, D], k, v [1, 1, Nk, D] stored values (fp16, exact), scale fl(fl(s dq) dk)
    dense: AttentionProblem
    #: v's descale of the group
    v_descale: float
    #: bound on the relative error of the dense problem's scale against s dq dk
    scale_error: float


def groups(problem) -> list:
    """The (batch, kv head) groups of an FP8 problem, in order."""
    stored, G = problem.stored, problem.group_size
    dq, dk, dv = (problem.descale(name) for name in ("q_descale", "k_descale", "v_descale"))
    roundings = 2 if stored.scale_is_exact else 3
    found = []
    for b in range(problem.batch):
        for kh in range(problem.kv_heads):
            heads = slice(kh * G, (kh + 1) * G)
            scale = stored.scale_value * dq[b, kh] * dk[b, kh]
            dense = AttentionProblem(stored.q[b:b + 1, heads], stored.k[b:b + 1, kh:kh + 1],
                                     stored.v[b:b + 1, kh:kh + 1], causal=problem.causal,
                                     causal_alignment=problem.causal_alignment, scale=float(scale))
            found.append(Group(b, kh, heads, dense, float(dv[b, kh]), float(gamma(roundings, U64))))
    return found


def max_abs_scores(dense: AttentionProblem) -> np.ndarray:
    """max_j |t_ij| over the keys row i attends, float64 [G, Nq] (0 for rows that see none),
    with slack for its own float64 roundings."""
    t = np.abs(dense.scale_value * (dense.q64()[0] @ dense.kv64()[0][0].swapaxes(-1, -2)))
    return np.where(dense.mask, t, 0.0).max(axis=-1, initial=0.0) * (1 + 1e-12)


def reference_fp8(problem, method: str = "certified", digits: int = 50) -> Reference:
    """The reference out and LSE of an FP8 problem with rigorous bounds (`Reference`'s guarantee,
    against attention of the true inputs in real arithmetic); `method` as `oracle.reference`'s."""
    shape, lse_shape = problem.out_shape, problem.lse_shape
    out, out_bound, row_scale = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    lse, lse_bound = np.zeros(lse_shape), np.zeros(lse_shape)
    mpmath_rows = gemm_rows = 0
    for g in groups(problem):
        ref = reference(g.dense, method, digits)
        delta = (g.scale_error * max_abs_scores(g.dense) * _SLACK)[None]
        index = (g.b, g.heads)
        out[index] = ref.out[0] * g.v_descale
        row_scale[index] = ref.row_scale[0] * g.v_descale
        moved = np.expm1(2 * delta)[..., None] * ref.row_scale * _SLACK
        out_bound[index] = ((ref.out_bound + moved)[0] * g.v_descale + U64 * np.abs(out[index])) * _SLACK
        lse[index] = ref.lse[0]
        lse_bound[index] = np.where(np.isfinite(ref.lse), ref.lse_bound + delta, 0.0)[0]
        mpmath_rows += ref.mpmath_rows
        gemm_rows += ref.gemm_rows
    return Reference(out=out, lse=lse, out_bound=out_bound, lse_bound=lse_bound, row_scale=row_scale,
                     method=method, mpmath_rows=mpmath_rows, gemm_rows=gemm_rows)
