"""numpy <-> torch without touching the bits, bf16 and the FP8 formats included, and torch
imported only on use.

numpy has no bfloat16 or float8 of its own and torch does not know ml_dtypes' types, so these
cross as their bit patterns (an int16 or uint8 view on both sides): `_BIT_VIEWS`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fa_verify.backends.base import Availability, AVAILABLE
from fa_verify.errors import InvalidArgumentError

TORCH_MISSING = "torch is not installed (pip install 'fa-verify[torch]')"

#: ml_dtypes type -> (torch dtype's name, the numpy integer type of its bits, torch's)
_BIT_VIEWS = {
    np.dtype(ml_dtypes.bfloat16): ("bfloat16", np.int16, "int16"),
    np.dtype(ml_dtypes.float8_e4m3fn): ("float8_e4m3fn", np.uint8, "uint8"),
    np.dtype(ml_dtypes.float8_e5m2): ("float8_e5m2", np.uint8, "uint8"),
}


def import_torch():
    """The torch module, or None when it cannot be imported."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_availability() -> Availability:
    return AVAILABLE if import_torch() is not None else Availability(False, TORCH_MISSING)


def _torch_dtype(torch, name: str):
    found = getattr(torch, name, None)
    if found is None:
        raise InvalidArgumentError(f"torch {torch.__version__} has no torch.{name}: --array torch needs a torch "
                                   "that has it (float8 types: torch >= 2.1), or use --array numpy")
    return found


def to_torch(x: np.ndarray):
    """A CPU tensor holding exactly the values of `x` (fp16, bf16, fp32, e4m3fn, e5m2 ...)."""
    torch = import_torch()
    if x.dtype in _BIT_VIEWS:
        name, bits, _ = _BIT_VIEWS[x.dtype]
        return torch.from_numpy(np.ascontiguousarray(x).view(bits)).view(_torch_dtype(torch, name))
    return torch.from_numpy(np.ascontiguousarray(x))


def to_numpy(t) -> np.ndarray:
    """The values of a torch tensor as a numpy array (ml_dtypes types for bf16 and float8)."""
    torch = import_torch()
    t = t.detach().cpu()
    for dtype, (name, _, bits) in _BIT_VIEWS.items():
        if getattr(torch, name, None) == t.dtype:
            return t.contiguous().view(getattr(torch, bits)).numpy().view(dtype)
    return t.numpy()
