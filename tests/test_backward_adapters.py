"""The backward targets (torch SDPA's math and CPU flash kernels, flex_attention, JAX's vjp, our
Triton backward kernel) against a float64 numpy gradient of the backward protocol's math, and
a wrong gradient (no D term) that the same comparison rejects.

Tolerance, per element: |g - g_ref| <= (6 u + (Nk + D) 2^-24) m + floor. m is the gradient
computed again from the absolute values of every factor, with dP - D replaced by
|dO| |V|^T + sum_c |dO_c O_c| (e.g. m_dQ = scale P (|dO| |V|^T + sum_c |dO_c O_c|) |K|): the sum
of the magnitudes of its terms, which bounds what rounding one relative error u into each term
can move. A backward in FlashAttention-2's precision model rounds four things to the input
dtype once each: O (through D), P, dS and the gradient, 4 u m; 6 u leaves room for conversions
that round toward zero (error up to 2 u: Triton 3.9's interpreter converts fp32 to bf16 so) and
for torch's CPU flash exponentials (relative error up to 2^-13 in fp16/bf16, under u_fp16/4).
Everything else is float32: the scores (|S| and |LSE| are a few units here, so P moves by a
few 2^-24 relative) and the sums over Nk keys or D dims, each under (Nk + D) 2^-24 m even when
every addition rounds the same way. floor is the dtype's smallest subnormal, the rounding of a
gradient that underflows. Rows that see no key have m = 0: their gradient must be 0.
Measured on these cases (torch 2.13, jax 0.10, Triton 3.9's interpreter): fp16/bf16 errors up
to 3.0 u m (our Triton kernel in bf16; 1.9 u m for the others), fp32 up to 12 x 2^-24 m,
against the 62 to 86 x 2^-24 m allowed.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends.torch_arrays import to_numpy, to_torch  # torch is imported on use
from fa_verify.dtypes import finfo, round_to, unit_roundoff
from fa_verify.problem import AttentionProblem

ROOT = Path(__file__).resolve().parent.parent
#: not 1/sqrt(D), so that a target that ignores `scale` fails
SCALE = 0.3
FP32_UNIT = 2.0 ** -24
DTYPES = ("fp32", "fp16", "bf16")
#: (B, H, Hkv, Nq, Nk, D): GQA, and Nq != Nk so that the causal alignment matters
SHAPE = (2, 4, 2, 24, 40, 16)


@dataclass(frozen=True)
class Case:
    """One backward problem: its inputs, its float64 gradients and their term magnitudes."""

    problem: AttentionProblem
    out: np.ndarray
    lse: np.ndarray
    dout: np.ndarray
    reference: tuple
    magnitude: tuple
    #: the gradient without the D term (dS = P dP), a classic bug, rounded to the dtype
    wrong: tuple

    def inputs(self) -> tuple:
        return self.problem.q, self.problem.k, self.problem.v, self.out, self.lse, self.dout

    def call(self, backward, convert=lambda x: x) -> tuple:
        """backward's (dq, dk, dv), given the inputs through `convert` (numpy to torch, ...)."""
        p = self.problem
        return backward(*(convert(x) for x in self.inputs()), causal=p.causal, scale=p.scale)


