"""The certified reference against the mpmath definition: always within the stated bounds."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fa_verify import AttentionProblem, InvalidArgumentError
from fa_verify.dtypes import finfo
from fa_verify.oracle import FALLBACK_THRESHOLD, reference
from fa_verify.oracle import certified
from fa_verify.oracle.certified import certified_reference


def _problem(q, k, v, dtype, **kw):
    return AttentionProblem.from_float(q, k, v, dtype, **kw)


def _normal(rng, b, h, hkv, nq, nk, d, dtype="fp16", spread=1.0, **kw):
    """Normal inputs; q and k multiplied by `spread` (spread**2 scales the logits)."""
    return _problem(rng.standard_normal((b, h, nq, d)) * spread,
                    rng.standard_normal((b, hkv, nk, d)) * spread,
                    rng.standard_normal((b, hkv, nk, d)), dtype, **kw)


def _split_support(rng, b, h, hkv, nq, nk, d, dtype, big=300.0, **kw):
    """q large where k is small and vice versa: |q||k| far below the norms' product (the free
    Cauchy-Schwarz bound is loose), and logits in the hundreds (peaky rows)."""
    weights = np.r_[np.full(d // 2, big), np.full(d - d // 2, 0.5)]
    return _problem(rng.standard_normal((b, h, nq, d)) * weights,
                    rng.standard_normal((b, hkv, nk, d)) * weights[::-1],
                    rng.standard_normal((b, hkv, nk, d)), dtype, **kw)


def _adversarial(rng):
    """Named problems at the edges the issue lists."""
    d = 8
    cases = {}
    cases["huge_logits"] = _normal(rng, 1, 2, 2, 5, 7, d, "fp32", spread=60.0)
    cases["huge_logits_fp16_max"] = _problem(
        np.full((1, 1, 3, d), 65504.0) * rng.choice([-1, 1], (1, 1, 3, d)),
        np.full((1, 1, 4, d), 65504.0) * rng.choice([-1, 1], (1, 1, 4, d)),
        rng.standard_normal((1, 1, 4, d)), "fp16")
    k = rng.standard_normal((1, 1, 6, d))
    k[:, :, 3:] = k[:, :, :3]  # duplicated keys: tied scores
    cases["ties"] = _problem(rng.standard_normal((1, 1, 4, d)), k,
                             rng.standard_normal((1, 1, 6, d)), "bf16")
    q = rng.standard_normal((1, 1, 4, d))
    k = rng.standard_normal((1, 1, 9, d)) * 0.01
    k[:, :, 4] = q[:, :, 0] * 8  # one key dominates row 0
    cases["dominant_key"] = _problem(q, k, rng.standard_normal((1, 1, 9, d)), "fp16")
    tiny = float(finfo("fp16").smallest_subnormal)
    cases["fp16_subnormal"] = _problem(
        rng.integers(-3, 4, (1, 1, 5, d)) * tiny, rng.integers(-3, 4, (1, 1, 5, d)) * tiny,
        rng.integers(-3, 4, (1, 1, 5, d)) * tiny, "fp16")
    v = rng.standard_normal((1, 1, 5, d))
    v[..., 0] = 65504.0
    cases["fp16_max_values"] = _problem(rng.standard_normal((1, 1, 5, d)),
                                        rng.standard_normal((1, 1, 5, d)), v, "fp16")
    cases["split_support_peaky"] = _split_support(rng, 1, 2, 2, 6, 9, 16, "fp16")
    cases["split_support_causal"] = _split_support(rng, 1, 2, 1, 7, 5, 16, "bf16", big=40.0,
                                                   causal=True)
    cases["fp32_enormous_logits"] = _normal(rng, 1, 1, 1, 3, 4, d, "fp32", spread=3e7)
    cases["fully_masked_rows"] = _normal(rng, 1, 2, 1, 7, 3, d, causal=True)
    cases["gqa_top_left_nq_lt_nk"] = _normal(rng, 2, 4, 2, 3, 8, d, "bf16", causal=True,
                                             causal_alignment="top-left")
    cases["mqa_nq_gt_nk"] = _normal(rng, 1, 3, 1, 9, 4, d, "fp32", causal=True)
    cases["single_key"] = _normal(rng, 1, 1, 1, 3, 1, d, "fp32")
    cases["explicit_scale"] = _normal(rng, 1, 1, 1, 4, 6, 5, "fp32", spread=3.0,
                                      scale=0.3)
    return cases


def _assert_within_bounds(fast, exact):
    """|fast - exact| <= fast's bound + exact's bound, for out and finite LSE; masked rows agree."""
    out_err = np.abs(fast.out - exact.out)
    assert (out_err <= fast.out_bound + exact.out_bound).all(), out_err.max()
    finite = np.isfinite(exact.lse)
    np.testing.assert_array_equal(np.isfinite(fast.lse), finite)
    assert (fast.lse[~finite] == -np.inf).all()
    assert (fast.out[~finite] == 0).all()
    lse_err = np.abs(fast.lse[finite] - exact.lse[finite])
    assert (lse_err <= fast.lse_bound[finite] + exact.lse_bound[finite]).all()


@pytest.mark.parametrize("name", sorted(_adversarial(np.random.default_rng(0))))
def test_certified_within_bound_of_mpmath_on_adversarial_problems(name):
    problem = _adversarial(np.random.default_rng(0))[name]
    fast = reference(problem)
    exact = reference(problem, method="mpmath")
    _assert_within_bounds(fast, exact)
    # Certified means: every row's bound is far below fp32 rounding of its row scale.
    assert fast.relative_bound <= FALLBACK_THRESHOLD * 1.01


@pytest.mark.parametrize("name", sorted(_adversarial(np.random.default_rng(0))))
def test_free_norm_bound_alone_holds_on_adversarial_problems(name):
    """With no fallback at all, the Cauchy-Schwarz bound is still rigorous (inf where the
    rounding argument gives none)."""
    problem = _adversarial(np.random.default_rng(0))[name]
    free = certified_reference(problem, threshold=math.inf)
    assert free.gemm_rows == free.mpmath_rows == 0
    _assert_within_bounds(free, reference(problem, method="mpmath"))


@pytest.mark.parametrize("name", sorted(_adversarial(np.random.default_rng(0))))
def test_score_magnitudes_bound_the_exact_ones(name):
    """Both grades of A_i >= max over attended keys of sum_d |q_d||k_d|, summed exactly
    (products of fp32 values are exact in float64; fsum rounds once)."""
    problem = _adversarial(np.random.default_rng(0))[name]
    q = problem.q64()[0]
    k = problem.kv64()[0][0]
    limits = problem.key_limit()
    exact = np.array([[max((math.fsum(np.abs(q[h, i] * k[h, j])) for j in range(limits[i])),
                           default=0.0) for i in range(problem.nq)] for h in range(q.shape[0])])
    assert (certified._norm_magnitude(q, k, limits) >= exact).all()
    rows = np.nonzero(np.ones(exact.shape, dtype=bool))
    mask = problem.mask if problem.causal else None
    assert (certified._gemm_magnitude(q, k, mask, rows) >= exact.ravel()).all()


def test_loose_free_bound_falls_back_to_the_gemm_not_to_mpmath():
    problem = _adversarial(np.random.default_rng(0))["split_support_peaky"]
    free = certified_reference(problem, threshold=math.inf)
    assert free.relative_bound > FALLBACK_THRESHOLD  # the free bound alone would go to mpmath
    ref = reference(problem)
    assert ref.gemm_rows == 12 and ref.mpmath_rows == 0
    assert ref.relative_bound <= FALLBACK_THRESHOLD


@pytest.mark.parametrize("name", ["huge_logits_fp16_max", "fp32_enormous_logits"])
def test_huge_logits_are_handed_to_mpmath(name):
    problem = _adversarial(np.random.default_rng(0))[name]
    ref = reference(problem)
    assert ref.gemm_rows > 0 and ref.mpmath_rows > 0
    assert certified_reference(problem, threshold=math.inf).relative_bound > FALLBACK_THRESHOLD


def test_mpmath_digits_from_15_to_1000_are_accepted_and_reach_the_computation():
    """The documented range, both ends included; 14 and 1001 are refused by name. 15 digits
    and 1000 give the same float64 answer with bounds that differ by 10^985."""
    rng = np.random.default_rng(2)
    problem = AttentionProblem.from_float(*(rng.standard_normal((1, 1, 2, 4)) for _ in range(3)), "fp32")
    low, high = reference(problem, "mpmath", digits=15), reference(problem, "mpmath", digits=1000)
    np.testing.assert_allclose(low.out, high.out, rtol=1e-13)
    assert (high.out_bound <= 1e-300 + 2.0 ** -52 * np.abs(high.out)).all()
    assert (low.out_bound - 2.0 ** -53 * np.abs(low.out) > 1e-20).all()  # 15 digits: a visible coefficient
    for digits in (14, 1001):
        with pytest.raises(InvalidArgumentError, match=f"digits={digits} must be between 15 and 1000"):
            reference(problem, "mpmath", digits=digits)


def test_mpmath_at_50_digits_within_its_bound_of_100_digits():
    problem = _normal(np.random.default_rng(1), 1, 1, 1, 4, 5, 6, "fp32", spread=4.0)
    _assert_within_bounds(reference(problem, "mpmath", digits=50),
                          reference(problem, "mpmath", digits=100))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nq=st.integers(1, 9), nk=st.integers(1, 9),
       d=st.sampled_from([1, 3, 8, 16]), dtype=st.sampled_from(["fp16", "bf16", "fp32"]),
       causal=st.sampled_from([None, "bottom-right", "top-left"]),
       logit_scale=st.sampled_from([0.1, 1.0, 8.0, 40.0]), split=st.booleans())
def test_certified_within_bound_of_mpmath_random(seed, nq, nk, d, dtype, causal, logit_scale,
                                                 split):
    inputs = _split_support if split else _normal
    kw = {"big": logit_scale * 8} if split else {"spread": logit_scale}
    problem = inputs(np.random.default_rng(seed), 1, 2, 1, nq, nk, d, dtype,
                     causal=causal is not None, causal_alignment=causal or "bottom-right", **kw)
    _assert_within_bounds(reference(problem), reference(problem, method="mpmath"))


def test_bound_is_tight_at_benchmark_scale():
    """N=1024, D=128, fp16 normal inputs: bound <= 1e-12 of the row scale from the free norm
    bound alone (no GEMM, no mpmath rows: what makes the oracle cheap)."""
    problem = _normal(np.random.default_rng(2), 1, 1, 1, 1024, 1024, 128)
    ref = reference(problem)
    assert ref.gemm_rows == ref.mpmath_rows == 0
    assert ref.relative_bound <= 1e-12


def test_bound_resolves_fp32_rounding():
    """The reference must see an fp32 computation's error: its bound is far below it."""
    problem = _normal(np.random.default_rng(3), 1, 1, 1, 64, 64, 32, "fp32")
    ref = reference(problem)
    q, k, v = problem.q, problem.k, problem.v
    s = (q[0, 0] @ k[0, 0].T) * np.float32(problem.scale_value)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out32 = (p @ v[0, 0]) / p.sum(axis=-1, keepdims=True)
    err = np.abs(out32.astype(np.float64) - ref.out[0, 0])
    assert err.max() > 1e3 * ref.out_bound[0, 0].max()


