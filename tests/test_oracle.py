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
