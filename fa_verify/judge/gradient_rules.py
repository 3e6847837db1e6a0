"""The rules others use for attention gradients, implemented from their descriptions, for the
backward side-by-side (`fa_verify mutants --family fa2_bwd`).

Each runs a fixed list of backward cases (randn q, k, v and dout, as their tests draw them; out
and lse the certified forward's, rounded) and judges dq, dk, dv against g_ref, the exact gradient
rounded to the dtype (their references compute in fp32: at these sizes the same to the rounding).
g_pt, the "same-precision baseline", is the eager gradient in the input dtype: every op's result
rounded to it (S, P, dV, dP, D, dS, dQ, dK), products summed in fp32 (`eager_gradients`).

flash-attention-bwd  flash-attention's backward assertions: per tensor,
                     max|g - g_ref| <= 3 max|g_pt - g_ref| (non-causal), 2 max|g_pt - g_ref| + 1e-5
                     (causal); a grid of sequence-length pairs, head dims, MHA/GQA, both masks.
torch-fudge-5        PyTorch's test_transformers: allclose with atol = 5 max|g_pt - g_ref| and rtol =
                     assert_close's default for the dtype (fudge factor 5, its default), same grid.
jax-0.2              JAX's attention tests: allclose(rtol = atol = 0.2), same grid.
triton-tutorial      the Triton tutorial's test: one causal shape (1, 2, 128, 128, 64) in fp16,
                     allclose(atol = 1e-2, rtol = 0).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from fa_verify.backward import BackwardProblem
from fa_verify.dtypes import round_to
from fa_verify.judge.rules import Case, Rule
from fa_verify.oracle.backward import gradient_reference
from fa_verify.problem import AttentionProblem

#: (Nq, Nk) pairs, head dims, heads (H, Hkv) of the grid the first three rules run.
GRID_SEQLENS = ((1, 1), (64, 128), (113, 203), (128, 217))
GRID_HEAD_DIMS = (64, 128)
GRID_HEADS = ((2, 2), (2, 1))
#: assert_close's default rtol per dtype (torch.testing).
DEFAULT_RTOL = {"fp16": 1e-3, "bf16": 1.6e-2, "fp32": 1.3e-6}
TENSORS = ("dq", "dk", "dv")


def _case(label, shape, dtype, causal, seed=0) -> Case:
    B, H, Hkv, Nq, Nk, D = shape
    rng = np.random.default_rng(seed)
    forward = AttentionProblem.from_float(rng.standard_normal((B, H, Nq, D)), rng.standard_normal((B, Hkv, Nk, D)),
                                          rng.standard_normal((B, Hkv, Nk, D)), dtype, causal=causal,
                                          tags=(("distribution", "normal"), ("seed", seed)))
    return Case(label, BackwardProblem.of(forward, rng.standard_normal(forward.out_shape), tags=(("dout", "normal"),)))


@functools.lru_cache(maxsize=4)  # per case: both baseline rules ask for each of dq, dk, dv
def eager_gradients(problem: BackwardProblem) -> dict:
    """dq, dk, dv as eager attention in the input dtype computes them (each op rounded to it)."""
    f, dtype = problem.forward, problem.dtype
    r = lambda x: round_to(x, dtype).astype(np.float64)  # noqa: E731
    q, k, v = (x.astype(np.float64) for x in (f.q, f.k, f.v))
    k, v = (np.repeat(x, f.group_size, axis=1) for x in (k, v))
    do = problem.dout.astype(np.float64)
    s = r(np.einsum("bhid,bhjd->bhij", q, k) * f.scale_value)
    s = np.where(f.mask, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p = r(np.nan_to_num(p / p.sum(axis=-1, keepdims=True)))
    o = r(p @ v)
    dv = r(np.einsum("bhij,bhid->bhjd", p, do))
    dp = r(do @ np.swapaxes(v, -1, -2))
    ds = r(p * (dp - r((do * o).sum(-1, keepdims=True))))
    dq = r(ds @ k * f.scale_value)
    dk = r(np.einsum("bhij,bhid->bhjd", ds, q) * f.scale_value)
    group = lambda x: r(x.reshape(x.shape[0], f.kv_heads, f.group_size, *x.shape[2:]).sum(2))  # noqa: E731
    return {"dq": dq, "dk": group(dk), "dv": group(dv)}


class GradientRule(Rule):
    """A rule judging a backward's (dq, dk, dv) per tensor."""

    kind = "backward"

    def grid(self, backend):
        dtypes = [d for d in ("bf16", "fp16") if d in backend.dtypes]
        for (nq, nk), d, (h, hkv), causal, dtype in itertools.product(GRID_SEQLENS, GRID_HEAD_DIMS, GRID_HEADS,
                                                                      (False, True), dtypes):
            label = f"[{nq}-{nk}-{d}-{'causal' if causal else 'full'}-{'mha' if h == hkv else 'gqa'}-{dtype}]"
            yield _case(label, (1, h, hkv, nq, nk, d), dtype, causal)

    cases = grid

    def judge(self, out, case):
        raise NotImplementedError  # gradient rules judge the whole result (judge_result)

    def judge_result(self, result, case):
        problem = case.problem
        ref = gradient_reference(problem.forward, problem.dout)
        exact = {"dq": ref.dq, "dk": ref.dk, "dv": ref.dv}
        g_ref = {name: round_to(x, problem.dtype).astype(np.float64) for name, x in exact.items()}
        got = {name: np.asarray(x).astype(np.float64) for name, x in zip(TENSORS, result)}
        for name in TENSORS:
            why = self.tensor(name, got[name], g_ref[name], problem)
            if why:
                return f"{name}: {why}"
        return None

    def tensor(self, name, got, ref, problem) -> str | None:
        """None if gradient `name` passes, else why not."""
        raise NotImplementedError