def test_lse_is_natural_log_of_sum_of_exp():
    problem = _problem(np.zeros((1, 1, 1, 4)), np.zeros((1, 1, 3, 4)),
                       np.arange(12.0).reshape(1, 1, 3, 4), "fp32")
    ref = reference(problem)
    assert ref.lse[0, 0, 0] == pytest.approx(math.log(3), abs=1e-15)
    np.testing.assert_allclose(ref.out[0, 0, 0], [4, 5, 6, 7], rtol=1e-15)


def test_unknown_method_is_rejected():
    problem = _normal(np.random.default_rng(0), 1, 1, 1, 2, 2, 2)
    with pytest.raises(InvalidArgumentError, match="method='fast'"):
        reference(problem, method="fast")


# --- The certified and mpmath bounds recomputed from their documented formulas --------------
# (fa_verify/oracle/certified.py, bounds.py, mp_path.py module docstrings), row by row in plain
# Python, and compared tightly with what the oracle returns.

import importlib
import re
import warnings

import mpmath

from fa_verify.oracle import mp_path

_U = 2.0 ** -53
_SUBNORMAL = 2.0 ** -1074
# Tight comparison: the recomputation sums in another order (fsum, other m, l, norms), which moves
# each bound by ~1e-15 relative; every term of a bound is far more than 1e-12 of it on the inputs
# below, and _BOUND_SLACK (1e-10) is far above.
_RTOL = 1e-12


