"""`jax.nn.dot_product_attention`, jit-compiled, as a callable-protocol target, and its
`jax.vjp` as a backward target.

It takes [B, T, N, H] arrays (fa_verify's `--layout bshd`) and its `is_causal` masks top-left
(query i sees keys j <= i, torch SDPA's convention): check it with
`--layout bshd --causal-alignment top-left`. Its LSE ("residual") is [B, T, N]; the protocol's
is [B, N, T]. Everything else is JAX's own: the LSE is returned in the dtype JAX gives it.

`backward` takes the backward protocol's [B, H, N, D] arrays (fa_verify's default layout: it
transposes to JAX's and back), recomputes the forward under `jax.vjp` (`out` and `lse` are not
read) and returns the gradients in the input dtype, fp16 and bf16 included; its causal is the
same top-left one: `--causal-alignment top-left`.
"""

from __future__ import annotations

import jax
import numpy as np

# is_causal and scale are Python values fixed at trace time: a new one compiles again, like a new shape.
_attention = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal", "scale", "return_residual"))


def attention(q, k, v, *, causal: bool, scale: float):
    out, lse = _attention(q, k, v, is_causal=causal, scale=scale, return_residual=True)
    return np.asarray(out), np.asarray(lse).transpose(0, 2, 1)


def _vjp(q, k, v, dout, is_causal: bool, scale: float):
    _, pullback = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, scale=scale),
                          q, k, v)
    return pullback(dout)


_backward = jax.jit(_vjp, static_argnames=("is_causal", "scale"))


def backward(q, k, v, out, lse, dout, *, causal: bool, scale: float):
    # [B, H, N, D] <-> JAX's [B, T, N, H]: the same swap both ways
    grads = _backward(*(np.swapaxes(x, 1, 2) for x in (q, k, v, dout)), is_causal=causal, scale=scale)
    return tuple(np.swapaxes(np.asarray(g), 1, 2) for g in grads)
