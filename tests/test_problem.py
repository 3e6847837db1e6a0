"""The problem model: validation messages, masks, GQA mapping, input policy."""

import numpy as np
import pytest

from fa_verify import AttentionProblem, InvalidArgumentError, InvalidProblemError
from fa_verify.dtypes import dtype_name, numpy_dtype, round_to, ulp, unit_roundoff


def _arrays(b=1, h=2, hkv=1, nq=3, nk=4, d=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, h, nq, d)).astype(dtype),
            rng.standard_normal((b, hkv, nk, d)).astype(dtype),
            rng.standard_normal((b, hkv, nk, d)).astype(dtype))


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q[0], k, v), "must have 4 dimensions"),
    (lambda q, k, v: (q, k, v[:, :, :2]), r"k.shape=.* and v.shape=.* must agree on \[B, Hkv, Nk\]"),
    (lambda q, k, v: (q[:, :, :, :4], k, v), "its head dim D=8 must be q's D=4"),
    (lambda q, k, v: (np.concatenate([q, q]), k, v), "batch sizes differ"),
    (lambda q, k, v: (q[:, :1].repeat(3, axis=1), k.repeat(2, axis=1), v.repeat(2, axis=1)),
     "H=3 must be divisible by Hkv=2"),
    (lambda q, k, v: (q.astype(np.float16), k, v), "share one dtype"),
    (lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)),
     "dtype='fp64' is not a problem dtype"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), "D must be >= 1|must be >= 1"),
    (lambda q, k, v: (q[:, :, :0], k, v), "Nq and Nk must be >= 1"),
    (lambda q, k, v: (q.tolist(), k, v), "q must be a numpy array"),
])
def test_malformed_problems_are_rejected_with_a_clear_message(change, message):
    with pytest.raises(InvalidProblemError, match=message):
        AttentionProblem(*change(*_arrays()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_rejected_with_their_index(bad):
    q, k, v = _arrays()
    v[0, 0, 2, 5] = bad
    with pytest.raises(InvalidProblemError, match=r"v holds a non-finite value .* \(0, 0, 2, 5\)"):
        AttentionProblem(q, k, v)


def test_bad_options_are_rejected():
    q, k, v = _arrays()
    with pytest.raises(InvalidProblemError, match="causal_alignment='middle'"):
        AttentionProblem(q, k, v, causal=True, causal_alignment="middle")
    with pytest.raises(InvalidProblemError, match="scale=-1.0"):
        AttentionProblem(q, k, v, scale=-1.0)
    with pytest.raises(InvalidArgumentError, match="dtype='int8'"):
        AttentionProblem.from_float(q, k, v, "int8")


@pytest.mark.parametrize("alignment, nq, nk, expected", [
    ("bottom-right", 2, 4, [[1, 1, 1, 0], [1, 1, 1, 1]]),
    ("top-left", 2, 4, [[1, 0, 0, 0], [1, 1, 0, 0]]),
    ("bottom-right", 4, 2, [[0, 0], [0, 0], [1, 0], [1, 1]]),
    ("top-left", 4, 2, [[1, 0], [1, 1], [1, 1], [1, 1]]),
])
def test_causal_masks_follow_their_alignment(alignment, nq, nk, expected):
    p = AttentionProblem(*_arrays(nq=nq, nk=nk), causal=True, causal_alignment=alignment)
    np.testing.assert_array_equal(p.mask, np.array(expected, dtype=bool))
    np.testing.assert_array_equal(p.masked_rows, ~np.array(expected, dtype=bool).any(axis=1))


def test_gqa_heads_map_to_kv_head_h_over_group():
    q, k, v = _arrays(h=4, hkv=2)
    k[:, 1] = 7.0
    p = AttentionProblem(q, k, v)
    k64, _ = p.kv64()
    assert p.group_size == 2
    assert (k64[:, 2:] == 7.0).all() and not (k64[:, :2] == 7.0).any()


def test_from_float_rounds_to_nearest_even():
    x = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8]).reshape(1, 1, 2, 1)  # bf16 ties
    p = AttentionProblem.from_float(x, x, x, "bf16")
    np.testing.assert_array_equal(p.q.astype(np.float64).ravel(), [1.0, 1 + 2.0 ** -6])
    assert p.dtype == "bf16"


def test_default_scale_is_flagged_inexact_unless_d_is_a_square():
    assert not AttentionProblem(*_arrays(d=8)).scale_is_exact
    assert AttentionProblem(*_arrays(d=16)).scale_is_exact
    assert AttentionProblem(*_arrays(d=8), scale=0.3).scale_is_exact


def test_dtype_helpers():
    assert dtype_name("bfloat16") == dtype_name(numpy_dtype("bf16")) == "bf16"
    assert unit_roundoff("fp16") == 2.0 ** -11 and unit_roundoff("bf16") == 2.0 ** -8
    assert unit_roundoff("fp32") == 2.0 ** -24
    np.testing.assert_array_equal(ulp([1.0, 1.5, 2.0, 0.0], "fp16"), [2.0 ** -10] * 2 + [2.0 ** -9, 2.0 ** -24])
    assert round_to([65520.0], "fp16")[0] == np.inf  # overflow rounds to inf, as on the GPU
