"""An honest FlashAttention-2 backward pass in numpy, at exactly FA2's precision.

What the kernel does, per key tile (a thread block owns block_n keys of one kv head), rounded
as the kernel rounds: every product and sum in float32 (numpy float32 arithmetic, GEMMs
included), P = exp(z - LSE) from the given float32 LSE, P rounded to `precision.p_rounding`
for dV = P^T dO, dP = dO V^T, dS = P (dP - D + dlse) (times the softcap's 1 - tanh^2) rounded
to `precision.p_rounding` for dK = dS^T Q and dQ = dS K (ml_dtypes rounding), scale applied
to dQ and dK in float32, outputs stored in `precision.output`. D_i comes from rowsum(dO o O)
of the given (rounded) out, or from rowsum(P o dP). dsink_h = -sum P_sink (D - dlse) in float32.

Where correct kernels differ, a parameter chooses:
    block_n, block_m   key and query tile sizes;
    order              the order of the query tiles (and heads of a group) summed into dK, dV;
    dq_order           the order the key tiles' dQ contributions are added (FA2 uses float32
                       atomics: any order): "ascending", "descending" or "shuffled" (by `seed`);
    d_from             "out" (rowsum(dO o O), FA2) or "p_dp" (rowsum(P o dP));
    gqa_reduce         "expanded" (FA2's mha_bwd: each query head's dK, dV stored in the output
                       dtype, then each group summed and rounded once) or "fp32" (the group's
                       heads accumulated in float32, rounded once: FA3's accumulators).
A row whose given LSE is -inf sees no key: its P is 0 (flash-attn substitutes 0 for the -inf max).
Only FA2's stages are emulated: scores and accumulations in float32 whatever
precision.score_accumulation and pv_accumulation say (p_rounding and output are followed).
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import numpy_dtype
from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle.backward import checked_upstream
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

ORDERS = ("ascending", "descending")
DQ_ORDERS = ("ascending", "descending", "shuffled")
D_SOURCES = ("out", "p_dp")
GQA_REDUCTIONS = ("expanded", "fp32")

F32 = np.float32


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (float32) rounded to `dtype` and back: what a kernel stores before a tensor-core GEMM."""
    return x.astype(numpy_dtype(dtype)).astype(F32)


