"""Properties of the P·V stage: O is a convex combination of the attended V rows.

With the kernel's own weights pi_ij = P_ij / l_i (whatever its scores and exponentials were),
O_ic = sum_j pi_ij v_jc. Score and exp errors only move the weights, so these relations are
far sharper than the error model where scores are large. What a correct kernel may still do:
  * weights that do not sum to exactly 1: P rounded (u_P) after the row sum took it unrounded
    (FA2), n u_P tiny_P for P below the P dtype's normal range, and the row sum's and the
    division's roundings;
  * P.V accumulated with n keys plus at most n rescales: gamma_{2n+2}(u_pv) of sum pi |v|;
  * products below the normal range of the P.V dtype: (2n+3) tiny_pv absolute;
  * V rounded inside the kernel (`precision.input_rounding`): u_r of max |v|, plus a subnormal;
  * the output rounded to its dtype: half an ulp — and so infinity, where the tolerance band
    reaches the dtype's overflow threshold (weights summing to 1 + u_P times V's largest fp16
    value round to inf).
eta_i below bounds the first two; no property of this module depends on the scores.

Null-model guard (`fa_verify.null_model`): constant_v (the range is one point, the exact
answer) and v_affinity (a relation within a tolerance) ask whether a trivial output would pass
as well. convex_hull does not: its range holds uniform attention, and zero wherever a column of
V has both signs, by design; it catches outputs outside the hull and says nothing about which
point inside.
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import finfo, round_to, ulp, unit_roundoff
from fa_verify.error_model import gamma
from fa_verify.null_model import guard, null_outputs
from fa_verify.oracle import reference
from fa_verify.properties._compare import differing, exceeding
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported

#: Powers of two (and their negatives) that V-affinity scales V by: exact, and never rounding.
AFFINE_SCALES = (1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 4.0, 0.25)


def weight_slack(problem, precision) -> tuple[np.ndarray, np.ndarray]:
    """(eta [B,H,Nq] relative to max |v|, absolute term [B,H,Nq]) of the module doc."""
    n = problem.key_limit().astype(np.float64)
    u_p, u_pv = unit_roundoff(precision.p_rounding), unit_roundoff(precision.pv_accumulation)
    tiny_p = float(finfo(precision.p_rounding).smallest_normal)
    g = gamma(2 * n + 2, u_pv)
    # values rounded inside the kernel move by u_r |v| <= u_r max |v| (+ half a subnormal)
    u_r = unit_roundoff(precision.input_rounding) if precision.input_rounding else 0.0
    x = u_p * (1 + n * tiny_p) + g + u_pv + u_r
    with np.errstate(divide="ignore", invalid="ignore"):
        eta = np.where(g < 1, (x + g) / (1 - g), np.inf)
    absolute = (2 * n + 3) * float(finfo(precision.pv_accumulation).smallest_normal) + (
        float(finfo(precision.input_rounding).smallest_subnormal) if u_r else 0.0)
    shape = problem.out_shape[:3]
    return np.broadcast_to(eta, shape), np.broadcast_to(absolute, shape)


def attended_range(problem, v=None) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) over the keys each row attends of v (default: the problem's), [B,H,Nq,D]."""
    v = np.repeat((problem.v if v is None else v).astype(np.float64), problem.group_size, axis=1)
    last = np.maximum(problem.key_limit() - 1, 0)[None, None, :, None]
    lo = np.take_along_axis(np.minimum.accumulate(v, axis=2), last, axis=2)
    hi = np.take_along_axis(np.maximum.accumulate(v, axis=2), last, axis=2)
    return lo, hi


def _half_ulp(x, dtype) -> np.ndarray:
    """Half an ulp of `dtype` at |x|; 0 where x is not finite (a NaN must not excuse itself)."""
    return 0.5 * ulp(np.where(np.isfinite(x), np.abs(x), 0.0), dtype)


def legitimate_overflow(got, want, tol, dtype) -> np.ndarray:
    """Where `got` is the infinity that rounding a value within `tol` of `want` may give."""
    info = finfo(dtype)
    threshold = float(info.max) + 0.5 * float(ulp(float(info.max), dtype))
    return np.isinf(got) & (np.sign(got) == np.sign(want)) & (np.abs(want) + tol >= threshold)