def _gamma(n):
    return n * _U / (1 - n * _U) if n * _U < 1 else math.inf


def _exact_scale_roundings(scale, d):
    """The least k >= 1 with |scale - 1/sqrt(D)| <= k u / sqrt(D) (certified's docstring)."""
    with mpmath.workdps(40):
        exact = 1 / mpmath.sqrt(d)
        return max(1, int(mpmath.ceil(abs(mpmath.mpf(scale) - exact) / (exact * _U))))


def _documented_row_bounds(b, rounds, l, m, nk, v_max):
    """(coefficient, tau, lse bound) of one row from its score error b (certified's docstring,
    softmax_output_coefficient's, and the D and tau factors of _bounds), in plain floats."""
    r = math.expm1(b) + certified.EPS_EXP * math.exp(b) if b < 700 else math.inf
    alpha = r + _gamma(rounds) * (1 + r)
    if not alpha < 1:
        return math.inf, math.inf, math.inf
    ratio = 2 * alpha / (1 - alpha)
    coefficient = (ratio + _U * (1 + ratio)) * (1 + alpha) / ((1 - alpha) * (1 - _U)) * (1 + 1e-10)
    tau = 4 * (nk + rounds) * _SUBNORMAL * (1 + v_max) / (l * (1 - alpha))
    log_l = math.log(l)
    lse_bound = (-math.log1p(-alpha) + certified.EPS_EXP * abs(log_l)
                 + 2 * _U * (abs(m) + abs(log_l))) * (1 + 1e-10)
    return coefficient, tau, lse_bound


def _documented_certified(problem, threshold=FALLBACK_THRESHOLD):
    """Everything certified_reference returns, recomputed row by row in plain loops: the
    logits with their variants, m, l, the extra rounding of softcap / ALiBi / sink, both grades
    of A_i (the tight one only for rows whose free bound misses the threshold), and the bounds.
    Rows left above the threshold (mpmath's) are marked in `certified_rows`."""
    B, H, Nq, Dv = problem.out_shape
    D, nk, g = problem.head_dim, problem.nk, problem.group_size
    q, k, v = (x.astype(np.float64) for x in (problem.q, problem.k, problem.v))
    scale = problem.scale_value
    kr = 1 if problem.scale_is_exact else _exact_scale_roundings(scale, D)
    scale_hi = scale / (1 - (0 if problem.scale_is_exact else kr * _U))
    rounds = min(1024, nk) + -(-nk // 1024) + (problem.sinks is not None)
    starts, limits = problem.key_start(), problem.key_limit()
    offset = problem.diagonal_offset
    res = {"out": np.zeros((B, H, Nq, Dv)), "row_scale": np.zeros((B, H, Nq, Dv)),
           "out_bound": np.zeros((B, H, Nq, Dv)), "lse": np.full((B, H, Nq), -math.inf),
           "lse_bound": np.zeros((B, H, Nq)), "certified_rows": np.ones((B, H, Nq), dtype=bool),
           "gemm_rows": 0}

    def norm(x):
        return math.sqrt(math.fsum(float(e) * float(e) for e in x)) / (1 - _gamma(D + 1))

    for b in range(B):
        for h in range(H):
            kh = h // g
            v_max = float(np.abs(v[b, kh]).max())
            sink = None if problem.sinks is None else float(problem.sinks[h])
            for i in range(Nq):
                keys = range(starts[i], limits[i])
                if not keys and sink is None:
                    continue  # fully masked: out 0, LSE -inf, bounds 0
                qs = [scale * float(x) for x in q[b, h, i]]
                t = [math.fsum(qs[d] * k[b, kh, j, d] for d in range(D)) for j in keys]
                z, extra = list(t), 0.0
                if problem.softcap > 0:
                    c = problem.softcap
                    z = [c * math.tanh(x / c) for x in t]
                    extra += _U * max(map(abs, t), default=0.0)
                    extra += (_U + certified.EPS_EXP) * max(map(abs, z), default=0.0)
                if problem.alibi_slopes is not None:
                    slopes = problem.alibi_slopes
                    slope = float(slopes[b, h] if slopes.ndim == 2 else slopes[h])
                    bias = [-slope * abs(i + offset - j) for j in keys]
                    extra += 3 * _U * max(map(abs, bias), default=0.0) + _U * max(map(abs, z), default=0.0)
                    z = [x + y for x, y in zip(z, bias)]
                m = max(z + ([] if sink is None else [sink]))
                if sink is not None:
                    extra += _U * (abs(sink) + abs(m))
                p = [math.exp(x - m) for x in z]
                l = math.fsum(p + ([] if sink is None else [math.exp(sink - m)]))
                cheap = norm(q[b, h, i]) * max(norm(k[b, kh, j]) for j in range(max(limits[i], 1)))
                tight = max((math.fsum(abs(float(a) * float(c)) for a, c in zip(q[b, h, i], k[b, kh, j]))
                             for j in keys), default=0.0) / (1 - _gamma(D))

                row = (rounds, l, m, nk, v_max)
                coefficient, tau, lse_bound = _documented_row_bounds(
                    _U * abs(m) + _gamma(D + 2 + kr) * scale_hi * cheap + extra, *row)
                if not coefficient <= threshold:
                    res["gemm_rows"] += 1
                    coefficient, tau, lse_bound = _documented_row_bounds(
                        _U * abs(m) + _gamma(D + 2 + kr) * scale_hi * min(cheap, tight) + extra, *row)
                res["certified_rows"][b, h, i] = coefficient <= threshold
                for col in range(Dv):
                    vc = [float(v[b, kh, j, col]) for j in keys]
                    res["out"][b, h, i, col] = math.fsum(x * y for x, y in zip(p, vc)) / l
                    rs = math.fsum(x * abs(y) for x, y in zip(p, vc)) / l
                    res["row_scale"][b, h, i, col] = rs
                    res["out_bound"][b, h, i, col] = coefficient * rs + tau
                res["lse"][b, h, i] = m + math.log(l)
                res["lse_bound"][b, h, i] = lse_bound
    return res


def _assert_close(got, expected, rtol=_RTOL, atol=0.0):
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape
    same = (got == expected) | (np.abs(got - expected) <= rtol * np.abs(expected) + atol)
    assert same.all(), (got[~same], expected[~same])


def _assert_certified_matches_documented(ref, problem):
    exp = _documented_certified(problem)
    ok = exp["certified_rows"]
    assert ref.method == "certified"
    assert ref.gemm_rows == exp["gemm_rows"]
    assert ref.mpmath_rows == int((~ok).sum())
    # tau can sit in the subnormals, where a product rounds to a multiple of 2^-1074: 4 of them.
    _assert_close(ref.out_bound[ok], exp["out_bound"][ok], atol=4 * _SUBNORMAL)
    _assert_close(ref.lse_bound[ok], exp["lse_bound"][ok])
    _assert_close(ref.row_scale[ok], exp["row_scale"][ok])
    # The output itself: float64 of two summation orders, 1e-12 of the row scale apart at most.
    assert (np.abs(ref.out[ok] - exp["out"][ok]) <= 1e-12 * exp["row_scale"][ok] + 1e-300).all()
    finite = np.isfinite(exp["lse"])
    np.testing.assert_array_equal(np.isfinite(ref.lse), finite)
    _assert_close(ref.lse[finite], exp["lse"][finite], atol=1e-13)
    assert (ref.lse[~finite] == -np.inf).all()


def _variants_problem(rng, **kw):
    """GQA (3 heads on 1 KV head), B=2, bottom-right causal with Nq > Nk (rows 0-1 attend no key),
    D=6 (1/sqrt(6) inexact), scores in the tens against a softcap of 7, ALiBi slopes as large
    as the scores, a sink per head (one far above the row maxima: m = the sink there)."""
    kw = {"causal": True, "softcap": 7.0, "alibi_slopes": np.array([3.0, 0.5, 9.0], np.float32),
          "sinks": np.array([-2.0, 60.0, 5.0], np.float32), **kw}
    return _problem(rng.standard_normal((2, 3, 6, 6)) * 4, rng.standard_normal((2, 1, 4, 6)) * 4,
                    rng.standard_normal((2, 1, 4, 6)), "fp32", **{k: x for k, x in kw.items() if x is not None})


def _tau_problem():
    """Head 0: v all zero (out_bound = tau alone, in the subnormals: v_max = 0); head 1: v zero on
    the keys rows 1-2 attend and 1e30 on the last key (tau = 1e30 * 2^-1074 ... a normal number,
    alone in those rows' out_bound). Bottom-right causal, Nq > Nk: row 0 attends no key."""
    rng = np.random.default_rng(5)
    v = np.zeros((1, 2, 3, 2))
    v[0, 1, 2] = [1e30, -1e30]
    return _problem(rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 2, 3, 3)), v, "fp32",
                    causal=True)


