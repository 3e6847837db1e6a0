"""The attention problem: inputs, dtype, masking and scale, validated once.

q is [B, H, Nq, D]; k is [B, Hkv, Nk, D] and v [B, Hkv, Nk, D_v] with H divisible by Hkv (MHA,
GQA, MQA); query head h reads key/value head h // (H // Hkv), as FlashAttention does. D (=
`head_dim`, D_qk) is the head dim of the scores q.k and sets the default scale 1/sqrt(D); D_v
(`head_dim_v`, usually D) is v's and the output's, [B, H, Nq, D_v]: FlashAttention-3's 192/128
and multi-head latent attention's 576/512 (DeepSeek's MLA decode) have D_v != D.

Input policy: q, k and v hold finite values of the problem dtype (fp16, bf16 or fp32).
NaN and Inf inputs are rejected, because attention over them has no reference answer; the
NaN-padding property checks kernels' reads *outside* the inputs instead. Use
`AttentionProblem.from_float` to round arbitrary float data to the dtype first.

Variants (flash-attn 2's conventions; the defaults switch each off and leave a problem dense).
With the diagonal offset o = Nk - Nq (bottom-right alignment; o = 0 for top-left):
- scores s_ij = scale q_i.k_j; with softcap > 0, s_ij = softcap tanh(s_ij / softcap);
- ALiBi then adds -slope[b, h] |i + o - j| (alibi_slopes [H], or [B, H] per batch entry);
- window_size = (left, right): query i sees key j iff i + o - left <= j <= i + o + right, -1
  meaning unbounded on that side; causal=True means right = 0 whatever right says (as
  flash-attn 2 sets it), so causal is the window (-1, 0) and a causal window is (left, 0);
- sinks [H]: one logit per head that joins the softmax denominator only:
  O_i = sum_j e^{s_ij} v_j / (e^{sink_h} + sum_j e^{s_ij}), LSE_i = log(e^{sink_h} + sum_j e^{s_ij});
- a row that sees no key has O = 0 and LSE = -inf (LSE = sink_h with a sink).
Slopes and sinks are float32, as flash-attn takes them; the oracle uses those values exactly.
"""

from __future__ import annotations

import math
import numbers
import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fa_verify.dtypes import DTYPE_NAMES, dtype_name, numpy_dtype, round_to
from fa_verify.errors import InvalidArgumentError, InvalidArgumentTypeError, InvalidProblemError
from fa_verify.outputs import attention_outputs

CAUSAL_ALIGNMENTS = ("bottom-right", "top-left")
#: The variants a problem may use, by the callable protocol's keyword that passes each.
FEATURES = {"window": "window_size", "softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sinks"}
NO_WINDOW = (-1, -1)
#: Why a forward output may not be NaN or infinite.
FINITE_ATTENTION = "attention of finite inputs is finite"
#: The variants' arrays, saved beside q, k and v when the problem has them.
_VARIANT_ARRAYS = ("alibi_slopes", "sinks")


class OnePart:
    """The kind protocol's part methods for a problem judged as one part (dense, FP8, backward;
    a ragged batch has a part per sequence)."""

    def parts(self) -> tuple:
        """The problems judged one by one: this one."""
        return (self,)

    def split(self, out, lse=None) -> list:
        """Per part (out, lse): [(out, lse)]."""
        return [(out, lse)]

    def join(self, per_part) -> tuple:
        """(out, lse) from `split`'s pairs."""
        return tuple(per_part[0])

    def map_parts(self, change):
        """The problem with `change` applied to each part."""
        return change(self)

    def part_label(self, index: int) -> str:
        return ""


