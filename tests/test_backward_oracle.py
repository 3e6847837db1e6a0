"""The gradient oracle: the certified float64 path within its bound of the mpmath definition on
adversarial cases of every variant, both against central finite differences of the certified
forward, and structural zeros exact."""

import itertools
import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest

from fa_verify import AttentionProblem, InvalidArgumentError
from fa_verify.dtypes import round_to
from fa_verify.oracle import reference
from fa_verify.oracle.backward import gradient_reference
from fa_verify.oracle.certified import certified_reference

#: The certified bound, relative to its tensor's natural scale (`_natural_scale`: the size of the
#: terms whose sum is the gradient, which may cancel), measured on these cases: at most 7e-14, and
#: 9.4e-12 on split_support (logits in the hundreds, max|k| 300x the typical |k|). Far below fp32's
#: unit roundoff (6e-8), so the error model's reference term never matters; the limit catches a
#: bound loosened 4x on split_support, and test_certified_bound_is_not_loose its ratio to the
#: true error on every tensor.
RELATIVE_BOUND_LIMIT = 3e-11
#: certified bound / |certified - mpmath| at the worst element of each tensor: never below 1
#: (soundness; measured minimum 47 on test_certified_bound_is_not_loose's cases, 37 over all), and
#: a median (measured 251) below MEDIAN_LOOSENESS: a bound loosened 4x (median 1000) fails. The
#: bound uses max|values| instead of GEMMs of magnitudes (no extra GEMM): hence the factor ~250.
SOUND = 1.0
MEDIAN_LOOSENESS = 800.0


def _problem(rng, b, h, hkv, nq, nk, d, dtype="fp32", spread=1.0, **kw):
    return AttentionProblem.from_float(rng.standard_normal((b, h, nq, d)) * spread,
                                       rng.standard_normal((b, hkv, nk, d)) * spread,
                                       rng.standard_normal((b, hkv, nk, d)), dtype, **kw)


