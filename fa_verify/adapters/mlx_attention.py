"""MLX's `mx.fast.scaled_dot_product_attention` as a callable-protocol target (CPU or Metal).

It takes [B, H, N, D] arrays (fa_verify's default layout), GQA by head count, and returns no LSE.
MLX has no numpy bfloat16, so arrays cross as float32 (exact for fp16 and bf16) and are cast to
and from the input dtype on MLX's side; the output comes back in the input dtype.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_MLX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def attention(q, k, v, *, causal: bool, scale: float):
    dtype = q.dtype
    q, k, v = (mx.array(np.asarray(a, dtype=np.float32)).astype(_MLX_DTYPES[dtype.name]) for a in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)
    return np.array(out.astype(mx.float32)).astype(dtype)
