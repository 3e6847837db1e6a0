"""The certified oracle on the variants (window, softcap, ALiBi, sinks) against the mpmath
definition, on adversarial cases of each: always within the stated bounds."""

import numpy as np
import pytest
from test_oracle import _assert_within_bounds, _normal

from fa_verify.oracle import FALLBACK_THRESHOLD, reference
from fa_verify.oracle.certified import certified_reference


def _adversarial():
    rng = np.random.default_rng(5)
    recipe = 2.0 ** (-8 * np.arange(1, 5) / 4)
    return {
        # |scores| in the hundreds, capped to 0.5 or 30: tanh saturates, the bound must not
        "softcap_binding_hard": _normal(rng, 1, 2, 1, 6, 11, 16, "fp32", spread=5.0, softcap=0.5),
        "softcap_30_large_logits": _normal(rng, 1, 2, 2, 5, 9, 16, "bf16", spread=6.0, softcap=30.0),
        "softcap_tiny": _normal(rng, 1, 1, 1, 4, 7, 8, "fp16", spread=4.0, softcap=1e-3),
        # biases of -1e4 per key of distance, one slope negative (a growing bias)
        "alibi_huge_biases": _normal(rng, 1, 2, 1, 5, 9, 8, "fp32", alibi_slopes=[1e4, -30.0]),
        "alibi_recipe_gqa_per_batch": _normal(rng, 2, 4, 2, 7, 12, 8, "fp16", causal=True,
                                              alibi_slopes=np.stack([recipe, recipe[::-1]])),
        # the sink far above every score (keys' weights underflow) and far below
        "sink_far_above_and_below": _normal(rng, 1, 2, 1, 4, 6, 8, "fp32", sinks=[1000.0, -1000.0]),
        "sink_near_the_row_max": _normal(rng, 1, 3, 1, 4, 6, 8, "fp32", spread=2.0, sinks=[3.0, 0.0, -3.0]),
        # windows leaving rows with no key, with and without a sink
        "window_empty_rows": _normal(rng, 1, 2, 1, 9, 4, 8, "fp32", window_size=(0, 0)),
        "window_empty_rows_sink": _normal(rng, 1, 2, 1, 9, 4, 8, "fp32", window_size=(1, 0), sinks=[2.0, -5.0]),
        "window_top_left_right_edge": _normal(rng, 1, 2, 2, 6, 13, 8, "bf16", window_size=(2, 3),
                                              causal_alignment="top-left"),
        "everything_at_once": _normal(rng, 2, 2, 1, 7, 10, 16, "fp16", spread=3.0, causal=True,
                                      window_size=(3, 5), softcap=2.0, alibi_slopes=[0.5, 4.0],
                                      sinks=[2.0, -2.0]),
    }


CASES = _adversarial()


@pytest.mark.parametrize("name", sorted(CASES))
def test_certified_within_bound_of_mpmath_on_adversarial_variants(name):
    problem = CASES[name]
    fast = reference(problem)
    _assert_within_bounds(fast, reference(problem, method="mpmath"))
    assert fast.relative_bound <= FALLBACK_THRESHOLD * 1.01


@pytest.mark.parametrize("name", ["softcap_binding_hard", "alibi_huge_biases", "everything_at_once"])
def test_rows_handed_to_mpmath_keep_the_variants(name):
    problem = CASES[name]
    via_mpmath = certified_reference(problem, threshold=0.0)
    assert via_mpmath.mpmath_rows == np.prod(problem.out_shape[:3])
    _assert_within_bounds(reference(problem), via_mpmath)


def test_rows_without_keys_follow_the_convention():
    empty = CASES["window_empty_rows"].masked_rows
    assert empty.any()
    plain = reference(CASES["window_empty_rows"])
    assert (plain.out[:, :, empty] == 0).all() and (plain.lse[:, :, empty] == -np.inf).all()
    problem = CASES["window_empty_rows_sink"]
    with_sink = reference(problem)
    empty = problem.masked_rows
    assert empty.any() and (with_sink.out[:, :, empty] == 0).all()
    np.testing.assert_array_equal(with_sink.lse[0][:, empty], np.repeat(problem.sinks[:, None], empty.sum(), 1))


def test_a_sink_far_above_the_scores_takes_all_the_weight():
    ref = reference(CASES["sink_far_above_and_below"])
    assert np.abs(ref.out[0, 0]).max() < 1e-300 and (ref.lse[0, 0] == 1000.0).all()