def _adversarial():
    rng = np.random.default_rng(21)
    d = 6
    cases = {}
    # every key aligned with one direction, the queries against it: logits ~ -100, LSE ~ -100
    direction = np.abs(rng.standard_normal(d)) + 1
    k = direction * (1 + 0.05 * rng.standard_normal((1, 1, 7, d)))
    q = -direction * 100 * np.sqrt(d) / (direction @ direction) * (1 + 0.01 * rng.standard_normal((1, 2, 4, 1)))
    cases["negative_lse"] = AttentionProblem.from_float(q, k, rng.standard_normal((1, 1, 7, d)), "fp32")
    # V nearly constant along the keys: dP ~ D, dS cancels
    v = np.ones((1, 1, 9, d)) + 1e-4 * rng.standard_normal((1, 1, 9, d))
    cases["near_uniform_cancelling"] = AttentionProblem.from_float(
        rng.standard_normal((1, 1, 5, d)) * 0.1, rng.standard_normal((1, 1, 9, d)), v, "fp32")
    q = rng.standard_normal((1, 1, 4, d))
    k = rng.standard_normal((1, 1, 8, d)) * 0.01
    k[:, :, 3] = q[:, :, 0] * 8
    cases["dominant_key"] = AttentionProblem.from_float(q, k, rng.standard_normal((1, 1, 8, d)), "fp16")
    # q large where k is small and back: the free norm bound is loose, logits in the hundreds
    weights = np.r_[np.full(d // 2, 300.0), np.full(d - d // 2, 0.5)]
    cases["split_support"] = AttentionProblem.from_float(rng.standard_normal((1, 1, 4, d)) * weights,
                                                         rng.standard_normal((1, 1, 6, d)) * weights[::-1],
                                                         rng.standard_normal((1, 1, 6, d)), "fp32")
    cases["gqa_3"] = _problem(rng, 1, 3, 1, 4, 6, d, "bf16")
    cases["gqa_5_batch_2"] = _problem(rng, 2, 5, 1, 3, 5, d, "fp16")
    cases["causal_bottom_right_nq_gt_nk"] = _problem(rng, 1, 2, 1, 7, 4, d, causal=True)
    cases["causal_top_left_nq_lt_nk"] = _problem(rng, 1, 2, 2, 4, 7, d, causal=True,
                                                 causal_alignment="top-left")
    cases["window"] = _problem(rng, 1, 2, 1, 6, 9, d, window_size=(1, 2))
    cases["softcap_binding"] = _problem(rng, 1, 2, 1, 4, 6, d, spread=3.0, softcap=1.5)
    cases["alibi"] = _problem(rng, 1, 2, 1, 5, 6, d, "bf16", alibi_slopes=[0.5, 8.0], causal=True)
    cases["sinks"] = _problem(rng, 2, 3, 1, 4, 5, d, sinks=[2.0, -1.0, 40.0])
    # the sink 720 above every logit: the keys' p ~ e^-720 are subnormal (exp's absolute error)
    cases["sink_subnormal_p"] = _problem(rng, 1, 2, 1, 3, 4, d, sinks=[720.0, 0.0])
    cases["sinks_empty_rows"] = _problem(rng, 1, 2, 1, 6, 3, d, causal=True, sinks=[0.5, -3.0])
    cases["everything"] = _problem(rng, 1, 3, 1, 5, 7, d, "fp16", spread=2.0, causal=True, window_size=(3, 0),
                                   softcap=3.0, alibi_slopes=[0.25, 1.0, 2.0], sinks=[1.0, 0.0, -1.0])
    return cases


CASES = _adversarial()


def _upstream(problem, seed, with_dlse):
    rng = np.random.default_rng(seed)
    dout = round_to(rng.standard_normal(problem.out_shape), problem.dtype)
    dlse = rng.standard_normal(problem.lse_shape).astype(np.float32) if with_dlse else None
    return dout, dlse


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no_dlse", "dlse"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_certified_gradients_within_their_bound_of_mpmath(name, with_dlse):
    problem = CASES[name]
    dout, dlse = _upstream(problem, 1, with_dlse)
    fast = gradient_reference(problem, dout, dlse)
    exact = gradient_reference(problem, dout, dlse, method="mpmath")
    assert set(fast.tensors()) == set(exact.tensors()) == ({"dq", "dk", "dv"} | (
        {"dsinks"} if problem.sinks is not None else set()))
    for tensor, (value, bound) in fast.tensors().items():
        mp_value, mp_bound = exact.tensors()[tensor]
        natural = _natural_scale(problem, dout, dlse, tensor)
        assert (mp_bound <= 1e-30 * natural + 2.0 ** -52 * np.abs(mp_value) + 2.0 ** -1074).all(), tensor
        error = np.abs(value - mp_value)
        assert (error <= bound + mp_bound).all(), (tensor, (error / (bound + mp_bound)).max())
        assert bound.max() <= RELATIVE_BOUND_LIMIT * natural, (tensor, bound.max() / natural)


def _natural_scale(problem, dout, dlse, tensor):
    """A coarse upper bound of the magnitudes summed into `tensor`: |dS| <= p (|dP| + |D| + |dlse|)
    with |dP|, |D| <= D max|dO| max|V|; dK, dV sum G Nq rows, dsinks B Nq."""
    big = lambda x: float(np.abs(np.asarray(x, np.float64)).max())  # noqa: E731
    up = 0.0 if dlse is None else big(dlse)
    ds = 2 * problem.head_dim * big(dout) * big(problem.v) + up
    rows = problem.group_size * problem.nq
    return {"dq": problem.scale_value * ds * big(problem.k),
            "dk": problem.scale_value * ds * big(problem.q) * rows,
            "dv": big(dout) * rows, "dsinks": (ds + up) * problem.batch * problem.nq}[tensor]


def test_certified_bound_is_not_loose():
    """At the worst element of each tensor the bound is at least SOUND times the true error, and
    the median of those ratios stays below MEDIAN_LOOSENESS."""
    ratios = []
    for name in ("near_uniform_cancelling", "gqa_3", "sinks", "softcap_binding"):
        problem = CASES[name]
        dout, dlse = _upstream(problem, 2, True)
        fast = gradient_reference(problem, dout, dlse)
        exact = gradient_reference(problem, dout, dlse, method="mpmath")
        for tensor, (value, bound) in fast.tensors().items():
            error = np.abs(value - exact.tensors()[tensor][0])
            worst = np.unravel_index(np.argmax(error), error.shape)
            ratios.append(bound[worst] / error[worst] if error[worst] else np.inf)
    assert min(ratios) >= SOUND
    assert np.median(ratios) <= MEDIAN_LOOSENESS, sorted(ratios)


def _mp_magnitudes_by_the_doc(problem, dout, dlse):
    """The mpmath path's magnitudes and amplification, written out from the module doc in plain
    float64 loops: the |.|-versions of the sums (|D_i| <- sum |dO| |O|, |dS_ij| <- P_ij (|V_j|.|dO_i|
    + |D_i| + |dlse_i|), dQ, dK = scale |dS| |K|, |dS|^T |Q|, dV = P^T |dO|, dsink = P_sink (|D| + |dlse|),
    a row without keys giving its |dlse| to the sink), and amp = max(1, 4 max|z| + 4 + scale max A)."""
    B, H, Nq, D = problem.out_shape
    G, Nk = problem.group_size, problem.nk
    q, k, v = (np.asarray(x, np.float64) for x in (problem.q, problem.k, problem.v))
    scale = problem.scale_value
    mags = {"dq": np.zeros((B, H, Nq, D)), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape),
            "delta": np.zeros((B, H, Nq)), "dsinks": np.zeros(H)}
    amp = 1.0
    for b, h, i in np.ndindex(B, H, Nq):
        hk = h // G
        up = 0.0 if dlse is None else abs(float(dlse[b, h, i]))
        keys = [j for j in range(Nk) if problem.mask[i, j]]
        if not keys:
            if problem.sinks is not None:
                mags["dsinks"][h] += up
            continue
        z = [scale * math.fsum(q[b, h, i] * k[b, hk, j]) for j in keys]
        z += [] if problem.sinks is None else [float(problem.sinks[h])]
        e = [math.exp(x - max(z)) for x in z]
        p = [x / math.fsum(e) for x in e]
        amp = max(amp, 4 * max(abs(x) for x in z) + 4
                  + scale * max(math.fsum(np.abs(q[b, h, i]) * np.abs(k[b, hk, j])) for j in keys))
        do = np.abs(dout[b, h, i])
        out = [math.fsum(p[n] * v[b, hk, j, c] for n, j in enumerate(keys)) for c in range(D)]
        mag_delta = math.fsum(do[c] * abs(out[c]) for c in range(D))
        mags["delta"][b, h, i] = mag_delta
        for n, j in enumerate(keys):
            g = p[n] * (math.fsum(np.abs(v[b, hk, j]) * do) + mag_delta + up)
            mags["dq"][b, h, i] += scale * g * np.abs(k[b, hk, j])
            mags["dk"][b, hk, j] += scale * g * np.abs(q[b, h, i])
            mags["dv"][b, hk, j] += p[n] * do
        if problem.sinks is not None:
            mags["dsinks"][h] += p[-1] * (mag_delta + up)
    return mags, amp


def _mp_precision(digits):
    with mpmath.workdps(digits):
        return mpmath.mp.prec


def _mp_bounds_by_the_doc(problem, dout, dlse, digits, values):
    """coefficient = 8 (G Nq + Nk + D + 40) 2^-prec amp times the magnitudes, + half an ulp of the
    value, + a subnormal spacing wherever the magnitude is not a structural zero."""
    mags, amp = _mp_magnitudes_by_the_doc(problem, dout, dlse)
    _, _, Nq, D = problem.out_shape
    n = problem.group_size * Nq + problem.nk + D + 40
    coefficient = 8 * n * 2.0 ** -_mp_precision(digits) * amp
    return {name: coefficient * mag + 2.0 ** -53 * np.abs(values[name]) + np.where(mag > 0, 2.0 ** -1074, 0.0)
            for name, mag in mags.items()}


def _mp_case():
    """GQA (G = 2), two batch entries, sinks, and bottom-right causal with Nq > Nk: rows 0 and 1 of
    every head see no key (their dlse goes to the sink), rows see 1 to 3 keys."""
    return _problem(np.random.default_rng(31), 2, 4, 2, 5, 3, 4, causal=True, sinks=[1.5, -0.75, 2.0, 0.25])


@pytest.mark.parametrize("scale_of_dout", [1.0, 2.0 ** -1062], ids=["normal", "subnormal"])
def test_mpmath_bound_is_the_documented_formula(scale_of_dout):
    """The mpmath path's bounds (dq, dk, dv, dsinks and delta) against the module doc's formula
    recomputed here. At 15 digits (prec 53) the coefficient term is ~1e-13 of the magnitudes and
    dominates half an ulp of the value ~1000x, so every factor of it shows; the magnitudes here and
    there differ only by float64 roundings of p (~1e-15 relative): rtol 1e-9. With dout and dlse
    scaled into the subnormal range the coefficient and ulp terms underflow to 0 and the bound is
    exactly one subnormal spacing wherever the magnitude is positive, 0 at structural zeros."""
    problem = _mp_case()
    dout, dlse = _upstream(problem, 11, True)
    dout, dlse = dout.astype(np.float64) * scale_of_dout, dlse.astype(np.float64) * scale_of_dout
    grads = gradient_reference(problem, dout, dlse, method="mpmath", digits=15)
    values = {"dq": grads.dq, "dk": grads.dk, "dv": grads.dv, "dsinks": grads.dsinks, "delta": grads.delta}
    expected = _mp_bounds_by_the_doc(problem, dout, dlse, 15, values)
    got = {"dq": grads.dq_bound, "dk": grads.dk_bound, "dv": grads.dv_bound, "dsinks": grads.dsinks_bound,
           "delta": grads.delta_bound}
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-9, atol=0, err_msg=name)
    if scale_of_dout != 1.0:
        assert (grads.dq_bound[:, :, problem.masked_rows] == 0).all()
        assert (grads.dq_bound[:, :, ~problem.masked_rows] == 2.0 ** -1074).all()
        assert (grads.dv_bound == 2.0 ** -1074).all()


