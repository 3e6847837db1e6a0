"""Judging the backward suite: our backward kernel's mutants (kernels/mutants/mutants.toml, family
fa2_bwd) each killed by the backward properties, none of them on the unmutated kernel over
seeds, and the gradient rules others use (fa_verify.judge.gradient_rules) side by side. The
default run kills the bug classes that only adversarial data or a strided dout show; the rest,
and 20 seeds, are slow (`fa_verify mutants --family fa2_bwd` runs them all)."""

from __future__ import annotations

import numpy as np
import pytest

from fa_verify.backends.backward_kernel import BackwardKernelBackend
from fa_verify.backends.cuda_kernels import cpu_runner_availability
from fa_verify.backends.numpy_backward import NumpyBackwardBackend
from fa_verify.judge.campaign import judge_mutant, run_suite
from fa_verify.judge.gradient_rules import (
    GRADIENT_RULES,
    FlashAttentionBackwardRule,
    JaxRule,
    TorchFudgeRule,
    TritonTutorialRule,
    _case,
    eager_gradients,
)
from fa_verify.judge.mutants import mutant_backend, unmutated_backend
from fa_verify.kernels.mutants import load_mutants
from fa_verify.oracle.backward import gradient_reference
from fa_verify.properties import Selection, get_property

CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)
MUTANTS = {m.name: m for m in load_mutants() if m.backward}
SMALL = Selection.from_profile("ci", max_examples=20, seed=0, shrink=False)  # a kill is the same unshrunk
#: The killer each mutant must fall to: the property that sees its bug class.
KILLERS = {
    "fa2-bwd-tile-tail-unmasked": "gradient_agreement",     # only anti-aligned rows (LSE ~ -100) show it
    "fa2-bwd-dout-with-out-strides": "gradient_strided_dout",
    "fa2-bwd-dq-add-not-atomic": "races",
    "fa2-bwd-no-delta": "gradient_agreement",
    "fa2-bwd-dk-unscaled": "gradient_agreement",
    "fa2-bwd-gqa-one-head": "gradient_agreement",
    "fa2-bwd-causal-alignment": "gradient_agreement",
    "fa2-bwd-tail-rows-unwritten": "gradient_agreement",
    "fa2-bwd-dq-workspace-not-zeroed": "gradient_agreement",
    "fa2-bwd-dq-accumulated-in-input-dtype": "gradient_agreement",
    "fa2-bwd-no-softcap-derivative": "gradient_variant_agreement",
    "fa2-bwd-window-left-off-by-one": "gradient_variant_agreement",
    "fa2-bwd-no-dsink": "gradient_variant_agreement",
}
DEFAULT = ("fa2-bwd-tile-tail-unmasked", "fa2-bwd-dout-with-out-strides", "fa2-bwd-dq-add-not-atomic")


def test_every_backward_mutant_has_its_killer():
    assert set(KILLERS) == set(MUTANTS)


@needs_cpu_runner
@pytest.mark.parametrize("name", DEFAULT)
def test_the_property_of_its_bug_class_kills_a_mutant(name):
    """The default run: the killer alone, on the mutants only adversarial data, a strided dout or
    the race detector show (each kill judged against the unmutated kernel's runs)."""
    mutant = MUTANTS[name]
    run = run_suite(mutant_backend(mutant), SMALL, properties=[get_property(KILLERS[name])],
                    control=unmutated_backend(mutant))
    assert run.killed and run.killer == KILLERS[name], f"{name} survived {KILLERS[name]}"


@pytest.mark.slow
@needs_cpu_runner
@pytest.mark.parametrize("name", list(KILLERS))
def test_the_backward_suite_kills_every_mutant(name):
    """The whole suite in its order, as the campaign runs it: the first property to kill is the one
    that sees the bug class."""
    verdict = judge_mutant(MUTANTS[name], SMALL, sanitizer=False, stop_at_first=True)
    assert verdict.killed, f"{name} ({verdict.description}) survived the backward suite"
    assert verdict.kill.killer == KILLERS[name], verdict.kill.detail
    assert verdict.kill.counterexample is not None


