"""torch's `flex_attention` as a callable-protocol target, eager and `torch.compile`d.

Inputs are [B, H, N, D] CPU tensors (`--array torch`); causal problems get a bottom-right mask
(fa_verify's default alignment), GQA runs with `enable_gqa`, and the LSE comes from flex_attention
itself (`AuxRequest(lse=True)`).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

# Each new shape compiles again; past torch's default of 8 recompiles dynamo would silently run
# the eager function instead, which is not what `compiled_attention` claims to check.
torch._dynamo.config.recompile_limit = 1024
_compiled = torch.compile(flex_attention)


def _bottom_right(nq: int, nk: int):
    offset = nk - nq

    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(mask, B=None, H=None, Q_LEN=nq, KV_LEN=nk, device="cpu")


def _run(fn, q, k, v, causal: bool, scale: float):
    block_mask = _bottom_right(q.shape[2], k.shape[2]) if causal else None
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
                  return_aux=AuxRequest(lse=True))
    return out, aux.lse


def attention(q, k, v, *, causal: bool, scale: float):
    return _run(flex_attention, q, k, v, causal, scale)


def compiled_attention(q, k, v, *, causal: bool, scale: float):
    return _run(_compiled, q, k, v, causal, scale)