def _gradients(p, q, k, v, out, dout, scale, group, *, magnitude=False):
    """(dq, dk, dv) of the protocol's math in float64; k, v expanded to H heads. With
    `magnitude`, every factor is taken as given (the caller passes absolute values) and
    dP - D becomes dP + D: the sum of the terms' magnitudes."""
    dp = dout @ v.swapaxes(-1, -2)
    d = (dout * out).sum(-1, keepdims=True)
    ds = p * (dp + d if magnitude else dp - d)
    dq = scale * ds @ k
    dk, dv = scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ dout
    batch, heads, nk, dim = dk.shape
    return (dq, *(x.reshape(batch, heads // group, group, nk, dim).sum(2) for x in (dk, dv)))


def _case(dtype: str, causal: bool, alignment: str, shape=SHAPE, seed=0) -> Case:
    batch, heads, kv_heads, nq, nk, dim = shape
    rng = np.random.default_rng(seed)
    problem = AttentionProblem.from_float(rng.standard_normal((batch, heads, nq, dim)),
                                          *(rng.standard_normal((batch, kv_heads, nk, dim)) for _ in "kv"),
                                          dtype, causal=causal, causal_alignment=alignment, scale=SCALE)
    dout = round_to(rng.standard_normal((batch, heads, nq, dim)), dtype)
    q, (k, v) = problem.q64(), problem.kv64()
    scores = np.where(problem.mask, SCALE * q @ k.swapaxes(-1, -2), -np.inf)
    top = np.where(problem.masked_rows[:, None], 0.0, scores.max(-1, keepdims=True))
    with np.errstate(divide="ignore"):  # a row that sees no key: LSE -inf, P 0
        lse = top[..., 0] + np.log(np.exp(scores - top).sum(-1))
    p = np.where(problem.mask, np.exp(scores - np.where(problem.masked_rows[:, None], 0.0, lse[..., None])), 0.0)
    out = round_to(p @ v, dtype)
    out64, dout64 = out.astype(np.float64), dout.astype(np.float64)
    args = (SCALE, problem.group_size)
    return Case(problem, out, lse.astype(np.float32), dout,
                reference=_gradients(p, q, k, v, out64, dout64, *args),
                magnitude=_gradients(p, abs(q), abs(k), abs(v), abs(out64), abs(dout64), *args, magnitude=True),
                wrong=tuple(round_to(g, dtype) for g in _gradients(p, q, k, v, 0 * out64, dout64, *args)))


def _mismatches(case: Case, grads) -> list[str]:
    """What in `grads` lies beyond the tolerance (the module's doc), one line per gradient."""
    dtype, (nk, dim) = case.problem.dtype, case.problem.k.shape[2:]
    factor = 6 * unit_roundoff(dtype) + (nk + dim) * FP32_UNIT
    floor = float(finfo(dtype).smallest_subnormal)
    found = []
    for name, got, want, magnitude in zip(("dq", "dk", "dv"), grads, case.reference, case.magnitude):
        if got.dtype != case.problem.q.dtype or got.shape != want.shape:
            found.append(f"{name}: {got.dtype} {got.shape}, expected {case.problem.q.dtype} {want.shape}")
            continue
        error = np.abs(got.astype(np.float64) - want)
        allowed = factor * magnitude + floor
        bad = ~(error <= allowed)  # NaN is bad
        if bad.any():
            at = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf) / allowed, 0)), bad.shape)
            found.append(f"{name}: {bad.sum()} of {bad.size} beyond tolerance; worst at {tuple(map(int, at))}: "
                         f"got {float(got[at])!r}, want {want[at]!r}, |error| {error[at]:.3g} > allowed {allowed[at]:.3g}")
    return found


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_comparison_rejects_a_gradient_without_the_d_term(dtype):
    case = _case(dtype, causal=True, alignment="top-left")
    assert not _mismatches(case, tuple(round_to(g, dtype) for g in case.reference))
    found = _mismatches(case, case.wrong)
    assert [line[:3] for line in found] == ["dq:", "dk:"], found  # dV does not read D


# --- torch SDPA ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdpa():
    pytest.importorskip("torch", reason="torch is not installed (pip install 'fa-verify[torch]')")
    return importlib.import_module("fa_verify.adapters.torch_sdpa_backward")