def test_mpmath_without_sinks_has_no_sink_gradient_nor_bound():
    problem = _problem(np.random.default_rng(32), 1, 2, 1, 3, 4, 4)
    dout, dlse = _upstream(problem, 12, True)
    grads = gradient_reference(problem, dout, dlse, method="mpmath", digits=15)
    assert grads.dsinks is None and grads.dsinks_bound is None
    assert set(grads.tensors()) == {"dq", "dk", "dv"}


def test_mpmath_error_with_exact_logits_needs_no_amplification():
    """Logits 2^20 + a_j 2^-9 are exact at 8 digits (prec 30: fp32 q, k with 30 significant bits
    in q.k, scale 1/2): the softmax's shift z - max z is then exact too, and the gradients at 8
    digits are within 8 (G Nq + Nk + D + 40) 2^-prec of their magnitudes (the documented
    coefficient without `amp`, which pays for rounded logits) of the 50-digit ones (measured: 0.4% of
    that at most). Shifting by + max z instead (the same softmax in exact arithmetic) would round
    2^21 + ... to 2^-9 absolute, a relative error of p ~2^-10, 2000x that coefficient."""
    q = np.zeros((1, 1, 2, 4), np.float32)
    q[0, 0, :, 0], q[0, 0, :, 1] = 2.0 ** 21, [1.0, 3.0]
    k = np.zeros((1, 1, 4, 4), np.float32)
    k[0, 0, :, 0], k[0, 0, :, 1] = 1.0, np.array([1, 2, 5, 8]) * 2.0 ** -8
    v = np.random.default_rng(33).standard_normal((1, 1, 4, 4)).astype(np.float32)
    problem = AttentionProblem(q, k, v)
    dout, _ = _upstream(problem, 13, False)
    dout = dout.astype(np.float64)
    low = gradient_reference(problem, dout, method="mpmath", digits=8)
    high = gradient_reference(problem, dout, method="mpmath", digits=50)
    mags, _ = _mp_magnitudes_by_the_doc(problem, dout, None)
    unit = 8 * (problem.nq + problem.nk + 4 + 40) * 2.0 ** -_mp_precision(8)
    for name, (value, _) in low.tensors().items():
        exact, exact_bound = high.tensors()[name]
        assert (np.abs(value - exact) <= unit * mags[name] + 2.0 ** -53 * np.abs(value) + exact_bound
                + 2.0 ** -1074).all(), name


