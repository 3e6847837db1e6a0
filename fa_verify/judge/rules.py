"""The checking rules others use for attention kernels, implemented from their descriptions.

Each rule runs a fixed list of cases (problems) on a target and judges the output only (none of
them looks at the LSE). `rule.run(backend)` returns a `RuleOutcome`: whether a case failed (a
kill, or a false positive on a correct kernel), how many cases ran until then, and the wall
seconds. A target that crashes or raises fails the case, as it fails a test.

flash-attention  Dao-AILab/flash-attention's forward test (`test_flash_attn_output`, FA2's tests
                 and FA3's hopper/test_flash_attn.py): a fixed grid of shapes; inputs randn;
                 out_ref = attention computed in fp32 from the same inputs and cast to the input
                 dtype (`attention_ref(upcast=True)`), out_pt = the same attention computed in the
                 input dtype (`upcast=False`; here `naive_attention` under the same-precision
                 model); pass iff max|out - out_ref| <= 2 * max|out_pt - out_ref| + fwd_atol,
                 fwd_atol = 2 * max|(out_ref + 0.3 - 0.3) - out_ref| (FA3's floor: the rounding
                 error of any arithmetic on out_ref), differences computed in the input dtype.
                 Grid order as pytest runs it (seqlen pair slowest, then D, causal, MHA/MQA/GQA,
                 dtype fastest); bf16 and fp16 only (the tests have no fp32).
kernelbench      KernelBench's correctness check (level 1, problem 97, scaled_dot_product_attention):
                 5 trials, each with fresh torch.rand-style inputs U[0, 1) of one shape, seeds drawn
                 from a generator seeded 42; the reference is the PyTorch model (torch's SDPA on the
                 same inputs in the same dtype); pass iff allclose(out, ref, atol=rtol=tol), tol =
                 1e-2 for fp16/bf16 and 1e-4 for fp32 (KernelBench's get_tolerance_for_precision).
assert_close     `torch.testing.assert_close(out, ref)` with its default tolerances (fp16 rtol 1e-3,
                 bf16 1.6e-2, fp32 1.3e-6; atol 1e-5) on 3 random N(0, 1) inputs of one shape,
                 non-causal and causal; ref = attention in fp32 cast to the input dtype.

Scaled to the CUDA-on-CPU runner (it emulates every GPU thread): the flash-attention grid keeps
the tests' sequence-length pairs up to 128 x 217 query-key pairs (10 of 20; `FA_SEQLENS_DROPPED`
lists the others) with all their head dims the kernels have (64, 96, 128, 256; 192 is no
kernel's), and runs batch 2 x 6 heads (the tests: 9 x 6 below 2048 keys, 2 x 6 above);
KernelBench's shape 32 x 32 x 512 x 1024 becomes 2 x 4 x 512 x 128 (D = 1024 is no kernel's).
KernelBench and assert_close run each dtype the kernel has (their users would pick one):
generous to the rules. A kill on a mutant counts only on a case the correct kernel passes
(`Rule.run(..., skip=...)`; fa_verify.judge.report runs the correct kernels first).
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from fa_verify.backends.naive import naive_attention
from fa_verify.backends.torch_arrays import import_torch, to_numpy, to_torch
from fa_verify.dtypes import numpy_dtype
from fa_verify.judge.campaign import Counterexample
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem


@dataclass(frozen=True)
class Case:
    """One problem a rule runs, with the label its test would carry."""

    label: str
    problem: AttentionProblem


@dataclass
class RuleOutcome:
    rule: str
    target: str
    #: a case failed
    killed: bool = False
    #: cases run (up to and including the first failing one)
    cases: int = 0
    #: cases the rule has for this target
    total_cases: int = 0
    #: wall seconds until the first failure (or for every case)
    seconds: float = 0.0
    failure: str = ""
    counterexample: Counterexample | None = None
    #: labels of every failing case (all of them when run with stop_at_first=False)
    failed_cases: list = field(default_factory=list)
    #: cases not run because the correct kernel fails them too (see Rule.run's `skip`)
    skipped: int = 0

    def as_dict(self) -> dict:
        return {"rule": self.rule, "target": self.target, "killed": self.killed, "cases": self.cases,
                "total_cases": self.total_cases, "skipped": self.skipped, "seconds": round(self.seconds, 3),
                "failure": self.failure, "failed_cases": list(self.failed_cases),
                "counterexample": None if self.counterexample is None else self.counterexample.as_dict()}


def _problem(q, k, v, dtype, causal=False, tags=()) -> AttentionProblem:
    return AttentionProblem.from_float(q, k, v, dtype, causal=causal, causal_alignment="bottom-right",
                                       tags=tags)


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x).astype(numpy_dtype(dtype))


def _max_abs_diff(a, b, dtype: str) -> float:
    """max |a - b| with the subtraction done in `dtype`, as torch does for two tensors of it."""
    a, b = _in_dtype(a, dtype), _in_dtype(b, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b).astype(np.float64)
    return float(diff.max()) if diff.size else 0.0  # NaN propagates, as torch's max does


class Rule(ABC):
    """A checking rule: a fixed list of cases and a pass/fail judgement of each output."""

    name: str
    title: str
    #: the kind of problem its cases are (`fa_verify.properties.kinds.KINDS`)
    kind = "dense"

    @abstractmethod
    def cases(self, backend):
        """The cases, in the order the rule runs them (all of them; unsupported ones are skipped)."""

    @abstractmethod
    def judge(self, out: np.ndarray, case: Case) -> str | None:
        """None if the output passes, else why it fails."""

    def judge_result(self, result: tuple, case: Case) -> str | None:
        """None if the run's result passes, else why not: the output judged (`judge`)."""
        return self.judge(np.asarray(result[0]), case)

    def run(self, backend, *, stop_at_first: bool = True, skip=frozenset()) -> RuleOutcome:
        """Run the cases on `backend` (stopping at the first failing one if `stop_at_first`),
        leaving out those labelled in `skip`: for a mutant, the cases the correct kernel already
        fails, so that a kill means the rule tells the bug from a correct kernel."""
        outcome = RuleOutcome(self.name, backend.name)
        cases = [c for c in self.cases(backend) if backend.supports(c.problem) is None]
        outcome.total_cases = len(cases)
        start = time.perf_counter()
        for case in cases:
            if case.label in skip:
                outcome.skipped += 1
                continue
            outcome.cases += 1
            try:
                why = self.judge_result(backend.run(case.problem), case)
            except Exception as exc:  # noqa: BLE001 - a target that raises fails its test
                why = f"the target raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if why is not None:
                outcome.failed_cases.append(case.label)
                if not outcome.killed:
                    outcome.killed = True
                    outcome.seconds = time.perf_counter() - start
                    outcome.failure = f"{case.label}: {why}"
                    outcome.counterexample = Counterexample.of(case.problem)
                if stop_at_first:
                    return outcome
        if not outcome.killed:
            outcome.seconds = time.perf_counter() - start
        return outcome


