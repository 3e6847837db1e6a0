"""torch's `flex_attention` as a callable-protocol target, eager and `torch.compile`d, and its
backward as a backward target.

Inputs are [B, H, N, D] CPU tensors (`--array torch`); causal problems get a bottom-right mask
(fa_verify's default alignment) and GQA runs with `enable_gqa`. The eager function returns
flex_attention's own LSE (`AuxRequest(lse=True)`); the compiled one returns none, as torch 2.13
cannot compile the LSE on the CPU ("return_lse is not supported yet"), so the properties that
need one are not applicable to it.

`backward` differentiates the eager function with autograd (recomputing the forward from q, k,
v; `out` and `lse` are not read) and returns CPU gradients in the input dtype. torch 2.13
refuses flex_attention's backward on the CPU ("FlexAttention does not support backward on
CPU"), so it runs on a CUDA GPU when torch sees one and otherwise raises
BackendUnavailableError saying so.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from fa_verify.errors import BackendUnavailableError

# Each new shape may compile again; past torch's default of 8 recompiles dynamo would silently run
# the eager function instead, which is not what `compiled_attention` claims to check.
torch._dynamo.config.recompile_limit = 1024
_compiled = torch.compile(flex_attention)


def _bottom_right(nq: int, nk: int, device):
    offset = nk - nq

    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(mask, B=None, H=None, Q_LEN=nq, KV_LEN=nk, device=device)


def _options(q, k, causal: bool, scale: float) -> dict:
    return dict(block_mask=_bottom_right(q.shape[2], k.shape[2], q.device) if causal else None, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1])


def attention(q, k, v, *, causal: bool, scale: float):
    out, aux = flex_attention(q, k, v, **_options(q, k, causal, scale), return_aux=AuxRequest(lse=True))
    return out, aux.lse


def compiled_attention(q, k, v, *, causal: bool, scale: float):
    return _compiled(q, k, v, **_options(q, k, causal, scale))


def backward(q, k, v, out, lse, dout, *, causal: bool, scale: float):
    device = "cuda" if torch.cuda.is_available() else q.device
    q, k, v = (x.detach().to(device).requires_grad_() for x in (q, k, v))
    try:
        result = flex_attention(q, k, v, **_options(q, k, causal, scale))
    except NotImplementedError as error:
        raise BackendUnavailableError(
            f"flex_attention's backward needs a CUDA GPU here: torch {torch.__version__} says {error}") from None
    result.backward(dout.to(device))
    return tuple(x.grad.cpu() for x in (q, k, v))
