"""The honest ensemble behind the verdict's "ensemble" rule: the same bits under every BLAS and
thread configuration, each member within the rigorous error-model bound, a deterministic exp,
and no false positive for the correct-but-different implementations of
tests/fixtures/honest_variants.py."""

import math
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import mpmath
import numpy as np
import pytest

from fa_verify import AttentionProblem, PrecisionModel
from fa_verify.dtypes import numpy_dtype
from fa_verify.error_model import error_bound
from fa_verify.honest_ensemble import (FULL_WORK, MAX_ROWS, MEMBERS, Member, ensemble_errors, ensemble_outputs, exp2_64, exp64,
                                      largest_and_spread, tanh64)
from fa_verify.oracle import reference
from fa_verify.strategies import make_problem
from fa_verify.verdict import check_attention

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import honest_variants  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def _problem(dtype, distribution="large_logits", shape=(1, 3, 1, 13, 31, 96), causal=True):
    problem = make_problem(distribution, shape, dtype, 0, causal=causal, causal_alignment="top-left")
    return problem, reference(problem)


def test_exp_is_accurate_and_handles_the_edges():
    x = np.concatenate([np.linspace(-745, 709, 2001), [0.0, -1e-300, 1e-300, -0.5, 0.5]])
    with mpmath.workdps(40):
        exact = np.array([float(mpmath.exp(mpmath.mpf(float(v)))) for v in x])
        exact2 = np.array([float(mpmath.power(2, mpmath.mpf(float(v)))) for v in x])
    normal = exact > 1e-300
    assert np.max(np.abs(exp64(x)[normal] / exact[normal] - 1)) < 4e-16
    assert np.max(np.abs(exp2_64(x)[normal] / exact2[normal] - 1)) < 4e-16
    assert exp64(-np.inf) == 0 and exp64(-1e6) == 0 and np.isinf(exp64(1e6)) and np.isnan(exp64(np.nan))
    assert exp2_64(-np.inf) == 0 and exp64(0.0) == 1 and exp2_64(3.0) == 8


def test_tanh_is_accurate_and_odd():
    x = np.concatenate([np.linspace(-25, 25, 2001), [0.0, 1e-300, -1e-20, 0.17, 0.1733, 0.1734, 0.35]])
    with mpmath.workdps(40):
        exact = np.array([float(mpmath.tanh(mpmath.mpf(float(v)))) for v in x])
    nonzero = exact != 0
    assert np.max(np.abs(tanh64(x)[nonzero] / exact[nonzero] - 1)) < 8e-16
    assert tanh64(0.0) == 0 and tanh64(50.0) == 1 and tanh64(-50.0) == -1
    np.testing.assert_array_equal(tanh64(-x), -tanh64(x))


def test_tanh_avoids_cancellation_for_small_arguments_and_works_in_float64():
    """Below |x| = ln 2 / 4 e^{2|x|} - 1 would cancel: the direct polynomial keeps tanh within
    2 eps (2^-51) there (e^y - 1 from exp reaches 3 eps); float32 input is widened first."""
    x = np.linspace(1e-3, 0.5, 3000)
    with mpmath.workdps(40):
        exact = np.array([float(mpmath.tanh(mpmath.mpf(float(v)))) for v in x])
    assert np.max(np.abs(tanh64(x) / exact - 1)) <= 2 * 2.0 ** -52
    x32 = np.float32([0.1, 0.3, 1.7, -4.2])
    assert tanh64(x32).dtype == np.float64
    np.testing.assert_array_equal(tanh64(x32), tanh64(x32.astype(np.float64)))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_every_member_is_within_the_rigorous_bound_with_the_variants(dtype):
    problem = make_problem("large_logits", (2, 2, 1, 13, 31, 32), dtype, 0, causal=True).replace(
        window_size=(9, 0), softcap=4.0, alibi_slopes=[[0.5, 0.01], [2.0, 0.25]], sinks=[3.0, -3.0])
    ref = reference(problem)
    bound = error_bound(problem, PrecisionModel.flash(dtype), ref)
    for name, out in ensemble_outputs(problem, PrecisionModel.flash(dtype)).items():
        err = np.abs(out.reshape(problem.out_shape) - ref.out)
        assert np.max(np.where(err == 0, 0, err / bound.out)) < 0.9, name