@needs_cpu_runner
@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s == 1 else pytest.mark.slow) for s in range(1, 21)])
def test_no_false_positive_on_the_unmutated_backward_kernel(seed):
    """The campaign's 20 seeds (one in the default run)."""
    run = run_suite(BackwardKernelBackend("cpu"), Selection.from_profile("ci", max_examples=10, seed=seed))
    assert not run.killed, f"{run.killer}: {run.detail}"


def test_no_false_positive_on_the_numpy_backward_model():
    run = run_suite(NumpyBackwardBackend(), Selection.from_profile("ci", max_examples=20, seed=3))
    assert not run.killed, f"{run.killer}: {run.detail}"


# --- the gradient rules ------------------------------------------------------------------------------

def _exact_rounded(case):
    ref = gradient_reference(case.problem.forward, case.problem.dout)
    return [x.astype(np.float64).astype(case.problem.q.dtype) for x in (ref.dq, ref.dk, ref.dv)]


@pytest.mark.parametrize("rule", GRADIENT_RULES, ids=lambda r: r.name)
def test_each_gradient_rule_passes_the_rounded_exact_gradients_and_fails_a_wrong_dk(rule):
    case = _case("tiny", (1, 2, 1, 16, 24, 64), "fp16", True)
    right = _exact_rounded(case)
    assert rule.judge_result(right, case) is None
    wrong = [right[0], (right[1].astype(np.float32) * 4).astype(right[1].dtype), right[2]]
    assert rule.judge_result(wrong, case).startswith("dk: ")


def test_the_eager_baseline_rounds_every_op_to_the_dtype():
    """g_pt of fp16 is farther from the exact gradients than fp32's, and fp32's within 1e-5."""
    errors = {}
    for dtype in ("fp16", "fp32"):
        case = _case("e", (1, 2, 2, 16, 16, 64), dtype, False)
        ref = gradient_reference(case.problem.forward, case.problem.dout)
        errors[dtype] = float(np.abs(eager_gradients(case.problem)["dq"] - ref.dq).max())
    assert errors["fp32"] < 1e-5 < errors["fp16"]


@pytest.mark.parametrize("rule, fraction", [(FlashAttentionBackwardRule(), "3x"), (TorchFudgeRule(), "5")])
def test_the_baseline_rules_scale_with_the_same_precision_error(rule, fraction):
    """An error a little under the rule's multiple of g_pt's passes, a little over fails."""
    case = _case("b", (1, 2, 2, 16, 24, 64), "bf16", False)
    ref = gradient_reference(case.problem.forward, case.problem.dout)
    g_ref = ref.dq.astype(case.problem.q.dtype).astype(np.float64)
    baseline = float(np.abs(eager_gradients(case.problem)["dq"] - g_ref).max())
    factor = 3 if isinstance(rule, FlashAttentionBackwardRule) else 5
    for scale, passes in ((0.9, True), (1.5, False)):
        got = g_ref.copy()
        got.flat[0] += scale * factor * baseline + (1.6e-2 * abs(g_ref.flat[0]) if factor == 5 and passes is False else 0)
        assert (rule.tensor("dq", got, g_ref, case.problem) is None) == passes, (fraction, scale)


def test_fixed_tolerance_rules():
    case = _case("t", (1, 1, 1, 4, 4, 64), "fp16", False)
    g = np.zeros((1, 1, 4, 64))
    assert JaxRule().tensor("dq", g + 0.19, g, case.problem) is None
    assert JaxRule().tensor("dq", g + 0.21, g, case.problem) is not None
    assert TritonTutorialRule().tensor("dq", g + 0.009, g, case.problem) is None
    assert TritonTutorialRule().tensor("dq", g + 0.011, g, case.problem) is not None


@needs_cpu_runner
def test_the_triton_tutorial_rule_misses_gqa_from_one_head():
    """Its one shape is MHA: a GQA bug cannot show (the campaign's table says which rules miss what)."""
    outcome = TritonTutorialRule().run(mutant_backend(MUTANTS["fa2-bwd-gqa-one-head"]))
    assert outcome.cases == 1 and not outcome.killed