_DOCUMENTED_CASES = {
    "variants": lambda: _variants_problem(np.random.default_rng(11)),
    "softcap_only": lambda: _variants_problem(np.random.default_rng(12), alibi_slopes=None, sinks=None),
    "alibi_only": lambda: _variants_problem(np.random.default_rng(13), softcap=None, sinks=None),
    "sinks_only": lambda: _variants_problem(np.random.default_rng(14), softcap=None, alibi_slopes=None),
    "split_support_gemm_rows": lambda: _split_support(
        np.random.default_rng(15), 2, 2, 1, 5, 6, 8, "fp16", big=150.0, causal=True,
        sinks=np.array([1.0, 30.0], np.float32)),
    "keys_over_one_pv_chunk": lambda: _normal(np.random.default_rng(16), 1, 1, 1, 2, 1100, 2, "fp32"),
    "tau": _tau_problem,
    "explicit_scale": lambda: _normal(np.random.default_rng(17), 1, 1, 1, 3, 4, 5, "fp32", spread=3.0,
                                      scale=0.3),
    "large_lse": lambda: _normal(np.random.default_rng(18), 1, 2, 2, 3, 4, 4, "fp32", spread=12.0),
}


@pytest.mark.parametrize("heads_at_once", ["all", "one"])
@pytest.mark.parametrize("name", sorted(_DOCUMENTED_CASES))
def test_certified_bounds_are_the_documented_formulas(name, heads_at_once, monkeypatch):
    """out_bound = coefficient * D + tau and the LSE bound, per row, as certified's docstring
    states them, on variants, masked rows, GEMM rows, N > 1024 and subnormal or huge tau; the
    same with the heads processed one at a time (_CHUNK_ENTRIES forced down)."""
    problem = _DOCUMENTED_CASES[name]()
    if heads_at_once == "one":
        monkeypatch.setattr(certified, "_CHUNK_ENTRIES", 1)
    ref = certified_reference(problem)
    _assert_certified_matches_documented(ref, problem)
    # Fully masked rows: out 0, row scale 0, bounds exactly 0 (the Reference contract).
    masked = problem.masked_rows
    if problem.sinks is None and masked.any():
        for arr in (ref.out, ref.row_scale, ref.out_bound, ref.lse_bound):
            assert (arr[:, :, masked] == 0).all()


def test_documented_cases_reach_what_they_are_for():
    """The cases above exercise the terms they are named for (else they would pin nothing)."""
    ref = certified_reference(_DOCUMENTED_CASES["split_support_gemm_rows"]())
    assert ref.gemm_rows >= 2 and ref.mpmath_rows < ref.out.shape[0] * ref.out.shape[1] * ref.out.shape[2]
    tau = certified_reference(_tau_problem())
    assert (tau.row_scale[0, 1, 1:3] == 0).all() and (tau.out_bound[0, 1, 1:3] > 1e-295).all()
    assert (tau.out_bound[0, 0, 1:] > 0).all() and (tau.out_bound[0, 0, 1:] < 1e-320).all()


