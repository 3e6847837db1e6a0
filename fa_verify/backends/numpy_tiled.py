"""A numpy model of a FlashAttention-2 forward kernel: tiles, online softmax, P rounding.

Each query tile keeps a running row max m, row sum l and accumulator acc in float32; each key
tile rescales them by exp(m_old - m_new). P is rounded to the precision model's p dtype (the
input dtype for FA2) before P·V, while l sums the unrounded fp32 P, as FA2 does. With a 16-bit
P·V accumulation dtype, l and acc are rounded to it after every key tile: a kernel that keeps
its running state in that dtype (not FA2, whose state is fp32). Work is vectorised over batch,
heads and the elements of a tile; only the tile loops are Python.
Variants: the softcap and ALiBi bias apply to each tile's scaled scores in fp32, the window
masks and skips tiles, and a sink joins the row sum after the last tile (one more rescale).
"""

from __future__ import annotations

import numpy as np

from fa_verify.backends.base import Backend, grouped, grouped_variants, parse_precision
from fa_verify.dtypes import DTYPE_NAMES, numpy_dtype
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import ANY_HEAD_DIM_V, Limits
from fa_verify.precision import PrecisionModel
from fa_verify.problem import FEATURES, AttentionProblem


def tiled_attention(problem: AttentionProblem, precision: PrecisionModel,
                    block_q: int = 64, block_k: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(out in precision.output, lse float32) as an FA2 kernel with these tile sizes computes them."""
    f32 = np.float32
    p_dtype = numpy_dtype(precision.p_rounding)
    state_dtype = numpy_dtype(precision.pv_accumulation)
    q, k, v = grouped(problem, np.dtype(f32))
    bias, sinks = grouped_variants(problem, np.dtype(f32))
    scale, cap = f32(problem.scale_value), f32(problem.softcap)
    start, limit = problem.key_start(), problem.key_limit()
    out = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=f32)
    lse = np.full(q.shape[:-1], -np.inf, dtype=f32)

    for q0 in range(0, problem.nq, block_q):
        rows = slice(q0, q0 + block_q)
        qt, row_start, row_limit = q[..., rows, :], start[rows], limit[rows]
        m = np.full(qt.shape[:-1], -np.inf, dtype=f32)
        l = np.zeros(qt.shape[:-1], dtype=f32)
        acc = np.zeros(qt.shape[:-1] + v.shape[-1:], dtype=f32)
        # Key tiles entirely outside every row's window are masked: the kernel skips them.
        first = int(row_start.min()) // block_k * block_k
        for k0 in range(first, int(row_limit.max()), block_k):
            cols = slice(k0, k0 + block_k)
            s = (qt @ np.swapaxes(k[..., cols, :], -1, -2)) * scale
            if cap > 0:
                s = cap * np.tanh(s / cap)
            if bias is not None:
                s = s + bias[..., rows, cols]
            keys = np.arange(k0, k0 + s.shape[-1])
            allowed = (keys >= row_start[:, None]) & (keys < row_limit[:, None])
            if not allowed.all():
                s = np.where(allowed, s, f32(-np.inf))
            m_new = np.maximum(m, s.max(axis=-1))
            # Rows with nothing allowed yet keep m = -inf; shift by 0 so exp(-inf - -inf) never occurs.
            shift = np.where(m_new == -np.inf, f32(0), m_new)
            alpha = np.exp(m - shift)
            p = np.exp(s - shift[..., None])
            l = alpha * l + p.sum(axis=-1, dtype=f32)
            acc = alpha[..., None] * acc + p.astype(p_dtype).astype(f32) @ v[..., cols, :]
            if state_dtype != f32:  # the running state is stored in a 16-bit dtype
                l, acc = (x.astype(state_dtype).astype(f32) for x in (l, acc))
            m = m_new
        if sinks is not None:  # the sink's term joins the row sum after the last tile
            m_new = np.maximum(m, sinks)
            alpha = np.exp(m - m_new)
            l = alpha * l + np.exp(sinks - m_new)
            acc = alpha[..., None] * acc
            if state_dtype != f32:
                l, acc = (x.astype(state_dtype).astype(f32) for x in (l, acc))
            m = m_new
        seen = l > 0
        out[..., rows, :] = acc / np.where(seen, l, f32(1))[..., None]
        with np.errstate(divide="ignore"):
            lse[..., rows] = np.where(seen, m + np.log(l), f32(-np.inf))
    shape = problem.out_shape
    return out.reshape(shape).astype(numpy_dtype(precision.output)), lse.reshape(shape[:3])


class NumpyTiledBackend(Backend):
    """tiled_attention as a backend. `precision` is a preset or spec for PrecisionModel.parse
    whose score and P·V accumulation are fp32 (the model keeps its softmax state in fp32)."""

    limits = Limits(head_dims_v=ANY_HEAD_DIM_V)

    def __init__(self, block_q: int = 64, block_k: int = 64, precision: str = "flash"):
        for arg, value in (("block_q", block_q), ("block_k", block_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{arg}={value!r} must be an integer >= 1")
        for dtype in DTYPE_NAMES:
            model = parse_precision(precision, dtype)
            if (model.score_accumulation, model.pv_accumulation) != ("fp32", "fp32"):
                raise InvalidArgumentError(
                    f"precision={precision!r} gives {model.describe()} for {dtype}; the tiled model "
                    "accumulates scores and P·V in fp32, so use e.g. 'flash' or 'fp32-accumulate'")
        self.block_q, self.block_k, self.precision_spec = block_q, block_k, precision
        self.features = tuple(FEATURES)
        default = (block_q, block_k, precision) == (64, 64, "flash")
        self.name = "numpy-tiled" if default else f"numpy-tiled-{block_q}x{block_k}-{precision}"

    def precision(self, dtype) -> PrecisionModel:
        return parse_precision(self.precision_spec, dtype)

    def _run(self, problem):
        return tiled_attention(problem, self.precision(problem.dtype), self.block_q, self.block_k)