def _tiles(n: int, size: int) -> list:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def fa2_backward(problem: AttentionProblem, out, lse, dout, dlse=None, *, precision: PrecisionModel | None = None,
                 block_n: int = 64, block_m: int = 64, order: str = "ascending", dq_order: str = "ascending",
                 d_from: str = "out", gqa_reduce: str = "expanded", seed: int = 0):
    """(dq, dk, dv, dsinks) as an FA2 backward of `precision` computes them (see the module doc).
    `out` in precision.output's dtype, `lse` float32 [B, H, Nq]; dsinks float32 [H] or None."""
    precision = precision or PrecisionModel.flash(problem.dtype)
    for name, value, allowed in (("order", order, ORDERS), ("dq_order", dq_order, DQ_ORDERS),
                                 ("d_from", d_from, D_SOURCES), ("gqa_reduce", gqa_reduce, GQA_REDUCTIONS)):
        if value not in allowed:
            raise InvalidArgumentError(f"{name}={value!r}; use one of {allowed}")
    dout64, dlse64 = checked_upstream(problem, dout, dlse)
    B, H, Nq, D = problem.out_shape
    G, Nk, Hkv = problem.group_size, problem.nk, problem.kv_heads
    p_dtype, out_dtype = precision.p_rounding, precision.output
    scale = F32(problem.scale_value)
    softcap = F32(problem.softcap)
    mask = problem.mask
    q, k, v = (x.astype(F32) for x in (problem.q, problem.k, problem.v))
    do = dout64.astype(F32)
    up = None if dlse64 is None else dlse64.astype(F32)
    o = np.asarray(out).astype(F32)
    L = np.asarray(lse).astype(F32)
    live = np.isfinite(L)
    L0 = np.where(live, L, F32(0))
    rng = np.random.default_rng(seed)
    key_tiles = _tiles(Nk, block_n)
    row_tiles = _tiles(Nq, block_m)
    if order == "descending":
        row_tiles = row_tiles[::-1]

    def probabilities(b, h, rows, keys):
        """P of rows x keys in float32 (and the capped scores' tanh, for the derivative)."""
        t = (q[b, h, rows] @ k[b, h // G, keys].T) * scale
        th = None
        if softcap > 0:
            th = np.tanh(t / softcap)
            t = softcap * th
        bias = problem.alibi_bias(b, h, np.arange(Nq)[rows])
        if bias is not None:
            t = t + bias[:, keys].astype(F32)
        allowed = mask[rows, keys] & live[b, h, rows, None]
        with np.errstate(under="ignore", over="ignore", invalid="ignore"):
            p = np.where(allowed, np.exp(t - L0[b, h, rows, None]), F32(0))
        return p.astype(F32), th

    delta = np.zeros((B, H, Nq), F32)
    for b, h in np.ndindex(B, H):
        if d_from == "out":
            delta[b, h] = (do[b, h] * o[b, h]).sum(axis=-1, dtype=F32)
            continue
        for keys in key_tiles:  # rowsum(P o dP), key tile by key tile
            p, _ = probabilities(b, h, slice(None), keys)
            delta[b, h] += (p * (do[b, h] @ v[b, h // G, keys].T)).sum(axis=-1, dtype=F32)

    dq = np.zeros((B, H, Nq, D), F32)
    dk = np.zeros((B, Hkv, Nk, D), F32)
    dv = np.zeros((B, Hkv, Nk, D), F32)
    heads_of = [list(range(hk * G, hk * G + G)) for hk in range(Hkv)]
    expanded_dk, expanded_dv = (np.zeros((B, H, Nk, D), F32) for _ in range(2))
    for b, hk in np.ndindex(B, Hkv):
        dq_parts = {h: [] for h in heads_of[hk]}
        for keys in key_tiles:
            dk_acc = np.zeros((keys.stop - keys.start, D), F32)
            dv_acc = np.zeros_like(dk_acc)
            heads = heads_of[hk] if order == "ascending" else heads_of[hk][::-1]
            for h in heads:
                if gqa_reduce == "expanded":  # this head's own dK, dV, stored in the output dtype
                    dk_acc, dv_acc = np.zeros_like(dk_acc), np.zeros_like(dv_acc)
                dq_tile = np.zeros((Nq, D), F32)
                for rows in row_tiles:
                    p, th = probabilities(b, h, rows, keys)
                    dv_acc += _rounded(p, p_dtype).T @ do[b, h, rows]
                    dp = do[b, h, rows] @ v[b, hk, keys].T
                    g = dp - delta[b, h, rows, None]
                    if up is not None:
                        g = g + up[b, h, rows, None]
                    ds = p * g
                    if th is not None:
                        ds = ds * (F32(1) - th * th)
                    ds = _rounded(ds, p_dtype)
                    dk_acc += ds.T @ q[b, h, rows]
                    dq_tile[rows] = ds @ k[b, hk, keys]
                dq_parts[h].append(dq_tile)
                if gqa_reduce == "expanded":
                    expanded_dk[b, h, keys] = _rounded(dk_acc * scale, out_dtype)
                    expanded_dv[b, h, keys] = _rounded(dv_acc, out_dtype)
            if gqa_reduce == "fp32":
                dk[b, hk, keys] = dk_acc * scale
                dv[b, hk, keys] = dv_acc
        for h, parts in dq_parts.items():
            sequence = {"ascending": parts, "descending": parts[::-1],
                        "shuffled": [parts[i] for i in rng.permutation(len(parts))]}[dq_order]
            acc = np.zeros((Nq, D), F32)
            for part in sequence:
                acc += part
            dq[b, h] = acc * scale

    if gqa_reduce == "expanded":  # summed over each group in float32, rounded once below
        dk = expanded_dk.reshape(B, Hkv, G, Nk, D).sum(axis=2, dtype=F32)
        dv = expanded_dv.reshape(B, Hkv, G, Nk, D).sum(axis=2, dtype=F32)
    dsinks = None
    if problem.sinks is not None:
        with np.errstate(under="ignore"):
            ps = np.exp(problem.sinks.astype(F32)[None, :, None] - L0).astype(F32)
        ps = np.where(live, ps, F32(0))
        terms = ps * (delta - (F32(0) if up is None else up))
        dsinks = -terms.sum(axis=(0, 2), dtype=F32)
    dtype = numpy_dtype(out_dtype)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype), dsinks
