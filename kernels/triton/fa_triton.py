"""A FlashAttention forward kernel in Triton, written for fa_verify's own checks.

One program per (block of BLOCK_M queries, batch x head); it walks the key blocks of BLOCK_N
keys with an online softmax in base 2: the scale is folded with log2(e) into one factor, so
exp2 replaces exp and the running max and LSE are in units of log2. Scores, the running max
and sum and the P.V accumulator are float32; P is rounded to the input dtype before P.V
(FlashAttention-2's precision model); the output is stored in the input dtype, the LSE in
float32 and in base 2 (log2 of the row's sum of exp(scaled scores)).

What it supports (its declared limits): Nq = Nk (causal masking is then the same top-left or
bottom-right), N a multiple of BLOCK (16), D in {16, 32, 64, 128} (tl.arange needs a power of
two, tl.dot at least 16), MHA, GQA and MQA. Fully masked rows cannot occur when Nq = Nk.

Runs on a GPU, or on the CPU with TRITON_INTERPRET=1 and CPU torch tensors:
    TRITON_INTERPRET=1 python3 -m fa_verify check kernels.triton.fa_triton:attention --array torch \
        --lse-base 2 --limits kernels/triton/limits.toml
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 16
HEAD_DIMS = (16, 32, 64, 128)
LOG2_E = 1.0 / math.log(2.0)
#: Input dtypes whose dots run on fp32 operands with input_precision="ieee": fp32, so that it is
#: not TF32 on a GPU; bf16, because Triton 3.9's interpreter computes bf16 tl.dot wrongly (values
#: ~1e10 off). bf16 x bf16 products are exact in fp32, so the model (fp32 accumulation) is the same.
WIDE_DOT = (torch.float32, torch.bfloat16)


@triton.jit
def _forward(Q, K, V, O, LSE, scale_log2,
             sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, so_b, so_h, so_n,
             heads, group, seq,
             CAUSAL: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    block_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    kv_h = h // group  # GQA: `group` query heads share one key/value head
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_n + dims[None, :])
    kv_base = b * sk_b + kv_h * sk_h
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)

    # Causal: key blocks past the last row of this query block hold nothing it may see.
    stop = (block_m + 1) * BLOCK_M if CAUSAL else seq
    for start in range(0, stop, BLOCK_N):
        keys = start + cols
        k = tl.load(K + kv_base + keys[:, None] * sk_n + dims[None, :])
        v = tl.load(V + kv_base + keys[:, None] * sk_n + dims[None, :])
        if WIDE:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale_log2
        if CAUSAL:
            scores = tl.where(rows[:, None] >= keys[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.math.exp2(running_max - new_max)
        p = tl.math.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, 1)
        if WIDE:  # P still rounded to the input dtype first
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                  input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(O + b * so_b + h * so_h + rows[:, None] * so_n + dims[None, :], out.to(O.dtype.element_ty))
    tl.store(LSE + batch_head * seq + rows, running_max + tl.math.log2(running_sum))


def check_limits(q: torch.Tensor, k: torch.Tensor) -> None:
    """The declared limits, shared with the backward kernel (fa_triton_bwd.py)."""
    seq, dim = q.shape[2:]
    assert k.shape[2] == seq, "Nq = Nk only"
    assert seq % BLOCK == 0, f"N must be a multiple of {BLOCK}"
    assert dim in HEAD_DIMS, f"D must be one of {HEAD_DIMS}"
    assert q.shape[1] % k.shape[1] == 0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float):
    """(out, lse2): q [B, H, N, D], k and v [B, Hkv, N, D]; lse2 [B, H, N] float32, base 2."""
    check_limits(q, k)
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    grid = (seq // BLOCK, batch * heads)
    _forward[grid](q, k, v, out, lse, scale * LOG2_E,
                   q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   out.stride(0), out.stride(1), out.stride(2),
                   heads, heads // kv_heads, seq,
                   CAUSAL=bool(causal), WIDE=q.dtype in WIDE_DOT, BLOCK_M=BLOCK, BLOCK_N=BLOCK,
                   HEAD_DIM=dim)
    return out, lse