# --- flash-attention -------------------------------------------------------------------------------

#: hopper/test_flash_attn.py's (seqlen_q, seqlen_k) pairs, in its order, up to 128 x 217 query-key
#: pairs. FA_SEQLENS_DROPPED are the larger ones: the five below 1023 cost the CPU runner 3x what
#: the ten kept cost together (the rest far more), and the kept ones already span several query
#: and key tiles, partial last tiles, Nq > Nk and Nq < Nk.
FA_SEQLENS = ((1, 1), (64, 128), (128, 192), (239, 1), (799, 3), (113, 203), (113, 128), (128, 217),
              (113, 211), (108, 256))
FA_SEQLENS_DROPPED = ((256, 256), (256, 512), (384, 256), (640, 128), (512, 256), (1024, 1024),
                      (1023, 1024), (1024, 1023), (4096, 4096), (4224, 4224))
#: the tests' head dims (COMPILED_HDIMS: 64, 96, 128, 192, 256); the kernels' subset is used.
FA_HEAD_DIMS = (64, 96, 128, 192, 256)
FA_BATCH, FA_HEADS = 2, 6


class FlashAttentionRule(Rule):
    name = "flash-attention"
    title = "flash-attention tests (2x same-precision error + atol floor, shape grid)"

    def __init__(self, seqlens=FA_SEQLENS, head_dims=FA_HEAD_DIMS, batch=FA_BATCH, heads=FA_HEADS):
        self.seqlens, self.head_dims, self.batch, self.heads = tuple(seqlens), tuple(head_dims), batch, heads

    def cases(self, backend):
        dtypes = [d for d in ("bf16", "fp16") if d in backend.dtypes]
        kv_heads = {"mha": self.heads, "mqa": 1, "gqa": 2}
        for (nq, nk), d, causal, mha, dtype in itertools.product(self.seqlens, self.head_dims, (False, True),
                                                                 ("mha", "mqa", "gqa"), dtypes):
            if backend.supports(_problem(np.zeros((1, 1, 1, d)), np.zeros((1, 1, 1, d)),
                                         np.zeros((1, 1, 1, d)), dtype)) is not None:
                continue  # no entry for this D: the test would not be compiled
            rng = np.random.default_rng(0)  # torch.random.manual_seed(0) in every test
            hkv = kv_heads[mha]
            q = rng.standard_normal((self.batch, self.heads, nq, d))
            k = rng.standard_normal((self.batch, hkv, nk, d))
            v = rng.standard_normal((self.batch, hkv, nk, d))
            label = f"test_flash_attn_output[{nq}-{nk}-{d}-{'causal' if causal else 'full'}-{mha}-{dtype}]"
            yield Case(label, _problem(q, k, v, dtype, causal, tags=(("distribution", "normal"), ("seed", 0))))

    def judge(self, out, case):
        p = case.problem
        out_ref, _ = naive_attention(p, PrecisionModel.fp32_accumulate(p.dtype))  # upcast, cast back
        out_pt, _ = naive_attention(p, PrecisionModel.same_precision(p.dtype))   # upcast=False
        ref = _in_dtype(out_ref, p.dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            perturbed = (ref + _in_dtype(0.3, p.dtype)) - _in_dtype(0.3, p.dtype)
        fwd_atol = 2 * _max_abs_diff(perturbed, ref, p.dtype)
        err = _max_abs_diff(out, ref, p.dtype)
        err_pt = _max_abs_diff(out_pt, ref, p.dtype)
        if err <= 2 * err_pt + fwd_atol:
            return None
        return (f"max|out - out_ref| = {err:.3g} > 2 * {err_pt:.3g} (same-precision) + {fwd_atol:.3g} (atol)")


# --- KernelBench -----------------------------------------------------------------------------------

KB_SHAPE = (2, 4, 4, 512, 512, 128)
KB_TRIALS, KB_SEED = 5, 42
KB_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 1e-2}


