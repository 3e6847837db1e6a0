"""The FP8 problem (fa_verify.fp8): FlashAttention-3's descale convention, validation, saving."""

import ml_dtypes
import numpy as np
import pytest

from fa_verify.errors import InvalidProblemError
from fa_verify.fp8 import DESCALES, FP8Problem
from fa_verify.precision import PrecisionModel


def _problem(B=2, H=4, Hkv=2, nq=3, nk=5, d=8, fmt="e4m3", seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    descales = {name: rng.uniform(0.1, 3.0, (B, Hkv)) for name in DESCALES}
    descales.update({k: kwargs.pop(k) for k in DESCALES if k in kwargs})
    return FP8Problem.from_float(rng.normal(size=(B, H, nq, d)), rng.normal(size=(B, Hkv, nk, d)),
                                 rng.normal(size=(B, Hkv, nk, d)), fmt, **descales, **kwargs)


def test_the_true_value_is_stored_times_the_descale_of_the_groups_kv_head():
    p = _problem()
    # query head 3 of batch 1 is in kv head 1's group (G = 2): its descale is q_descale[1, 1]
    assert p.descale("q_descale")[1, 3 // p.group_size] == np.float32(p.q_descale[1, 1])
    assert p.descale("k_descale").shape == (2, 2)
    per_tensor = _problem(k_descale=[0.375])
    assert np.all(per_tensor.descale("k_descale") == np.float32(0.375))


def test_shapes_dtype_and_outputs_follow_the_stored_problem():
    p = _problem(fmt="e5m2", causal=True)
    assert (p.kind, p.dtype, p.nk, p.head_dim, p.heads, p.kv_heads) == ("fp8", "e5m2", 5, 8, 4, 2)
    assert p.mask.shape == (3, 5) and p.q.dtype == np.dtype(ml_dtypes.float8_e5m2)
    out, lse = p.outputs(PrecisionModel.flash("e5m2"))
    assert (out.name, out.dtype, out.shape, lse.dtype) == ("out", "bf16", (2, 4, 3, 8), "fp32")
    assert p.replace(output_dtype="fp16").outputs(PrecisionModel.flash("e5m2"))[0].dtype == "fp16"
    assert set(p.input_arrays()) == {"q", "k", "v", *DESCALES}
    assert "dtype=e5m2" in p.describe() and "q[2, 2] k[2, 2] v[2, 2]" in p.describe()


def test_saved_and_rebuilt_bit_for_bit():
    p = _problem(v_descale=[1.5], tags=(("seed", 3),))
    again = FP8Problem.from_saved(*p.saved("x_"), prefix="x_")
    for name in ("q", "k", "v", *DESCALES):
        assert np.array_equal(getattr(again, name).view(np.uint8), getattr(p, name).view(np.uint8))
    assert again.describe() == p.describe() and again.tags == p.tags


@pytest.mark.parametrize("change, message", [
    (dict(q=np.zeros((1, 1, 2, 8), np.float16)), "q must be a numpy array of an FP8 format"),
    (dict(k=np.zeros((2, 2, 5, 8), ml_dtypes.float8_e5m2)), "must share one FP8 format"),
    (dict(q_descale=np.ones((2, 4))), r"q_descale.shape=\[2, 4\] must be \[B, Hkv\] = \[2, 2\]"),
    (dict(k_descale=[[1.0, 0.0], [1.0, 1.0]]), "k_descale=0.0 at index \\(0, 1\\) must be a finite float32 > 0"),
    (dict(v_descale=[np.inf]), "v_descale=inf"),
    (dict(v_descale="big"), "cannot be read as float data"),
    (dict(output_dtype="e4m3"), "output_dtype='e4m3' must be one of fp16, bf16, fp32"),
    (dict(q=np.full((2, 4, 3, 8), np.nan, ml_dtypes.float8_e4m3fn)), "non-finite"),
    (dict(k=np.zeros((2, 3, 5, 8), ml_dtypes.float8_e4m3fn), v=np.zeros((2, 3, 5, 8), ml_dtypes.float8_e4m3fn)),
     "divisible by Hkv=3"),
])
def test_every_new_input_is_validated(change, message):
    with pytest.raises(InvalidProblemError, match=message):
        _problem().replace(**change)


def test_the_fa3_fp8_model_is_flash_for_fp8_inputs_and_others_are_declarable():
    model = PrecisionModel.flash("e4m3")
    assert (model.p_rounding, model.p_offset, model.output, model.score_accumulation) == ("e4m3", 8, "bf16", "fp32")
    assert PrecisionModel.parse("fa3-fp8,p=e5m2", "e4m3").p_rounding == "e5m2"
    assert PrecisionModel.parse("fa3-fp8,p_offset=0", "e4m3").p_offset == 0
    assert PrecisionModel.parse("fa3-fp8,p=bf16", "e4m3").describe().endswith("p_offset=8")
    with pytest.raises(Exception, match="p_offset=9 must be"):
        PrecisionModel.fa3_fp8("e4m3", p_offset=9)  # 2^9 = 512 > 448: P would saturate
