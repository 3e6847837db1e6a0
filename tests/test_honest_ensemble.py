"""The honest ensemble behind the verdict's "ensemble" rule: the same bits under every BLAS and
thread configuration, each member within the rigorous error-model bound, a deterministic exp,
and no false positive for the correct-but-different implementations of
tests/fixtures/honest_variants.py."""

import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import mpmath
import numpy as np
import pytest

from fa_verify import AttentionProblem, PrecisionModel
from fa_verify.error_model import error_bound
from fa_verify.honest_ensemble import (FULL_WORK, MAX_ROWS, MEMBERS, ensemble_errors, ensemble_outputs, exp2_64, exp64,
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
    for b in (wide, narrow):
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