_CONFIG_SCRIPT = """
import hashlib, sys, numpy as np
from fa_verify.precision import PrecisionModel
from fa_verify.honest_ensemble import ensemble_outputs
from fa_verify.strategies import make_problem
digest = hashlib.sha256()
for dtype in ("fp32", "bf16"):
    for shape, dist in (((1, 3, 1, 13, 31, 96), "large_logits"), ((2, 2, 2, 9, 70, 32), "fa3_outliers")):
        p = make_problem(dist, shape, dtype, 0, causal=True, causal_alignment="top-left")
        for name, out in ensemble_outputs(p, PrecisionModel.flash(dtype)).items():
            digest.update(name.encode() + out.tobytes())
    # the variants: tanh, bias and sink terms from + - x only too
    p = make_problem("normal", (1, 2, 1, 9, 40, 16), dtype, 0).replace(
        window_size=(7, 3), softcap=0.7, alibi_slopes=[0.25, 1.5], sinks=[1.0, -2.0])
    for name, out in ensemble_outputs(p, PrecisionModel.flash(dtype)).items():
        digest.update(name.encode() + out.tobytes())
print(digest.hexdigest())
# the backward's members (tests/test_backward_ensemble.py): GQA, anti-aligned rows, dlse, the variants
from fa_verify.backward import BackwardProblem
from fa_verify.backward_ensemble import ensemble_gradients
from fa_verify.strategies._backward import anti_aligned
digest = hashlib.sha256()
for dtype in ("fp32", "bf16"):
    f = anti_aligned(make_problem("large_logits", (1, 4, 2, 13, 70, 24), dtype, 0, causal=True), [0, 5])
    g = make_problem("normal", (2, 2, 1, 9, 40, 16), dtype, 0).replace(
        window_size=(7, 3), softcap=0.7, alibi_slopes=[0.25, 1.5], sinks=[1.0, -2.0])
    for forward in (f, g):
        rng = np.random.default_rng(0)
        bp = BackwardProblem.of(forward, rng.standard_normal(forward.out_shape), rng.standard_normal(forward.lse_shape))
        for name, grads in ensemble_gradients(forward, bp.out, bp.lse, bp.dout, bp.dlse).items():
            digest.update(name.encode() + b"".join(x.tobytes() for x in grads.values() if x is not None))
print(digest.hexdigest())
"""

