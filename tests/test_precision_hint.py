"""Precision, said plainly: a callable that computes its scores in the input dtype fails the
default (FlashAttention's) model, and the failure names the looser preset that passes it and
the option that declares it; a real bug is told that no looser model explains it."""

import sys
from pathlib import Path

from fa_verify.backends import CallableBackend
from fa_verify.precision import PrecisionModel
from fa_verify.properties import Selection, search_property

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from attention_variants import no_max_subtraction  # noqa: E402
from user_kernels import scores_in_input_dtype  # noqa: E402

# The hint, not the depth of the search, is what these tests are about: no 4096-key draws, 20 fixed
# cases, no shrinking (the hint is computed on the failing example found).
QUICK = Selection(dtypes=("fp16",), max_examples=20, max_long_keys=257, max_edge_cases=20, shrink=False)


def test_input_scores_preset():
    model = PrecisionModel.parse("input-scores", "bf16")
    assert (model.score_accumulation, model.p_rounding, model.pv_accumulation) == ("bf16", "bf16", "fp32")


def test_a_failure_names_the_looser_preset_that_passes():
    outcome = search_property(CallableBackend(scores_in_input_dtype), "oracle_agreement", QUICK)
    assert outcome.status == "failed"
    assert "passes under --precision input-scores" in outcome.message()
    # and declaring it is enough: the same search passes
    declared = CallableBackend(scores_in_input_dtype, precision="input-scores")
    assert search_property(declared, "oracle_agreement", QUICK).passed


def test_a_bug_is_told_no_looser_model_explains_it():
    outcome = search_property(CallableBackend(no_max_subtraction), "oracle_agreement", QUICK)
    assert outcome.status == "failed"
    assert "fails under the looser legitimate models too (input-scores, same-precision)" in outcome.message()


def test_the_loosest_model_gets_no_hint():
    outcome = search_property(CallableBackend(no_max_subtraction, precision="same-precision"), "oracle_agreement",
                              QUICK)
    assert outcome.status == "failed" and "precision:" not in outcome.message()