def test_forward_of_the_gradients_uses_the_requested_digits():
    """fp16 logits ~1e9 send every row of the forward to mpmath; its bounds depend on the digits
    (2^-prec), and the record's forward is certified_reference at the digits asked for."""
    rng = np.random.default_rng(0)
    big = lambda shape: np.full(shape, 65504.0) * rng.choice([-1, 1], shape)  # noqa: E731
    problem = AttentionProblem.from_float(big((1, 1, 3, 4)), big((1, 1, 4, 4)),
                                          rng.standard_normal((1, 1, 4, 4)), "fp16")
    dout, _ = _upstream(problem, 14, False)
    forward = certified_reference(problem, digits=20)
    assert forward.mpmath_rows > 0
    grads = gradient_reference(problem, dout, digits=20)
    np.testing.assert_array_equal(grads.forward.out_bound, forward.out_bound)
    np.testing.assert_array_equal(grads.forward.lse_bound, forward.lse_bound)
    assert (certified_reference(problem, digits=50).out_bound != forward.out_bound).any()


def test_underflow_term_counts_every_rounding_of_its_doc(monkeypatch):
    """_underflow = tau (terms (products max(factor, 1) + 1) + [terms > 0]) written out per case:
    a factor below 1 counts as 1, above 1 as itself; one term or several; no term, no scale's.
    tau itself is 2^-1072, where float64 keeps only quarters of it: the count is read with tau = 1
    (exact small integers and quarters), and tau's own value checked once."""
    import fa_verify.oracle.backward as backward
    assert backward._TAU == 2.0 ** -50 / (2 * 2.0 ** -53) * 2.0 ** -1074
    monkeypatch.setattr(backward, "_TAU", 1.0)
    for terms, products, factor in itertools.product([0, 1, 3], [1, 2], [0.25, 1.0, 3.0]):
        carried = products * max(factor, 1.0) + 1
        expected = terms * carried + (1 if terms > 0 else 0)
        got = backward._underflow(np.array([terms]), products, np.array([factor]))
        assert got[0] == expected, (terms, products, factor)