def test_bounds_formula_with_large_alpha_and_no_bound_beyond_one():
    """_bounds against the documented formulas where alpha is far from 0 (each (1 +- alpha)
    factor visible), with tau a normal number, and alpha >= 1 (inf everywhere), all without a
    floating-point warning (overflow of exp, inf - inf are expected there)."""
    problem = _normal(np.random.default_rng(0), 1, 1, 1, 2, 3, 6, "fp32", scale=0.25)
    b_values = [0.0, 1e-9, 1e-3, 0.05, 0.2, 0.4, 0.7, 5.0, 800.0]
    m = np.array([[3.0, -200.0, 0.0, 7.0, -1.0, 2.0, 0.0, 1.0, 0.0]])
    l = np.array([[1.0, 2.5, 1e100, 3.0, 1.5, 7.0, 1.0, 1.0, 1.0]])
    magnitude = np.array([[0.0, 0.0, 10.0, 0.0, 1e3, 0.0, 0.0, 0.0, 0.0]])
    rounds, v_max = 9, np.array([1e300])
    # extra sets b: b = u|m| + g_{D+3} scale A + extra (scale exact: one rounding, k = 1)
    base = _U * np.abs(m) + _gamma(6 + 3) * 0.25 * magnitude
    extra = np.array([b_values]) - base
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, tau, lb = certified._bounds(problem, l, m, magnitude, rounds, v_max, extra)
    for col, b in enumerate(b_values):
        bb = float(base[0, col] + extra[0, col])
        exp = _documented_row_bounds(bb, rounds, l[0, col], m[0, col], problem.nk, 1e300)
        for got, want in zip((c[0, col], tau[0, col], lb[0, col]), exp):
            assert got == want or abs(got - want) <= _RTOL * abs(want), (b, got, want)
    assert math.isinf(c[0, -2]) and math.isinf(lb[0, -1])  # alpha >= 1 there
    # v_max = 0: the tau's (1 + v_max) factor shows alone
    _, tau0, _ = certified._bounds(problem, l, m, magnitude, rounds, np.array([0.0]), extra)
    exp = _documented_row_bounds(0.05, rounds, 3.0, 7.0, problem.nk, 0.0)[1]
    assert abs(tau0[0, 3] - exp) <= 4 * _SUBNORMAL and exp > 12 * _SUBNORMAL


def test_explicit_scale_counts_one_rounding_whatever_its_distance_to_one_over_sqrt_d():
    """An explicit scale is exact (k = 1): far from 1/sqrt(D), the default's count of roundings
    must not be applied to it."""
    problem = _normal(np.random.default_rng(0), 1, 1, 1, 1, 2, 5, "fp32", scale=0.3)
    assert _exact_scale_roundings(0.3, 5) > 1e10  # what the default's count would be
    m, l, magnitude = np.array([[2.0]]), np.array([[1.5]]), np.array([[40.0]])
    c, _, _ = certified._bounds(problem, l, m, magnitude, 3, np.array([1.0]))
    b = _U * 2.0 + _gamma(5 + 3) * 0.3 * 40.0
    assert abs(c[0, 0] - _documented_row_bounds(b, 3, 1.5, 2.0, 2, 1.0)[0]) <= _RTOL * c[0, 0]


def test_softmax_output_coefficient_is_the_documented_formula():
    """alpha = r + gamma_n (1 + r), coefficient = 2a/(1-a) + unit (1 + 2a/(1-a)); inf once
    alpha >= 1 (never a negative or nan coefficient, never a warning)."""
    from fa_verify.oracle.bounds import softmax_output_coefficient
    unit = 2.0 ** -10
    for r, n in [(0.0, 5), (0.01, 3), (0.2, 40), (0.45, 100), (0.9, 0)]:
        nu = n * unit
        alpha = r + nu / (1 - nu) * (1 + r)
        ratio = 2 * alpha / (1 - alpha)
        c, a = softmax_output_coefficient(r, n, unit)
        assert abs(float(a) - alpha) <= 1e-14 * alpha + 1e-300
        assert abs(float(c) - (ratio + unit * (1 + ratio))) <= 1e-14 * c
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for r, n in [(1.0, 0), (1.5, 0), (0.6, 400), (math.inf, 1)]:  # alpha = 1, 1.5, > 1, inf
            c, a = softmax_output_coefficient(np.array([r]), n, unit)
            assert c[0] == math.inf and not a[0] < 1


def _mp_rows_expected(problem, rows, digits):
    """out, LSE, row scale of mpmath rows at `digits` and their bounds as documented:
    coefficient * D + u |out| (the float64 rounding of out), alpha + u |LSE|, 0 where LSE = -inf."""
    coefficient, alpha = certified.mp_row_bounds(problem, rows, digits)
    got = {}
    for (b, h, i, o, lse, s), c, a in zip(mp_path.mp_rows(problem, rows, digits), coefficient, alpha):
        got[b, h, i] = (o, lse, s, c * s + _U * np.abs(o), a + _U * abs(lse) if math.isfinite(lse) else 0.0)
    return got


def _mp_case():
    """Bottom-right causal with Nq > Nk (row 0 attends nothing); logits of some hundreds (|LSE|
    large: its u |LSE| term dominates alpha); v of mixed signs and size (row scale != 1)."""
    rng = np.random.default_rng(21)
    return _problem(rng.standard_normal((1, 2, 4, 3)) * 12, rng.standard_normal((1, 2, 3, 3)) * 12,
                    rng.standard_normal((1, 2, 3, 2)) * 3, "fp32", causal=True)