@pytest.mark.parametrize("kernel", ["math_backward", "flash_backward"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_sdpa_backward_matches_float64(sdpa, kernel, causal, dtype):
    case = _case(dtype, causal, "top-left")
    found = _mismatches(case, case.call(getattr(sdpa, kernel)))
    assert not found, "\n".join(found)


def test_torch_sdpa_causal_is_top_left_and_nq_above_nk_works(sdpa):
    """Nq > Nk (and MHA): top-left leaves no row empty; judged bottom-right, the same gradients fail."""
    shape = (1, 2, 2, 40, 24, 16)
    top_left = _case("fp32", True, "top-left", shape)
    for kernel in (sdpa.math_backward, sdpa.flash_backward):
        grads = top_left.call(kernel)
        assert not _mismatches(top_left, grads)
        assert _mismatches(_case("fp32", True, "bottom-right", shape), grads)


# --- flex_attention --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flex():
    pytest.importorskip("torch.nn.attention.flex_attention",
                        reason="torch with flex_attention is not installed (pip install 'fa-verify[torch]')")
    return importlib.import_module("fa_verify.adapters.flex_attention")


def test_flex_backward_says_that_torch_refuses_it_on_the_cpu(flex):
    import torch

    from fa_verify.errors import BackendUnavailableError
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the adapter runs flex_attention's backward on it")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU here.*does not support backward on CPU"):
        _case("fp32", True, "bottom-right").call(flex.backward, to_torch)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flex_backward_matches_float64(flex, monkeypatch, causal, dtype):
    """Bottom-right causal with Nq > Nk (rows that see no key). Without a GPU, torch's CPU guard is
    lifted for the test only: beneath it, eager flex_attention's forward and backward are the
    dense implementations that eager CUDA runs too, so this checks the adapter's masks, GQA,
    scale and dtypes; what a GPU computes is checked only where one is."""
    import torch
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.nn.attention.flex_attention, "_validate_device", lambda *tensors: None)
    case = _case(dtype, causal, "bottom-right", (2, 4, 2, 40, 24, 16))
    found = _mismatches(case, tuple(map(to_numpy, case.call(flex.backward, to_torch))))
    assert not found, "\n".join(found)


# --- JAX -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_backward():
    pytest.importorskip("jax", reason="jax is not installed (pip install 'fa-verify[jax]')")
    return importlib.import_module("fa_verify.adapters.jax_attention").backward


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_jax_backward_matches_float64(jax_backward, causal, dtype):
    case = _case(dtype, causal, "top-left")
    found = _mismatches(case, case.call(jax_backward))
    assert not found, "\n".join(found)


def test_jax_backward_in_fp16_is_refused_by_xla_on_the_cpu(jax_backward):
    """Its jit-compiled vjp asks for an fp16 dot with fp32 accumulation, which XLA's CPU backend
    refuses (bf16 it runs). Should a JAX release run it, this test says to add fp16 above."""
    import jax
    if jax.default_backend() != "cpu":
        pytest.skip(f"JAX runs on {jax.default_backend()} here")
    with pytest.raises(ValueError, match="F16_F16_F32' is not supported by dot_general on CPU"):
        _case("fp16", False, "top-left").call(jax_backward)


# --- our Triton kernel -----------------------------------------------------------------------

#: Runs kernels/triton/fa_triton_bwd.py on pickled calls in a fresh process: Triton's interpreter
#: must be chosen before triton is first imported (its own tl.sum ... are compiled on import),
#: and torch may have imported it in this one.
CHILD = """
import pickle, sys
from fa_verify.backends.torch_arrays import to_numpy, to_torch
from kernels.triton.fa_triton_bwd import backward
with open(sys.argv[1], "rb") as file:
    calls = pickle.load(file)
grads = [tuple(map(to_numpy, backward(*map(to_torch, inputs), causal=causal, scale=scale)))
         for inputs, causal, scale in calls]
with open(sys.argv[2], "wb") as file:
    pickle.dump(grads, file)
"""
#: (B, H, Hkv, N, N, D): every head dim it supports, MHA, GQA and MQA
TRITON_SHAPES = {"gqa-d16": (2, 4, 2, 32, 32, 16), "mha-d32": (1, 2, 2, 48, 48, 32), "mqa-d64": (1, 3, 1, 32, 32, 64),
                 "mqa-d128": (1, 2, 1, 16, 16, 128)}
TRITON_CASES = {(dtype, causal, shape): _case(dtype, causal, "bottom-right", TRITON_SHAPES[shape])
                for dtype in DTYPES for causal in (False, True) for shape in TRITON_SHAPES}
#: given the forward kernel's base-2 LSE instead of the natural log
BASE_2 = "base-2 LSE"


@pytest.fixture(scope="module")
def triton_grads(tmp_path_factory):
    """Every Triton case's gradients from one run, under Triton's interpreter without a GPU."""
    torch = pytest.importorskip("torch", reason="the kernel takes torch tensors")
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")
    calls = {key: (case.inputs(), case.problem.causal, SCALE) for key, case in TRITON_CASES.items()}
    q, k, v, out, lse, dout = TRITON_CASES["fp32", True, "gqa-d16"].inputs()
    calls[BASE_2] = ((q, k, v, out, lse / np.float32(np.log(2)), dout), True, SCALE)
    folder = tmp_path_factory.mktemp("triton")
    with open(folder / "calls.pkl", "wb") as file:
        pickle.dump(list(calls.values()), file)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", CHILD, folder / "calls.pkl", folder / "grads.pkl"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(folder / "grads.pkl", "rb") as file:
        return dict(zip(calls, pickle.load(file)))


@pytest.mark.parametrize("shape", TRITON_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backward_matches_float64(triton_grads, dtype, causal, shape):
    found = _mismatches(TRITON_CASES[dtype, causal, shape], triton_grads[dtype, causal, shape])
    assert not found, "\n".join(found)


def test_triton_backward_takes_a_natural_log_lse(triton_grads):
    """Handed the forward kernel's base-2 LSE instead, its gradients fail the comparison."""
    assert _mismatches(TRITON_CASES["fp32", True, "gqa-d16"], triton_grads[BASE_2])
