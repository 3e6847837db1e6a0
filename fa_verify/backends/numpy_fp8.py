"""The numpy model of FlashAttention-3's FP8 forward as a backend of FP8 problems, and of paged
batches of them (an FP8 KV cache: `fa_verify.ragged`, kind "paged-fp8").

`fp8_emulation.fp8_forward`: the reference implementation the FP8 properties must pass, and the
honest member of the FP8 judging campaigns (tests/fixtures/fp8_mutants.py).
"""

from __future__ import annotations

from fa_verify.backends.base import Backend, parse_precision
from fa_verify.backends.numpy_ragged import sequences_of
from fa_verify.dtypes import FP8_DTYPES
from fa_verify.fp8_emulation import fp8_forward
from fa_verify.precision import PrecisionModel


class NumpyFP8Backend(Backend):
    """FA3's FP8 forward in numpy (key tiles of `block_n`), judged under `precision` (default
    "flash": FlashAttention-3's FP8 model for FP8 inputs)."""

    kinds = ("fp8",)
    dtypes = FP8_DTYPES

    def __init__(self, block_n: int = 128, precision: str = "flash", name: str = "numpy-fa3-fp8"):
        self.block_n, self.precision_spec, self.name = block_n, precision, name

    def precision(self, dtype) -> PrecisionModel:
        return parse_precision(self.precision_spec, dtype)

    def _run(self, problem):
        return fp8_forward(problem, self.precision(problem.dtype), self.block_n)


class NumpyPagedFP8Backend(NumpyFP8Backend):
    """A paged FP8 batch: each sequence read back from the layout's own arrays (block table,
    cache_seqlens, the scales q_descale / k_scale / v_scale: `numpy_ragged.sequences_of`) through
    FA3's FP8 forward."""

    kinds = ("paged-fp8",)
    batch_invariant = True  # sequences never share a tile

    def __init__(self, block_n: int = 128, precision: str = "flash", name: str = "numpy-paged-fp8"):
        super().__init__(block_n, precision, name)

    def _run(self, problem):
        return self.run_inputs(problem, problem.inputs())

    def run_inputs(self, problem, inputs: dict):
        """(out, lse) of the batch whose layout arrays are `inputs`."""
        precision = self.precision(problem.dtype)
        return problem.join([fp8_forward(seq, precision, self.block_n) for seq in sequences_of(problem, inputs)])
