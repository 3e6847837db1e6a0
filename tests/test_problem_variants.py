"""The problem model's variants: windows, softcap, ALiBi and sinks (flash-attn 2's conventions)."""

import numpy as np
import pytest

from fa_verify import AttentionProblem, InvalidArgumentError, InvalidProblemError


def _problem(nq=4, nk=6, h=2, b=1, **kwargs):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, nq, 8))
    k = rng.standard_normal((b, 1, nk, 8))
    return AttentionProblem.from_float(q, k, k, "fp32", **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window_size=(-2, 0)), r"left=-2 is below -1"),
    (dict(window_size=(3, -5)), r"right=-5 is below -1"),
    (dict(window_size=(3,)), r"must be a pair \(left, right\)"),
    (dict(window_size=(1.5, 0)), r"left=1.5 must be an integer"),
    (dict(window_size=(True, 0)), r"left=True must be an integer"),
    (dict(softcap=-1.0), r"softcap=-1.0 must be a finite number >= 0"),
    (dict(softcap=float("inf")), r"softcap=inf must be a finite number >= 0"),
    (dict(softcap="30"), r"softcap='30' must be a number"),
    (dict(alibi_slopes=np.ones(3)), r"alibi_slopes.shape=\[3\] must be \[H\] or \[B, H\] = \[2\] or \[1, 2\]"),
    (dict(alibi_slopes=np.ones((2, 2))), r"alibi_slopes.shape=\[2, 2\] must be"),
    (dict(alibi_slopes=[np.nan, 1.0]), r"alibi_slopes holds a value that is not a finite float32 at index \(0,\)"),
    (dict(alibi_slopes=[1e39, 1.0]), r"not a finite float32"),
    (dict(sinks=np.zeros((1, 2))), r"sinks.shape=\[1, 2\] must be \[H\] = \[2\]"),
    (dict(sinks=np.zeros(5)), r"sinks.shape=\[5\] must be \[H\]"),
    (dict(sinks=[0.0, np.inf]), r"sinks holds a value that is not a finite float32 at index \(1,\)"),
])
def test_bad_variant_inputs_are_rejected_naming_the_argument(kwargs, message):
    with pytest.raises((InvalidProblemError, InvalidArgumentError), match=message):
        _problem(**kwargs)


def test_defaults_leave_a_problem_dense_and_unchanged():
    dense, causal = _problem(), _problem(causal=True)
    assert dense.features == () and causal.features == ()
    assert dense.mask.all()
    # causal is the window (-1, 0): the mask is the bottom-right triangle as before
    assert np.array_equal(causal.mask, np.arange(6)[None, :] <= np.arange(4)[:, None] + 2)
    assert np.array_equal(causal.key_limit(), [3, 4, 5, 6]) and not causal.key_start().any()


def test_window_edges_follow_the_diagonal_with_the_nk_minus_nq_offset():
    p = _problem(window_size=(1, 2))
    i, j = np.arange(4)[:, None], np.arange(6)[None, :]
    assert np.array_equal(p.mask, (i + 2 - 1 <= j) & (j <= i + 2 + 2))
    top_left = _problem(window_size=(1, 2), causal_alignment="top-left")
    assert np.array_equal(top_left.mask, (i - 1 <= j) & (j <= i + 2))


def test_causal_sets_the_right_edge_to_zero_as_flash_attn_does():
    p = _problem(window_size=(1, 3), causal=True)
    assert p.window == (1, 0)
    assert np.array_equal(p.mask, _problem(window_size=(1, 0)).mask)


def test_left_zero_sees_only_the_diagonal_and_a_window_can_leave_rows_empty():
    assert np.array_equal(_problem(window_size=(0, 0)).mask.sum(axis=1), [1, 1, 1, 1])
    p = _problem(nq=6, nk=3, window_size=(0, 0))  # offset -3: rows 0..2 see no key
    assert np.array_equal(p.masked_rows, [True, True, True, False, False, False])


def test_alibi_bias_is_minus_slope_times_distance_to_the_diagonal():
    p = _problem(alibi_slopes=[0.5, 0.25])
    bias = p.alibi_bias(0, np.arange(2)[:, None], np.arange(4))
    assert bias.shape == (2, 4, 6)
    assert bias[1, 0, 0] == -0.25 * 2 and bias[0, 3, 5] == 0 and bias[0, 0, 5] == -0.5 * 3
    per_batch = _problem(b=2, alibi_slopes=[[1, 2], [3, 4]])
    assert per_batch.alibi_bias(1, 1, 0)[0] == -4 * 2 and per_batch.alibi_bias(0, 1, 0)[0] == -2 * 2


def test_variants_are_named_in_features_and_describe():
    p = _problem(window_size=(4, 0), softcap=30, alibi_slopes=[1, 2], sinks=[0.0, 1.0])
    assert p.features == ("window", "softcap", "alibi", "sinks")
    assert "window_size=(4, 0) softcap=30.0 alibi_slopes=[2] sinks=[2]" in p.describe()
    assert p.sinks.dtype == np.float32 and p.alibi_slopes.dtype == np.float32
