"""The three problem dtypes (and FP8's two storage formats): names, numpy types, unit
roundoffs, rounding and ULPs.

Everything that rounds on the CPU goes through ml_dtypes / numpy casts, which round to
nearest-even exactly as the GPU's conversion instructions do.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fa_verify.errors import InvalidArgumentError

#: Canonical dtype names, in the order reports list them.
DTYPE_NAMES = ("fp16", "bf16", "fp32")
#: FP8 storage formats (`fa_verify.fp8`): q, k, v of an FP8 problem, and what P may be rounded to.
FP8_DTYPES = ("e4m3", "e5m2")

_NUMPY = {
    "fp16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp32": np.dtype(np.float32),
    "fp64": np.dtype(np.float64),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64",
    "e4m3": "e4m3", "e4m3fn": "e4m3", "float8_e4m3fn": "e4m3",
    "e5m2": "e5m2", "float8_e5m2": "e5m2",
}


def dtype_name(dtype) -> str:
    """Canonical name ('fp16', 'bf16', 'fp32', 'fp64', 'e4m3', 'e5m2') of a name, numpy dtype or
    torch dtype."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = str(dtype).removeprefix("torch.")  # a torch.dtype
    try:
        return _ALIASES[key]
    except KeyError:
        raise InvalidArgumentError(
            f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)} (FP8 problems: "
            f"{', '.join(FP8_DTYPES)})"
        ) from None


def numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype that stores values of `dtype` (ml_dtypes.bfloat16 for bf16)."""
    return _NUMPY[dtype_name(dtype)]


def unit_roundoff(dtype) -> float:
    """u = 2^-p for round-to-nearest with p significand bits (fp16 2^-11, bf16 2^-8, fp32 2^-24)."""
    return float(ml_dtypes.finfo(numpy_dtype(dtype)).eps) / 2


def finfo(dtype):
    return ml_dtypes.finfo(numpy_dtype(dtype))


def round_to(x, dtype) -> np.ndarray:
    """Round float64 values to `dtype` (nearest-even; beyond the range, inf, as on the GPU)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float64).astype(numpy_dtype(dtype))


def round_trip(x, dtype) -> np.ndarray:
    """Round to `dtype` and return as float64: models a kernel storing an intermediate in `dtype`."""
    return round_to(x, dtype).astype(np.float64)


def ulp(x, dtype) -> np.ndarray:
    """The spacing of `dtype` at |x| (the subnormal spacing below the smallest normal)."""
    info = finfo(dtype)
    mag = np.abs(np.asarray(x, dtype=np.float64))
    tiny = float(info.smallest_normal)
    exponent = np.floor(np.log2(np.maximum(mag, tiny)))
    return np.exp2(exponent) * float(info.eps)
