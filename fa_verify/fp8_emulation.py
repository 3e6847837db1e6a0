"""FlashAttention-3's FP8 forward in numpy: the honest implementation the FP8 properties must pass.

Per (batch, kv head), over key tiles of `block_n` in ascending order (the online softmax):
s = fl32(q.k) of the stored values times the folded scale fl32(fl32(fl32(scale) dq) dk);
the running max m; P = exp(s - m) 2^offset in fp32, its row sum added to l (fp32), P rounded
once to the declared P format and multiplied by the stored v (fp32 accumulation, the earlier
tiles rescaled by exp(m_old - m_new)); at the end O = acc / l times dv, stored in the output
dtype, and LSE = m + log(l) - offset ln 2 (base e, float32). A row that sees no key gives 0 and
-inf. `fa3_fp8_forward` takes the descales per query head, so that the mutants of the judging
fixtures (a descale read at the wrong granularity) are this same code given other descales.

The products are explicit fp32 sums in ascending order (`_product`), not BLAS: the FP8 ensemble's
members are this code, and a rule must give the same bits on every machine, whatever BLAS kernel
a CPU would pick.
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import numpy_dtype, round_to


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in float32, each product rounded and added in ascending K."""
    out = np.zeros(a.shape[:-1] + b.shape[-1:], np.float32)
    for i in range(a.shape[-1]):
        out = out + a[..., :, i:i + 1] * b[..., i:i + 1, :]
    return out


def fa3_fp8_forward(problem, precision, q_descale, k_descale, v_descale, block_n: int = 128,
                    fold_times: int = 1, lse_offset: bool = True, descending: bool = False,
                    at_load: bool = False):
    """(out, lse) of FP8 problem `problem` as FlashAttention-3's kernel of `precision` computes
    them, with descales per query head ([B, H] float32 each: q's, then the k and v descales of
    the head's kv head). `fold_times` multiplies the q.k descales into the scale that many times
    (1: right) and `lse_offset` compensates the LSE for P's offset (True: right). Honest
    alternatives (`fp8_ensemble`): key tiles in `descending` order; descales applied `at_load`
    (q dq, k dk and v dv rounded to fp32 as they are read, instead of folded and at the end)."""
    f32 = np.float32
    B, H, Nq, _ = problem.out_shape
    G, nk = problem.group_size, problem.nk
    dq, dk, dv = (d.astype(f32)[..., None, None] for d in (q_descale, k_descale, v_descale))
    q = problem.q.astype(f32)
    k = np.repeat(problem.k.astype(f32), G, axis=1)
    v = np.repeat(problem.v.astype(f32), G, axis=1)
    scale = np.full((B, H), f32(problem.scale_value), f32)
    if at_load:
        q, k, v, dv = q * dq, k * dk, v * dv, f32(1)
    else:
        for _ in range(fold_times):
            scale = (scale * q_descale.astype(f32)) * k_descale.astype(f32)  # [B, H] in fp32
    offset = f32(2.0 ** precision.p_offset)
    mask = problem.mask
    m = np.full((B, H, Nq, 1), -np.inf, f32)
    l = np.zeros((B, H, Nq, 1), f32)
    acc = np.zeros((B, H, Nq, v.shape[-1]), f32)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        starts = range(0, nk, block_n)
        for j0 in reversed(starts) if descending else starts:
            keys = slice(j0, min(j0 + block_n, nk))
            s = _product(q, k[:, :, keys].swapaxes(-1, -2)) * scale[..., None, None]
            s = np.where(mask[:, keys], s, f32(-np.inf))
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = np.where(np.isfinite(m_new), m_new, f32(0))
            alpha = np.where(np.isfinite(m), np.exp(m - m_safe), f32(0))
            p = np.exp(s - m_safe) * offset
            l = l * alpha + p.sum(axis=-1, keepdims=True, dtype=f32)
            p_stored = round_to(p, precision.p_rounding).astype(f32)
            acc = acc * alpha + _product(p_stored, v[:, :, keys])
            m = m_new
        out = np.where(l > 0, acc / np.where(l > 0, l, f32(1)), f32(0)) * dv
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l > 0, l, f32(1)))[..., 0], -np.inf)
    if lse_offset:
        lse = lse - f32(precision.p_offset * np.log(2.0))
    return out.astype(numpy_dtype(problem.output_dtype)), lse.astype(f32)


def per_head(problem, name: str) -> np.ndarray:
    """Descale `name` of `problem` as the kernel reads it per query head, float32 [B, H]: query
    head h uses its kv head h // G (for q as for k and v)."""
    return np.repeat(problem.descale(name), problem.group_size, axis=1).astype(np.float32)


def fp8_forward(problem, precision, block_n: int = 128):
    """(out, lse) of FlashAttention-3's FP8 forward, the descales read as the convention says."""
    return fa3_fp8_forward(problem, precision, *(per_head(problem, n) for n in ("q_descale", "k_descale", "v_descale")),
                           block_n=block_n)
