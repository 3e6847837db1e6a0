"""The fast certified reference: float64 attention with a rigorous a-posteriori error bound.

Computation, per head (u = 2^-53, every problem dtype embeds exactly in float64):
    Q' = fl(scale * Q), t = fl(Q' K^T), m_i = max_j t_ij, x = fl(t - m), p = exp(x),
    then [num | l | dabs] = P [V | 1 | |V|] accumulated in chunks of c = 1024 keys (each term
    passes through <= c + N/c roundings instead of N), O = num / l, LSE = m + log(l),
    row scale D = dabs / l.
Bound: with A_i >= max_j sum_d |q_id| |k_jd| over the keys row i attends and scale_hi >= the
exact scale, the computed t_ij is within g_{D+2} scale_hi A_i of scale * q_i.k_j (the GEMM's
gamma_D, one rounding more for Q' and one for a rounded scale), so |t_ij| <= (1 + g_{D+2})
scale_hi A_i, and x's subtraction adds u (|t_ij| + |m_i|). Every computed x_ij is thus within
    b_i = u |m_i| + g_{D+3} scale_hi A_i
of the exact scaled score minus m_i (g_{D+4} where the float64 1/sqrt(D) is more than one
rounding off: `scale_roundings`). Then every probability has relative error
r_i <= expm1(b_i) + eps_exp e^{b_i}, and `softmax_output_coefficient` turns r into the
output bound. Exact t - m vs computed m does not matter: softmax is shift invariant.

Variants (fa_verify.problem): the scores become logits z = softcap tanh(t / softcap) + bias
before the max; a sink joins the max and the row sum (one more term and rounding, no value).
tanh' <= 1, so the softcap never amplifies the scores' error; it adds the quotient's rounding
(u |t|), tanh's error and the product's ((u + eps) |z|); ALiBi adds the bias product's and
the addition's roundings (u |bias| each, and u |bias| more in the max subtraction, since
|z| is no longer bounded by scale A_i); a sink adds u (|sink| + |m_i|) in its subtraction.
These per-row terms (row maxima over the attended keys) join b_i.

A_i comes in two grades. The cheap one is free: Cauchy-Schwarz, sum_d |q_d||k_d| <= |q| |k|,
from Euclidean norms computed in float64 (about 1.6x larger than A for random vectors, far
more for vectors whose large entries sit in different coordinates). Only rows whose cheap
bound misses FALLBACK_THRESHOLD get the tight one, fl(|q_i| |K|^T) / (1 - g_D): one GEMM row
each. Rows still above the threshold are recomputed by the mpmath path, so every row of the
result is far more accurate than any fp32 kernel can be.

Assumptions: IEEE binary64 round-to-nearest; a BLAS that obeys the gamma_n bound (any
order, FMA, not Strassen); numpy's exp and log within 4 ulp (EPS_EXP; 0.69 ulp measured).
Underflow of p (x < -708) and of products p*v is covered by an absolute term (tau, below
1e-300 of max|v|, per row). Scores cannot overflow: |q k| <= D * (3.4e38)^2 < 1e308.
"""

from __future__ import annotations

import functools
import math

import mpmath
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
#: Keys per P.V partial product: enough that the GEMM runs at full speed and adding the
#: partial products up costs little, few enough that each term sees <= 1024 + N/1024
#: roundings instead of N (gamma_1024 = 1.1e-13).
_PV_CHUNK = 1024


