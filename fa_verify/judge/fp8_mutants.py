"""FP8 attention kernels with the bugs reported in FP8 paths (issue 23), as numpy targets.

Each is FlashAttention-3's FP8 forward (`fa_verify.fp8_emulation.fa3_fp8_forward`, the code the
honest `NumpyFP8Backend` runs) given what the buggy kernel reads or does:

* k_descale_dropped         k's descale never applied
* v_uses_k_descale          v multiplied by k's descale (the k <-> v mix-up)
* q_descale_by_query_head   q's descale read at [b, h] of the flat [B * Hkv] array instead of
                            [b, h // G] (out of range reads wrap, as a neighbouring buffer would)
* one_scalar_descale        descale [0, 0] for every (batch, kv head)
* qk_descales_twice         q.k descales folded into the softmax scale twice
* p_without_offset          P rounded to e4m3 without the 2^8 offset (and the LSE consistent)
* lse_without_compensation  P offset by 2^8 but the LSE not compensated (8 ln 2 too large)

The first five equal the honest kernel whenever every descale is 1: unit-descale testing cannot
see them. `EMULATED_MUTANTS` holds them as `EmulatedMutant`s, which the mutant campaign judges as
it judges a mutant of kernels/mutants/mutants.toml (`fa_verify.judge.mutants.mutant_backend`):
the FP8 judging table (`fa_verify mutants --fp8`, `fa_verify.judge.over_seeds`) lists them with
any CUDA FP8 mutant of mutants.toml.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.backends.numpy_fp8 import NumpyFP8Backend
from fa_verify.errors import InvalidArgumentError
from fa_verify.fp8_emulation import fa3_fp8_forward, per_head

#: The family the emulated mutants and their control are reported under.
FAMILY = "numpy-fp8"
NAMES = ("q_descale", "k_descale", "v_descale")


def _by_query_head(problem, name):
    flat = getattr(problem, name).reshape(-1)
    B, H = problem.batch, problem.heads
    index = (np.arange(B)[:, None] * problem.kv_heads + np.arange(H)[None, :]) % flat.size
    return flat[index].astype(np.float32)


def _scalar(problem, name):
    return np.full((problem.batch, problem.heads), getattr(problem, name).reshape(-1)[0], np.float32)


def per_head_descales(problem, **changes):
    """The three descales per (batch, query head), as the kernel applies them; `changes` replace some."""
    right = {name: per_head(problem, name) for name in NAMES}
    return [changes.get(name, right[name]) for name in NAMES]


MUTANTS = {
    "k_descale_dropped": lambda p, prec: fa3_fp8_forward(
        p, prec, *per_head_descales(p, k_descale=np.ones((p.batch, p.heads), np.float32))),
    "v_uses_k_descale": lambda p, prec: fa3_fp8_forward(p, prec, *per_head_descales(p, v_descale=per_head(p, "k_descale"))),
    "q_descale_by_query_head": lambda p, prec: fa3_fp8_forward(
        p, prec, *per_head_descales(p, q_descale=_by_query_head(p, "q_descale"))),
    "one_scalar_descale": lambda p, prec: fa3_fp8_forward(p, prec, *(_scalar(p, name) for name in NAMES)),
    "qk_descales_twice": lambda p, prec: fa3_fp8_forward(p, prec, *per_head_descales(p), fold_times=2),
    "p_without_offset": lambda p, prec: fa3_fp8_forward(p, prec.replace(p_offset=0), *per_head_descales(p)),
    "lse_without_compensation": lambda p, prec: fa3_fp8_forward(p, prec, *per_head_descales(p), lse_offset=False),
}
#: The mutants that equal the honest kernel when every descale is 1.
DESCALE_MUTANTS = ("k_descale_dropped", "v_uses_k_descale", "q_descale_by_query_head", "one_scalar_descale",
                   "qk_descales_twice")
_BUG_CLASS = {"k_descale_dropped": "descale dropped", "v_uses_k_descale": "descales swapped",
              "q_descale_by_query_head": "descale indexed wrongly", "one_scalar_descale": "descale granularity",
              "qk_descales_twice": "descale applied twice", "p_without_offset": "P quantised without offset",
              "lse_without_compensation": "LSE not compensated"}
_DESCRIPTION = {
    "k_descale_dropped": "k's descale never applied",
    "v_uses_k_descale": "v multiplied by k's descale",
    "q_descale_by_query_head": "q's descale read at [b, h] of the flat [B*Hkv] array instead of [b, h // G]",
    "one_scalar_descale": "descale [0, 0] used for every (batch, kv head)",
    "qk_descales_twice": "q.k descales folded into the softmax scale twice",
    "p_without_offset": "P rounded to e4m3 without the 2^8 offset",
    "lse_without_compensation": "P offset by 2^8, the LSE not compensated (8 ln 2 too large)",
}


class MutantFP8Backend(NumpyFP8Backend):
    """FA3's FP8 forward with one of the bugs of MUTANTS, judged under FA3's FP8 model."""

    def __init__(self, mutant: str):
        if mutant not in MUTANTS:
            raise InvalidArgumentError(f"mutant={mutant!r} is no FP8 mutant; mutants: {', '.join(MUTANTS)}")
        super().__init__(name=f"fp8-mutant-{mutant}")
        self.mutant = mutant

    def _run(self, problem):
        return MUTANTS[self.mutant](problem, self.precision(problem.dtype))


@dataclass(frozen=True)
class EmulatedMutant:
    """A mutant that is a numpy target rather than an edit of a .cu file: the campaign runs
    `backend()` and judges its kills against `control_backend()` (the honest kernel)."""

    name: str
    bug_class: str
    description: str
    family: str = FAMILY

    def backend(self, sanitize: bool = False):
        """The mutant's target (None for the sanitizer build: numpy has none)."""
        return None if sanitize else MutantFP8Backend(self.name)

    def control_backend(self):
        return NumpyFP8Backend()


EMULATED_MUTANTS = tuple(EmulatedMutant(name, _BUG_CLASS[name], _DESCRIPTION[name]) for name in MUTANTS)


def unit_descales(problem):
    """`problem` with every descale 1, as tests that use identity scales draw them."""
    return problem.replace(**{name: np.ones_like(getattr(problem, name)) for name in NAMES})
