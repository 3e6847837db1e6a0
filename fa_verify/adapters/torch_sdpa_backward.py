"""The backward of torch's `scaled_dot_product_attention`, CPU math and flash kernels, as
backward targets (`bwd(q, k, v, out, lse, dout, *, causal, scale) -> (dq, dk, dv)`).

Each recomputes the forward under autograd from q, k, v in the input dtype (numpy arrays,
bf16 as ml_dtypes.bfloat16, in [B, H, N, D]) and back-propagates dout; `out` and `lse` are not
read. The gradients come back in the input dtype. `is_causal` is SDPA's, top-left aligned (query
i sees keys j <= i): check them with `--causal-alignment top-left`. GQA runs with `enable_gqa`.

- `math_backward`: the math backend, a composite of aten ops differentiated by autograd. It
  upcasts fp16/bf16 to fp32 and rounds each gradient once at the end, unless the global flag
  `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)` is set (then it computes in
  the input dtype); the adapter leaves that flag as the caller has it.
- `flash_backward`: the CPU flash kernel only (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`),
  whose backward is `_scaled_dot_product_flash_attention_for_cpu_backward`. In torch 2.13 it
  takes every problem this protocol passes (any D, Nq != Nk, GQA, fp16, bf16, fp32); were it to
  refuse one, torch raises "No available kernel" (its reasons as warnings) instead of running
  another kernel, since the context allows no other.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa_verify.backends.torch_arrays import to_numpy, to_torch


def _backward(kernel, q, k, v, dout, causal: bool, scale: float):
    q, k, v = (to_torch(x).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(kernel):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    out.backward(to_torch(dout))
    return tuple(to_numpy(x.grad) for x in (q, k, v))


def math_backward(q, k, v, out, lse, dout, *, causal: bool, scale: float):
    return _backward(SDPBackend.MATH, q, k, v, dout, causal, scale)


def flash_backward(q, k, v, out, lse, dout, *, causal: bool, scale: float):
    return _backward(SDPBackend.FLASH_ATTENTION, q, k, v, dout, causal, scale)
