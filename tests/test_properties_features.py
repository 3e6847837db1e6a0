"""The variant properties (fa_verify.properties.variants) against correct implementations of
sliding windows, softcap, ALiBi and sinks and against one-bug fixtures of each; the callable
protocol's variant keywords; the variant strategies; not applicable without the variants."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from fa_verify import AttentionProblem, InvalidArgumentError
from fa_verify import strategies as fst
from fa_verify.backends.registry import get_backend
from fa_verify.backends.user_callable import CallableBackend
from fa_verify.properties import Selection, search_property
from fa_verify.properties.variants import check_feature_sensitivity, check_window_independence

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import feature_kernels  # noqa: E402

VARIANT_PROPERTIES = ("variant_agreement", "feature_sensitivity", "wide_window", "softcap_limit",
                      "window_independence")
FEW = Selection(max_examples=10, shrink=False)
#: Correct implementations: fewer examples (every bug above is caught within 5).
FEWER = Selection(max_examples=5, shrink=False)
#: What each one-bug fixture must be caught by within FEW examples.
CATCHES = {
    "window_edge_off_by_one": {"variant_agreement", "feature_sensitivity", "window_independence"},
    "softcap_before_scale": {"variant_agreement", "feature_sensitivity"},
    "alibi_sign_flipped": {"variant_agreement", "feature_sensitivity"},
    "sink_in_numerator": {"variant_agreement", "feature_sensitivity"},
    "ignores_softcap": {"variant_agreement", "feature_sensitivity"},
}


def _problem(nq=12, nk=20, dtype="fp16", **variants):
    rng = np.random.default_rng(7)
    return AttentionProblem.from_float(rng.standard_normal((1, 4, nq, 16)), rng.standard_normal((1, 2, nk, 16)),
                                       rng.standard_normal((1, 2, nk, 16)), dtype, **variants)


@pytest.mark.parametrize("target", ["numpy-tiled", "naive-fp32", "correct"])
@pytest.mark.parametrize("prop", VARIANT_PROPERTIES)
def test_correct_implementations_pass(target, prop):
    backend = CallableBackend(feature_kernels.correct) if target == "correct" else get_backend(target)
    outcome = search_property(backend, prop, FEWER)
    assert outcome.status == "passed" and outcome.examples == FEWER.max_examples, outcome.message()


@pytest.mark.parametrize("bug", sorted(CATCHES))
def test_each_one_bug_fixture_is_caught(bug):
    backend = CallableBackend(feature_kernels.BUGGY[bug], name=bug)
    failed = {prop for prop in CATCHES[bug] if search_property(backend, prop, FEW).status == "failed"}
    assert failed == CATCHES[bug]


def test_a_variant_taken_and_ignored_is_named_as_ignored():
    problem = _problem(softcap=0.5, dtype="fp32")
    result = check_feature_sensitivity(CallableBackend(feature_kernels.ignores_softcap), problem)
    assert result.failed and "switching softcap off (the output did not move" in result.detail
    assert "looks ignored" in result.detail


def test_window_independence_cuts_at_a_row_edge():
    problem = _problem(window_size=(2, 1))
    assert check_window_independence(CallableBackend(feature_kernels.correct), problem, seed=3).passed
    caught = [check_window_independence(CallableBackend(feature_kernels.window_edge_off_by_one), problem, seed=s)
              for s in range(4)]
    assert any(r.failed and "changed rows whose window" in r.detail for r in caught)


@pytest.mark.parametrize("prop", VARIANT_PROPERTIES)
def test_not_applicable_to_a_target_without_the_variants(prop):
    backend = CallableBackend(feature_kernels.correct, features=())
    outcome = search_property(backend, prop, FEWER)
    assert outcome.status == "not applicable" and outcome.examples == 0
    assert "does not implement" in outcome.reason and "keyword" in outcome.reason


def test_a_property_about_one_variant_needs_that_one():
    def no_window(q, k, v, *, causal, scale, softcap=0.0):
        return feature_kernels.correct(q, k, v, causal=causal, scale=scale, softcap=softcap)

    backend = CallableBackend(no_window)
    assert backend.features == ("softcap",)
    assert "window_size" in search_property(backend, "wide_window", FEW).reason
    assert search_property(backend, "softcap_limit", Selection(max_examples=3)).status == "passed"


def test_callables_get_the_variants_by_flash_attn_keywords():
    seen = {}

    def spy(q, k, v, *, causal, scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
        seen.update(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        return feature_kernels.correct(q, k, v, causal=causal, scale=scale)

    problem = _problem(window_size=(3, 0), softcap=2.0, alibi_slopes=[1, 2, 3, 4], sinks=[0, 1, 2, 3])
    CallableBackend(spy).run(problem)
    assert seen["window_size"] == (3, 0) and seen["softcap"] == 2.0
    assert seen["alibi_slopes"].dtype == np.float32 and seen["sinks"].tolist() == [0, 1, 2, 3]
    CallableBackend(spy).run(_problem())  # a dense problem: every variant passed as off
    assert seen == dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None)


def test_a_callable_without_a_keyword_does_not_run_that_variant():
    plain = CallableBackend(lambda q, k, v, *, causal, scale: feature_kernels.correct(q, k, v, causal=causal,
                                                                                       scale=scale))
    reason = plain.supports(_problem(sinks=[0, 0, 0, 0]))
    assert "does not implement sinks" in reason and "keyword sinks" in reason
    assert get_backend("numpy-tiled").supports(_problem(sinks=[0, 0, 0, 0])) is None


@pytest.mark.parametrize("features, message", [
    (("dropout",), r"'dropout' is not a variant"),
    (("window", "alibi"), r"no keyword parameter 'alibi_slopes'"),
])
def test_declared_features_are_checked_against_the_signature(features, message):
    def windowed(q, k, v, *, causal, scale, window_size=(-1, -1)):
        return q

    with pytest.raises(InvalidArgumentError, match=message):
        CallableBackend(windowed, features=features)


@settings(max_examples=40, database=None, deadline=None)
@given(fst.variant_problems(features=("window", "sinks"), always=("window",)))
def test_variant_problems_switch_on_only_the_features_asked_for(problem):
    assert "window" in problem.features and set(problem.features) <= {"window", "sinks"}
    assert problem.window != (-1, -1)


def test_variant_strategy_arguments_are_checked():
    with pytest.raises(InvalidArgumentError, match="features="):
        fst.variant_problems(features=("dropout",))
    with pytest.raises(InvalidArgumentError, match="tile="):
        fst.variant_problems(tile=0)
