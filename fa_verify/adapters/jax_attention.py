"""`jax.nn.dot_product_attention`, jit-compiled, as a callable-protocol target.

It takes [B, T, N, H] arrays (fa_verify's `--layout bshd`) and its `is_causal` masks top-left
(query i sees keys j <= i, torch SDPA's convention): check it with
`--layout bshd --causal-alignment top-left`. Its LSE ("residual") is [B, T, N]; the protocol's
is [B, N, T]. Everything else is JAX's own: the LSE is returned in the dtype JAX gives it.
"""

from __future__ import annotations

import jax
import numpy as np

# is_causal and scale are Python values fixed at trace time: a new one compiles again, like a new shape.
_attention = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal", "scale", "return_residual"))


def attention(q, k, v, *, causal: bool, scale: float):
    out, lse = _attention(q, k, v, is_causal=causal, scale=scale, return_residual=True)
    return np.asarray(out), np.asarray(lse).transpose(0, 2, 1)
