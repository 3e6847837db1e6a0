"""numpy <-> torch without touching the bits, bf16 included, and torch imported only on use.

numpy has no bfloat16 of its own and torch does not know ml_dtypes.bfloat16, so bf16 crosses
as its 16-bit pattern (an int16 view on both sides).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fa_verify.backends.base import Availability, AVAILABLE

TORCH_MISSING = "torch is not installed (pip install 'fa-verify[torch]')"


def import_torch():
    """The torch module, or None when it cannot be imported."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_availability() -> Availability:
    return AVAILABLE if import_torch() is not None else Availability(False, TORCH_MISSING)


def to_torch(x: np.ndarray):
    """A CPU tensor holding exactly the values of `x` (fp16, bf16, fp32 ...)."""
    torch = import_torch()
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def to_numpy(t) -> np.ndarray:
    """The values of a torch tensor as a numpy array (ml_dtypes.bfloat16 for bf16)."""
    torch = import_torch()
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