def _assert_reference_is_mp_rows(ref, problem, digits):
    B, H, Nq, _ = problem.out_shape
    rows = [(b, h, i) for b in range(B) for h in range(H) for i in range(Nq)]
    expected = _mp_rows_expected(problem, rows, digits)
    assert ref.mpmath_rows == len(rows)
    for (b, h, i), (o, lse, s, ob, lb) in expected.items():
        np.testing.assert_array_equal(ref.out[b, h, i], o)  # the same mpmath values, rounded once
        np.testing.assert_array_equal(ref.row_scale[b, h, i], s)
        assert ref.lse[b, h, i] == lse
        _assert_close(ref.out_bound[b, h, i], ob)
        _assert_close(ref.lse_bound[b, h, i], lb)
    lse_finite = np.isfinite(ref.lse)
    assert not lse_finite.all() and (ref.lse_bound[~lse_finite] == 0).all()
    assert (np.abs(ref.lse[lse_finite]) > 50).any()  # the u |LSE| term is visible


def test_mpmath_method_bounds_are_assembled_as_documented():
    """reference(method="mpmath") at 15 digits (a coefficient comparable to u |out|): every row is
    mpmath's at those digits with coefficient * D + u |out| and alpha + u |LSE| (0 when masked)."""
    problem = _mp_case()
    ref = reference(problem, "mpmath", digits=15)
    assert ref.method == "mpmath" and ref.gemm_rows == 0
    assert ref.lse_bound.dtype == np.float64 and ref.row_scale.shape == ref.out.shape
    _assert_reference_is_mp_rows(ref, problem, 15)
    # 15 digits must differ from the default's 50 somewhere (else the digits would pin nothing)
    assert not np.array_equal(mp_path.mp_reference_arrays(problem, 50)[0], ref.out)


def test_certified_rows_handed_to_mpmath_are_assembled_as_documented():
    """threshold < 0 sends every row (masked ones too) to mpmath at the given digits."""
    problem = _mp_case()
    ref = certified_reference(problem, digits=15, threshold=-1.0)
    assert ref.method == "certified"
    _assert_reference_is_mp_rows(ref, problem, 15)


def test_reference_passes_digits_to_the_certified_path():
    """The certified path's mpmath rows use the caller's digits (their bounds depend on them)."""
    problem = _adversarial(np.random.default_rng(0))["fp32_enormous_logits"]
    ref = reference(problem, digits=20)
    assert ref.mpmath_rows > 0
    want = certified_reference(problem, digits=20)
    for name in ("out", "lse", "out_bound", "lse_bound"):
        np.testing.assert_array_equal(getattr(ref, name), getattr(want, name))
    assert not np.array_equal(certified_reference(problem).out_bound, want.out_bound)


def test_wrong_problem_type_message_names_real_apis():
    """The message points to AttentionProblem(...), AttentionProblem.from_float and
    fa_verify.oracle.ragged.reference_ragged: each name it spells must exist."""
    with pytest.raises(InvalidArgumentError) as info:
        reference(np.zeros((1, 1, 2, 2)))
    message = str(info.value)
    dotted = re.findall(r"\bfa_verify(?:\.\w+)+", message)
    assert dotted
    for name in dotted:
        module, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attr), name
    methods = re.findall(r"\bAttentionProblem\.(\w+)\(q, k, v, 'fp16'", message)
    assert methods and all(hasattr(AttentionProblem, x) for x in methods)
    assert "AttentionProblem(q, k, v, causal=" in message


# --- Mutation kills (helper B): the mpmath path's a-posteriori bound (mp_path.mp_bound) and its
# inputs per row (certified.mp_row_bounds), both grades of A_i (_gemm_magnitude, _norm_magnitude),
# bounds.gamma, the mpmath rows' row scale and rows without keys, the wrong-type message:
# recomputed from mp_path's, certified's and bounds' docstrings in plain floats / mpmath.

def _documented_mp_bound(nk, d, scale, magnitude, logit, digits):
    """mp_bound's docstring: unit = 2^-prec at `digits`, score error (D + 3) unit scale A +
    4 unit L, r = expm1(score error + 2 unit) (x's subtraction and exp), alpha = r +
    gamma_{N+4} (1 + r), coefficient 2 alpha / (1 - alpha) + unit (1 + that); both doubled."""
    with mpmath.workdps(digits):
        unit = 2.0 ** -mpmath.mp.prec
    r = math.expm1((d + 3) * unit * scale * magnitude + 4 * unit * logit + 2 * unit)
    n = nk + 4
    alpha = r + n * unit / (1 - n * unit) * (1 + r)
    ratio = 2 * alpha / (1 - alpha)
    return 2 * (ratio + unit * (1 + ratio)), 2 * alpha


@pytest.mark.parametrize("nk, d, scale, magnitude, logit, digits", [
    (5, 8, 0.35, 10.0, 50.0, 15),     # every term within a factor ~30 of the others
    (3, 64, 0.125, 300.0, 1.0, 15),   # the scores' term dominates
    (1000, 4, 0.5, 1.0, 0.0, 20),     # the sums' N + 4 roundings dominate
    (0, 2, 3.0, 0.0, 7.0, 30),        # no key (a sink row): the logits' term and the constants
])
def test_mp_bound_is_its_documented_formula(nk, d, scale, magnitude, logit, digits):
    """Each term of the mpmath path's bound is its docstring's, to 1e-12 (every term is more than
    1e-4 of the bound on these inputs, so a changed constant or sign shows)."""
    got = mp_path.mp_bound(nk, d, scale, magnitude, logit, digits)
    want = _documented_mp_bound(nk, d, scale, magnitude, logit, digits)
    for g, w in zip(got, want, strict=True):
        assert w > 0 and abs(float(g) - w) <= _RTOL * w, (g, w)