def _hull_check(name: str, backend, problem, what: str, guarded: bool = False) -> PropertyResult:
    """O within the attended V rows' range; `guarded`: a pass is also asked whether a trivial
    output would pass (only where the range is one point: otherwise it holds uniform attention)."""
    out, _ = backend.run(problem)
    precision = backend.precision(problem.dtype)
    eta, absolute = (x[..., None] for x in weight_slack(problem, precision))
    lo, hi = attended_range(problem)
    magnitude = np.maximum(np.abs(lo), np.abs(hi))
    tol = eta * magnitude + absolute + 0.5 * ulp(magnitude * (1 + eta) + absolute, precision.output)
    tol = np.where(np.isinf(eta), np.inf, tol)  # no bound on the weights: nothing to judge (not 0 * inf)

    def mismatch_in(out):
        got = out.astype(np.float64)
        nearest = np.clip(got, lo, hi)  # the closest point of the hull; NaN stays NaN
        live = ~problem.masked_rows[None, None, :, None] & ~legitimate_overflow(got, nearest, tol, precision.output)
        return exceeding(got, nearest, tol, where=live)

    mismatch, worst = mismatch_in(out)
    if mismatch is None:
        null_guard = None if not guarded else guard(
            null_outputs(problem, reference(problem), precision.output),
            lambda null: mismatch_in(null.out)[0] is None)
        return passed(name, problem, worst_ratio=worst, guard=null_guard)
    return failed(name, problem, f"{mismatch.describe(what)} (expected = the nearest point of the "
                                 f"range; the tolerance allows weights summing to 1 +- eta, eta = "
                                 f"{float(eta[mismatch.index[:3]][0]):.3g}, and output rounding)", worst)


def check_convex_hull(backend, problem) -> PropertyResult:
    """Every O_ic lies within [min, max] of v_jc over the keys row i attends, up to rounding."""
    return _hull_check("convex_hull", as_backend(backend), problem,
                       "O outside the range of the attended V rows")


def check_constant_v(backend, problem, *, seed: int = 0) -> PropertyResult:
    """With every key's value row equal to one row c of V, O = c (up to rounding)."""
    backend = as_backend(backend)
    rng = np.random.default_rng(seed)
    row = rng.integers(0, problem.nk, problem.k.shape[:2])  # one key per (batch, kv head)
    picked = np.take_along_axis(problem.v, row[:, :, None, None], axis=2)
    derived = problem.replace(v=np.broadcast_to(picked, problem.v.shape).copy())
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable("constant_v", problem, reason)
    return _hull_check("constant_v", backend, derived, "O vs the constant value row", guarded=True)


def check_v_affinity(backend, problem, *, seed: int = 0) -> PropertyResult:
    """O(aV + b) = a O(V) + b for a power of two a and a per-column b (rounded to the dtype;
    the rounding is accounted for exactly), and the LSE does not change at all."""
    backend = as_backend(backend)
    rng = np.random.default_rng(seed)
    v = problem.v.astype(np.float64)
    v_max = max(float(np.abs(v).max()), float(finfo(problem.dtype).smallest_normal))
    room = float(finfo(problem.dtype).max) / 8
    a = float(rng.choice(AFFINE_SCALES))
    while abs(a) * v_max > room / 2:
        a /= 2
    b_shape = problem.v.shape[:2] + (1, problem.head_dim_v)
    b = round_to(np.clip(rng.uniform(-4, 4, b_shape) * v_max, -room / 2, room / 2), problem.dtype)
    b = b.astype(np.float64)
    v_new = round_to(a * v + b, problem.dtype)
    derived = problem.replace(v=v_new)
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable("v_affinity", problem, reason)

    out, lse = backend.run(problem)
    out_new, lse_new = backend.run(derived)
    precision = backend.precision(problem.dtype)
    eta, absolute = (x[..., None] for x in weight_slack(problem, precision))
    delta = np.abs(v_new.astype(np.float64) - (a * v + b)) + 2.0 ** -52 * (np.abs(a * v) + np.abs(b))
    delta_max = attended_range(problem, delta)[1]
    lo, hi = attended_range(problem)
    lo_new, hi_new = attended_range(derived)
    m_old = np.maximum(np.abs(lo), np.abs(hi))
    m_new = np.maximum(np.abs(lo_new), np.abs(hi_new))
    old = out.astype(np.float64)
    b_rows = np.repeat(b, problem.group_size, axis=1)
    expected = a * old + b_rows
    allowed = (np.abs(b_rows) * eta + delta_max * (1 + eta) + eta * (m_new + abs(a) * m_old)
               + absolute * (1 + abs(a)) + abs(a) * _half_ulp(old, precision.output))

    def mismatch_in(out_new):
        got = out_new.astype(np.float64)
        tol = np.where(np.isinf(eta), np.inf, allowed + _half_ulp(got, precision.output))
        live = ~problem.masked_rows[None, None, :, None] & ~legitimate_overflow(got, expected, tol, precision.output)
        return exceeding(got, expected, tol, where=live)

    mismatch, worst = mismatch_in(out_new)
    lse_changed = None if lse is None else differing(lse_new, lse)
    if mismatch is None and lse_changed is None:
        note = "" if lse is not None else "no LSE returned: only the output was checked"
        # the guard asks the tolerance on O; the LSE must be identical, which no tolerance loosens
        null_guard = guard(null_outputs(derived, reference(derived), precision.output),
                           lambda null: mismatch_in(null.out)[0] is None)
        return passed("v_affinity", problem, note=note, worst_ratio=worst, guard=null_guard)
    found = []
    if mismatch is not None:
        found.append(mismatch.describe(f"O(aV+b) vs a O(V) + b with a={a:g}"))
    if lse_changed is not None:
        found.append(lse_changed.describe("LSE changed with V (it depends on q and k only)"))
    return failed("v_affinity", problem, "; ".join(found), worst)
