"""The FP8 problem: q, k, v stored in an 8-bit float format with float32 descales.

FlashAttention-3's convention, exactly: q, k and v are stored as e4m3fn (or e5m2) values, each
with a descale; the true value of an element is its stored value times its descale,

    q_true[b, h]   = q[b, h]   * q_descale[b, h // G]     (G = H / Hkv: the kv head of q's group)
    k_true[b, kh]  = k[b, kh]  * k_descale[b, kh]
    v_true[b, kh]  = v[b, kh]  * v_descale[b, kh]

Descales are float32 of shape [B, Hkv] (FlashAttention-3's `q_descale`, `k_descale`,
`v_descale`) or [1], one per tensor (as FP8 KV caches carry `k_scale`, `v_scale`), finite and
> 0. The problem is attention of the true inputs (`fa_verify.problem`'s conventions: causal
alignment, scale = 1/sqrt(D) unless given, LSE natural and float32, a row that sees no key
gives 0 and -inf); its output is stored in `output_dtype` (bf16 unless declared). The product
stored x descale has at most 4 + 24 significand bits (e5m2: 3 + 24), so it is exact in float64.

Shapes and masking are those of the stored values as a dense problem (`stored`, the values
widened exactly to fp16, which holds every e4m3 and e5m2 value): `problem.nk`, `problem.mask`,
... are read through it. Variants (window, softcap, ALiBi, sinks) are not part of this kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES, dtype_name, numpy_dtype, round_to
from fa_verify.errors import InvalidArgumentError, InvalidProblemError
from fa_verify.outputs import attention_outputs
from fa_verify.problem import FINITE_ATTENTION, AttentionProblem, OnePart

#: The descales, by the callable protocol's (FlashAttention-3's) keyword names.
DESCALES = ("q_descale", "k_descale", "v_descale")


@dataclass(frozen=True, eq=False)
class FP8Problem(OnePart):
    """One FP8 forward-attention problem (see the module's doc for the exact convention)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    #: float32 [B, Hkv] or [1]: true value = stored value x descale
    q_descale: np.ndarray
    k_descale: np.ndarray
    v_descale: np.ndarray
    causal: bool = False
    causal_alignment: str = "bottom-right"
    #: Softmax scale of the true scores; None means exactly 1/sqrt(D).
    scale: float | None = None
    #: dtype of the output (FlashAttention-3's FP8 kernel: bf16)
    output_dtype: str = "bf16"
    tags: tuple = ()

    def __post_init__(self):
        for name in ("q", "k", "v"):
            x = getattr(self, name)
            if not isinstance(x, np.ndarray) or _format_name(x.dtype) not in FP8_DTYPES:
                got = f"{type(x).__name__} {getattr(x, 'dtype', '')}".strip()
                raise InvalidProblemError(
                    f"{name} must be a numpy array of an FP8 format ({', '.join(FP8_DTYPES)}: ml_dtypes.float8_e4m3fn "
                    f"or float8_e5m2), got {got}; FP8Problem.from_float rounds float data")
        if not (self.q.dtype == self.k.dtype == self.v.dtype):
            raise InvalidProblemError(f"q, k, v must share one FP8 format, got {self.q.dtype}, {self.k.dtype}, "
                                      f"{self.v.dtype}")
        if _format_name(self.output_dtype) not in DTYPE_NAMES:
            raise InvalidProblemError(f"output_dtype={self.output_dtype!r} must be one of {', '.join(DTYPE_NAMES)}")
        object.__setattr__(self, "output_dtype", dtype_name(self.output_dtype))
        stored = self.stored  # validates shapes, causal, scale and finiteness as a dense problem does
        for name in DESCALES:
            object.__setattr__(self, name, _checked_descale(name, getattr(self, name), stored))

    @classmethod
    def from_float(cls, q, k, v, dtype="e4m3", **kwargs) -> "FP8Problem":
        """Round stored values (float data, within the format's range: e4m3fn has no infinity and
        ml_dtypes gives NaN past 464) to the FP8 format `dtype` (ml_dtypes rounds float64 through
        float32, as data stored from fp32 is)."""
        return cls(*(round_to(np.asarray(x, dtype=np.float64), dtype) for x in (q, k, v)), **kwargs)

    def replace(self, **changes) -> "FP8Problem":
        return dataclasses.replace(self, **changes)

    @cached_property
    def stored(self) -> AttentionProblem:
        """The stored values as a dense fp16 problem (exact): shapes, masking, the scale."""
        return AttentionProblem(*(x.astype(np.float16) for x in (self.q, self.k, self.v)), causal=self.causal,
                                causal_alignment=self.causal_alignment, scale=self.scale)

    def __getattr__(self, name):
        # Shapes and masking are the stored problem's; dunder names and the fields are not
        # delegated, so copying and unpickling never recurse.
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        return getattr(self.stored, name)

    @property
    def dtype(self) -> str:
        return dtype_name(self.q.dtype)

    def descale(self, name: str) -> np.ndarray:
        """The descale `name` (one of DESCALES) per (batch, kv head), float64 [B, Hkv]."""
        x = getattr(self, name).astype(np.float64)
        return np.broadcast_to(x.reshape(-1, 1) if x.size == 1 else x, (self.batch, self.kv_heads))

    # --- the kind protocol (fa_verify.properties.kinds) --------------------------------------
    kind = "fp8"
    finite_because = FINITE_ATTENTION
    out_label, lse_label = AttentionProblem.out_label, AttentionProblem.lse_label

    def outputs(self, precision) -> tuple:
        """out in the problem's output dtype, and the LSE (optional)."""
        return attention_outputs(self, precision.replace(output=self.output_dtype))

    def input_arrays(self) -> dict:
        """q, k, v and the descales: a callable is given the descales by these names."""
        return {"q": self.q, "k": self.k, "v": self.v, **{name: getattr(self, name) for name in DESCALES}}

    def unsupported_by(self, backend) -> str | None:
        return backend.limits.check(self)

    def saved(self, prefix: str = "") -> tuple[dict, dict]:
        parameters = {"dtype": self.dtype, "causal": self.causal, "causal_alignment": self.causal_alignment,
                      "scale": self.scale, "output_dtype": self.output_dtype, "tags": [list(t) for t in self.tags]}
        arrays = {**{name: getattr(self, name).view(np.uint8) for name in ("q", "k", "v")},
                  **{name: getattr(self, name) for name in DESCALES}}
        return parameters, {prefix + name: x for name, x in arrays.items()}

    @classmethod
    def from_saved(cls, parameters: dict, arrays, prefix: str = "") -> "FP8Problem":
        dtype = numpy_dtype(parameters["dtype"])
        q, k, v = (np.ascontiguousarray(arrays[prefix + name]).view(dtype) for name in ("q", "k", "v"))
        return cls(q, k, v, *(np.asarray(arrays[prefix + name]) for name in DESCALES), causal=parameters["causal"],
                   causal_alignment=parameters["causal_alignment"], scale=parameters["scale"],
                   output_dtype=parameters["output_dtype"], tags=tuple(tuple(t) for t in parameters["tags"]))

    def describe(self) -> str:
        dense = self.stored.describe().replace("dtype=fp16", f"dtype={self.dtype}")
        shapes = " ".join(f"{name[0]}{list(getattr(self, name).shape)}" for name in DESCALES)
        return f"{dense} out={self.output_dtype} descales {shapes}"


#: Attributes never delegated to the stored problem (`FP8Problem.__getattr__`).
_OWN = frozenset(f.name for f in dataclasses.fields(FP8Problem)) | {"stored"}


def _format_name(dtype) -> str | None:
    try:
        return dtype_name(dtype)
    except InvalidArgumentError:  # the caller's message names what is wanted
        return None


def _checked_descale(name: str, x, stored: AttentionProblem) -> np.ndarray:
    """`x` as float32 of shape [B, Hkv] or [1], finite and > 0."""
    shapes = ((stored.batch, stored.kv_heads), (1,))
    try:
        values = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidProblemError(f"{name}: a {type(x).__name__} cannot be read as float data; pass a float32 "
                                  "array of shape [B, Hkv] or [1]") from None
    if values.shape not in shapes:
        raise InvalidProblemError(
            f"{name}.shape={list(values.shape)} must be [B, Hkv] = {list(shapes[0])} (FlashAttention-3's "
            f"descales) or [1] (one per tensor, as an FP8 KV cache's k_scale / v_scale)")
    with np.errstate(over="ignore"):
        values = values.astype(np.float32)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidProblemError(f"{name}={float(values[where])!r} at index {where} must be a finite float32 > 0 "
                                  "(true value = stored value x descale)")
    return values
