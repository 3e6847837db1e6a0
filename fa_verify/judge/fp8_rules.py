"""The FP8 gates others use for attention kernels, implemented from their descriptions, for the
FP8 judging table (`fa_verify mutants --fp8`; `fa_verify.judge.over_seeds`).

Each runs the same short list of FP8 cases (`fp8_cases`: e4m3 q, k, v quantised from randn,
float32 descales drawn per (batch, kv head) from U(DESCALE_RANGE), never 1 and never equal
across q, k, v or heads; a KV-cache case with one k and one v scale per tensor) drawn from the
rule's `seed`, and judges the bf16 output only (none looks at the LSE) against `ref`, the exact
attention of the true inputs (`reference_fp8`), rounded to the output dtype where its project's
reference is a computation in that dtype.

flash-attention-fp8  flash-attention's FP8 test (FA3's hopper tests): max|out - ref| <=
                     FA_FP8_MULT x max|out_pt - ref| + fwd_atol, out_pt a baseline attention of
                     the true inputs whose normalised P is rounded to e4m3 before P.V (the
                     tests' reference with an FP8 intermediate), fwd_atol FA3's floor
                     2 max|(ref + 0.3 - 0.3) - ref|; FA_FP8_MULT_KVCACHE for the KV-cache case.
transformer-engine   TransformerEngine's FP8 attention tests: RMSE(out - ref) < TE_RMSE_TOL x
                     (max ref - min ref); its elementwise comparison is only logged, not judged.
torchao-sqnr         torchao's float8 tests: SQNR = 20 log10(|ref| / |out - ref|) > TORCHAO_SQNR_DB.
flashinfer-mse       FlashInfer's FP8 attention tests: mean((out - ref)^2) < FLASHINFER_MSE.
unit-descales        the target tested with every descale 1, the way the JAX cuDNN FP8 tests set
                     every scale to 1, judged as fa_verify judges an FP8 output (out and LSE within
                     FlashAttention-3's FP8 bound, then the FP8 ensemble rule): the strictest
                     comparison, on inputs that cannot show a descale bug.
"""

from __future__ import annotations

import functools

import numpy as np

from fa_verify.dtypes import round_to
from fa_verify.fp8 import DESCALES, FP8Problem
from fa_verify.judge.rules import Case, Rule, _max_abs_diff

#: Descales are drawn from U(DESCALE_RANGE) per (batch, kv head) and tensor.
DESCALE_RANGE = (0.25, 2.0)
#: (B, H, Hkv, Nq, Nk, D, causal, kv_cache) of the FP8 cases: GQA (so that q's descale index
#: matters), a partial key tile and Nq != Nk, MHA with two batches, a decode step on a KV cache
#: with one k and one v scale per tensor.
FP8_CASES = ((1, 4, 2, 128, 128, 64, False, False), (1, 4, 2, 113, 203, 128, True, False),
             (2, 2, 2, 64, 64, 64, False, False), (1, 4, 1, 1, 257, 64, False, True))
#: flash-attention's FP8 multiplier of the baseline's error, and for a KV cache.
FA_FP8_MULT, FA_FP8_MULT_KVCACHE = 2.0, 4.0
#: TransformerEngine: RMSE below this share of the output's value range (its FP8 tests use
#: 0.11 to 0.15; the tightest, generous to the rule's kills).
TE_RMSE_TOL = 0.11
#: torchao: signal-to-quantisation-noise ratio above this, in dB.
TORCHAO_SQNR_DB = 25.0
#: FlashInfer: mean squared error below this.
FLASHINFER_MSE = 1.0


def fp8_case(shape, causal: bool, kv_cache: bool, seed: int, unit: bool = False) -> FP8Problem:
    """One FP8 problem: e4m3 values of randn, descales from U(DESCALE_RANGE) ([B, Hkv], or [1]
    for k and v of a KV cache); all 1 with `unit`."""
    B, H, Hkv, Nq, Nk, D = shape
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    shapes = {"q_descale": (B, Hkv), "k_descale": (1,) if kv_cache else (B, Hkv),
              "v_descale": (1,) if kv_cache else (B, Hkv)}
    descales = {name: (np.ones(s) if unit else rng.uniform(*DESCALE_RANGE, s)).astype(np.float32)
                for name, s in shapes.items()}
    return FP8Problem.from_float(q, k, v, "e4m3", causal=causal, **descales,
                                 tags=(("distribution", "normal"), ("seed", seed)))


@functools.lru_cache(maxsize=8)
def fp8_cases(seed: int, unit: bool = False) -> tuple:
    """The FP8 rules' cases, drawn from `seed` (case i from seed * 1000 + i); the same objects
    for every rule and target of a seed, so that their references are computed once."""
    cases = []
    for i, (*shape, causal, kv_cache) in enumerate(FP8_CASES):
        label = (f"fp8[{'-'.join(map(str, shape))}-{'causal' if causal else 'full'}"
                 f"{'-kvcache' if kv_cache else ''}{'-unit' if unit else ''} seed {seed}]")
        cases.append(Case(label, fp8_case(shape, causal, kv_cache, seed * 1000 + i, unit)))
    return tuple(cases)


@functools.lru_cache(maxsize=16)
def _reference(problem: FP8Problem):
    """The certified reference of a case (cached by the problem's identity)."""
    from fa_verify.oracle.fp8 import reference_fp8

    return reference_fp8(problem)