def _documented_mp_row_bounds(problem, rows, digits):
    """mp_row_bounds's inputs to mp_bound, per row: A = max over attended keys of
    sum_d |q_d||k_d| and L = max |scale q.k|, each times 1.01 (L + 1); with variants L =
    2 (2 max|scale q.k| + max|bias| + |sink|) and the sink one more term of the sums."""
    q = problem.q.astype(np.float64)
    k = problem.k.astype(np.float64)
    g, scale, d = problem.group_size, problem.scale_value, problem.head_dim
    starts, limits = problem.key_start(), problem.key_limit()
    coefficients, alphas = [], []
    for b, h, i in rows:
        keys = range(starts[i], limits[i])
        qi, kh = [float(x) for x in q[b, h, i]], k[b, h // g]
        a = max((math.fsum(abs(x * float(y)) for x, y in zip(qi, kh[j], strict=True)) for j in keys), default=0.0)
        t = max((abs(scale * math.fsum(x * float(y) for x, y in zip(qi, kh[j], strict=True))) for j in keys),
                default=0.0)
        n = len(keys)
        if problem.features:
            bias = 0.0
            if problem.alibi_slopes is not None:
                slopes = problem.alibi_slopes
                slope = float(slopes[b, h] if slopes.ndim == 2 else slopes[h])
                bias = max((abs(slope) * abs(i + problem.diagonal_offset - j) for j in keys), default=0.0)
            sink = 0.0 if problem.sinks is None else abs(float(problem.sinks[h]))
            t = 2 * (2 * t + bias + sink)
            n += problem.sinks is not None
        c, al = _documented_mp_bound(n, d, scale, 1.01 * a, 1.01 * t + 1, digits)
        coefficients.append(c)
        alphas.append(al)
    return np.array(coefficients), np.array(alphas)


_MP_ROW_CASES = {
    # plain rows: causal Nq > Nk (row 0 attends nothing), logits in the hundreds
    "plain": _mp_case,
    # features, but every |score| < 1 and no bias or sink: the constant terms stand alone
    "softcap_small_scores": lambda: _problem(
        np.random.default_rng(31).standard_normal((1, 2, 3, 4)) * 0.3,
        np.random.default_rng(32).standard_normal((1, 1, 5, 4)) * 0.3,
        np.random.default_rng(33).standard_normal((1, 1, 5, 4)), "fp32", softcap=5.0),
    # ALiBi and sinks of the size of the scores, GQA, causal with rows that see only the sink
    "alibi_sinks": lambda: _variants_problem(np.random.default_rng(34), softcap=None),
    # everything at once, per-batch ALiBi slopes
    "everything": lambda: _variants_problem(
        np.random.default_rng(35), alibi_slopes=np.array([[0.25, 4.0, 1.0], [2.0, 0.5, 8.0]], np.float32)),
}


@pytest.mark.parametrize("digits", [15, 30])
@pytest.mark.parametrize("name", sorted(_MP_ROW_CASES))
def test_mp_row_bounds_feed_mp_bound_the_documented_magnitudes(name, digits):
    """The mpmath rows' bounds (both paths use them) are mp_bound of each row's documented A, L
    and N, to 1e-12: the scores, biases and sink all reach it."""
    problem = _MP_ROW_CASES[name]()
    B, H, Nq, _ = problem.out_shape
    rows = [(b, h, i) for b in range(B) for h in range(H) for i in range(Nq)]
    got = certified.mp_row_bounds(problem, rows, digits)
    want = _documented_mp_row_bounds(problem, rows, digits)
    for g, w in zip(got, want, strict=True):
        _assert_close(g, w)


def test_mp_row_bound_cases_reach_what_they_are_for():
    """The cases above have what their names say (else they would pin nothing)."""
    small = _MP_ROW_CASES["softcap_small_scores"]()
    t = np.abs(small.scale_value * small.q64()[0] @ small.kv64()[0][0].swapaxes(-1, -2))
    assert small.features and t.max() < 1 and small.sinks is None and small.alibi_slopes is None
    for name in ("alibi_sinks", "everything"):
        problem = _MP_ROW_CASES[name]()
        assert problem.masked_rows.any() and problem.sinks is not None and problem.alibi_slopes is not None
    assert _MP_ROW_CASES["plain"]().masked_rows.any() and not _MP_ROW_CASES["plain"]().features


def test_gemm_magnitude_is_the_exact_attended_maximum_over_one_minus_gamma_d():
    """The tight A_i is max over the keys row i attends of sum_d |q_d||k_d|, over (1 - g_D), to
    1e-12 (not merely above it): entries of size 0.1, so each sum is far below 1 and a masked key
    counted as anything but 0 would show; bottom-right causal with Nq > Nk (row 0 attends nothing)."""
    rng = np.random.default_rng(41)
    problem = _problem(rng.standard_normal((1, 2, 5, 6)) * 0.1, rng.standard_normal((1, 2, 4, 6)) * 0.1,
                       rng.standard_normal((1, 2, 4, 6)), "fp32", causal=True)
    q, k = problem.q64()[0], problem.kv64()[0][0]
    limits = problem.key_limit()
    exact = np.array([[max((math.fsum(np.abs(q[h, i] * k[h, j])) for j in range(limits[i])), default=0.0)
                       for i in range(problem.nq)] for h in range(2)]) / (1 - _gamma(6))
    assert exact.max() < 0.5 and (limits == 0).any()
    rows = np.nonzero(np.ones(exact.shape, dtype=bool))
    _assert_close(certified._gemm_magnitude(q, k, problem.mask, rows), exact.ravel())


def test_mpmath_row_scale_is_the_weighted_mean_of_abs_v():
    """The mpmath path's row scale D_c = sum_j p_j |v_jc| / sum_j p_j (mp_path._row's docstring),
    recomputed in float64 with fsum from the logits, to 1e-12; rows with several comparable keys
    (sum_j p_j far from 1 relative to the row's max)."""
    rng = np.random.default_rng(42)
    problem = _problem(rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 5, 4)),
                       rng.standard_normal((1, 1, 5, 3)) * 4, "fp32")
    ref = reference(problem, "mpmath")
    q, k, v = problem.q64()[0], problem.kv64()[0][0], problem.kv64()[1][0]
    for h in range(2):
        for i in range(3):
            t = [problem.scale_value * math.fsum(q[h, i] * k[h, j]) for j in range(5)]
            p = [math.exp(x - max(t)) for x in t]
            assert math.fsum(p) > 1.5
            want = [math.fsum(w * abs(v[h, j, c]) for j, w in enumerate(p)) / math.fsum(p) for c in range(3)]
            _assert_close(ref.row_scale[0, h, i], want)