def _attend(q, k, v, mask, scale: float, variants=None):
    """Float64 attention of a group of heads (q, k [G, N, D], v [G, N, D_v]) with the quantities
    the bound needs.
    `variants`, a `_Variants` of these heads, turns the scores into the variant's logits."""
    scores = np.matmul(q * scale, k.swapaxes(-1, -2))
    extra = variants.apply(scores, mask) if variants is not None else None
    if mask is not None:
        scores[:, ~mask] = -np.inf
    m = scores.max(axis=-1)
    sinks = None if variants is None else variants.sinks
    if sinks is not None:  # the sink is one more logit of the row's max and sum (its value: none)
        m = np.maximum(m, sinks[:, None])
    m = np.where(np.isfinite(m), m, 0.0)  # fully masked rows: p = exp(-inf) = 0 below
    scores -= m[..., None]
    p = np.exp(scores, out=scores)

    nk, d = k.shape[1], v.shape[2]
    values = np.concatenate([v, np.ones(v.shape[:-1] + (1,)), np.abs(v)], axis=-1)
    chunk = _PV_CHUNK
    acc = np.matmul(p[..., :chunk], values[:, :chunk])
    for start in range(chunk, nk, chunk):
        acc += np.matmul(p[..., start:start + chunk], values[:, start:start + chunk])
    rounds = min(chunk, nk) + -(-nk // chunk)
    if sinks is not None:
        acc[..., d] += np.exp(sinks[:, None] - m)
        extra = extra + U64 * (np.abs(sinks[:, None]) + np.abs(m))  # the subtraction sink - m
        rounds += 1
    return acc[..., :d], acc[..., d], acc[..., d + 1:], m, rounds, extra


class _Variants:
    """The variants of heads `heads` of batch entry `b`: softcap, ALiBi bias and sinks applied
    to float64 scores, with the extra rounding error of every logit per row."""

    def __init__(self, problem: AttentionProblem, b: int, heads: slice):
        self.softcap = problem.softcap
        self.bias = problem.alibi_bias(b, np.arange(problem.heads)[heads][:, None], np.arange(problem.nq))
        self.sinks = None if problem.sinks is None else problem.sinks[heads].astype(np.float64)

    def apply(self, scores, mask):
        """scores -> softcap tanh(scores / softcap) + bias, in place; returns per row [G, N] a
        bound on the logits' rounding beyond the scores' own (see the module's doc)."""
        def row_max(x):
            return np.where(mask, np.abs(x), 0.0).max(axis=-1) if mask is not None else np.abs(x).max(axis=-1)

        extra = np.zeros(scores.shape[:-1])
        if self.softcap > 0:
            # t / c and c tanh: one rounding each, tanh within EPS_EXP; tanh' <= 1 carries the
            # quotient's rounding (u |t| / c) through as at most u |t|.
            extra += U64 * row_max(scores)
            scores[...] = self.softcap * np.tanh(scores / self.softcap)
            extra += (U64 + EPS_EXP) * row_max(scores)
        if self.bias is not None:
            # the bias product, the addition and its share of the max subtraction
            extra += 3 * U64 * row_max(self.bias) + U64 * row_max(scores)
            scores += self.bias
        return extra


def _norm_magnitude(q, k, limits):
    """Per row, an upper bound of max_j sum_d |q_id||k_jd| over the keys it attends, free:
    Cauchy-Schwarz on norms computed in float64 (sum of D squares and a sqrt: g_{D+1})."""
    slack = 1 - gamma(q.shape[-1] + 1)
    q_norm = np.sqrt((q * q).sum(axis=-1)) / slack
    k_norm = np.sqrt((k * k).sum(axis=-1)) / slack
    attended_max = np.maximum.accumulate(k_norm, axis=-1)[..., np.maximum(limits, 1) - 1]
    return q_norm * attended_max


def _gemm_magnitude(q, k, mask, rows):
    """The same bound for `rows` (g, i) only, tight: fl(|q_i| |K|^T) / (1 - g_D) per row."""
    out = np.empty(len(rows[0]))
    for g in np.unique(rows[0]):
        pick = rows[0] == g
        i = rows[1][pick]
        a = np.abs(q[g, i]) @ np.abs(k[g]).T
        out[pick] = (a if mask is None else np.where(mask[i], a, 0.0)).max(axis=-1)
    return out / (1 - gamma(q.shape[-1]))


@functools.cache
def scale_roundings(scale: float, head_dim: int) -> int:
    """How many roundings of size u the default scale's error counts as: the least k >= 1 with
    |scale - 1/sqrt(D)| <= k u / sqrt(D), for the float64 `scale` that stands for 1/sqrt(D).
    AttentionProblem.scale_value rounds twice (the sqrt, then the reciprocal) and can miss by
    more than one rounding: 1.21 u at D = 3, 1.24 u at D = 6 and 96, 1.39 u at D = 75 (k = 2).
    Exact: mpmath at 40 digits."""
    with mpmath.workdps(40):
        exact = 1 / mpmath.sqrt(head_dim)
        error = abs(mpmath.mpf(scale) - exact) / (exact * mpmath.mpf(U64))
        return max(1, int(mpmath.ceil(error)))


def _bounds(problem, l, m, magnitude, rounds, v_max, extra=None):
    """Relative output coefficient, absolute underflow term and LSE bound, per row; `extra`
    bounds the logits' rounding beyond the scores' (variants)."""
    # The scale counts as one rounding (exact or not), or as many as its error needs.
    k = 1 if problem.scale_is_exact else scale_roundings(problem.scale_value, problem.head_dim)
    scale_hi = problem.scale_value / (1 - (0 if problem.scale_is_exact else k * U64))
    b = U64 * np.abs(m) + gamma(problem.head_dim + 2 + k) * scale_hi * magnitude
    if extra is not None:
        b = b + extra
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        r = np.expm1(b) + EPS_EXP * np.exp(b)
        coefficient, alpha = softmax_output_coefficient(r, rounds, U64)
        # D computed from the same perturbed sums: true D <= D_hat (1+alpha) / ((1-alpha)(1-u)).
        coefficient = coefficient * (1 + alpha) / ((1 - alpha) * (1 - U64)) * _BOUND_SLACK
        log_l = np.log(l)
        tau = (4 * (problem.nk + rounds) * _SMALLEST_SUBNORMAL * (1 + v_max[..., None])
               / (l * (1 - alpha)))
        lse_bound = (-np.log1p(-alpha) + EPS_EXP * np.abs(log_l)
                     + 2 * U64 * (np.abs(m) + np.abs(log_l))) * _BOUND_SLACK
    bounded = alpha < 1  # beyond, the argument bounds nothing (signs flip): no bound, inf
    return (np.where(bounded, coefficient, np.inf), np.where(bounded, tau, np.inf),
            np.where(bounded, lse_bound, np.inf))


def mp_row_bounds(problem, rows, digits):
    """Bounds of mpmath rows (b, h, i) in the same form as `_bounds`'s coefficient and LSE."""
    q = problem.q64()
    k, _ = problem.kv64()
    scale = problem.scale_value
    coefficients, lse_bounds = [], []
    starts, limits = problem.key_start(), problem.key_limit()
    for b, h, i in rows:
        keys = k[b, h, starts[i]:max(starts[i], limits[i])]
        n = len(keys)
        a = np.abs(q[b, h, i]) @ np.abs(keys).T if n else np.zeros(1)
        logits = np.abs(scale * (q[b, h, i] @ keys.T)) if n else np.zeros(1)
        if problem.features:  # scores, capped scores, biases and the sink, twice (see mp_bound)
            bias = problem.alibi_bias(b, h, i)
            bias = np.zeros(1) if bias is None or not n else np.abs(bias[starts[i]:limits[i]])
            sink = 0.0 if problem.sinks is None else abs(float(problem.sinks[h]))
            logits = 2 * (logits.max(initial=0.0) * 2 + bias.max(initial=0.0) + sink) + np.zeros(1)
            n += problem.sinks is not None
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
    mask = problem.mask if problem.is_masked else None
    # Every head is filled in by the loop below.
    out, row_scale = (np.empty((B, H, Nq, D)) for _ in range(2))
    lse, coefficient, tau, lse_bound = (np.empty((B, H, Nq)) for _ in range(4))

    heads_per_chunk = max(1, _CHUNK_ENTRIES // (Nq * problem.nk))
    limits = problem.key_limit()
    gemm_rows = 0
    for b in range(B):
        for h0 in range(0, H, heads_per_chunk):
            sl = (b, slice(h0, h0 + heads_per_chunk))
            heads = slice(h0, h0 + heads_per_chunk)
            variants = _Variants(problem, b, heads) if problem.features else None
            num, l, dabs, m, rounds, extra = _attend(q[sl], k[sl], v[sl], mask, problem.scale_value, variants)
            live = l > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                out[sl] = np.where(live[..., None], num / l[..., None], 0.0)
                row_scale[sl] = np.where(live[..., None], dabs / l[..., None], 0.0)
                lse[sl] = np.where(live, m + np.log(l), -np.inf)
            v_max = np.abs(v[sl]).max(axis=(-2, -1))
            magnitude = _norm_magnitude(q[sl], k[sl], limits)
            c, t, lb = _bounds(problem, l, m, magnitude, rounds, v_max, extra)
            loose = np.nonzero(live & ~(c <= threshold))
            if loose[0].size:  # the free bound is not enough there: pay for the tight one
                gemm_rows += loose[0].size
                magnitude[loose] = np.minimum(magnitude[loose],
                                              _gemm_magnitude(q[sl], k[sl], mask, loose))
                c, t, lb = _bounds(problem, l, m, magnitude, rounds, v_max, extra)
            coefficient[sl] = np.where(live, c, 0.0)
            tau[sl] = np.where(live, t, 0.0)
            lse_bound[sl] = np.where(live, lb, 0.0)

    out_bound = coefficient[..., None] * row_scale + tau[..., None]
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
                     row_scale=row_scale, method="certified", mpmath_rows=len(redo),
                     gemm_rows=gemm_rows)