@functools.lru_cache(maxsize=16)
def fp8_baseline(problem: FP8Problem) -> np.ndarray:
    """Attention of the true inputs in float64 with the normalised P rounded to e4m3 before P.V,
    output in the problem's output dtype: flash-attention's FP8 baseline."""
    per_head = {n: np.repeat(problem.descale(n), problem.group_size, axis=1)[..., None, None] for n in DESCALES}
    q, (k, v) = problem.stored.q64() * per_head["q_descale"], problem.stored.kv64()
    k, v = k * per_head["k_descale"], v * per_head["v_descale"]
    s = np.where(problem.mask, problem.scale_value * (q @ np.swapaxes(k, -1, -2)), -np.inf)
    with np.errstate(invalid="ignore"):
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
        total = p.sum(axis=-1, keepdims=True)
        p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
    p = round_to(p, "e4m3").astype(np.float64)
    return round_to(p @ v, problem.output_dtype)


class FP8Rule(Rule):
    """A rule of FP8 problems: the cases of `fp8_cases(seed)`; `reseeded(seed)` draws others."""

    kind = "fp8"
    unit = False

    def __init__(self, seed: int = 0):
        self.seed = seed

    def reseeded(self, seed: int) -> "FP8Rule":
        return type(self)(seed)

    def cases(self, backend):
        if "e4m3" in backend.dtypes:
            yield from fp8_cases(self.seed, self.unit)

    @staticmethod
    def reference(problem) -> np.ndarray:
        return _reference(problem).out


def _error(out, ref) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(out, dtype=np.float64) - ref


class FlashAttentionFP8Rule(FP8Rule):
    name = "flash-attention-fp8"
    title = "flash-attention FP8 test (2x / 4x KV cache an FP8-P baseline's error + atol)"

    def judge(self, out, case):
        p = case.problem
        dtype = p.output_dtype
        ref = round_to(self.reference(p), dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            perturbed = round_to(round_to(ref.astype(np.float64) + 0.3, dtype).astype(np.float64) - 0.3, dtype)
        fwd_atol = 2 * _max_abs_diff(perturbed, ref, dtype)
        mult = FA_FP8_MULT_KVCACHE if p.k_descale.size == 1 else FA_FP8_MULT
        err = _max_abs_diff(np.asarray(out), ref, dtype)
        err_pt = _max_abs_diff(fp8_baseline(p), ref, dtype)
        if err <= mult * err_pt + fwd_atol:
            return None
        return f"max|out - out_ref| = {err:.3g} > {mult:g} * {err_pt:.3g} (FP8-P baseline) + {fwd_atol:.3g} (atol)"


class TransformerEngineRule(FP8Rule):
    name = "transformer-engine"
    title = f"TransformerEngine FP8 tests (RMSE < {TE_RMSE_TOL:g} x the output's range)"

    def judge(self, out, case):
        ref = self.reference(case.problem)
        rmse = float(np.sqrt(np.mean(_error(out, ref) ** 2)))
        allowed = TE_RMSE_TOL * float(ref.max() - ref.min())
        if rmse < allowed:
            return None
        return f"RMSE {rmse:.3g} >= {TE_RMSE_TOL:g} x the range {ref.max() - ref.min():.3g} = {allowed:.3g}"


def sqnr_db(out, ref) -> float:
    """20 log10(|ref| / |out - ref|) in dB (inf for an exact out, nan for a non-finite one)."""
    noise = float(np.linalg.norm(_error(out, ref)))
    signal = float(np.linalg.norm(ref))
    with np.errstate(divide="ignore"):
        return float(20 * np.log10(signal / noise)) if noise > 0 or not np.isfinite(noise) else float("inf")


class TorchaoSQNRRule(FP8Rule):
    name = "torchao-sqnr"
    title = f"torchao float8 tests (SQNR > {TORCHAO_SQNR_DB:g} dB)"

    def judge(self, out, case):
        sqnr = sqnr_db(out, self.reference(case.problem))
        if sqnr > TORCHAO_SQNR_DB:
            return None
        return f"SQNR {sqnr:.3g} dB <= {TORCHAO_SQNR_DB:g} dB"


class FlashInferMSERule(FP8Rule):
    name = "flashinfer-mse"
    title = f"FlashInfer FP8 tests (MSE < {FLASHINFER_MSE:g})"

    def judge(self, out, case):
        mse = float(np.mean(_error(out, self.reference(case.problem)) ** 2))
        if mse < FLASHINFER_MSE:
            return None
        return f"MSE {mse:.3g} >= {FLASHINFER_MSE:g}"


class UnitDescaleRule(FP8Rule):
    name = "unit-descales"
    title = "unit-descale testing (fa_verify's FP8 bound and ensemble rule, every descale 1)"
    unit = True

    def judge(self, out, case):  # pragma: no cover - judge_result judges out and LSE together
        return self.judge_result((out, None), case)

    def judge_result(self, result, case):
        from fa_verify.properties.fp8 import _agreement

        p = case.problem
        failure, _ = _agreement(self.name, p, result, _reference(p), _bound(p), _allowance(p))
        return None if failure is None else failure.detail.splitlines()[0]


@functools.lru_cache(maxsize=8)
def _bound(problem: FP8Problem):
    """FlashAttention-3's FP8 bound of a case (cached by the problem's identity)."""
    from fa_verify.fp8_error_model import fp8_error_bound
    from fa_verify.precision import PrecisionModel

    return fp8_error_bound(problem, PrecisionModel.flash(problem.dtype), _reference(problem))


@functools.lru_cache(maxsize=8)
def _allowance(problem: FP8Problem):
    """The FP8 ensemble rule's allowance of a case (cached by the problem's identity)."""
    from fa_verify.fp8_ensemble import ensemble_allowance

    return ensemble_allowance(problem, _bound(problem).precision, _reference(problem))


#: The FP8 rules of the side-by-side, in table order.
FP8_RULES = (FlashAttentionFP8Rule(), TransformerEngineRule(), TorchaoSQNRRule(), FlashInferMSERule(),
             UnitDescaleRule())
