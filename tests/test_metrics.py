"""Error measures: exact values on hand-made arrays, ULPs at binade edges and subnormals,
NaN as infinite error, fully masked rows."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

from fa_verify import AttentionProblem, InvalidArgumentError
from fa_verify.metrics import ErrorStats, OutputErrors, lse_errors, measure
from fa_verify.oracle import reference
from fa_verify.oracle.result import Reference


def _reference(out, lse, row_scale):
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    return Reference(out=out, lse=lse, out_bound=np.zeros_like(out), lse_bound=np.zeros_like(lse),
                     row_scale=np.asarray(row_scale, dtype=np.float64), method="certified")


# --- ErrorStats -----------------------------------------------------------------------------

def test_stats_exact_values():
    s = ErrorStats.from_values([1.0, -2.0, 3.0, -4.0])
    assert s.max == 4.0
    assert s.median == 2.5
    assert s.rmse == math.sqrt((1 + 4 + 9 + 16) / 4)
    assert s.mean == -0.5  # signed: the bias
    assert s.count == 4
    assert s.p99 == 4.0  # nearest rank of 4 values: the largest


def test_stats_p99_is_nearest_rank():
    values = np.arange(1.0, 101.0)  # 1 .. 100
    s = ErrorStats.from_values(-values)
    assert s.p99 == 99.0
    assert s.median == 50.5
    assert s.max == 100.0
    assert s.mean == -50.5


def test_stats_empty_and_zero():
    assert ErrorStats.from_values([]) == ErrorStats(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    z = ErrorStats.from_values(np.zeros((3, 4)))
    assert (z.max, z.p99, z.median, z.rmse, z.mean, z.count) == (0.0, 0.0, 0.0, 0.0, 0.0, 12)


def test_stats_nan_is_an_infinite_error_never_skipped():
    values = np.arange(1.0, 101.0)
    values[10] = np.nan
    s = ErrorStats.from_values(values)
    assert s.max == math.inf
    assert s.rmse == math.inf
    assert math.isnan(s.mean)  # no bias is defined when an error is undefined
    assert s.p99 == 100.0      # one NaN of 100 sits above the 99th rank
    values[20] = np.nan
    assert ErrorStats.from_values(values).p99 == math.inf


def test_stats_as_dict_is_json_ready():
    d = ErrorStats.from_values([1.0, -1.0]).as_dict()
    assert set(d) == {"max", "p99", "median", "rmse", "mean", "count"}
    json.dumps(d)


# --- ULPs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,eps", [("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7), ("fp32", 2.0 ** -23)])
def test_ulp_at_powers_of_two(dtype, eps):
    # At 2^e the spacing is the one above: 2^e * eps. One step up is 1 ulp, one step
    # below is half an ulp *measured at the reference value*.
    for e in (-3, 0, 5):
        ref = np.array([2.0 ** e, 2.0 ** e, -(2.0 ** e)])
        out = np.array([2.0 ** e * (1 + eps), 2.0 ** e * (1 - eps / 2), -(2.0 ** e) * (1 + eps)])
        errors = OutputErrors.compute(out, ref, np.ones(3), dtype)
        np.testing.assert_array_equal(errors.ulp, [1.0, 0.5, 1.0])
        np.testing.assert_array_equal(errors.signed / errors.ulp_size, [1.0, -0.5, -1.0])


@pytest.mark.parametrize("dtype,spacing", [("fp16", 2.0 ** -24), ("bf16", 2.0 ** -133),
                                           ("fp32", 2.0 ** -149)])
def test_ulp_in_the_subnormal_range(dtype, spacing):
    ref = np.array([0.0, 3 * spacing, 100 * spacing])
    out = np.array([spacing, 4 * spacing, 98 * spacing])
    errors = OutputErrors.compute(out, ref, np.ones(3), dtype)
    np.testing.assert_array_equal(errors.ulp_size, [spacing] * 3)
    np.testing.assert_array_equal(errors.ulp, [1.0, 1.0, 2.0])


def test_correct_rounding_is_at_most_half_an_ulp():
    rng = np.random.default_rng(0)
    exact = rng.standard_normal(10_000) * np.exp2(rng.integers(-20, 20, 10_000))
    for dtype, np_dtype in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16), ("fp32", np.float32)):
        x = exact if dtype != "fp16" else exact * 1e-2  # stay inside fp16's range
        errors = OutputErrors.compute(x.astype(np_dtype), x, np.ones_like(x), dtype)
        assert errors.ulp.max() <= 0.5


# --- normalised error, NaN, masked rows ------------------------------------------------------

def test_normalised_defines_zero_over_zero():
    errors = OutputErrors.compute(np.array([0.0, 1e-3, 2e-3, 0.0]), np.zeros(4),
                                  np.array([0.0, 0.0, 0.5, 1.0]), "fp32")
    np.testing.assert_array_equal(errors.normalised, [0.0, np.inf, 4e-3, 0.0])


def test_nan_output_is_infinite_error():
    ref = np.zeros((1, 1, 2, 2))
    out = ref.copy()
    out[0, 0, 1, 0] = np.nan
    errors = OutputErrors.compute(out, ref, np.ones_like(ref), "fp16")
    assert errors.abs[0, 0, 1, 0] == np.inf
    assert errors.normalised[0, 0, 1, 0] == np.inf
    assert errors.ulp[0, 0, 1, 0] == np.inf
    assert np.isnan(errors.signed[0, 0, 1, 0])
    summary = measure(out.astype(np.float16), _reference(ref, np.zeros((1, 1, 2)), np.ones_like(ref)))
    assert summary.abs.max == np.inf and summary.normalised.max == np.inf
    assert summary.worst_index == (0, 0, 1, 0)


def test_lse_of_fully_masked_rows_must_be_minus_inf():
    ref = np.array([-np.inf, -np.inf, -np.inf, -np.inf, 1.5])
    got = np.array([-np.inf, 0.0, np.inf, np.nan, 1.25], dtype=np.float32)
    e = lse_errors(got, ref)
    assert e[0] == 0.0
    assert e[1] == np.inf and e[2] == np.inf
    assert np.isnan(e[3])
    assert e[4] == -0.25
    s = ErrorStats.from_values(e)
    assert s.max == np.inf


def test_measure_masked_rows_and_summary_fields():
    # Two rows: the first fully masked (out 0, LSE -inf, D 0), the second ordinary.
    ref_out = np.array([[[[0.0, 0.0], [0.5, -0.25]]]])
    ref = _reference(ref_out, np.array([[[-np.inf, 0.75]]]), np.array([[[[0.0, 0.0], [1.0, 0.5]]]]))
    good = ref_out.astype(np.float16)
    s = measure(good, ref, "fp16", lse=np.array([[[-np.inf, 0.75]]], dtype=np.float32))
    assert s.abs.max == 0.0 and s.normalised.max == 0.0 and s.lse_abs.max == 0.0
    bad = good.copy()
    bad[0, 0, 0, 1] = 1e-3  # nonzero output in the masked row: normalised error inf
    s = measure(bad, ref, "fp16", lse=np.array([[[0.0, 0.75]]], dtype=np.float32))
    assert s.normalised.max == np.inf and s.worst_index == (0, 0, 0, 1)
    assert s.lse_abs.max == np.inf and s.lse_worst_index == (0, 0, 0)
    assert s.dtype == "fp16"
    json.dumps(s.as_dict())


def test_measure_without_lse_and_default_dtype():
    ref_out = np.full((1, 1, 1, 4), 1.0)
    ref = _reference(ref_out, np.zeros((1, 1, 1)), np.ones_like(ref_out))
    s = measure(np.full((1, 1, 1, 4), 1.0 + 2.0 ** -10, dtype=np.float16), ref)
    assert s.lse_abs is None and s.lse_worst_index is None
    assert s.dtype == "fp16"
    assert s.ulp.max == 1.0 and s.ulp.mean == 1.0  # a biased kernel: the signed mean shows it
    assert s.abs.mean == 2.0 ** -10


def test_measure_rounded_reference_is_within_half_ulp_and_u_normalised():
    rng = np.random.default_rng(1)
    problem = AttentionProblem.from_float(rng.standard_normal((1, 2, 32, 16)),
                                          rng.standard_normal((1, 2, 32, 16)),
                                          rng.standard_normal((1, 2, 32, 16)), "bf16", causal=True)
    ref = reference(problem)
    s = measure(ref.out.astype(ml_dtypes.bfloat16), ref, lse=ref.lse.astype(np.float32))
    assert s.ulp.max <= 0.5
    assert s.normalised.max <= 2.0 ** -8  # |round(O) - O| <= u |O| <= u D
    assert s.lse_abs.max <= 2.0 ** -24 * np.abs(ref.lse).max()


def test_shape_mismatch_is_an_argument_error():
    with pytest.raises(InvalidArgumentError, match="shape"):
        OutputErrors.compute(np.zeros(3), np.zeros(4), np.zeros(4), "fp32")
    with pytest.raises(InvalidArgumentError, match="lse.shape"):
        lse_errors(np.zeros(3), np.zeros(4))
