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


def mp_scale(problem: AttentionProblem):
    """The exact scale: 1/sqrt(D) in mpmath when the problem keeps the default."""
    if problem.scale is None:
        return 1 / mpmath.sqrt(problem.head_dim)
    return mpmath.mpf(problem.scale)


def logits(q_row, keys, scale, softcap=0.0, bias=None):
    """(scaled scores scale q.k_j, logits: softcapped and ALiBi-biased) of one row, in mpmath."""
    scores = [scale * mpmath.fdot(q_row, key) for key in keys]
    z = scores
    if softcap > 0:
        cap = mpmath.mpf(softcap)
        z = [cap * mpmath.tanh(x / cap) for x in z]
    if bias is not None:
        z = [x + mpmath.mpf(c) for x, c in zip(z, bias)]
    return scores, z


def _row(q_row, keys, values, scale, softcap=0.0, bias=None, sink=None):
    """Out, LSE and row scale D_c = sum_j p_j |v_jc| / sum_j p_j of one row with at least one
    key (or a sink), in mpmath; the variants as the problem module states them (bias: the
    ALiBi term per key, exact; sink: the sink logit, whose exponential joins the sum only)."""
    t = logits(q_row, keys, scale, softcap, bias)[1]
    m = max(t + ([] if sink is None else [mpmath.mpf(sink)]))
    p = [mpmath.exp(x - m) for x in t]
    total = mpmath.fsum(p + ([] if sink is None else [mpmath.exp(mpmath.mpf(sink) - m)]))
    columns = list(zip(*values))
    out = [mpmath.fdot(p, col) / total for col in columns]
    row_scale = [mpmath.fdot(p, [abs(x) for x in col]) / total for col in columns]
    lse = m + mpmath.log(total)
    return out, lse, row_scale


def as_mp(x: np.ndarray):
    """Nested lists of mpf over the last axis (exact: the inputs are binary floats)."""
    return [[mpmath.mpf(float(v)) for v in row] for row in x.reshape(-1, x.shape[-1])]


def mp_bound(nk, head_dim: int, scale: float, max_score_magnitude, max_abs_logit,
                         digits: int):
    """Relative error bound of `_row` in mpmath, in units of the row scale D_c, per row.

    Every mpmath operation rounds with relative error <= 2^-prec. A score t_j carries D + 3
    roundings relative to scale * sum_d |q_d k_jd| (fdot, the scale, the scale's own
    rounding), x_j = t_j - m one more relative to |x_j| <= 2 max|t|, exp one; the sums over
    N keys N + 2 more. The variants (softcap: a division, tanh and a product; ALiBi: an
    exact bias and an addition; a sink: one more term) add a few roundings relative to the
    largest magnitude among the scores, logits, biases and sink, which max_abs_logit must
    bound (4 units of it are counted: callers pass twice the magnitude for variant rows).
    With r the largest relative error of a probability and
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
    as float64 (out, row_scale numpy [D_v]; lse float)."""
    g = problem.group_size
    cache = {}
    with mpmath.workdps(digits):
        scale = mp_scale(problem)
        starts, limits = problem.key_start(), problem.key_limit()
        for b, h, i in rows:
            lo, hi = int(starts[i]), int(limits[i])
            sink = None if problem.sinks is None else float(problem.sinks[h])
            if hi <= lo:
                lse = -math.inf if sink is None else sink
                yield b, h, i, np.zeros(problem.head_dim_v), lse, np.zeros(problem.head_dim_v)
                continue
            key = (b, h // g)
            if key not in cache:
                cache[key] = (as_mp(problem.k[b, h // g]), as_mp(problem.v[b, h // g]))
            keys, values = cache[key]
            q_row = as_mp(problem.q[b, h, i])[0]
            bias = problem.alibi_bias(b, h, i)
            out, lse, row_scale = _row(q_row, keys[lo:hi], values[lo:hi], scale, problem.softcap,
                                       None if bias is None else bias[lo:hi], sink)
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
