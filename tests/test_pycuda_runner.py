"""Parts of the PyCUDA runner that need neither a GPU nor the fake driver: torch input checks and
output allocation (torch's CPU build), the atomic cubin cache write."""

from __future__ import annotations

import pytest

from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels import get_family
from fa_verify.kernels import pycuda_runner
from fa_verify.kernels.pycuda_runner import check_torch_inputs, run_torch, torch_outputs

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("q_shape, kv_shape, message", [
    ((1, 2, 8, 16), (1, 4, 8, 16), "H=2 must be a multiple of k/v's heads Hkv=4"),
    ((1, 3, 8, 16), (1, 2, 8, 16), "H=3 must be a multiple of k/v's heads Hkv=2"),
    ((2, 2, 8, 16), (1, 2, 8, 16), "disagree on B or D"),
    ((1, 2, 8, 16), (1, 2, 8, 32), "disagree on B or D"),
    ((2, 8, 16), (1, 2, 8, 16), "q must be [B,H,Nq,D]"),
])
def test_run_torch_checks_shapes_before_anything_reaches_a_kernel(q_shape, kv_shape, message):
    q, k = torch.zeros(q_shape, dtype=torch.float16), torch.zeros(kv_shape, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError) as info:
        run_torch(get_family("fa2"), q, k, k.clone())
    assert message in str(info.value)


def test_run_torch_checks_k_and_v_agree_and_dtypes():
    q = torch.zeros((1, 2, 8, 16), dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match=r"k \[B,Hkv,Nk,D\] and v \[B,Hkv,Nk,D_v\]"):
        check_torch_inputs(q, q, q[:, :, :4])
    assert check_torch_inputs(q, q, q[..., :4]) == "fp16"  # D_v != D
    with pytest.raises(InvalidArgumentError, match="share one of fp16, bf16, fp32"):
        check_torch_inputs(q, q.float(), q)
    assert check_torch_inputs(q.bfloat16(), q.bfloat16(), q.bfloat16()) == "bf16"
    with pytest.raises(InvalidArgumentError, match="run_torch takes CUDA tensors; q is on cpu"):
        run_torch(get_family("fa2"), q, q, q)


def test_torch_outputs_start_as_nan_so_unwritten_elements_fail():
    family = get_family("naive16")
    q = torch.zeros((1, 2, 5, 16), dtype=torch.bfloat16)
    launch = family.launch_for(1, 2, 1, 5, 7, 16, "bf16")
    o, lse, scratch = torch_outputs(q, q, launch)
    assert o.shape == q.shape and o.dtype == q.dtype and torch.isnan(o).all()
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32 and torch.isnan(lse).all()
    assert scratch.numel() == 1 * 2 * 5 * 7 and scratch.dtype == torch.bfloat16


def test_write_atomically_leaves_nothing_behind_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "x.cubin"
    pycuda_runner.write_atomically(target, b"first")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(pycuda_runner.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        pycuda_runner.write_atomically(target, b"second")
    assert target.read_bytes() == b"first" and sorted(p.name for p in tmp_path.iterdir()) == ["x.cubin"]
