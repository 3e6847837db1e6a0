"""The fast certified reference: float64 attention with a rigorous a-posteriori error bound.

Computation, per head (u = 2^-53, every problem dtype embeds exactly in float64):
    S = fl(Q K^T), A = fl(|Q| |K|^T), t = fl(S * scale), m_i = max_j t_ij,
    x = fl(t - m), p = exp(x), then [num | l | dabs] = P [V | 1 | |V|] accumulated in
    chunks of c keys (each term passes through <= c + N/c roundings instead of N),
    O = num / l, LSE = m + log(l), row scale D = dabs / l.
Bound: the computed x_ij differs from the exact t_ij - m_i by at most
    b_i = u/(1-u) max|x| + g2/(1-g2) max|t| + scale' * g_D/(1-g_D) * max_j A_ij
(x's subtraction; the product with a possibly rounded scale; the GEMM's gamma_D bound
with |Q||K|^T <= A/(1-g_D)). Then every probability has relative error
r_i <= expm1(b_i) + eps_exp e^{b_i}, and `softmax_output_coefficient` turns r into the
output bound. Exact t - m vs computed m does not matter: softmax is shift invariant.

Assumptions: IEEE binary64 round-to-nearest; a BLAS that obeys the gamma_n bound (any
order, FMA, not Strassen); numpy's exp and log within 4 ulp (EPS_EXP; 0.69 ulp measured).
Underflow of p (x < -708) and of products p*v is covered by an absolute term (tau, below
1e-300 of max|v|). Scores cannot overflow: |q k| <= D * (3.4e38)^2 < 1e308.

Rows whose relative bound exceeds FALLBACK_THRESHOLD (1e-3 of fp32's unit roundoff) are
recomputed by the mpmath path, so every row of the result is far more accurate than any
fp32 kernel can be.
"""

from __future__ import annotations

import math

import numpy as np

from fa_verify.oracle import mp_path
from fa_verify.oracle.bounds import U64, gamma, softmax_output_coefficient
from fa_verify.oracle.result import Reference
from fa_verify.problem import AttentionProblem

#: numpy's exp/log: 4 ulp of float64 (relative error), a safe margin over the 0.69 ulp measured.
EPS_EXP = 2.0 ** -50
#: Rows whose bound exceeds this share of the row scale go to mpmath.
FALLBACK_THRESHOLD = 1e-3 * 2.0 ** -24
#: Slack for the rounding of the bound arithmetic itself (a few dozen float64 operations).
_BOUND_SLACK = 1 + 1e-10
#: Entries of S held at once (per array): bounds memory at ~32 MiB per N x N temporary.
_CHUNK_ENTRIES = 1 << 22
_SMALLEST_SUBNORMAL = 2.0 ** -1074


def _key_chunk(nk: int) -> int:
    """Keys per P.V partial product: about sqrt(N) minimises c + N/c."""
    return max(16, int(math.isqrt(max(nk, 1))))


