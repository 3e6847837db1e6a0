"""`--array torch` on FP8 problems (issue 23): a torch callable taking FlashAttention-3's descales
gets torch float8 tensors holding the stored values bit for bit, and its output comes back exactly;
a torch FP8 reference (tests/fixtures/torch_fp8.py) passes and its k <-> v descale mix-up fails."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install 'fa-verify[torch]')")

from fa_verify.backends import CallableBackend  # noqa: E402
from fa_verify.backends.torch_arrays import to_numpy, to_torch  # noqa: E402
from fa_verify.errors import BackendOutputError  # noqa: E402
from fa_verify.properties import Selection, search_property  # noqa: E402
from fa_verify.strategies._fp8 import make_fp8_problem  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import torch_fp8  # noqa: E402


@pytest.mark.parametrize("fmt, torch_name", [(ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
                                              (ml_dtypes.float8_e5m2, "float8_e5m2")])
def test_every_fp8_bit_pattern_crosses_to_torch_and_back_unchanged(fmt, torch_name):
    bits = np.arange(256, dtype=np.uint8)
    t = to_torch(bits.view(fmt))
    assert t.dtype == getattr(torch, torch_name)
    assert np.array_equal(t.view(torch.uint8).numpy(), bits)  # the same bits on torch's side
    back = to_numpy(t)
    assert back.dtype == fmt and np.array_equal(back.view(np.uint8), bits)
    finite = np.isfinite(bits.view(fmt).astype(np.float64))
    assert np.array_equal(t.to(torch.float64).numpy()[finite], bits.view(fmt).astype(np.float64)[finite])


def test_an_fp8_problem_reaches_a_torch_callable_as_float8_tensors_with_float32_descales():
    seen = {}

    def recording(q, k, v, *, causal, scale, q_descale=None, k_descale=None, v_descale=None):
        seen.update(q=q, k=k, v=v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return torch_fp8.attention(q, k, v, causal=causal, scale=scale, q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale)

    backend = CallableBackend(recording, name="recording", array="torch")
    for fmt, torch_dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        p = make_fp8_problem((2, 4, 2, 3, 5, 8), fmt, 1)
        out, lse = backend.run(p)
        for name in ("q", "k", "v"):
            assert seen[name].dtype == torch_dtype
            assert np.array_equal(seen[name].view(torch.uint8).numpy(), getattr(p, name).view(np.uint8))
        for name in ("q_descale", "k_descale", "v_descale"):
            assert seen[name].dtype == torch.float32 and np.array_equal(seen[name].numpy(), getattr(p, name))
        assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32


def test_a_float8_output_comes_back_exactly_and_is_refused_by_its_dtype():
    def float8_out(q, k, v, *, causal, scale, q_descale=None, k_descale=None, v_descale=None):
        out, lse = torch_fp8.attention(q, k, v, causal=causal, scale=scale, q_descale=q_descale,
                                       k_descale=k_descale, v_descale=v_descale)
        return out.to(torch.float8_e4m3fn), lse

    backend = CallableBackend(float8_out, name="float8_out", array="torch", dtypes=("e4m3",))
    with pytest.raises(BackendOutputError, match=r"returned out with shape=\(1, 2, 3, 8\) dtype=e4m3; expected "
                                                 r"shape=\(1, 2, 3, 8\) \(\[B,H,Nq,D_v\]\) dtype=bf16"):
        backend.run(make_fp8_problem((1, 2, 1, 3, 5, 8), "e4m3", 0))


@pytest.mark.parametrize("fn, status", [("attention", "passed"), ("v_uses_k_descale", "failed")])
@pytest.mark.parametrize("prop", ["fp8_agreement", "descale_sensitivity"])
def test_the_torch_fp8_reference_passes_and_its_descale_mix_up_fails(fn, status, prop):
    backend = CallableBackend(getattr(torch_fp8, fn), name=f"torch_fp8:{fn}", array="torch", dtypes=("e4m3", "e5m2"))
    assert search_property(backend, prop, Selection(max_examples=8, shrink=False)).status == status


@pytest.mark.parametrize("fn, code", [("attention", 0), ("v_uses_k_descale", 1)])
def test_fa_verify_check_array_torch_runs_fp8_problems(fn, code, monkeypatch, capsys):
    from fa_verify.cli.main import main

    monkeypatch.chdir(FIXTURES)
    assert main(["check", f"torch_fp8:{fn}", "--array", "torch", "--dtype", "e4m3", "--property", "fp8_agreement",
                 "--max-examples", "4", "--no-isolate"]) == code
    output = capsys.readouterr().out
    assert ("PASS fp8_agreement" if code == 0 else "FAIL fp8_agreement") in output, output


def test_the_same_torch_callable_runs_dense_problems_without_descales(monkeypatch, capsys):
    from fa_verify.cli.main import main

    monkeypatch.chdir(FIXTURES)
    assert main(["check", "torch_fp8:attention", "--array", "torch", "--dtype", "bf16", "--dtype", "e5m2",
                 "--property", "oracle_agreement", "--property", "fp8_agreement", "--max-examples", "3",
                 "--no-isolate"]) == 0
    output = capsys.readouterr().out
    assert "PASS oracle_agreement" in output and "PASS fp8_agreement" in output, output
