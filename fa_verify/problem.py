"""The attention problem: inputs, dtype, masking and scale, validated once.

q is [B, H, Nq, D]; k and v are [B, Hkv, Nk, D] with H divisible by Hkv (MHA, GQA, MQA);
query head h reads key/value head h // (H // Hkv), as FlashAttention does.

Input policy: q, k and v hold finite values of the problem dtype (fp16, bf16 or fp32).
NaN and Inf inputs are rejected, because attention over them has no reference answer; the
NaN-padding property checks kernels' reads *outside* the inputs instead. Use
`AttentionProblem.from_float` to round arbitrary float data to the dtype first.
"""

from __future__ import annotations

import math
import numbers
import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fa_verify.dtypes import DTYPE_NAMES, dtype_name, round_to
from fa_verify.errors import InvalidArgumentError, InvalidArgumentTypeError, InvalidProblemError

CAUSAL_ALIGNMENTS = ("bottom-right", "top-left")


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """One forward-attention problem. Construct it with arrays already of the problem dtype."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool = False
    causal_alignment: str = "bottom-right"
    #: Softmax scale; None means exactly 1/sqrt(D) (irrational in general: the oracle keeps it exact).
    scale: float | None = None
    #: Free-form labels (distribution, seed, ...) carried into records and reproducers.
    tags: tuple = ()

    def __post_init__(self):
        _check_options(self.causal, self.scale)
        object.__setattr__(self, "causal", bool(self.causal))  # a numpy bool becomes a bool
        q, k, v = self.q, self.k, self.v
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, np.ndarray):
                raise InvalidProblemError(
                    f"{name} must be a numpy array, got {type(x).__name__}; "
                    "AttentionProblem.from_float(q, k, v, dtype) takes torch tensors and lists too")
            if x.ndim != 4:
                raise InvalidProblemError(
                    f"{name}.shape={x.shape!r} must have 4 dimensions: q [B,H,Nq,D], k/v [B,Hkv,Nk,D]"
                )
        if not (q.dtype == k.dtype == v.dtype):
            raise InvalidProblemError(
                f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        name = dtype_name(q.dtype)
        if name not in DTYPE_NAMES:
            raise InvalidProblemError(
                f"dtype={name!r} is not a problem dtype; use one of {', '.join(DTYPE_NAMES)} "
                "(AttentionProblem.from_float rounds float64 data)"
            )
        if k.shape != v.shape:
            raise InvalidProblemError(f"k.shape={k.shape!r} and v.shape={v.shape!r} must be equal")
        B, H, Nq, D = q.shape
        Bk, Hkv, Nk, Dk = k.shape
        if Bk != B:
            raise InvalidProblemError(f"batch sizes differ: q has B={B}, k/v have B={Bk}")
        if Dk != D:
            raise InvalidProblemError(f"head dims differ: q has D={D}, k/v have D={Dk}")
        if min(B, H, Hkv, D) < 1:
            raise InvalidProblemError(f"B, H, Hkv and D must be >= 1, got B={B}, H={H}, Hkv={Hkv}, D={D}")
        if Nq < 1 or Nk < 1:
            raise InvalidProblemError(f"Nq and Nk must be >= 1, got Nq={Nq}, Nk={Nk}")
        if H % Hkv:
            raise InvalidProblemError(f"H={H} must be divisible by Hkv={Hkv} (MHA, GQA or MQA)")
        if self.causal_alignment not in CAUSAL_ALIGNMENTS:
            raise InvalidProblemError(
                f"causal_alignment={self.causal_alignment!r}; use one of {CAUSAL_ALIGNMENTS}"
            )
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise InvalidProblemError(f"scale={self.scale!r} must be a finite positive number or None")
        for tensor_name, x in (("q", q), ("k", k), ("v", v)):
            finite = np.isfinite(x.astype(np.float32))
            if not finite.all():
                where = tuple(int(i) for i in np.argwhere(~finite)[0])
                raise InvalidProblemError(
                    f"{tensor_name} holds a non-finite value {x[where]!r} at index {where}; "
                    "fa_verify only checks finite inputs"
                )

    @classmethod
    def from_float(cls, q, k, v, dtype, **kwargs) -> "AttentionProblem":
        """Round float data (numpy arrays, torch tensors of any float dtype, or anything
        array-like) to `dtype`, then build the problem."""
        return cls(*(round_to(_as_float64(name, x), dtype) for name, x in (("q", q), ("k", k), ("v", v))),
                   **kwargs)

    def replace(self, **changes) -> "AttentionProblem":
        return dataclasses.replace(self, **changes)

    # --- shape -----------------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return dtype_name(self.q.dtype)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def nq(self) -> int:
        return self.q.shape[2]

    @property
    def nk(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def out_shape(self) -> tuple:
        return self.q.shape

    @property
    def scale_value(self) -> float:
        """The scale as the nearest float64 (exact when given, rounded when 1/sqrt(D))."""
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)

    @property
    def scale_is_exact(self) -> bool:
        """Whether `scale_value` is the exact scale (a float64 that was given, or 1/sqrt(D) of a square D)."""
        return self.scale is not None or math.isqrt(self.head_dim) ** 2 == self.head_dim

    # --- masking ---------------------------------------------------------------------------
    def key_limit(self) -> np.ndarray:
        """For each query row i, the number of keys it may attend (keys 0..limit-1), int64 [Nq]."""
        i = np.arange(self.nq, dtype=np.int64)
        if not self.causal:
            return np.full(self.nq, self.nk, dtype=np.int64)
        offset = self.nk - self.nq if self.causal_alignment == "bottom-right" else 0
        return np.clip(i + offset + 1, 0, self.nk)

    @cached_property
    def mask(self) -> np.ndarray:
        """Boolean [Nq, Nk]: True where query i attends key j."""
        return np.arange(self.nk)[None, :] < self.key_limit()[:, None]

    @property
    def masked_rows(self) -> np.ndarray:
        """Boolean [Nq]: rows that attend no key (output 0, LSE -inf)."""
        return self.key_limit() == 0

    # --- views in float64 (exact: every problem dtype embeds in float64) -----------------------
    def q64(self) -> np.ndarray:
        return self.q.astype(np.float64)

    def kv64(self) -> tuple[np.ndarray, np.ndarray]:
        """k and v in float64, expanded to H heads so that head h pairs with q's head h."""
        g = self.group_size
        return (np.repeat(self.k.astype(np.float64), g, axis=1),
                np.repeat(self.v.astype(np.float64), g, axis=1))

    def describe(self) -> str:
        """A one-line description for messages: shapes, dtype, masking, scale."""
        causal = f"causal={self.causal_alignment}" if self.causal else "causal=no"
        scale = "1/sqrt(D)" if self.scale is None else repr(self.scale)
        return (f"B={self.batch} H={self.heads} Hkv={self.kv_heads} Nq={self.nq} Nk={self.nk} "
                f"D={self.head_dim} dtype={self.dtype} {causal} scale={scale}")


def _check_options(causal, scale) -> None:
    """The options' types, before anything uses them: a string is truthy, so causal='no'
    would otherwise make a causal problem."""
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentTypeError(
            f"causal={causal!r} must be True or False, got {type(causal).__name__} (a non-empty "
            "string is truthy: causal='no' would mean causal); pass causal=False or causal=True")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise InvalidArgumentTypeError(
            f"scale={scale!r} must be None (1/sqrt(D)) or a finite positive number, got "
            f"{type(scale).__name__}; pass a float, e.g. scale=0.125, or leave it out for 1/sqrt(D)")


def _as_float64(name: str, x) -> np.ndarray:
    """`x` as float64 values: a torch tensor (bf16 included, which numpy cannot read) through
    torch's own exact widening, anything else through numpy."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        return x.detach().cpu().double().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{name}: a {type(x).__name__} cannot be read as float data ({exc}); pass a numpy "
            "array, a torch tensor or nested lists of numbers") from None
