"""Declared limits: the problems a target supports, in one place.

Real kernels support a few head dims, sequence lengths that are a multiple of their tile,
Nq = Nk only, MHA only, one dtype, causal only. `Limits` says so once; the CLI (`fa_verify check
--head-dims 64,128 --seq-multiple 64 ...`), the pytest plugin (`--fa-head-dims ...`), a TOML file
(`--limits FILE`) and the Python API (`CallableBackend(fn, limits=Limits(...))`) all build it
with `parse_limits`, so the options are spelled the same everywhere. The strategies draw within
the limits, fixed edge cases are moved to the nearest allowed shape (`adapt`), and
`Backend.supports` keeps `check` as the final gate.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace

from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES, dtype_name
from fa_verify.errors import InvalidArgumentError
from fa_verify.shape import Shape

#: --head-dims-v's value for a target that runs any D_v (v's head dim) with any D.
ANY_HEAD_DIM_V = "any"
#: Head layouts: Hkv == H, 1 < Hkv < H, Hkv == 1.
HEAD_LAYOUTS = ("mha", "gqa", "mqa")
#: --causal's values and the causal modes they allow.
CAUSAL_CHOICES = {"yes": (True,), "no": (False,), "both": (False, True)}
_YES_NO = {"yes": True, "no": False, "true": True, "false": False}


@dataclass(frozen=True)
class Limits:
    """What a target supports; the defaults allow everything fa_verify draws."""

    #: dtype names, or None: every dtype
    dtypes: tuple | None = None
    #: the head dims supported, or None: any
    head_dims: tuple | None = None
    #: the head dims of v (D_v) supported beside D_v = D: None (D_v = D only, what most kernels
    #: run), ANY_HEAD_DIM_V (any D_v, drawn independently of D), or the D_v values
    head_dims_v: tuple | str | None = None
    #: Nq and Nk are multiples of this
    seq_multiple: int = 1
    seq_min: int = 1
    #: None: no upper bound (the search's --max-seq still applies)
    seq_max: int | None = None
    #: Nq == Nk only
    equal_seq: bool = False
    #: allowed head layouts, a subset of HEAD_LAYOUTS
    heads: tuple = HEAD_LAYOUTS
    #: allowed group sizes H/Hkv (query heads per K/V head; 1 is MHA), or None: any. Declared as
    #: group sizes rather than Hkv values because that is what a GQA kernel specialises on (the
    #: query heads it packs per K/V head, a compile-time constant), whatever the model's H.
    group_sizes: tuple | None = None
    #: allowed causal modes: (False,), (True,) or both
    causal: tuple = (False, True)
    #: whether the target returns an LSE; None: probed with one tiny run
    lse: bool | None = None

    def __post_init__(self):
        """Values built directly are read as the options are (normalised: sorted, deduplicated),
        with the same messages: Limits(head_dims=(-1,)) is refused."""
        for option, (field, read, example, what) in LIMIT_OPTIONS.items():
            value = getattr(self, field)
            if value is None:
                continue
            if field == "causal":  # a field of modes, not the option's yes / no / both
                valid = isinstance(value, tuple) and value and set(value) <= {False, True}
                normalised = tuple(c for c in (False, True) if valid and c in value)
            else:
                try:
                    normalised, valid = read(value), True
                except (ValueError, KeyError, TypeError, InvalidArgumentError):
                    valid = False
            if not valid:
                raise InvalidArgumentError(f"Limits({field}={value!r}) is not valid: {what}; e.g. as the option "
                                           f"--{option} {example}")
            object.__setattr__(self, field, normalised)

    def head_dim_v_allowed(self, d: int, dv: int) -> bool:
        """Whether v's head dim `dv` is allowed with q's and k's `d`."""
        return dv == d or self.head_dims_v == ANY_HEAD_DIM_V or (
            self.head_dims_v is not None and dv in self.head_dims_v)

    @property
    def seq_lo(self) -> int:
        """The smallest allowed sequence length."""
        return self.seq_multiple * math.ceil(self.seq_min / self.seq_multiple)

    def seq_allowed(self, n: int) -> bool:
        return n % self.seq_multiple == 0 and n >= self.seq_min and (self.seq_max is None or n <= self.seq_max)

    def nearest_seq(self, n: int) -> int | None:
        """The allowed sequence length nearest to n (the larger on a tie), or None if none is."""
        m = self.seq_multiple
        candidates = [c for c in (m * (n // m), m * -(-n // m), self.seq_lo) if self.seq_allowed(c)]
        return min(candidates, key=lambda c: (abs(c - n), -c)) if candidates else None

    def check(self, problem) -> str | None:
        """None if `problem` is within the limits, else which limit it breaks and the option."""
        layout = "mha" if problem.kv_heads == problem.heads else "mqa" if problem.kv_heads == 1 else "gqa"
        breaks = [
            (self.dtypes is not None and problem.dtype not in self.dtypes, f"dtype={problem.dtype}", "--dtype"),
            (self.head_dims is not None and problem.head_dim not in self.head_dims, f"D={problem.head_dim}",
             "--head-dims"),
            (not self.head_dim_v_allowed(problem.head_dim, problem.head_dim_v),
             f"D_v={problem.head_dim_v} != D={problem.head_dim}", "--head-dims-v"),
            (not self.seq_allowed(problem.nq), f"Nq={problem.nq}", "--seq-multiple/--seq-min/--seq-max"),
            (not self.seq_allowed(problem.nk), f"Nk={problem.nk}", "--seq-multiple/--seq-min/--seq-max"),
            (self.equal_seq and problem.nq != problem.nk, f"Nq={problem.nq} != Nk={problem.nk}", "--equal-seq"),
            (layout not in self.heads, f"{layout.upper()} (H={problem.heads}, Hkv={problem.kv_heads})", "--heads"),
            (self.group_sizes is not None and problem.heads // problem.kv_heads not in self.group_sizes,
             f"H/Hkv={problem.heads // problem.kv_heads} (H={problem.heads}, Hkv={problem.kv_heads})",
             "--group-sizes"),
            (problem.causal not in self.causal, "causal" if problem.causal else "non-causal", "--causal"),
        ]
        broken = [f"{what} (declared by {option})" for bad, what, option in breaks if bad]
        return f"outside the declared limits ({self.describe()}): " + ", ".join(broken) if broken else None

    def adapt(self, shape):
        """`shape` moved to the nearest allowed one (Nq and Nk to the nearest allowed lengths, Nq to
        Nk's under equal_seq, D to the nearest allowed head dim, D_v to D where it is not allowed,
        Hkv to an allowed layout), or a string saying why it cannot be."""
        nk = self.nearest_seq(shape.nk)
        nq = nk if self.equal_seq else self.nearest_seq(shape.nq)
        if nq is None or nk is None:
            return f"no sequence length is allowed ({self.describe()})"
        d = shape.head_dim if self.head_dims is None else min(self.head_dims, key=lambda x: (abs(x - shape.head_dim), x))
        heads, kv_heads = _layout(shape.heads, shape.kv_heads, self.heads, self.group_sizes)
        dv = shape.head_dim_v if self.head_dim_v_allowed(d, shape.head_dim_v) else d
        return replace(shape, heads=heads, kv_heads=kv_heads, nq=nq, nk=nk, head_dim=d, head_dim_v=dv)

    def smallest_shape(self, head_dim: int | None = None):
        """The smallest shape within the limits (for probing a target)."""
        heads, kv_heads = _layout(1, 1, self.heads, self.group_sizes)
        d = head_dim or (self.head_dims[0] if self.head_dims else 8)
        return Shape(1, heads, kv_heads, self.seq_lo, self.seq_lo, d)

    @property
    def declared(self) -> bool:
        """Whether the limits narrow the shapes drawn (D_v widens them and narrows nothing)."""
        return replace(self, head_dims_v=None) != Limits()

    def describe_causal(self) -> str:
        return {(True,): "causal only", (False,): "non-causal only"}.get(self.causal, "causal and non-causal")

    def describe(self) -> str:
        """The limits in words, e.g. 'fp16; D in {64, 128}; N a multiple of 64; Nq = Nk; MHA; causal only'."""
        parts = []
        if self.dtypes is not None:
            parts.append(", ".join(self.dtypes))
        if self.head_dims is not None:
            parts.append("D in {" + ", ".join(map(str, self.head_dims)) + "}")
        if self.head_dims_v == ANY_HEAD_DIM_V:
            parts.append("any D_v")
        elif self.head_dims_v is not None:
            parts.append("D_v = D or in {" + ", ".join(map(str, self.head_dims_v)) + "}")
        if self.seq_multiple > 1:
            parts.append(f"N a multiple of {self.seq_multiple}")
        if self.seq_min > 1 or self.seq_max is not None:
            parts.append(f"{self.seq_min} <= N" + (f" <= {self.seq_max}" if self.seq_max is not None else ""))
        if self.equal_seq:
            parts.append("Nq = Nk")
        if self.heads != HEAD_LAYOUTS:
            parts.append(" or ".join(h.upper() for h in self.heads))
        if self.group_sizes is not None:
            parts.append("H/Hkv in {" + ", ".join(map(str, self.group_sizes)) + "}")
        if self.causal != (False, True):
            parts.append(self.describe_causal())
        if self.lse is not None:
            parts.append("returns an LSE" if self.lse else "no LSE")
        return "; ".join(parts) or "none declared"

    def as_dict(self) -> dict:
        """The limits as JSON values, keyed by their option names (what parse_limits reads)."""
        return {"dtype": list(self.dtypes) if self.dtypes else None,
                "head-dims": list(self.head_dims) if self.head_dims else None,
                "head-dims-v": (list(self.head_dims_v) if isinstance(self.head_dims_v, tuple)
                                else self.head_dims_v),
                "seq-multiple": self.seq_multiple, "seq-min": self.seq_min, "seq-max": self.seq_max,
                "equal-seq": self.equal_seq, "heads": list(self.heads),
                "group-sizes": list(self.group_sizes) if self.group_sizes else None,
                "causal": {v: k for k, v in CAUSAL_CHOICES.items()}[self.causal], "lse": self.lse}


def _layout(heads: int, kv_heads: int, allowed: tuple, group_sizes: tuple | None = None) -> tuple:
    """(H, Hkv) of an allowed layout and group size, as close to the given one as is simple
    (parse_limits makes sure that one exists)."""
    layout = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
    if layout in allowed and (group_sizes is None or heads // kv_heads in group_sizes):
        return heads, kv_heads
    if "mha" in allowed and (group_sizes is None or 1 in group_sizes):
        return heads, heads
    groups = [g for g in group_sizes or (max(heads, 2),) if g > 1]
    if "mqa" in allowed:
        return min(groups, key=lambda g: (abs(g - heads), g)), 1
    return 2 * (min(groups) if group_sizes else 2), 2


def _positive(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError
    n = int(value)
    if n < 1:
        raise ValueError
    return n


def _list(value) -> list:
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    items = [i.strip() if isinstance(i, str) else i for i in items]
    if not items or "" in items:
        raise ValueError
    return items


def yes_no(value) -> bool:
    if isinstance(value, bool):
        return value
    return _YES_NO[str(value).lower()]


def _dtypes(value) -> tuple:
    names = tuple(dict.fromkeys(dtype_name(d) for d in _list(value)))
    if not set(names) <= set(DTYPE_NAMES + FP8_DTYPES):
        raise ValueError
    return names


def _positive_set(value) -> tuple:
    return tuple(sorted({_positive(x) for x in _list(value)}))


def _head_dims_v(value):
    if isinstance(value, str) and value.strip().lower() == ANY_HEAD_DIM_V:
        return ANY_HEAD_DIM_V
    return _positive_set(value)


def _head_layouts(value) -> tuple:
    layouts = {str(v).lower() for v in _list(value)}
    if not layouts <= set(HEAD_LAYOUTS):
        raise ValueError
    return tuple(h for h in HEAD_LAYOUTS if h in layouts)


#: Each limit option: (the Limits field, how to read one value, an example, what it declares).
LIMIT_OPTIONS = {
    "dtype": ("dtypes", _dtypes, "fp16,bf16", "dtypes the target runs"),
    "head-dims": ("head_dims", _positive_set, "64,128",
                  "head dims D the target supports (comma-separated)"),
    "head-dims-v": ("head_dims_v", _head_dims_v, "128,512",
                    "head dims D_v of v and the output the target supports besides D_v = D (comma-separated), or "
                    "'any' (D_v drawn independently of D)"),
    "seq-multiple": ("seq_multiple", _positive, "64", "Nq and Nk must be multiples of this (the kernel's tile)"),
    "seq-min": ("seq_min", _positive, "16", "smallest Nq and Nk supported"),
    "seq-max": ("seq_max", _positive, "4096", "largest Nq and Nk supported"),
    "equal-seq": ("equal_seq", yes_no, "yes", "Nq = Nk only (yes/no)"),
    "heads": ("heads", _head_layouts, "mha,gqa", "head layouts supported: mha, gqa, mqa (comma-separated)"),
    "group-sizes": ("group_sizes", _positive_set, "1,2,4,8",
                    "group sizes H/Hkv supported (query heads per K/V head; 1 is MHA; comma-separated)"),
    "causal": ("causal", lambda v: CAUSAL_CHOICES[str(v).lower()], "yes", "causal only (yes), non-causal only "
               "(no) or both"),
    "lse": ("lse", yes_no, "no", "whether the target returns an LSE (default: probed)"),
}


def parse_limits(values: dict, prefix: str = "--", base: Limits | None = None) -> Limits:
    """Limits from option values (strings as typed, or TOML values), keyed by LIMIT_OPTIONS names
    (underscores allowed); None values are ignored. `prefix` names the options in errors
    ('--', '--fa-', 'limits.' for the API, '' for TOML keys). Raises InvalidArgumentError."""
    limits = replace(base or Limits(), **read_options(values, LIMIT_OPTIONS, prefix, "limit"))
    if limits.seq_max is not None and limits.seq_lo > limits.seq_max:
        raise InvalidArgumentError(
            f"{prefix}seq-min={limits.seq_min}, {prefix}seq-multiple={limits.seq_multiple} and "
            f"{prefix}seq-max={limits.seq_max} allow no sequence length; raise {prefix}seq-max")
    groups = limits.group_sizes
    if groups is not None and not ((1 in groups and "mha" in limits.heads)
                                   or (max(groups) > 1 and {"mqa", "gqa"} & set(limits.heads))):
        raise InvalidArgumentError(
            f"{prefix}heads={','.join(limits.heads)} and {prefix}group-sizes={','.join(map(str, groups))} allow no "
            f"head layout (MHA is group size 1, GQA and MQA larger ones); add to {prefix}group-sizes")
    return limits


def read_options(values: dict, options: dict, prefix: str, kind: str) -> dict:
    """Dataclass fields from option values keyed by the names of `options` (name -> (field, read,
    example, what it declares); underscores allowed; None values ignored), with errors that name
    the option (`prefix`), what it declares and an example. Limits and conventions share it."""
    fields = {}
    for key, value in values.items():
        option = str(key).replace("_", "-")
        if option not in options:
            raise InvalidArgumentError(
                f"{prefix}{option} is not a {kind}; {kind}s: {', '.join(prefix + o for o in options)}")
        if value is None:
            continue
        field, read, example, what = options[option]
        try:
            fields[field] = read(value)
        except (ValueError, KeyError, TypeError, InvalidArgumentError):
            raise InvalidArgumentError(
                f"{prefix}{option}={value!r} is not valid: {what}; e.g. "
                f"{prefix}{option}{' ' if prefix.startswith('-') else '='}{example}") from None
    return fields


def read_limits_file(path) -> dict:
    """The limit values of a TOML file (keys as the options, e.g. head-dims = [64, 128])."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read it ({exc.strerror}); give a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgumentError(f"not valid TOML ({exc}); e.g. head-dims = [64, 128]") from None


def limit_arguments(skip=()) -> dict:
    """argparse / pytest addoption keyword arguments of each limit option (and `limits`, the
    TOML file), by option name; the values stay strings for `parse_limits`."""
    arguments = {option: dict(default=None, help=f"declared limit: {what} (e.g. {example})")
                 for option, (_, _, example, what) in LIMIT_OPTIONS.items() if option not in skip}
    if "equal-seq" in arguments:  # a bare --equal-seq says yes
        arguments["equal-seq"].update(nargs="?", const="yes")
    arguments["limits"] = dict(default=None, metavar="FILE",
                               help="declared limits and conventions from a TOML file, keys as these "
                                    "options (head-dims = [64, 128], seq-multiple = 64, equal-seq = true, "
                                    "lse-base = 2, ...); options given on the command line win")
    return arguments


def limits_from_options(values: dict, limits_file=None, prefix: str = "--", other_keys=()) -> Limits:
    """Limits from a TOML file (if given) overridden by the option values given (None: not given).
    The file's keys in `other_keys` declare something else (the target builder passes the
    conventions' keys: one file declares both) and are left to their reader."""
    base = Limits()
    if limits_file is not None:
        try:
            declared = {k: v for k, v in read_limits_file(limits_file).items()
                        if str(k).replace("_", "-") not in other_keys}
            base = parse_limits(declared, prefix="")
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{prefix}limits {limits_file}: {exc}") from None
    return parse_limits(values, prefix, base)