def test_no_nan_turns_a_missing_bound_into_inf():
    from fa_verify.oracle.backward import _no_nan
    got = _no_nan(np.array([np.nan, 0.0, 1.5, np.inf]))
    np.testing.assert_array_equal(got, [np.inf, 0.0, 1.5, np.inf])


@pytest.mark.parametrize("group", [1, 2, 16])
def test_group_sum_adds_gamma_g_of_the_magnitudes(group):
    """Query heads summed into kv heads: values summed; bounds summed + gamma_G (sum |x| + sum bound),
    gamma_G = G u / (1 - G u), computed exactly here. G = 1 adds nothing (a copy). Values of size 1
    and bounds of size 1/2 and 3 make both parts of the gamma term visible: dropping the bounds' part
    (or flipping it) moves the result by 2 gamma_G sum(bound), at least 16x the one rounding the
    float64 result may carry (tolerance 2 u relative)."""
    from fa_verify.oracle.backward import _group_sum
    problem = _problem(np.random.default_rng(34), 1, 2 * group, 2, 2, 3, 4)
    rng = np.random.default_rng(35)
    per_head = np.where(rng.random((1, 2 * group, 3, 4)) < 0.5, -1.0, 1.0)
    bound = np.where(rng.random((1, 2 * group, 3, 4)) < 0.5, 0.5, 3.0)
    total, got = _group_sum(problem, per_head, bound)
    u = Fraction(1, 2 ** 53)
    g = group * u / (1 - group * u)
    for hk, n, c in np.ndindex(2, 3, 4):
        heads = range(hk * group, (hk + 1) * group)
        assert total[0, hk, n, c] == sum(per_head[0, h, n, c] for h in heads)
        summed = sum(Fraction(bound[0, h, n, c]) for h in heads)
        exact = summed + (g * (sum(Fraction(abs(per_head[0, h, n, c])) for h in heads) + summed) if group > 1 else 0)
        if group == 1:
            assert got[0, hk, n, c] == bound[0, hk, n, c]
        else:
            assert abs(Fraction(got[0, hk, n, c]) - exact) <= 2 * u * exact, (hk, n, c)


def _loss(problem, dout, dlse):
    ref = reference(problem)
    live = np.isfinite(ref.lse)
    return (dout * ref.out).sum() + (np.where(live, dlse * ref.lse, 0.0)).sum()


def _perturbed(problem, tensor, index, h):
    if tensor == "dsinks":
        sinks = problem.sinks.astype(np.float64).copy()
        sinks[index] += h
        return problem.replace(sinks=sinks)
    name = tensor[1:]
    x = getattr(problem, name).copy()
    x[index] += np.float32(h)
    return problem.replace(**{name: x})


@pytest.mark.parametrize("name", ["gqa_3_fp32", "causal_bottom_right_nq_gt_nk", "softcap_binding", "alibi_fp32",
                                  "sinks_empty_rows"])