def _attend(q, k, v, mask, scale: float):
    """Float64 attention of a group of heads [G, N, D] with the quantities the bound needs."""
    scores = np.matmul(q, k.swapaxes(-1, -2))
    a_max = np.matmul(np.abs(q), np.abs(k).swapaxes(-1, -2)).max(axis=-1)
    scores *= scale
    if mask is not None:
        scores[:, ~mask] = -np.inf
    m = scores.max(axis=-1)
    m = np.where(np.isfinite(m), m, 0.0)  # fully masked rows: p = exp(-inf) = 0 below
    scores -= m[..., None]
    x_min = (scores if mask is None else np.where(mask, scores, 0.0)).min(axis=-1)
    p = np.exp(scores, out=scores)

    nk, d = k.shape[1], k.shape[2]
    values = np.concatenate([v, np.ones(v.shape[:-1] + (1,)), np.abs(v)], axis=-1)
    chunk = _key_chunk(nk)
    acc = np.zeros(q.shape[:-1] + (2 * d + 1,))
    for start in range(0, nk, chunk):
        acc += np.matmul(p[..., start:start + chunk], values[:, start:start + chunk])
    rounds = chunk + -(-nk // chunk)
    return acc[..., :d], acc[..., d], acc[..., d + 1:], m, -x_min, a_max, rounds


def _bounds(problem, l, m, max_abs_x, a_max, rounds, v_max):
    """Relative output coefficient, absolute underflow term and LSE bound, per row."""
    scale_hi = problem.scale_value * (1 + (0 if problem.scale_is_exact else U64))
    g2 = gamma(2)
    max_abs_t = np.abs(m) + max_abs_x / (1 - U64)
    g_d = gamma(problem.head_dim)
    b = U64 / (1 - U64) * max_abs_x + g2 / (1 - g2) * max_abs_t + scale_hi * g_d / (1 - g_d) * a_max
    r = np.expm1(b) + EPS_EXP * np.exp(b)
    coefficient, alpha = softmax_output_coefficient(r, rounds, U64)
    # D computed from the same perturbed sums: true D <= D_hat (1+alpha) / ((1-alpha)(1-u)).
    coefficient = coefficient * (1 + alpha) / ((1 - alpha) * (1 - U64)) * _BOUND_SLACK
    with np.errstate(divide="ignore"):
        log_l = np.log(l)
        tau = (4 * (problem.nk + rounds) * _SMALLEST_SUBNORMAL
               * (1 + v_max[..., None, :]) / (l * (1 - alpha))[..., None])
    lse_bound = (-np.log1p(-alpha) + EPS_EXP * np.abs(log_l)
                 + 2 * U64 * (np.abs(m) + np.abs(log_l))) * _BOUND_SLACK
    return coefficient, tau, lse_bound


def mp_row_bounds(problem, rows, digits):
    """Bounds of mpmath rows (b, h, i) in the same form as `_bounds`'s coefficient and LSE."""
    q = problem.q64()
    k, _ = problem.kv64()
    scale = problem.scale_value
    coefficients, lse_bounds = [], []
    limits = problem.key_limit()
    for b, h, i in rows:
        n = int(limits[i])
        a = np.abs(q[b, h, i]) @ np.abs(k[b, h, :n]).T if n else np.zeros(1)
        logits = scale * (q[b, h, i] @ k[b, h, :n].T) if n else np.zeros(1)
        coefficient, alpha = mp_path.mp_bound(n, problem.head_dim, scale, a.max() * 1.01,
                                              np.abs(logits).max() * 1.01 + 1, digits)
        coefficients.append(coefficient)
        lse_bounds.append(alpha)
    return np.array(coefficients), np.array(lse_bounds)


def certified_reference(problem: AttentionProblem, digits: int = mp_path.DEFAULT_DIGITS,
                        threshold: float = FALLBACK_THRESHOLD) -> Reference:
    """Reference with rigorous bounds; rows not certified to `threshold` are redone in mpmath."""
    B, H, Nq, D = problem.out_shape
    q = problem.q64()
    k, v = problem.kv64()
    mask = problem.mask if problem.causal else None
    out = np.zeros((B, H, Nq, D))
    row_scale = np.zeros_like(out)
    lse = np.full((B, H, Nq), -np.inf)
    coefficient = np.zeros((B, H, Nq))
    tau = np.zeros_like(out)
    lse_bound = np.zeros_like(lse)

    heads_per_chunk = max(1, _CHUNK_ENTRIES // (Nq * problem.nk))
    for b in range(B):
        for h0 in range(0, H, heads_per_chunk):
            sl = (b, slice(h0, h0 + heads_per_chunk))
            num, l, dabs, m, max_abs_x, a_max, rounds = _attend(q[sl], k[sl], v[sl], mask,
                                                                problem.scale_value)
            live = l > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                out[sl] = np.where(live[..., None], num / l[..., None], 0.0)
                row_scale[sl] = np.where(live[..., None], dabs / l[..., None], 0.0)
                lse[sl] = np.where(live, m + np.log(l), -np.inf)
            c, t, lb = _bounds(problem, l, m, max_abs_x, a_max, rounds, np.abs(v[sl]).max(axis=-2))
            coefficient[sl] = np.where(live, c, 0.0)
            tau[sl] = np.where(live[..., None], t, 0.0)
            lse_bound[sl] = np.where(live, lb, 0.0)

    out_bound = coefficient[..., None] * row_scale + tau
    redo = [tuple(int(x) for x in idx) for idx in np.argwhere(~(coefficient <= threshold))]
    if redo:
        mp_coefficient, mp_lse_bound = mp_row_bounds(problem, redo, digits)
        for (b, h, i, o, l_, s), c, lb in zip(mp_path.mp_rows(problem, redo, digits),
                                             mp_coefficient, mp_lse_bound):
            out[b, h, i], lse[b, h, i], row_scale[b, h, i] = o, l_, s
            # The mpmath values reach us rounded to float64: half an ulp more.
            out_bound[b, h, i] = c * s + U64 * np.abs(o)
            lse_bound[b, h, i] = lb + U64 * abs(l_) if math.isfinite(l_) else 0.0
    return Reference(out=out, lse=lse, out_bound=out_bound, lse_bound=lse_bound,
                     row_scale=row_scale, method="certified", mpmath_rows=len(redo))
