"""Messages that name the right cause: NaN where the reference is finite, absolute errors where
the row scale is subnormal (flush to zero), and a rounded scale told apart from truncation."""

import collections
import re
import sys
from pathlib import Path

import numpy as np
from fa_verify.backends import CallableBackend, get_backend
from fa_verify.dtypes import finfo, round_to
from fa_verify.properties import check_unbiased_rounding, check_v_affinity
from fa_verify.strategies import make_problem
from fa_verify.verdict import check_attention

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import attention_variants as variants  # noqa: E402

TILED = get_backend("numpy-tiled")


def test_nan_outputs_are_named_where_the_reference_is_finite():
    problem = make_problem("normal", (1, 1, 1, 4, 6, 8), "fp32", 3)
    out, lse = TILED.run(problem)
    out[0, 0, 1, 2] = np.nan
    message = check_attention(out, problem, lse=lse, precision=TILED.precision("fp32")).message()
    assert "NaN/Inf values where the reference is finite" in message
    assert "worst at [0, 0, 1, 2]: got NaN where the reference is finite (" in message
    assert "got nan" not in message


def test_a_nan_on_both_sides_of_a_property_is_not_got_nan_expected_nan():
    def nan_everywhere(problem):
        out, lse = TILED.run(problem)
        return np.full_like(out, np.nan), lse

    problem = make_problem("normal", (1, 1, 1, 4, 6, 8), "fp16", 0)
    result = check_v_affinity(nan_everywhere, problem, seed=0)
    assert result.failed and "got nan, expected nan" not in result.detail
    assert "got NaN, and the expected value (derived from the target's own output) is NaN too" in result.detail


def test_a_flush_to_zero_target_is_shown_its_absolute_error_and_the_likely_cause():
    problem = make_problem("tiny", (1, 1, 1, 4, 6, 8), "fp32", 3)
    out, lse = TILED.run(problem)
    flushed = np.where(np.abs(out) < float(finfo("fp32").smallest_normal), 0, out).astype(out.dtype)
    verdict = check_attention(flushed, problem, lse=lse, precision=TILED.precision("fp32"))
    assert not verdict.passed
    assert "below the fp32 normal range" in verdict.message() and "a flush-to-zero target?" in verdict.message()
    assert re.search(r"absolute error \d\.?\d*e-(39|4\d) \(normalised 1\)", verdict.cause), verdict.cause


def test_the_flush_to_zero_note_stays_out_of_ordinary_failures():
    problem = make_problem("normal", (1, 1, 1, 4, 6, 8), "fp32", 3)
    out, lse = TILED.run(problem)
    verdict = check_attention(out * 1.01, problem, lse=lse, precision=TILED.precision("fp32"))
    assert not verdict.passed and verdict.cause == "" and "flush-to-zero" not in verdict.message()


def _scale_rounded_to_fp16(q, k, v, *, causal, scale):
    """Correct FA2 but for a scale rounded to fp16 (1/sqrt(40): relative error -2.1e-4)."""
    return variants._flash(q, k, v, causal, float(round_to(scale, "fp16")))


#: Shapes whose 1/sqrt(D) is not a power of two, so rounding the scale to fp16 changes it.
SHAPES = [(1, 4, 2, 64, 48, 40), (2, 2, 2, 40, 33, 24), (1, 2, 1, 96, 80, 12), (1, 4, 4, 64, 64, 80)]


def _causes(fn, dtype) -> collections.Counter:
    """Over 20 seeds x SHAPES: runs, failures, and which cause each failure names."""
    counts = collections.Counter()
    for shape in SHAPES:
        for seed in range(20):
            result = check_unbiased_rounding(CallableBackend(fn), make_problem("normal", shape, dtype, seed), seed=seed)
            counts["runs"] += 1
            counts["failed"] += result.failed
            counts["scale"] += "a rounded scale or rounded scores, not output rounding" in result.detail
            counts["fp16 scale"] += "as rounding the scale to fp16" in result.detail
            counts["truncation"] += "outputs rounded toward zero (truncation)" in result.detail
    return counts


def test_unbiased_rounding_tells_a_rounded_scale_from_truncated_outputs():
    scale = _causes(_scale_rounded_to_fp16, "fp16")  # measured: 68 of 80 fail, each named a scale error
    assert scale["failed"] >= scale["runs"] // 2, scale
    assert scale["scale"] == scale["fp16 scale"] == scale["failed"] and scale["truncation"] == 0, scale
    for dtype in ("fp16", "bf16"):
        truncated = _causes(variants.truncation, dtype)  # measured: all fail, each named truncation
        assert truncated["failed"] == truncated["truncation"] == truncated["runs"] and truncated["scale"] == 0
        assert _causes(variants.tiles_in_order, dtype)["failed"] == 0


def test_a_masked_row_failure_prints_no_empty_measurement():
    """Issue 25 item 12: a masked-row failure printed a second block "0 / 1 (0.0%) exceed ... error 0
    = 0 x bound 0"; the measurement shows only where something exceeds its bound."""

    from fa_verify.backends.naive import naive_attention
    from fa_verify.precision import PrecisionModel
    from fa_verify.strategies import Shape, make_problem
    from fa_verify.verdict import check_attention

    problem = make_problem("normal", Shape(1, 1, 1, 3, 1, 8), "fp32", seed=0, causal=True)  # rows 0, 1 see no key
    out, lse = naive_attention(problem, PrecisionModel.flash("fp32"))
    lse = lse.copy()
    lse[0, 0, 0] = 0.0  # LSE 0 instead of -inf on a fully masked row
    verdict = check_attention(out, problem, lse=lse, precision="flash")
    assert verdict.rule == "masked_rows"
    assert "exceed" not in verdict.message() and "× bound" not in verdict.message()