def _baseline_error(name: str, ref, problem) -> float:
    """max |g_pt - g_ref| of gradient `name`: the same-precision baseline's error."""
    return float(np.abs(eager_gradients(problem)[name] - ref).max())


def _allclose(got, ref, atol, rtol) -> str | None:
    with np.errstate(invalid="ignore"):
        close = np.abs(got - ref) <= atol + rtol * np.abs(ref)
    if close.all():
        return None
    with np.errstate(invalid="ignore"):
        worst = float(np.nanmax(np.abs(got - ref))) if np.isfinite(got).any() else float("nan")
    return f"allclose(atol={atol:.3g}, rtol={rtol:.3g}) fails at {int((~close).sum())} of {close.size} (max diff {worst:.3g})"


class FlashAttentionBackwardRule(GradientRule):
    name = "flash-attention-bwd"
    title = "flash-attention's backward (3x, causal 2x + 1e-5, the same-precision error)"

    def tensor(self, name, got, ref, problem):
        baseline = _baseline_error(name, ref, problem)
        err = float(np.abs(got - ref).max()) if got.size else 0.0
        limit = 2 * baseline + 1e-5 if problem.causal else 3 * baseline
        if err <= limit:
            return None
        return f"max|g - g_ref| = {err:.3g} > {limit:.3g} ({'2x + 1e-5' if problem.causal else '3x'} {baseline:.3g})"


class TorchFudgeRule(GradientRule):
    name = "torch-fudge-5"
    title = "PyTorch's test_transformers (atol 5x the same-precision error, default rtol)"

    def tensor(self, name, got, ref, problem):
        return _allclose(got, ref, 5 * _baseline_error(name, ref, problem), DEFAULT_RTOL[problem.dtype])


class JaxRule(GradientRule):
    name = "jax-0.2"
    title = "JAX's attention tests (allclose rtol = atol = 0.2)"

    def tensor(self, name, got, ref, problem):
        return _allclose(got, ref, 0.2, 0.2)


class TritonTutorialRule(GradientRule):
    name = "triton-tutorial"
    title = "the Triton tutorial's test (one causal shape, fp16, atol 1e-2)"

    def cases(self, backend):
        if "fp16" in backend.dtypes:
            yield _case("test_op[1-2-128-64-causal]", (1, 2, 2, 128, 128, 64), "fp16", True)

    def tensor(self, name, got, ref, problem):
        return _allclose(got, ref, 1e-2, 0.0)


GRADIENT_RULES = (FlashAttentionBackwardRule(), TorchFudgeRule(), JaxRule(), TritonTutorialRule())
