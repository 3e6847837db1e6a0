"""The backward of torch's `scaled_dot_product_attention`, CPU math and flash kernels, as
backward targets (`bwd(q, k, v, out, lse, dout, *, causal, scale) -> (dq, dk, dv)`).

Arrays are numpy, bf16 as ml_dtypes.bfloat16, in [B, H, N, D]; the gradients come back in the
input dtype. `is_causal` is SDPA's, top-left aligned (query
i sees keys j <= i): check them with `--causal-alignment top-left`. GQA runs with `enable_gqa`.

- `math_backward`: the math backend, a composite of aten ops differentiated by autograd: it
  recomputes the forward from q, k, v (`out` and `lse` are not read) and back-propagates dout. It
  upcasts fp16/bf16 to fp32 and rounds each gradient once at the end, unless the global flag
  `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)` is set (then it computes in
  the input dtype); the adapter leaves that flag as the caller has it.
- `flash_backward`: the CPU flash kernel's backward, `_scaled_dot_product_flash_attention_for_cpu_backward`,
  called as a FlashAttention backward is: with the `out` and `lse` it is given (not a forward of
  its own, whose errors the verdict would not know). In torch 2.13 it takes every problem this
  protocol passes (any D, Nq != Nk, GQA natively, fp16, bf16, fp32).
"""

from __future__ import annotations

import torch
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
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    grads = backward(*(to_torch(x) for x in (dout, q, k, v, out, lse)), 0.0, causal, scale=scale)
    return tuple(to_numpy(g) for g in grads)