def test_mpmath_rows_without_keys_have_lse_minus_inf():
    """The mpmath path (whole problem, and rows handed over by the certified path) gives a row
    that attends no key out 0, row scale 0, LSE -inf and bounds 0, as the Reference contract says."""
    problem = _mp_case()  # row 0 of each head attends no key
    masked = problem.masked_rows
    assert masked.any()
    for ref in (reference(problem, "mpmath", digits=15), certified_reference(problem, digits=15, threshold=-1.0)):
        assert (ref.lse[:, :, masked] == -np.inf).all() and np.isfinite(ref.lse[:, :, ~masked]).all()
        for arr in (ref.out, ref.row_scale, ref.out_bound, ref.lse_bound):
            assert (arr[:, :, masked] == 0).all()


def test_norm_magnitude_is_the_documented_product_of_norms_bit_for_bit():
    """The free A_i = |q_i| / (1 - g_{D+1}) * max over keys j < limit_i (at least key 0) of
    |k_j| / (1 - g_{D+1}). Integer entries with integer norms (3^2 + 4^2 = 5^2, 1 + 4 + 4 + 16 =
    5^2, ...) make every sum of squares and sqrt exact, so the only roundings are the documented
    divisions and product, and the result is pinned bit for bit: a slack of g_{D+2}, g_D or
    g_{Nq+1} moves it by an ulp. Nq = 3 and D = 4 differ; bottom-right causal over 5 keys."""
    quads = np.array([[1, 2, 2, 0], [2, 3, 6, 0], [1, 4, 8, 0], [4, 4, 7, 0], [0, 0, 0, 5],
                      [3, 4, 0, 0], [1, 2, 2, 4], [2, 4, 5, 6], [2, 6, 9, 0]], dtype=np.float64)
    norms = np.array([3, 7, 9, 9, 5, 5, 5, 9, 11], dtype=np.float64)
    assert (np.sqrt((quads * quads).sum(axis=-1)) == norms).all()
    rng = np.random.default_rng(43)
    q_pick, k_pick = np.array([[7, 1, 4], [8, 2, 6]]), np.array([[0, 5, 8, 3, 1], [4, 2, 6, 7, 0]])
    q = quads[q_pick] * rng.choice([-1.0, 1.0], (2, 3, 4))
    k = quads[k_pick] * rng.choice([-1.0, 1.0], (2, 5, 4))
    problem = _problem(q[None], k[None], np.ones((1, 2, 5, 1)), "fp32", causal=True)
    limits = problem.key_limit()
    assert list(limits) == [3, 4, 5]
    slack = 1 - _gamma(4 + 1)
    q_norm, k_norm = norms[q_pick] / slack, norms[k_pick] / slack
    want = np.array([[q_norm[h, i] * max(k_norm[h, :limits[i]]) for i in range(3)] for h in range(2)])
    got = certified._norm_magnitude(problem.q64()[0], problem.kv64()[0][0], limits)
    np.testing.assert_array_equal(got, want)
    # a row that attends no key takes key 0's norm (its bound is never used: p = 0 there)
    np.testing.assert_array_equal(certified._norm_magnitude(q, k, np.array([0, 0, 2]))[:, 0],
                                  q_norm[:, 0] * k_norm[:, 0])


def test_wrong_problem_type_message_names_the_type_given():
    """The message says which type it got (the caller's, not a placeholder)."""
    for bad, name in [(np.zeros((1, 1, 2, 2)), "ndarray"), ([1.0], "list"), (None, "NoneType")]:
        with pytest.raises(InvalidArgumentError, match=f"got {name};"):
            reference(bad)


def test_gamma_is_n_u_over_one_minus_n_u_and_inf_from_n_u_equal_one():
    """bounds.gamma: n u / (1 - n u) while n u < 1, inf from n u = 1 on (exactly 1 included, and
    between 1 and 2), elementwise over arrays of counts, in float64 whatever the counts' type
    (integers, float32 or float16), no warning."""
    from fa_verify.oracle.bounds import gamma
    unit = 2.0 ** -10
    counts = np.array([0, 1, 7, 512, 1000, 1023, 1024, 1025, 1536, 2047, 2048, 5000])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = gamma(counts, unit)
        scalar = gamma(1024, unit)
    assert got.dtype == np.float64 and got.shape == counts.shape
    for n, g in zip(counts.tolist(), got.tolist(), strict=True):
        nu = n * unit
        assert (g == nu / (1 - nu)) if nu < 1 else g == math.inf, (n, g)
    assert scalar == math.inf
    assert gamma(3) == 3 * _U / (1 - 3 * _U)  # float64's u by default
    # a count held in a narrower float type is the same count: the arithmetic stays float64
    for dtype in (np.float32, np.float16):
        g32 = gamma(np.array([3, 1000], dtype=dtype))
        assert g32.dtype == np.float64 and g32.tolist() == [3 * _U / (1 - 3 * _U), 1000 * _U / (1 - 1000 * _U)]


def _sink_far_above():
    """Sinks 700 and 690 above scores below 0.1: at 15 digits each x = z - sink rounds at
    |sink| 2^-53 ~ 8e-14 (p ~ 1e-304 is still a normal float64), far above every other term of
    the row's bound: only mp_bound's sink term covers it."""
    rng = np.random.default_rng(44)
    return _problem(rng.standard_normal((1, 2, 3, 4)) * 0.15, rng.standard_normal((1, 1, 6, 4)) * 0.15,
                    rng.standard_normal((1, 1, 6, 3)), "fp32", sinks=np.array([700.0, 690.0], np.float32))


@pytest.mark.parametrize("name", sorted(_MP_ROW_CASES) + ["sink_far_above"])
def test_mpmath_at_15_digits_within_its_bound_of_60_digits(name):
    """The other side of the mpmath rows' bound: at 15 digits (a coefficient of a few 1e-15) the
    computed rows are within it of the 60-digit ones, variants and rows without keys included;
    the bound stays below 1e-11 of the row scale (measured: the error reaches 0.2 % to 9 % of it)."""
    problem = _sink_far_above() if name == "sink_far_above" else _MP_ROW_CASES[name]()
    low, high = reference(problem, "mpmath", digits=15), reference(problem, "mpmath", digits=60)
    _assert_within_bounds(low, high)
    assert (low.out_bound <= 1e-11 * low.row_scale + 2.0 ** -52 * np.abs(low.out)).all()
