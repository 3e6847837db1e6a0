"""The backward of our Triton FlashAttention kernel (fa_triton.py), written for fa_verify's checks.

Three kernels, FlashAttention-2's backward split so that no two programs write one element:
- `_preprocess`, one program per (block of queries, batch x head): D_i = sum_c dO_ic O_ic, and
  the LSE turned from the protocol's natural log into base 2 (the kernels work with exp2, as
  the forward does);
- `_dkdv`, one program per (block of keys, batch x kv head): it walks every query block of
  every query head that reads this kv head (GQA sums over the group there, not through atomics),
  recomputes P = exp2(scale log2(e) Q K^T - LSE2) and accumulates dV += P^T dO and
  dK += dS^T Q, with dS = P (dO V^T - D);
- `_dq`, one program per (block of queries, batch x head): it walks the key blocks and
  accumulates dQ += dS K, in a fixed order (a deterministic dQ, unlike FA2's atomic adds).
Scores, P, dP, dS and the accumulators are float32; P and dS are rounded to the input dtype
before their GEMMs (FlashAttention-2's precision model); the scale multiplies dK and dQ once at
the end; gradients are stored in the input dtype.

Its limits are the forward's: Nq = Nk, N a multiple of 16, D in {16, 32, 64, 128}, MHA, GQA,
MQA; causal masking (top-left = bottom-right when Nq = Nk). Inputs are torch tensors
(`--array torch`); on the CPU it runs with TRITON_INTERPRET=1 (tests/test_backward_adapters.py
checks it there; no GPU has run it yet):
    TRITON_INTERPRET=1 python3 -m fa_verify check kernels.triton.fa_triton_bwd:backward --array torch \
        --limits kernels/triton/limits.toml
(limits.toml's `lse-base = 2` is the forward's LSE output; the backward reads the protocol's
natural-log LSE whatever it says.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.fa_triton import BLOCK, LOG2_E, WIDE_DOT, check_limits


@triton.jit
def _dot(a, b, WIDE: tl.constexpr):
    # fp32 and bf16 operands go through fp32 with input_precision="ieee" (fa_triton.WIDE_DOT says why)
    if WIDE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _preprocess(O, DO, LSE, DELTA, LSE2, log2_e, s_b, s_h, s_n, heads, seq,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    batch_head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    at = (batch_head // heads) * s_b + (batch_head % heads) * s_h + rows[:, None] * s_n + dims[None, :]
    o = tl.load(O + at).to(tl.float32)
    do = tl.load(DO + at).to(tl.float32)
    tl.store(DELTA + batch_head * seq + rows, tl.sum(o * do, 1))
    tl.store(LSE2 + batch_head * seq + rows, tl.load(LSE + batch_head * seq + rows) * log2_e)


@triton.jit
def _dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, scale, scale_log2,
          sq_b, sq_h, sq_n, sk_b, sk_h, sk_n,
          heads, kv_heads, group, seq,
          CAUSAL: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          HEAD_DIM: tl.constexpr):
    block_n = tl.program_id(0)
    batch_kv = tl.program_id(1)
    b = batch_kv // kv_heads
    kv_h = batch_kv % kv_heads
    keys = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in_block = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)

    kv_at = b * sk_b + kv_h * sk_h + keys[:, None] * sk_n + dims[None, :]
    k = tl.load(K + kv_at)
    v = tl.load(V + kv_at)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)

    # Causal: query blocks before this key block see none of its keys.
    first = block_n * BLOCK_N if CAUSAL else 0
    for g in range(0, group):
        h = kv_h * group + g
        q_base = b * sq_b + h * sq_h
        stats = (b * heads + h) * seq
        for start in range(first, seq, BLOCK_M):
            rows = start + rows_in_block
            q_at = q_base + rows[:, None] * sq_n + dims[None, :]
            q = tl.load(Q + q_at)
            do = tl.load(DO + q_at)
            lse2 = tl.load(LSE2 + stats + rows)
            delta = tl.load(DELTA + stats + rows)
            # Transposed tiles ([keys, rows]) so that both GEMMs take them as their left operand.
            p_t = tl.math.exp2(_dot(k, tl.trans(q), WIDE) * scale_log2 - lse2[None, :])
            if CAUSAL:
                p_t = tl.where(keys[:, None] <= rows[None, :], p_t, 0.0)
            dv += _dot(p_t.to(do.dtype), do, WIDE)
            dp_t = _dot(v, tl.trans(do), WIDE)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, WIDE)

    tl.store(DK + kv_at, (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + kv_at, dv.to(DV.dtype.element_ty))


@triton.jit
def _dq(Q, K, V, DO, DQ, LSE2, DELTA, scale, scale_log2,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n,
        heads, group, seq,
        CAUSAL: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr):
    block_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    kv_base = b * sk_b + (h // group) * sk_h
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)

    q_at = b * sq_b + h * sq_h + rows[:, None] * sq_n + dims[None, :]
    q = tl.load(Q + q_at)
    do = tl.load(DO + q_at)
    lse2 = tl.load(LSE2 + batch_head * seq + rows)
    delta = tl.load(DELTA + batch_head * seq + rows)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)

    stop = (block_m + 1) * BLOCK_M if CAUSAL else seq
    for start in range(0, stop, BLOCK_N):
        keys = start + cols
        kv_at = kv_base + keys[:, None] * sk_n + dims[None, :]
        k = tl.load(K + kv_at)
        v = tl.load(V + kv_at)
        p = tl.math.exp2(_dot(q, tl.trans(k), WIDE) * scale_log2 - lse2[:, None])
        if CAUSAL:
            p = tl.where(rows[:, None] >= keys[None, :], p, 0.0)
        ds = p * (_dot(do, tl.trans(v), WIDE) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, WIDE)

    tl.store(DQ + q_at, (dq * scale).to(DQ.dtype.element_ty))


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             dout: torch.Tensor, *, causal: bool, scale: float):
    """(dq, dk, dv) in the input dtype: q, out, dout [B, H, N, D]; k, v [B, Hkv, N, D]; lse
    [B, H, N] float32, natural log (the backward protocol's, not the forward's base 2)."""
    check_limits(q, k)
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    wide = q.dtype in WIDE_DOT
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    k_strides = (k.stride(0), k.stride(1), k.stride(2))
    shape = dict(BLOCK_M=BLOCK, BLOCK_N=BLOCK, HEAD_DIM=dim)

    _preprocess[(seq // BLOCK, batch * heads)](out, dout, lse, delta, lse2, LOG2_E, *q_strides, heads, seq,
                                               BLOCK_M=BLOCK, HEAD_DIM=dim)
    _dkdv[(seq // BLOCK, batch * kv_heads)](q, k, v, dout, dk, dv, lse2, delta, scale, scale * LOG2_E,
                                            *q_strides, *k_strides, heads, kv_heads, heads // kv_heads, seq,
                                            CAUSAL=bool(causal), WIDE=wide, **shape)
    _dq[(seq // BLOCK, batch * heads)](q, k, v, dout, dq, lse2, delta, scale, scale * LOG2_E,
                                       *q_strides, *k_strides, heads, heads // kv_heads, seq,
                                       CAUSAL=bool(causal), WIDE=wide, **shape)
    return dq, dk, dv