def test_gradients_match_central_differences_of_the_certified_forward(name):
    """dL/dx by (L(x + h) - L(x - h)) / 2h, L = sum dO o out + sum dlse lse; h = 2^-10 keeps
    x +- h exact in fp32 (|x| < 4) and the truncation error ~h^2 below 1e-5 of the gradients."""
    rng = np.random.default_rng(3)
    problem = {"gqa_3_fp32": _problem(rng, 1, 3, 1, 3, 5, 4),
               "alibi_fp32": _problem(rng, 1, 2, 1, 4, 5, 4, alibi_slopes=[0.5, 2.0], causal=True)}.get(name)
    problem = problem or CASES[name]
    dout, dlse = _upstream(problem, 4, True)
    dout = dout.astype(np.float64)
    grads = gradient_reference(problem, dout, dlse)
    h = 2.0 ** -10
    for tensor, (value, _) in grads.tensors().items():
        magnitude = np.abs(value).max()
        for index in [np.unravel_index(i, value.shape) for i in rng.choice(value.size, min(3, value.size), replace=False)]:
            if tensor != "dsinks" and abs(float(getattr(problem, tensor[1:])[index])) >= 4:
                continue
            plus, minus = (_loss(_perturbed(problem, tensor, index, s * h), dout, dlse) for s in (1, -1))
            fd = (plus - minus) / (2 * h)
            assert abs(fd - value[index]) <= 1e-5 * magnitude + 1e-9, (tensor, index, fd, value[index])


def test_rows_the_norm_bound_leaves_loose_get_the_gemm_bound(monkeypatch):
    """split_support: ||q|| ||k|| is ~300x sum |q||k|; the |q||K|^T row (rows whose probabilities'
    relative error exceeds _TIGHT_REL) makes dv's bound 10x tighter (measured 10.7)."""
    import fa_verify.oracle.backward as backward
    problem = CASES["split_support"]
    dout, _ = _upstream(problem, 8, False)
    tight = gradient_reference(problem, dout)
    monkeypatch.setattr(backward, "_TIGHT_REL", np.inf)
    free = gradient_reference(problem, dout)
    assert (free.dv_bound >= 4 * tight.dv_bound).all()


def test_the_gemm_bound_goes_to_the_rows_above_tight_rel_and_to_no_other(monkeypatch):
    """_TIGHT_REL routes each row to one of two valid bounds. Two rows either side of it: q = [306, 0]
    and [50, 0] against keys [0, +-100] and [1e-3, 0], where |q| |k| is 1e5 x sum |q||k|; the free
    bound leaves their probabilities 2.4e-11 and 0.39e-11 relative error (the scores' gamma_5 s |q||k|
    and the forward's LSE bound, measured 1.2e-11 and 0.2e-11). The first pays for its |q||K|^T row
    and gets the tighter bound; the second, already far below any kernel's error, is not charged
    one. A threshold 4x higher leaves the first loose, 4x lower charges the second."""
    import fa_verify.oracle.backward as backward
    problem = AttentionProblem(np.array([[[[306, 0], [50, 0]]]], np.float32),
                               np.array([[[[0, 100], [1e-3, 0], [0, -100]]]], np.float32),
                               np.array([[[[1, 2], [-1, 0.5], [0.3, -2]]]], np.float32))
    dout = np.array([[[[1.0, -0.5], [0.7, 1.0]]]])
    charged, gemm = [], backward._gemm_magnitude

    def counted(q, k, mask, rows):
        charged.extend(rows[1].tolist())
        return gemm(q, k, mask, rows)

    monkeypatch.setattr(backward, "_gemm_magnitude", counted)
    chosen = gradient_reference(problem, dout)
    assert charged == [0]
    bounds = {}
    for grade, threshold in (("free", np.inf), ("gemm", 0.0)):
        monkeypatch.setattr(backward, "_TIGHT_REL", threshold)
        bounds[grade] = gradient_reference(problem, dout).dq_bound[0, 0]
    assert (chosen.dq_bound[0, 0, 0] == bounds["gemm"][0]).all() and (bounds["gemm"] < bounds["free"]).all()
    assert (chosen.dq_bound[0, 0, 1] == bounds["free"][1]).all()
    exact = gradient_reference(problem, dout, method="mpmath", digits=60)
    assert (np.abs(chosen.dq - exact.dq) <= chosen.dq_bound + exact.dq_bound).all()


