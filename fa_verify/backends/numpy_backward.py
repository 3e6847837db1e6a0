"""The numpy model of FlashAttention-2's backward as a backend of backward problems.

`backward_emulation.fa2_backward` in float32 with P and dS rounded to the input dtype: the
reference implementation the backward properties must pass (every variant, dlse), and the
honest member of the backward's judging campaign.
"""

from __future__ import annotations

from fa_verify.backends.base import Backend, parse_precision
from fa_verify.backward_emulation import fa2_backward
from fa_verify.precision import PrecisionModel
from fa_verify.problem import FEATURES


class NumpyBackwardBackend(Backend):
    """FA2's backward in numpy (key tiles of `block_n`, query tiles of `block_m`)."""

    kinds = ("backward",)
    features = tuple(FEATURES)
    takes_dlse = True

    def __init__(self, block_m: int = 64, block_n: int = 64, precision: str = "flash"):
        self.block_m, self.block_n, self.precision_spec = block_m, block_n, precision
        self.name = "numpy-fa2-backward"

    def precision(self, dtype) -> PrecisionModel:
        return parse_precision(self.precision_spec, dtype)

    def _run(self, problem):
        dq, dk, dv, dsinks = fa2_backward(problem.forward, problem.out, problem.lse, problem.dout, problem.dlse,
                                          precision=self.precision(problem.dtype), block_m=self.block_m,
                                          block_n=self.block_n)
        return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