@dataclass(frozen=True, eq=False)
class AttentionProblem(OnePart):
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
    #: (left, right) keys around the diagonal; -1 = unbounded (see the module's doc).
    window_size: tuple = NO_WINDOW
    #: tanh soft cap of the scaled scores; 0 = off.
    softcap: float = 0.0
    #: ALiBi slopes, float32 [H] or [B, H]; None = off.
    alibi_slopes: np.ndarray | None = None
    #: attention-sink logits, float32 [H]; None = off.
    sinks: np.ndarray | None = None

    def __post_init__(self):
        _check_options(self.causal, self.scale)
        object.__setattr__(self, "causal", bool(self.causal))  # a numpy bool becomes a bool
        object.__setattr__(self, "window_size", _checked_window(self.window_size))
        object.__setattr__(self, "softcap", _checked_softcap(self.softcap))
        q, k, v = self.q, self.k, self.v
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, np.ndarray):
                raise InvalidProblemError(
                    f"{name} must be a numpy array, got {type(x).__name__}; "
                    "AttentionProblem.from_float(q, k, v, dtype) takes torch tensors and lists too")
            if x.ndim != 4:
                raise InvalidProblemError(
                    f"{name}.shape={x.shape!r} must have 4 dimensions: q [B,H,Nq,D], k [B,Hkv,Nk,D], "
                    "v [B,Hkv,Nk,D_v]"
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
        if k.shape[:3] != v.shape[:3]:
            raise InvalidProblemError(
                f"k.shape={k.shape!r} and v.shape={v.shape!r} must agree on [B, Hkv, Nk] (v's last dim, D_v, "
                "may differ from k's)")
        B, H, Nq, D = q.shape
        Bk, Hkv, Nk, Dk = k.shape
        Dv = v.shape[3]
        if Bk != B:
            raise InvalidProblemError(f"batch sizes differ: q has B={B}, k/v have B={Bk}")
        if Dk != D:
            raise InvalidProblemError(
                f"k.shape={k.shape!r}: its head dim D={Dk} must be q's D={D} (q.shape={q.shape!r}); only v's "
                "last dim (D_v) may differ")
        if min(B, H, Hkv, D, Dv) < 1:
            raise InvalidProblemError(
                f"B, H, Hkv, D and D_v must be >= 1, got B={B}, H={H}, Hkv={Hkv}, D={D}, D_v={Dv}")
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
        object.__setattr__(self, "alibi_slopes", _checked_vector(
            "alibi_slopes", self.alibi_slopes, ((H,), (B, H)), "[H] or [B, H]"))
        object.__setattr__(self, "sinks", _checked_vector("sinks", self.sinks, ((H,),), "[H]"))

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
        """D (D_qk): the head dim of q and k, which sets the default scale."""
        return self.q.shape[3]

    @property
    def head_dim_v(self) -> int:
        """D_v: the head dim of v and the output (D unless the problem says otherwise)."""
        return self.v.shape[3]

    @property
    def out_shape(self) -> tuple:
        return self.q.shape[:3] + (self.head_dim_v,)

    @property
    def scale_value(self) -> float:
        """The scale as the nearest float64 (exact when given, rounded when 1/sqrt(D))."""
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)

    @property
    def scale_is_exact(self) -> bool:
        """Whether `scale_value` is the exact scale (a float64 that was given, or 1/sqrt(D) of a square D)."""
        return self.scale is not None or math.isqrt(self.head_dim) ** 2 == self.head_dim

    # --- variants --------------------------------------------------------------------------
    @property
    def features(self) -> tuple:
        """The variants this problem uses (keys of FEATURES), in FEATURES' order."""
        return used_features(self.window_size, self.softcap, self.alibi_slopes, self.sinks)

    @property
    def diagonal_offset(self) -> int:
        """o: query i's diagonal is key i + o (Nk - Nq bottom-right, 0 top-left)."""
        return self.nk - self.nq if self.causal_alignment == "bottom-right" else 0

    @property
    def window(self) -> tuple:
        """The effective (left, right): right = 0 when causal, as flash-attn 2 sets it."""
        left, right = self.window_size
        return (left, 0) if self.causal else (left, right)

    @property
    def is_masked(self) -> bool:
        """Whether any key is masked for any row (causal or a window)."""
        return self.window != NO_WINDOW

    def alibi_bias(self, b, h, i) -> np.ndarray | None:
        """The ALiBi term -slope[b, h] |i + o - j| for every key j, float64 [..., Nk] over the
        index arrays (or ints) b, h, i broadcast together; None without ALiBi. Each entry is
        one rounded product of a float32 slope and an integer distance."""
        if self.alibi_slopes is None:
            return None
        slopes = self.alibi_slopes if self.alibi_slopes.ndim == 2 else self.alibi_slopes[None]
        b = np.asarray(b) if slopes.shape[0] > 1 else np.zeros_like(np.asarray(b))
        slope = slopes[b, np.asarray(h)].astype(np.float64)
        distance = np.abs(np.asarray(i)[..., None] + self.diagonal_offset - np.arange(self.nk))
        return -slope[..., None] * distance.astype(np.float64)

    def capped(self, scores: np.ndarray) -> np.ndarray:
        """softcap tanh(scores / softcap) in float64 when the problem has a softcap, else scores."""
        return self.softcap * np.tanh(scores / self.softcap) if self.softcap > 0 else scores

    # --- masking ---------------------------------------------------------------------------
    def key_start(self) -> np.ndarray:
        """For each query row i, the first key it may attend, int64 [Nq] (0 without a left edge)."""
        left = self.window[0]
        if left < 0:
            return np.zeros(self.nq, dtype=np.int64)
        return np.clip(np.arange(self.nq, dtype=np.int64) + self.diagonal_offset - left, 0, self.nk)

    def key_limit(self) -> np.ndarray:
        """For each query row i, one past the last key it may attend, int64 [Nq]: row i attends
        keys key_start()[i] .. key_limit()[i] - 1 (none if the limit is not above the start)."""
        right = self.window[1]
        if right < 0:
            return np.full(self.nq, self.nk, dtype=np.int64)
        return np.clip(np.arange(self.nq, dtype=np.int64) + self.diagonal_offset + right + 1, 0, self.nk)

    @cached_property
    def mask(self) -> np.ndarray:
        """Boolean [Nq, Nk]: True where query i attends key j."""
        j = np.arange(self.nk)[None, :]
        return (j >= self.key_start()[:, None]) & (j < self.key_limit()[:, None])

    @property
    def masked_rows(self) -> np.ndarray:
        """Boolean [Nq]: rows that attend no key (output 0, LSE -inf, or the sink's logit)."""
        return self.key_limit() <= self.key_start()

    # --- views in float64 (exact: every problem dtype embeds in float64) -----------------------
    def q64(self) -> np.ndarray:
        return self.q.astype(np.float64)

    def kv64(self) -> tuple[np.ndarray, np.ndarray]:
        """k and v in float64, expanded to H heads so that head h pairs with q's head h."""
        g = self.group_size
        return (np.repeat(self.k.astype(np.float64), g, axis=1),
                np.repeat(self.v.astype(np.float64), g, axis=1))

    # --- the kind protocol (fa_verify.kinds): what the one pipeline asks of every problem ---
    kind = "dense"
    #: how out and LSE are laid out, for messages
    out_label, lse_label = "[B,H,Nq,D_v]", "[B,H,Nq]"
    #: why a non-finite output is wrong (`backends.watch`)
    finite_because = FINITE_ATTENTION

    def outputs(self, precision) -> tuple:
        """What a run returns (`fa_verify.outputs`): out and the LSE (optional)."""
        return attention_outputs(self, precision)

    @property
    def lse_shape(self) -> tuple:
        return self.q.shape[:3]

    def input_arrays(self) -> dict:
        """The arrays a target is given, which must come back unchanged."""
        return {"q": self.q, "k": self.k, "v": self.v}

    def unsupported_by(self, backend) -> str | None:
        """Why `backend` cannot run this problem beyond its dtypes and kinds, or None."""
        return unsupported_features(backend.name, self, backend.features) or backend.limits.check(self)

    def saved(self, prefix: str = "") -> tuple[dict, dict]:
        """(parameters, arrays) that `from_saved` rebuilds it from bit for bit (bf16 as uint16
        bits: numpy has no bf16); the arrays' names start with `prefix`."""
        parameters = {"dtype": self.dtype, "causal": self.causal, "causal_alignment": self.causal_alignment,
                      "scale": self.scale, "tags": [list(t) for t in self.tags],
                      "window_size": list(self.window_size), "softcap": self.softcap}
        arrays = {name: getattr(self, name) for name in ("q", "k", "v")}
        if self.dtype == "bf16":
            arrays = {name: x.view(np.uint16) for name, x in arrays.items()}
        arrays.update({name: getattr(self, name) for name in _VARIANT_ARRAYS if getattr(self, name) is not None})
        return parameters, {prefix + name: x for name, x in arrays.items()}

    @classmethod
    def from_saved(cls, parameters: dict, arrays, prefix: str = "") -> "AttentionProblem":
        dtype = numpy_dtype(parameters["dtype"])
        q, k, v = (np.ascontiguousarray(arrays[prefix + name]).view(dtype) for name in ("q", "k", "v"))
        variant_arrays = {name: arrays[prefix + name] for name in _VARIANT_ARRAYS if prefix + name in arrays}
        return cls(q, k, v, causal=parameters["causal"], causal_alignment=parameters["causal_alignment"],
                   scale=parameters["scale"], tags=tuple(tuple(t) for t in parameters["tags"]),
                   window_size=tuple(parameters.get("window_size", NO_WINDOW)),
                   softcap=parameters.get("softcap", 0.0), **variant_arrays)

    def describe(self) -> str:
        """A one-line description for messages: shapes, dtype, masking, scale."""
        causal = f"causal={self.causal_alignment}" if self.causal else "causal=no"
        scale = "1/sqrt(D)" if self.scale is None else repr(self.scale)
        variants = {"window": f"window_size={self.window_size}", "softcap": f"softcap={self.softcap!r}",
                    "alibi": f"alibi_slopes={list(np.shape(self.alibi_slopes))}",
                    "sinks": f"sinks={list(np.shape(self.sinks))}"}
        dv = f" Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        return (f"B={self.batch} H={self.heads} Hkv={self.kv_heads} Nq={self.nq} Nk={self.nk} "
                f"D={self.head_dim}{dv} dtype={self.dtype} {causal} scale={scale}"
                + "".join(" " + variants[name] for name in self.features))