def torch_sdpa(problem: AttentionProblem) -> np.ndarray:
    """torch.nn.functional.scaled_dot_product_attention on the problem's inputs in its dtype
    (KernelBench's reference model), non-causal MHA; fp32 attention cast to the dtype without torch."""
    torch = import_torch()
    if torch is None or problem.causal or problem.kv_heads != problem.heads:
        return naive_attention(problem, PrecisionModel.fp32_accumulate(problem.dtype))[0]
    q, k, v = (to_torch(x) for x in (problem.q, problem.k, problem.v))
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return to_numpy(out)


class KernelBenchRule(Rule):
    name = "kernelbench"
    title = "KernelBench (5 random inputs, allclose 1e-2 / 1e-4)"

    def __init__(self, shape=KB_SHAPE, trials=KB_TRIALS, seed=KB_SEED):
        self.shape, self.trials, self.seed = tuple(shape), trials, seed

    def cases(self, backend):
        B, H, Hkv, Nq, Nk, D = self.shape
        seeds = np.random.default_rng(self.seed).integers(0, 2**32 - 1, self.trials)
        for dtype in backend.dtypes:
            for trial, seed in enumerate(seeds):
                rng = np.random.default_rng(int(seed))
                q, k, v = (rng.random(s) for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
                yield Case(f"level1/97 {dtype} trial {trial}",
                           _problem(q, k, v, dtype, tags=(("distribution", "torch.rand"), ("seed", int(seed)))))

    def judge(self, out, case):
        p = case.problem
        ref = torch_sdpa(p).astype(np.float64)
        got = _in_dtype(out, p.dtype).astype(np.float64)
        if got.shape != ref.shape:
            return f"output shape {got.shape} != {ref.shape}"
        tol = KB_TOLERANCE[p.dtype]
        with np.errstate(invalid="ignore"):
            close = np.abs(got - ref) <= tol + tol * np.abs(ref)
        if close.all():
            return None
        bad = int((~close).sum())
        with np.errstate(invalid="ignore"):
            worst = float(np.nanmax(np.abs(got - ref))) if np.isfinite(got).any() else float("nan")
        return f"allclose(atol=rtol={tol:g}) fails at {bad} of {close.size} elements (max diff {worst:.3g})"


# --- torch.testing.assert_close ---------------------------------------------------------------------

AC_SHAPE = (2, 4, 4, 128, 128, 64)
AC_SEEDS = (0, 1, 2)
#: torch.testing.assert_close's default (rtol, atol) per dtype.
AC_DEFAULTS = {"fp16": (1e-3, 1e-5), "bf16": (1.6e-2, 1e-5), "fp32": (1.3e-6, 1e-5)}


class AssertCloseRule(Rule):
    name = "assert_close"
    title = "torch.testing.assert_close defaults (3 random inputs)"

    def __init__(self, shape=AC_SHAPE, seeds=AC_SEEDS):
        self.shape, self.seeds = tuple(shape), tuple(seeds)

    def cases(self, backend):
        B, H, Hkv, Nq, Nk, D = self.shape
        for dtype in backend.dtypes:
            for causal in (False, True):
                for seed in self.seeds:
                    rng = np.random.default_rng(seed)
                    q, k, v = (rng.standard_normal(s) for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
                    yield Case(f"{dtype} {'causal' if causal else 'full'} seed {seed}",
                               _problem(q, k, v, dtype, causal, tags=(("distribution", "normal"), ("seed", seed))))

    def judge(self, out, case):
        p = case.problem
        ref, _ = naive_attention(p, PrecisionModel.fp32_accumulate(p.dtype))
        torch = import_torch()
        if torch is not None:
            try:
                torch.testing.assert_close(to_torch(_in_dtype(out, p.dtype)), to_torch(_in_dtype(ref, p.dtype)))
            except AssertionError as exc:
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                return "; ".join(lines[:3])
            return None
        rtol, atol = AC_DEFAULTS[p.dtype]
        got, want = _in_dtype(out, p.dtype).astype(np.float64), _in_dtype(ref, p.dtype).astype(np.float64)
        with np.errstate(invalid="ignore"):
            close = (np.abs(got - want) <= atol + rtol * np.abs(want)) | (got == want)
        if close.all():
            return None
        return f"Tensor-likes are not close! Mismatched elements: {int((~close).sum())} / {close.size}"


#: The forward rules of the side-by-side, in table order (fa_verify.judge.rule_table has them all).
FORWARD_RULES = (FlashAttentionRule(), KernelBenchRule(), AssertCloseRule())
