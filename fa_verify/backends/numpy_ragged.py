"""The reference ragged backends: varlen and paged batches through the dense numpy FA2 model.

`sequences_of` reads each sequence back from the layout's own arrays (cu_seqlens, or the block
table and cache_seqlens), so a batch whose layout arrays are wrong gives wrong sequences here
too; each then runs through `tiled_attention`, every variant included.
"""

from __future__ import annotations

import numpy as np

from fa_verify.backends.base import Backend, parse_precision
from fa_verify.backends.numpy_tiled import tiled_attention
from fa_verify.errors import InvalidArgumentError
from fa_verify.precision import PrecisionModel
from fa_verify.problem import FEATURES
from fa_verify.ragged import LAYOUTS, PAGED_SCALES, sequence_scales


def sequences_of(problem, inputs: dict) -> list:
    """Each sequence as a problem with B = 1 (dense, or FP8), its q, k, v read from the layout's
    `inputs` (cu_seqlens, or block_table and cache_seqlens), an FP8 batch's descales from its
    scales (q_descale, k_scale, v_scale: [1] or row b of [B, Hkv]), its options from the problem."""
    if problem.layout == "varlen":
        cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
        parts = [(inputs["q"][cu_q[b]:cu_q[b + 1]], inputs["k"][cu_k[b]:cu_k[b + 1]],
                  inputs["v"][cu_k[b]:cu_k[b + 1]]) for b in range(problem.batch)]
    else:
        page_size, parts = inputs["k_cache"].shape[1], []
        for b in range(problem.batch):
            j = np.arange(inputs["cache_seqlens"][b])
            page, slot = inputs["block_table"][b, j // page_size], j % page_size
            parts.append((inputs["q"][b], inputs["k_cache"][page, slot], inputs["v_cache"][page, slot]))
    scales = {keyword: inputs[keyword] for keyword in PAGED_SCALES.values() if keyword in inputs}
    return [seq.replace(**{name: np.ascontiguousarray(x.transpose(1, 0, 2))[None] for name, x in zip("qkv", part)},
                        **sequence_scales(scales, b))
            for b, (seq, part) in enumerate(zip(problem.sequences, parts))]


class NumpyRaggedBackend(Backend):
    """Each sequence, read from the layout's inputs, through the dense numpy FA2 model."""

    def __init__(self, layout: str = "varlen", block_q: int = 64, block_k: int = 64, precision: str = "flash"):
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout={layout!r}; use one of {LAYOUTS}")
        self.kinds, self.block_q, self.block_k, self.precision_spec = (layout,), block_q, block_k, precision
        self.features = tuple(FEATURES)
        self.batch_invariant = True  # sequences never share a tile
        self.name = f"numpy-ragged-{layout}"

    def precision(self, dtype) -> PrecisionModel:
        return parse_precision(self.precision_spec, dtype)

    def _run(self, problem):
        precision = self.precision(problem.dtype)
        return problem.join([tiled_attention(seq, precision, self.block_q, self.block_k)
                             for seq in sequences_of(problem, problem.inputs())])


def numpy_ragged_backends() -> list[Backend]:
    """One per layout, the paged one with the varlen one as its twin."""
    varlen, paged = NumpyRaggedBackend("varlen"), NumpyRaggedBackend("paged")
    paged.contiguous = varlen
    return [varlen, paged]