def used_features(window_size, softcap, alibi_slopes, sinks) -> tuple:
    """The variants (keys of FEATURES, in their order) that these parameters switch on."""
    used = {"window": tuple(window_size) != NO_WINDOW, "softcap": softcap > 0,
            "alibi": alibi_slopes is not None, "sinks": sinks is not None}
    return tuple(name for name in FEATURES if used[name])


def unsupported_features(name: str, problem: AttentionProblem, features) -> str | None:
    """Why a target implementing `features` cannot run `problem`, or None when it can."""
    missing = [f for f in problem.features if f not in features]
    if not missing:
        return None
    keywords = ", ".join(FEATURES[f] for f in missing)
    return (f"{name} does not implement {', '.join(missing)} (a callable takes it through the keyword "
            f"{keywords}); the problem uses it")


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


def _checked_window(window) -> tuple:
    """window_size as a tuple of two ints >= -1."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise InvalidArgumentTypeError(
            f"window_size={window!r} must be a pair (left, right) of integers >= -1, e.g. (128, 0) "
            "for a causal sliding window of 128 keys, or (-1, -1) for none") from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise InvalidArgumentTypeError(
                f"window_size={window!r}: {side}={value!r} must be an integer (-1 = unbounded)")
        if value < -1:
            raise InvalidProblemError(
                f"window_size={window!r}: {side}={value} is below -1; use -1 for no bound on that side "
                "or a number of keys >= 0")
    return int(left), int(right)


def _checked_softcap(softcap) -> float:
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise InvalidArgumentTypeError(f"softcap={softcap!r} must be a number (0 = no softcap)")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise InvalidProblemError(f"softcap={softcap!r} must be a finite number >= 0; pass 0 for no softcap")
    return float(softcap)


def _checked_vector(name: str, x, shapes: tuple, spelled: str) -> np.ndarray | None:
    """`x` (None, or float data of one of `shapes`) as a float32 array of finite values."""
    if x is None:
        return None
    values = _as_float64(name, x)
    if values.shape not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise InvalidProblemError(
            f"{name}.shape={list(values.shape)} must be {spelled} = {expected} for this problem")
    with np.errstate(over="ignore"):
        values = values.astype(np.float32)
    if not np.isfinite(values).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise InvalidProblemError(f"{name} holds a value that is not a finite float32 at index {where}")
    return values


def _as_float64(name: str, x) -> np.ndarray:
    """`x` as float64 values: a torch tensor (bf16 included, which numpy cannot read) through
    torch's own exact widening, anything else through numpy."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        if getattr(x, "is_meta", False):  # no values to read: .cpu() raises NotImplementedError
            raise InvalidArgumentError(f"{name}: a torch tensor on the meta device has no values; pass a tensor "
                                       "on the CPU (or any device whose values can be copied to it)")
        return x.detach().cpu().double().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{name}: a {type(x).__name__} cannot be read as float data ({exc}); pass a numpy "
            "array, a torch tensor or nested lists of numbers") from None