#: OpenBLAS core types (its DYNAMIC_ARCH build) and thread counts; numpy's SIMD dispatch off
#: (NPY_DISABLE_CPU_FEATURES) where this numpy allows it.
CONFIGS = (
    {},
    {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1"},
    {"OPENBLAS_CORETYPE": "SkylakeX", "OPENBLAS_NUM_THREADS": "2"},
    {"OPENBLAS_CORETYPE": "Sandybridge", "OPENBLAS_NUM_THREADS": "1"},
    {"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"},
)


def test_members_give_the_same_bits_under_every_blas_configuration():
    """The forward's members and the backward's (fa_verify.backward_ensemble): one digest each."""
    digests = set()
    for config in CONFIGS:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **config}
        done = subprocess.run([sys.executable, "-c", _CONFIG_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        digests.add(tuple(done.stdout.split()))
    assert len(digests) == 1 and len(next(iter(digests))) == 2, digests


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("distribution", ["normal", "large_logits", "fa3_outliers"])
def test_every_member_is_within_the_rigorous_bound(dtype, distribution):
    """Each member is a correct implementation of the precision model: the error model's
    worst-case bound (which holds for any summation order) holds for it, with margin."""
    problem, ref = _problem(dtype, distribution)
    precision = PrecisionModel.flash(dtype)
    bound = error_bound(problem, precision, ref)
    live = np.isfinite(ref.lse)[..., None] & np.ones(problem.out_shape, bool)
    for name, out in ensemble_outputs(problem, precision).items():
        err = np.abs(out.reshape(problem.out_shape) - ref.out)
        ratio = np.max(np.where(live, err / bound.out, 0))
        assert ratio < 0.9, (name, ratio)


def test_members_differ_where_correct_kernels_differ():
    """The orders, tiles and exps matter: at large logits in fp32 the members' errors differ."""
    problem, ref = _problem("fp32")
    errors = ensemble_errors(problem, PrecisionModel.flash("fp32"), ref).errors
    assert set(errors) == {m.name for m in MEMBERS}
    assert len({round(e, 12) for e in errors.values()}) >= 3, errors


@pytest.mark.parametrize("member", MEMBERS[:3], ids=lambda m: m.name)
def test_gemm_in_blocks_gives_the_bits_of_one_explicit_sum_per_element(member):
    """Blocks of rows change no bit: with K x N over BLOCK one row per block, and an empty a."""
    from fa_verify.honest_ensemble import BLOCK, Stage, gemm, rounded_dot

    rng = np.random.default_rng(11)
    stage = Stage("fp16", np.dtype(np.float32))
    a = stage(rng.standard_normal((5, 4)))  # more rows than columns
    wide = stage(rng.standard_normal((4, BLOCK // 4 + 5)))  # K x N > BLOCK: blocks of one row
    narrow = stage(rng.standard_normal((4, 6)))
    few = stage(rng.standard_normal((4, 3)))  # K > N
    for b in (wide, narrow, few):
        whole = rounded_dot(a[:, :, None], b[None], member, stage)
        got = gemm(a, b, member, stage)
        assert got.shape == (5, b.shape[1]) and got.dtype == np.float32
        np.testing.assert_array_equal(got, whole)
    empty = gemm(a[:0], narrow, member, stage)
    assert empty.shape == (0, 6) and empty.dtype == np.float32


def test_rows_are_spread_over_the_whole_range_and_the_largest_are_added():
    spread = largest_and_spread(None, 1000, 10)
    assert len(spread) == 5 and spread[0] == 0 and spread[-1] == 999
    assert np.ptp(np.diff(spread)) <= 1  # evenly spaced
    relative = np.zeros(1000)
    relative[[3, 500, 7, 801, 640, 2]] = [6, 5, 4, 3, 2, 1]
    chosen = largest_and_spread(relative, 1000, 10)
    np.testing.assert_array_equal(chosen, np.union1d(spread, [3, 500, 7, 801, 640]))
    levels = np.random.default_rng(0).integers(0, 3, 1000).astype(float)  # 0, 1, 2, a third each
    ties = largest_and_spread(levels, 1000, 10)  # among the 2s: the last five
    np.testing.assert_array_equal(ties, np.union1d(spread, np.flatnonzero(levels == 2)[-5:]))


def test_large_problems_run_on_the_rows_with_the_largest_bounds():
    problem = make_problem("large_logits", (1, 2, 1, 300, 300, 32), "fp32", 0)
    assert problem.batch * problem.heads * problem.nq * problem.nk * problem.head_dim > FULL_WORK
    ref = reference(problem)
    precision = PrecisionModel.flash("fp32")
    bound = error_bound(problem, precision, ref)
    part = ensemble_errors(problem, precision, ref, bound)
    assert MAX_ROWS // 2 <= part.rows <= MAX_ROWS and part.total_rows == 600
    verdict = check_attention(ref.out.astype(np.float32), problem, reference=ref, bound=bound)
    assert verdict.passed and verdict.ensemble_rows == part.rows
    assert f"on the {part.rows} of 600 rows" in verdict.message()


def test_an_overflowing_member_is_left_out_of_E():
    """Same-precision fp16 with V near the fp16 maximum: P·V overflows in a 16-bit accumulator;
    E comes from the members that stay finite (or is inf, when none does)."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 8, 16))
    v = np.full((1, 1, 8, 16), 6e4)
    problem = AttentionProblem.from_float(q, k, v, "fp16")
    ens = ensemble_errors(problem, PrecisionModel.same_precision("fp16"), reference(problem))
    assert any(np.isinf(e) for e in ens.errors.values())
    finite = [e for e in ens.errors.values() if np.isfinite(e)]
    assert ens.max_error == (max(finite) if finite else np.inf)
    if not finite:
        assert ens.worst_member is None


VARIANT_PROBLEMS = [
    (dist, shape, dtype, causal)
    for dist, shape in (("normal", (1, 2, 1, 70, 130, 64)), ("large_logits", (1, 3, 1, 13, 31, 96)),
                        ("fa3_outliers", (2, 4, 2, 65, 63, 32)), ("large_logits", (1, 1, 1, 40, 200, 128)))
    for dtype in ("fp16", "bf16", "fp32") for causal in (False, True)
]


@pytest.mark.parametrize("dist, shape, dtype, causal", VARIANT_PROBLEMS)
def test_honest_variants_pass_the_verdict(dist, shape, dtype, causal):
    """Correct kernels built differently from every member pass every rule, with margin."""
    problem = make_problem(dist, shape, dtype, 1, causal=causal)
    ref = reference(problem)
    precision = PrecisionModel.flash(dtype)
    bound = error_bound(problem, precision, ref)
    ensemble = ensemble_errors(problem, precision, ref, bound)
    for name, fn in honest_variants.VARIANTS.items():
        out, lse = fn(problem.q, problem.k, problem.v, causal=causal, scale=problem.scale_value)
        verdict = check_attention(out, problem, lse=lse, reference=ref, bound=bound, ensemble=ensemble)
        assert verdict.passed, f"{name}: {verdict.message()}"
        assert verdict.ensemble_ratio < 0.5, f"{name}: {verdict.message()}"


# --- every member pinned bit for bit to a plain-loop recomputation of its documented arithmetic ---

_LOG2E = math.log2(math.e)


def _rounder(dtype):
    """x (a Python float holding one exact or float64-rounded operation) rounded to `dtype`:
    correctly rounded, since 53 >= 2 p + 2 bits makes the double rounding exact."""
    kind = numpy_dtype(dtype).type
    return lambda x: float(kind(x))


def _significand(x, bits):
    """x rounded to `bits` significant bits, ties to even (Python's round)."""
    if x == 0 or not math.isfinite(x):
        return x
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(math.ldexp(mantissa, bits)), exponent - bits)


def _loop_sum(terms, order, r, init=None):
    """init + the terms, every addition rounded: forward, reversed, or pairwise (element j with
    element j + half, the odd one carried; init added last)."""
    if order == "pairwise":
        while len(terms) > 1:
            half = len(terms) // 2
            terms = [r(terms[j] + terms[j + half]) for j in range(half)] + terms[2 * half:]
        return terms[0] if init is None else r(init + terms[0])
    total = init
    for term in (terms if order == "forward" else terms[::-1]):
        total = term if total is None else r(total + term)
    return total


def _loop_dot(a, b, member, r, init=None):
    """init + sum a_j b_j: rounded products and rounded sums, or (fused, not pairwise) exact
    products, each addition rounded to float64 and then to the stage."""
    if member.fused and member.order != "pairwise":
        total = 0.0 if init is None else init
        for j in (range(len(a)) if member.order == "forward" else range(len(a) - 1, -1, -1)):
            total = r(total + a[j] * b[j])
        return total
    return _loop_sum([r(x * y) for x, y in zip(a, b, strict=True)], member.order, r, init)


def _loop_member_row(member, precision, q, k, v, mask, scale, softcap, bias, sink):
    """One member's output row as the module doc describes it, in Python floats, one rounding
    per operation (the score stage's ops in fp32 where the work dtype is fp32, rounded)."""
    stages = (precision.score_accumulation, precision.p_rounding, precision.pv_accumulation)
    sc, pr, pv = (_rounder(d) for d in stages)
    work = _rounder("fp64" if "fp64" in stages else "fp32")  # what the values are held in
    exp2 = member.exp == "exp2"
    unit = _LOG2E if exp2 else 1.0

    def power(y):  # the module's deterministic exp (pinned to mpmath above), to 22 bits for ex2.approx
        value = float(exp2_64(y) if exp2 else exp64(y))
        return _significand(value, 22) if precision.exp == "approx" else value

    def tanh(x):
        if precision.tanh == "absolute":  # 1 - 2 / (e^{2x} + 1), every operation rounded
            return sc(1.0 - sc(2.0 / sc(sc(float(exp64(2.0 * x))) + 1.0)))
        value = float(tanh64(x))
        return sc(_significand(value, 11) if precision.tanh == "approx" else value)  # tanh.approx: 2^-11

    t = []
    for j in range(len(k)):
        s = _loop_dot(q, k[j], member, sc)
        if softcap > 0 and exp2:
            x = sc(tanh(sc(s * sc(scale / softcap))) * sc(softcap * _LOG2E))
        elif softcap > 0:
            x = sc(work(softcap) * tanh(sc(sc(s * sc(scale)) / sc(softcap))))  # the cap held like a value
        else:
            x = sc(s * sc(scale * _LOG2E if exp2 else scale))
        if bias is not None:
            x = sc(x + sc(bias[j] * unit))
        t.append(x if mask[j] else -math.inf)
    tile = member.tile or len(k)
    starts = list(range(0, len(k), tile))[::-1 if member.order == "reversed" else 1]
    m, l, acc = -math.inf, 0.0, [0.0] * len(v[0])
    for start in starts:
        block = t[start:start + tile]
        m_new = max(m, *block)
        shift = m_new if math.isfinite(m_new) else 0.0
        alpha = sc(power(sc(m - shift)))
        p = [sc(power(sc(x - shift))) for x in block]
        p_rounded = [pr(x) for x in p]
        l = _loop_sum([pv(x) for x in (p_rounded if member.sum_rounded_p else p)], member.order, pv, pv(l * alpha))
        acc = [_loop_dot(p_rounded, [v[start + j][d] for j in range(len(block))], member, pv, pv(acc[d] * alpha))
               for d in range(len(acc))]
        m = m_new
    if sink is not None:  # one more rescale; the sink's term in the row sum only (sinks held in fp32)
        sink = sc(sink * work(unit))
        m_new = max(m, sink)
        alpha = sc(power(sc(m - m_new)))
        l = pv(pv(l * alpha) + sc(power(sc(sink - m_new))))
        acc = [pv(a * alpha) for a in acc]
    out = _rounder(precision.output)
    return [out(pv(a / (l if l > 0 else 1.0))) for a in acc]


def _loop_outputs(problem, precision, members):
    B, H, Nq, D = problem.out_shape
    rounded = numpy_dtype(precision.input_rounding or problem.dtype)  # rounded first, where declared
    q, k, v = (x.astype(rounded).astype(np.float64).tolist() for x in (problem.q, problem.k, problem.v))
    outs = {m.name: np.zeros((B * H * Nq, D)) for m in members}
    for b in range(B):
        for h in range(H):
            kv = h // problem.group_size
            for i in range(Nq):
                bias = problem.alibi_bias(b, h, i)
                sink = None if problem.sinks is None else float(np.float32(problem.sinks[h]))
                for member in members:
                    outs[member.name][(b * H + h) * Nq + i] = _loop_member_row(
                        member, precision, q[b][h][i], k[b][kv], v[b][kv], problem.mask[i],
                        problem.scale_value, problem.softcap, None if bias is None else list(bias), sink)
    return outs


#: (distribution, shape (B, H, H_kv, Nq, Nk, D), dtype, variants, precision spec): Nk = 70 makes the
#: 64-key tile and the 16-key tiles split the row (three 16-key tiles and a part one).
LOOP_CASES = {
    "fp16-flash-causal": ("large_logits", (1, 2, 1, 3, 70, 3), "fp16", {}, "flash"),
    "bf16-input-scores-alibi": ("large_logits", (1, 2, 1, 3, 70, 3), "bf16", dict(alibi_slopes=[0.5, 0.125]),
                                "input-scores"),
    "fp32-variants": ("large_logits", (1, 2, 1, 3, 70, 3), "fp32",
                      dict(softcap=3.0, alibi_slopes=[0.5, 0.125], sinks=[2.5, -1.0]), "flash"),
    "fp16-same-precision-window": ("normal", (1, 2, 2, 3, 70, 3), "fp16", dict(window_size=(40, 5), sinks=[1.0, 9.0]),
                                   "same-precision"),
    "fp32-absolute-tanh-approx-exp": ("large_logits", (1, 1, 1, 3, 70, 3), "fp32", dict(softcap=2.0),
                                      "flash,tanh=absolute,exp=approx"),
    "fp32-approx-tanh-fp16-inputs": ("large_logits", (1, 1, 1, 3, 70, 3), "fp32",
                                     dict(softcap=5.0, alibi_slopes=[0.25]), "fp32-accumulate,tanh=approx,inputs=fp16"),
    # a softcap below 1 and not an fp32 number, sinks whose fp32 product with log2(e) depends on
    # log2(e) being held in fp32
    "fp32-small-softcap-sinks": ("normal", (1, 2, 1, 3, 70, 3), "fp32", dict(softcap=0.7, sinks=[4.5, -2.25]),
                                 "flash"),
    # Nq > Nk (bottom-right causal): rows 0 and 1 attend no key
    "fp16-masked-rows": ("large_logits", (1, 1, 1, 6, 4, 2), "fp16", {}, "flash"),
    # Nk = 65: a last 64-key tile and a last 16-key tile of one key; D = 1: q·k of one product
    "fp32-one-key-tiles": ("large_logits", (1, 1, 1, 6, 65, 1), "fp32", {}, "flash"),
    # fp64 stages: every value held in float64
    "fp64-stages": ("large_logits", (1, 1, 1, 3, 70, 3), "fp32", dict(softcap=3.0, sinks=[9.0]),
                    "score=fp64,p=fp32,pv=fp64,out=fp64"),
}

#: Members beyond MEMBERS, so that every combination of the choices is reached: pairwise sums over
#: tiles (the running sums added last), a fused pairwise sum (rounded products), a fused sum over
#: tiles in order, and the two-pass exp2 fold reversed.
EXTRA_MEMBERS = (
    Member("online-16-pairwise", "pairwise", tile=16),
    Member("fused-pairwise", "pairwise", fused=True, tile=16),
    Member("online-16-fused-forward-unrounded", "forward", fused=True, tile=16, sum_rounded_p=False),
    Member("reversed-exp2", "reversed", exp="exp2"),
)


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_every_member_computes_its_documented_arithmetic_bit_for_bit(case):
    """Each member's output is, bit for bit, a plain-loop recomputation of what the module doc
    and `Member` say it computes (orders, tiles and their order, FMA, exp or exp2 fold, the row
    sum before or after P's rounding, softcap, ALiBi, sinks, the declared tanh and exp, inputs
    rounded first): a change in any of them moves some output bits at these large logits."""
    dist, shape, dtype, variants, spec = LOOP_CASES[case]
    problem = make_problem(dist, shape, dtype, 2, causal=True).replace(**variants)
    precision = PrecisionModel.parse(spec, dtype)
    members = MEMBERS + EXTRA_MEMBERS
    got = ensemble_outputs(problem, precision, members=members)
    expected = _loop_outputs(problem, precision, members)
    for member in members:
        np.testing.assert_array_equal(got[member.name], expected[member.name], err_msg=member.name)
    picked = [len(got["sequential"]) - 1, 0]
    part = ensemble_outputs(problem, precision, rows=picked, members=members[:2])  # rows given: those rows
    for member in members[:2]:
        np.testing.assert_array_equal(part[member.name], got[member.name][picked])
    distinct = {got[m.name].tobytes() for m in members}
    if case == "fp16-masked-rows":  # rows without keys: exactly 0 (all members agree on these 4 keys)
        assert not np.any(got["sequential"][:2]) and np.all(got["sequential"][2:] != 0)
    else:
        assert len(distinct) >= 3, case  # the members differ on these inputs


def test_logits_and_the_power_function_default_to_accurate_and_give_tanh_only_with_a_softcap():
    """exp_kind and logits without an accuracy: the accurate exp64 / exp2_64 and tanh64, unrounded
    beyond the score stage; logits returns th = None without a softcap (the backward's 1 - th^2
    has no term then) and the rounded tanh with one."""
    from fa_verify.honest_ensemble import Stage, exp_kind, logits

    assert exp_kind("exp") == (1.0, exp64) and exp_kind("exp2") == (math.log2(math.e), exp2_64)
    score = Stage("fp32", np.dtype(np.float32))
    s = np.float32([[0.3, -2.0, 7.5]])
    t, th, unit, power = logits(s, "exp", score, 0.5)
    assert th is None and unit == 1.0 and power is exp64
    np.testing.assert_array_equal(t, np.float32(s * np.float32(0.5)))
    t, th, unit, power = logits(s, "exp", score, 0.5, softcap=2.0)
    np.testing.assert_array_equal(th, np.float32(tanh64(np.float32(np.float32(s * np.float32(0.5)) / 2))))
    np.testing.assert_array_equal(t, np.float32(2 * th))


def test_members_overflow_silently_as_a_kernel_would():
    """fp16 accumulation of V near the fp16 maximum overflows to inf (and inf - inf to NaN) in
    the members without a numpy warning: the members compute under their own error state."""
    import warnings

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 8, 16))
    problem = AttentionProblem.from_float(q, k, np.full((1, 1, 8, 16), 6e4), "fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = ensemble_outputs(problem, PrecisionModel.same_precision("fp16"))
    assert any(not np.all(np.isfinite(out)) for out in outs.values())
    scores = AttentionProblem.from_float(np.full((1, 1, 2, 16), 250.0), np.full((1, 1, 4, 16), 250.0),
                                         np.ones((1, 1, 4, 16)), "fp16")  # q·k = 1e6: inf, then inf / inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = ensemble_outputs(scores, PrecisionModel.same_precision("fp16"))
    assert all(np.all(np.isnan(out)) for out in outs.values())


def test_exp_works_in_float64_saturates_at_any_magnitude_and_warns_about_nothing():
    """float32 arguments are widened first (the members pass float32 logits); arguments beyond
    the clip limits, up to the float64 maximum, still give exactly 0 and inf; NaN stays NaN; the
    overflow to inf is silent."""
    import warnings

    x32 = np.float32([-87.3, -3.1, 0.7, 11.2, 80.9])
    for power in (exp64, exp2_64):
        assert power(x32).dtype == np.float64
        np.testing.assert_array_equal(power(x32), power(x32.astype(np.float64)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            huge = power(np.array([-1e300, -np.finfo(np.float64).max, 1e300, np.finfo(np.float64).max, 2000.0]))
        np.testing.assert_array_equal(huge, [0.0, 0.0, np.inf, np.inf, np.inf])
        both = power(np.array([np.nan, 0.0]))
        assert both.dtype == np.float64 and np.isnan(both[0]) and both[1] == 1.0


def test_the_rows_chosen_are_all_up_to_the_limits_then_the_largest_relative_bounds_and_a_spread():
    """`_chosen_rows` on stand-ins (only the shapes, bound.out and row_scale are read): every row
    while B·H·Nq·Nk·D <= FULL_WORK or the rows <= MAX_ROWS; above both, the MAX_ROWS // 2 rows
    with the largest max_d bound.out / row_scale (0/0 and x/0 counting as 0) and MAX_ROWS // 2
    spread evenly; the spread alone without a bound. No numpy warning for the zero scales."""
    import warnings
    from types import SimpleNamespace

    from fa_verify.honest_ensemble import _chosen_rows

    def problem(B, H, Nq, Nk, D):
        return SimpleNamespace(out_shape=(B, H, Nq, D), nk=Nk)

    D = 4
    nk = FULL_WORK // (2 * 200 * D)  # 2 x 200 rows: exactly FULL_WORK
    assert 2 * 200 * nk * D == FULL_WORK
    np.testing.assert_array_equal(_chosen_rows(problem(1, 2, 200, nk, D), None, None), np.arange(400))
    np.testing.assert_array_equal(_chosen_rows(problem(1, 1, MAX_ROWS, 10 ** 6, D), None, None), np.arange(MAX_ROWS))
    big = problem(1, 2, 200, nk + 1, D)
    spread = np.unique(np.linspace(0, 399, MAX_ROWS // 2).round().astype(int))
    np.testing.assert_array_equal(_chosen_rows(big, None, None), spread)
    rng = np.random.default_rng(5)
    row_scale = rng.uniform(0.5, 2.0, (1, 2, 200, 1))
    bound_out = rng.uniform(0.0, 1.0, (1, 2, 200, D)) * row_scale
    bound_out[0, 0, 7, 2] = 9.0 * row_scale[0, 0, 7, 0]  # the max over d decides
    row_scale[0, 1, :30] = 0.0  # x / 0 and 0 / 0 count as 0
    bound_out[0, 1, :15] = 0.0
    relative = np.zeros(400)
    for row in range(400):
        b_out, scale = bound_out.reshape(400, D)[row], row_scale.reshape(400)[row]
        relative[row] = max(x / scale for x in b_out) if scale > 0 else 0.0
    largest = [int(i) for i in sorted(range(400), key=lambda i: (relative[i], i), reverse=True)[:MAX_ROWS // 2]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = _chosen_rows(big, SimpleNamespace(row_scale=row_scale), SimpleNamespace(out=bound_out))
    np.testing.assert_array_equal(chosen, np.union1d(spread, largest))
    assert 7 in largest and not set(range(200, 230)) & set(largest)


def test_the_ensemble_error_is_each_members_max_normalised_error_over_the_rows_chosen(monkeypatch):
    """With FULL_WORK lowered, a 300-row problem runs on the rows `_chosen_rows` picks from the
    bound: each member's error is its max |out - ref| / row scale over those rows, recomputed
    here (fully masked rows: error 0); `members` selects the members run."""
    from fa_verify import honest_ensemble
    from fa_verify.honest_ensemble import _chosen_rows

    monkeypatch.setattr(honest_ensemble, "FULL_WORK", 1000)
    problem = make_problem("large_logits", (1, 2, 1, 150, 8, 4), "bf16", 3, causal=True)
    ref = reference(problem)
    precision = PrecisionModel.flash("bf16")
    bound = error_bound(problem, precision, ref)
    rows = _chosen_rows(problem, ref, bound)
    assert MAX_ROWS // 2 < len(rows) <= MAX_ROWS
    assert not np.array_equal(rows, _chosen_rows(problem, ref, None))
    ens = ensemble_errors(problem, precision, ref, bound, members=MEMBERS[1:3])
    assert set(ens.errors) == {MEMBERS[1].name, MEMBERS[2].name}
    assert (ens.rows, ens.total_rows) == (len(rows), 300)
    outs = ensemble_outputs(problem, precision, rows, MEMBERS[1:3])
    flat_ref, flat_scale = ref.out.reshape(300, 4)[rows], np.broadcast_to(ref.row_scale, ref.out.shape).reshape(300, 4)[rows]
    for name, out in outs.items():
        expected = max(abs(o - r) / s if o != r else 0.0  # fully masked rows: 0 = 0, error 0
                       for o, r, s in zip(out.ravel(), flat_ref.ravel(), flat_scale.ravel(), strict=True))
        assert ens.errors[name] == pytest.approx(expected, rel=1e-15) and expected > 0


def test_tanh_at_the_end_of_the_direct_polynomial_is_correctly_rounded():
    """y = 2|x| = ln 2 / 2, the largest argument of the direct polynomial (the branch includes its
    end): tanh64 is the correctly rounded tanh there, in both signs."""
    from fa_verify.honest_ensemble import _LN2

    x = _LN2 / 4
    assert 2 * x == _LN2 / 2
    with mpmath.workdps(40):
        exact = float(mpmath.tanh(mpmath.mpf(x)))
    assert tanh64(x) == exact and tanh64(-x) == -exact
