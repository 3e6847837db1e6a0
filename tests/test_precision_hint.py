"""Precision, said plainly: a callable that computes its scores in the input dtype fails the
default (FlashAttention's) model, and the run names the looser preset that passes it and the
option that declares it, only when it passes every failing property; a real bug is told that
no looser model explains it."""

import sys
from pathlib import Path

from fa_verify.backends import CallableBackend
from fa_verify.precision import PrecisionModel
from fa_verify.check import check_backend
from fa_verify.properties import FAILED, Selection, search_property
from fa_verify.properties.precision_hint import run_precision_hint
from fa_verify.properties.search import PropertyOutcome

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


def _hint(fn, **declared) -> str:
    return check_backend(CallableBackend(fn, **declared), QUICK, properties=["oracle_agreement"]).precision_hint()


def test_a_failure_names_the_looser_preset_that_passes():
    assert _hint(scores_in_input_dtype).startswith(
        "precision: its failing example passes under --precision input-scores")
    # and declaring it is enough: the same search passes
    declared = CallableBackend(scores_in_input_dtype, precision="input-scores")
    assert search_property(declared, "oracle_agreement", QUICK).passed


def test_a_bug_is_told_no_looser_model_explains_it():
    assert _hint(no_max_subtraction) == (
        "precision: not a matter of declared precision: oracle_agreement fails under every looser legitimate "
        "model (input-scores, same-precision) too")


def test_the_loosest_model_gets_no_hint():
    assert _hint(no_max_subtraction, precision="same-precision") == ""


def _failed(name, passes_under, worst_ratio=2.0):
    return PropertyOutcome(name, "user", status=FAILED, passes_under=passes_under, worst_ratio=worst_ratio)


def test_a_preset_is_offered_only_when_every_failing_property_passes_under_it():
    """A kernel that never rescales its accumulator can pass one property under same-precision and
    fail another under every model: no preset is offered then, and the other is named."""
    lost_rescaling = [_failed("oracle_agreement", ("same-precision",)), _failed("key_order", ())]
    assert run_precision_hint(lost_rescaling) == (
        "precision: not a matter of declared precision: key_order fails under every looser legitimate model "
        "(input-scores, same-precision) too")
    # each explained by some model, but not one model for both
    assert run_precision_hint([_failed("a", ("input-scores",)), _failed("b", ("same-precision",))]).endswith(
        "no looser legitimate model passes every one of a, b")
    # the least lenient model common to all is the one offered
    both = [_failed("a", ("input-scores", "same-precision")), _failed("b", ("same-precision",))]
    assert "every one of a, b passes under --precision same-precision" in run_precision_hint(both)
    assert run_precision_hint(both, offer=False) == ""  # one test of a pytest run: only the negative
    # passes and built-in backends (precision not judged) say nothing
    assert run_precision_hint([PropertyOutcome("a", "user"), _failed("b", None)]) == ""


def test_a_bitwise_failure_is_no_matter_of_precision():
    """A check without an error ratio (bits compared) passes under no model; alone it says nothing
    (precision never entered), beside a tolerance failure it withholds the hint."""
    bitwise = _failed("determinism", (), worst_ratio=None)
    assert run_precision_hint([bitwise]) == ""
    assert "determinism fails under every looser" in run_precision_hint([bitwise, _failed("a", ("input-scores",))])


def test_a_cheap_softcap_tanh_is_told_the_tanh_declaration_first():
    """A softcap computing tanh as 1 - 2 / (e^{2x} + 1) (fixtures/cheap_tanh.py) fails softcap_limit
    under the default accurate tanh; the hint names its own declaration plus tanh=absolute (before
    any preset), and declaring it passes."""
    from cheap_tanh import softcap_attention

    fp32 = Selection(dtypes=("fp32",), max_examples=5, max_long_keys=257, max_edge_cases=5, shrink=False)
    outcome = check_backend(CallableBackend(softcap_attention), fp32, properties=["softcap_limit"])
    assert outcome.precision_hint().startswith(
        "precision: its failing example passes under --precision flash,tanh=absolute (tanh with an absolute error")
    declared = CallableBackend(softcap_attention, precision="flash,tanh=absolute")
    assert search_property(declared, "softcap_limit", fp32).passed


def test_looser_presets_keep_what_the_target_declares_of_its_implementation():
    """A target declaring its tanh, exp and input rounding is tried under each looser preset with
    those kept (they say how it computes, not how precise its stages are), and the hint names the
    whole spelling; a preset already declared is not tried again."""
    from types import SimpleNamespace

    from fa_verify.properties.precision_hint import passes_under
    from fa_verify.problem import AttentionProblem
    import numpy as np

    tried = []

    def prop(backend, problem, seed):
        model = backend.precision(problem.dtype)
        tried.append((model.score_accumulation, model.tanh, model.exp, model.input_rounding))
        return SimpleNamespace(applicable=True, failed=model.score_accumulation == "fp32", informative=True)

    q = np.zeros((1, 1, 2, 8), np.float16)
    problem = AttentionProblem(q, q, q)
    failing = SimpleNamespace(worst_ratio=3.0)
    declared = CallableBackend(scores_in_input_dtype, precision="flash,tanh=approx,exp=approx,inputs=fp16")
    assert passes_under(declared, prop, problem, 0, failing) == (
        "input-scores,tanh=approx,exp=approx,inputs=fp16", "same-precision,tanh=approx,exp=approx,inputs=fp16")
    assert tried == [("fp16", "approx", "approx", "fp16")] * 2
    tried.clear()
    already = CallableBackend(scores_in_input_dtype, precision="input-scores,inputs=fp16")
    assert passes_under(already, prop, problem, 0, failing) == ("same-precision,inputs=fp16",)
    assert tried == [("fp16", "accurate", "accurate", "fp16")]
    hint = run_precision_hint([_failed("a", ("input-scores,tanh=approx",))])
    assert "--precision input-scores,tanh=approx (q·k and the softmax in the input dtype, P·V accumulated in fp32, " \
           "with the declared tanh=approx)" in hint
