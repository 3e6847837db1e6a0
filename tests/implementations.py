"""Attention implementations that tests share: correct ones built differently from ours."""

import pytest


def torch_math_public(problem):
    """torch's math path through the public API (F.scaled_dot_product_attention + MATH)."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from fa_verify.backends.torch_arrays import to_numpy, to_torch
    q, k, v = (to_torch(x) for x in (problem.q, problem.k, problem.v))
    k, v = (x.repeat_interleave(problem.group_size, dim=1) for x in (k, v))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=problem.causal, scale=problem.scale_value)
    return to_numpy(out), None