def test_structural_zeros_are_exact():
    for name in ("causal_bottom_right_nq_gt_nk", "window", "sinks_empty_rows"):
        problem = CASES[name]
        dout, dlse = _upstream(problem, 5, True)
        for method in ("certified", "mpmath"):
            grads = gradient_reference(problem, dout, dlse, method=method)
            empty = problem.masked_rows
            unseen = ~problem.mask.any(axis=0)
            assert empty.any() or unseen.any()
            assert (grads.dq[:, :, empty] == 0).all() and (grads.dq_bound[:, :, empty] == 0).all()
            for x, b in ((grads.dk, grads.dk_bound), (grads.dv, grads.dv_bound)):
                assert (x[:, :, unseen] == 0).all() and (b[:, :, unseen] == 0).all()


def test_a_row_without_keys_gives_its_dlse_to_the_sink():
    """LSE = sink there, so dsink gains dlse_i; without dlse such rows contribute nothing."""
    problem = CASES["sinks_empty_rows"]
    dout, dlse = _upstream(problem, 6, True)
    empty = problem.masked_rows
    with_dlse = gradient_reference(problem, dout, dlse).dsinks
    dlse_live = np.where(empty[None, None], 0.0, dlse)
    without = gradient_reference(problem, dout, dlse_live).dsinks
    np.testing.assert_allclose(with_dlse - without, dlse[:, :, empty].astype(np.float64).sum(axis=(0, 2)),
                               rtol=1e-12, atol=1e-12)


def test_arguments_are_validated():
    problem = CASES["gqa_3"]
    dout, _ = _upstream(problem, 7, False)
    with pytest.raises(InvalidArgumentError, match="dout.shape"):
        gradient_reference(problem, dout[:, :1])
    with pytest.raises(InvalidArgumentError, match="method"):
        gradient_reference(problem, dout, method="exact")
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        gradient_reference(problem, dout * np.nan)


def test_heads_in_chunks_give_the_same_gradients(monkeypatch):
    """_CHUNK_ENTRIES only bounds memory: one head at a time gives the same gradients and bounds."""
    import fa_verify.oracle.backward as backward
    problem = CASES["everything"]
    dout, dlse = _upstream(problem, 9, True)
    whole = gradient_reference(problem, dout, dlse)
    monkeypatch.setattr(backward, "_CHUNK_ENTRIES", 1)
    for (x, bx), (y, by) in zip(whole.tensors().values(), gradient_reference(problem, dout, dlse).tensors().values()):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-300)
        np.testing.assert_allclose(bx, by, rtol=1e-12)


@pytest.mark.parametrize("name", ["sinks", "softcap_below_one"])
def test_both_methods_carry_the_forward_delta_and_their_name(name):
    """The record of either method: its method, the certified forward it used, and D = dO . O
    within its bound of the other method's; a softcap below 1 is a softcap like any other."""
    problem = (CASES[name] if name in CASES else
               _problem(np.random.default_rng(5), 1, 2, 1, 4, 6, 6, spread=2.0, softcap=0.5))
    dout, dlse = _upstream(problem, 3, True)
    forward = certified_reference(problem)
    records = {method: gradient_reference(problem, dout, dlse, method=method) for method in ("certified", "mpmath")}
    for method, record in records.items():
        assert record.method == method
        np.testing.assert_array_equal(record.out, forward.out)
        np.testing.assert_array_equal(record.lse, forward.lse)
        assert np.isfinite(record.delta_bound).all() and (record.delta_bound >= 0).all()
    fast, exact = records["certified"], records["mpmath"]
    assert (np.abs(fast.delta - exact.delta) <= fast.delta_bound + exact.delta_bound).all()
    for tensor, (value, bound) in fast.tensors().items():
        mp_value, mp_bound = exact.tensors()[tensor]
        assert (np.abs(value - mp_value) <= bound + mp_bound).all(), tensor


def test_underflow_and_overflow_inside_the_oracle_raise_no_warnings():
    """exp of logits 720 below the sink underflows, and rows that see no key hold -inf: expected,
    handled, and not reported."""
    import warnings

    for name in ("sink_subnormal_p", "sinks_empty_rows", "split_support"):
        problem = CASES[name]
        dout, dlse = _upstream(problem, 4, True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gradient_reference(problem, dout, dlse)


def test_a_problem_that_is_not_one_is_named_in_the_error():
    dout, _ = _upstream(CASES["gqa_3"], 7, False)
    with pytest.raises(InvalidArgumentError, match="problem must be an AttentionProblem, got str"):
        gradient_reference("gqa_3", dout)
