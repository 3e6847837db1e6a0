"""The definition of attention, evaluated row by row in mpmath at a chosen precision.

Slow (tens of ms per row) but independent of float64 rounding: the certified path is tested
against it, and hands it the rows whose float64 bound is not tight enough.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
from mpmath.libmp import dps_to_prec

from fa_verify.oracle.bounds import softmax_output_coefficient
from fa_verify.problem import AttentionProblem

DEFAULT_DIGITS = 50


def _mp_scale(problem: AttentionProblem):
    """The exact scale: 1/sqrt(D) in mpmath when the problem keeps the default."""
    if problem.scale is None:
        return 1 / mpmath.sqrt(problem.head_dim)
    return mpmath.mpf(problem.scale)


def _row(q_row, keys, values, scale):
    """Out, LSE and row scale D_c = sum_j p_j |v_jc| / sum_j p_j of one unmasked row, in mpmath."""
    t = [scale * mpmath.fdot(q_row, key) for key in keys]
    m = max(t)
    p = [mpmath.exp(x - m) for x in t]
    total = mpmath.fsum(p)
    columns = list(zip(*values))
    out = [mpmath.fdot(p, col) / total for col in columns]
    row_scale = [mpmath.fdot(p, [abs(x) for x in col]) / total for col in columns]
    lse = m + mpmath.log(total)
    return out, lse, row_scale


def _as_mp(x: np.ndarray):
    """Nested lists of mpf over the last axis (exact: the inputs are binary floats)."""
    return [[mpmath.mpf(float(v)) for v in row] for row in x.reshape(-1, x.shape[-1])]


def mp_bound(nk, head_dim: int, scale: float, max_score_magnitude, max_abs_logit,
                         digits: int):
    """Relative error bound of `_row` in mpmath, in units of the row scale D_c, per row.

    Every mpmath operation rounds with relative error <= 2^-prec. A score t_j carries D + 3
    roundings relative to scale * sum_d |q_d k_jd| (fdot, the scale, the scale's own
    rounding), x_j = t_j - m one more relative to |x_j| <= 2 max|t|, exp one; the sums over
    N keys N + 2 more. With r the largest relative error of a probability and
    alpha = r + (N + 4) 2^-prec (1 + r), the argument of `certified` gives
    |out - exact| <= coefficient * D_c, and |lse - exact| <= alpha (+ its last rounding).
    Both are doubled for safety. Returns (coefficient, alpha) per row.
    """
    unit = 2.0 ** -dps_to_prec(digits)
    score_err = (head_dim + 3) * unit * scale * max_score_magnitude + 4 * unit * max_abs_logit
    r = np.expm1(score_err + 2 * unit)
    coefficient, alpha = softmax_output_coefficient(r, np.asarray(nk) + 4, unit)
    return 2 * coefficient, 2 * alpha


def mp_rows(problem: AttentionProblem, rows, digits: int = DEFAULT_DIGITS):
    """Evaluate selected rows. rows: iterable of (b, h, i). Yields (b, h, i, out, lse, row_scale)
    as float64 (out, row_scale numpy [D]; lse float)."""
    g = problem.group_size
    cache = {}
    with mpmath.workdps(digits):
        scale = _mp_scale(problem)
        limits = problem.key_limit()
        for b, h, i in rows:
            n = int(limits[i])
            if n == 0:
                yield b, h, i, np.zeros(problem.head_dim), -math.inf, np.zeros(problem.head_dim)
                continue
            key = (b, h // g)
            if key not in cache:
                cache[key] = (_as_mp(problem.k[b, h // g]), _as_mp(problem.v[b, h // g]))
            keys, values = cache[key]
            q_row = _as_mp(problem.q[b, h, i])[0]
            out, lse, row_scale = _row(q_row, keys[:n], values[:n], scale)
            yield (b, h, i, np.array([float(x) for x in out]), float(lse),
                   np.array([float(x) for x in row_scale]))


def mp_reference_arrays(problem: AttentionProblem, digits: int = DEFAULT_DIGITS):
    """Out, LSE and row scale of every row (float64 arrays), the whole problem in mpmath."""
    B, H, Nq, D = problem.out_shape
    out = np.zeros((B, H, Nq, D))
    lse = np.full((B, H, Nq), -math.inf)
    row_scale = np.zeros((B, H, Nq, D))
    rows = ((b, h, i) for b in range(B) for h in range(H) for i in range(Nq))
    for b, h, i, o, l_, s in mp_rows(problem, rows, digits):
        out[b, h, i], lse[b, h, i], row_scale[b, h, i] = o, l_, s
    return out, lse, row_scale
