"""Kernel specs: how to launch a published CUDA attention kernel, in one TOML table or object.

A spec says which kernel parameter is q, k, v, o, lse and each scalar, the entry (a kernel's
name or a template instantiation written as in C++), the launch as expressions of the problem,
and the kernel's declared limits. `fa_verify check kernel.cu --spec kernel.toml` reads the TOML
form; `KernelSpec(...)` / `KernelSpec.from_dict(...)` is the same spec in Python (TOML keys with
``-`` are the fields with ``_``). The complete format, with a worked example, is in the README
("Check your CUDA kernel without a GPU"). In short::

    entry = "flash_fwd<{D}, 64, {T}>"      # {D}: head dim, {T}: C element type, {dtype}: fp16/...
    params = ["q", "k", "v", "o", "lse", "Nq", "Nk", "H", "Hkv", "scale", "causal"]
    grid = ["cdiv(Nq, 64)", "H", "B"]
    block = 128
    shared-bytes = "(64 + 2 * 64) * D * itemsize"
    shared-opt-in = true                   # the host calls cudaFuncSetAttribute(MaxDynamicSharedMemorySize)
    layout = "bshd"                        # of q, k, v, o; lse is [B, H, Nq] float32
    [limits]                               # fa_verify.limits' options, as in --limits FILE
    dtype = ["fp16"]
    head-dims = [64, 128]
    [conventions]                          # fa_verify.conventions' options, e.g. a base-2 LSE
    lse-base = 2

`params` lists every kernel parameter in order: a buffer name (q, k, v, o, lse), "null" (a null
pointer) or an expression of NAMES (fa_verify.kernels.expressions) whose value is passed as an
`int` or, when it is a float, a `float`.
"""

from __future__ import annotations

import math
import re
import string
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from fa_verify.conventions import Conventions, parse_conventions
from fa_verify.conventions import of as conventions_of
from fa_verify.dtypes import DTYPE_NAMES, dtype_name
from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels import expressions
from fa_verify.limits import Limits, parse_limits
from fa_verify.precision import PrecisionModel

#: The buffers a kernel may take, and their shapes' names.
BUFFERS = ("q", "k", "v", "o", "lse")
#: A null pointer in `params`.
NULL = "null"
LAYOUTS = ("bhsd", "bshd")
#: The C element type of each dtype, for {T} in `entry`.
C_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}
#: Names spec expressions may use (strides are in elements, of the layout's contiguous tensors).
NAMES = (
    "B", "H", "Hkv", "Nq", "Nk", "D", "scale", "causal", "causal_offset", "group", "itemsize",
    *(f"{t}_stride_{axis}" for t in ("q", "k", "v", "o") for axis in ("b", "h", "n")),
    "lse_stride_b", "lse_stride_h",
)  # fmt: skip
_ENTRY_FIELDS = ("D", "T", "dtype")
_CAUSAL_ALIGNMENTS = ("bottom-right", "top-left")


@dataclass(frozen=True)
class KernelSpec:
    """How to launch one kernel of a CUDA file; the module docstring and the README give the format."""

    entry: str
    params: tuple
    grid: tuple
    block: tuple
    shared_bytes: object = 0
    #: False: no opt-in (48 KiB at most); True: the host opts in to what the launch asks; or the
    #: bytes (an expression) it passes to cudaFuncAttributeMaxDynamicSharedMemorySize
    shared_opt_in: object = False
    layout: str = "bhsd"
    #: element type per buffer: "input" (the problem's dtype) or a dtype; q, k, v may only widen
    types: dict = field(default_factory=dict)
    defines: dict = field(default_factory=dict)
    include_dirs: tuple = ()
    arch: str = "sm_80"
    causal_alignment: str = "bottom-right"
    #: precision model preset or spec (fa_verify.precision), FlashAttention's by default
    precision: str = "flash"
    limits: Limits = Limits()
    #: where its outputs differ from fa_verify's conventions on purpose (a [conventions] table)
    conventions: Conventions = Conventions()
    #: the backend's name (default: the .cu file's stem)
    name: str | None = None
    #: the .cu file, relative to the spec file (the command line may give it instead)
    source: str | None = None
    #: a table's own name in messages, e.g. "kernel.toml"
    origin: str = field(default="spec", compare=False)

    def __post_init__(self):
        where = self.origin
        if not isinstance(self.entry, str) or not self.entry.strip():
            raise InvalidArgumentError(f"{where}: entry={self.entry!r} must name the kernel, e.g. "
                                       "'flash_fwd' or 'flash_fwd<{D}, 64, {T}>'")
        fields_used = {f for _, f, _, _ in string.Formatter().parse(self.entry) if f is not None}
        if not fields_used <= set(_ENTRY_FIELDS):
            raise InvalidArgumentError(f"{where}: entry={self.entry!r} uses {sorted(fields_used - set(_ENTRY_FIELDS))}; "
                                       f"placeholders: {{D}}, {{T}}, {{dtype}}")
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"{where}: layout={self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.causal_alignment not in _CAUSAL_ALIGNMENTS:
            raise InvalidArgumentError(f"{where}: causal-alignment={self.causal_alignment!r}; use one of "
                                       f"{', '.join(_CAUSAL_ALIGNMENTS)}")
        arch = self.arch.removeprefix("sm_") if isinstance(self.arch, str) else ""
        if not arch.isdigit():
            raise InvalidArgumentError(f"{where}: arch={self.arch!r}; give it as 'sm_80', 'sm_90', ...")
        from fa_verify.cuda_cpu._shared_limits import arch_maximum

        try:
            arch_maximum(int(arch))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
        object.__setattr__(self, "params", self._parsed_params())
        object.__setattr__(self, "grid", self._dims("grid", self.grid))
        object.__setattr__(self, "block", self._dims("block", self.block))
        object.__setattr__(self, "shared_bytes", expressions.parse(self.shared_bytes, f"{where}: shared-bytes", NAMES))
        if not isinstance(self.shared_opt_in, bool):
            object.__setattr__(self, "shared_opt_in",
                               expressions.parse(self.shared_opt_in, f"{where}: shared-opt-in", NAMES))
        object.__setattr__(self, "types", self._types())
        if not isinstance(self.defines, dict) or not all(isinstance(k, str) for k in self.defines):
            raise InvalidArgumentError(f"{where}: defines={self.defines!r} must be a table NAME = value")
        if isinstance(self.include_dirs, str) or not all(isinstance(d, str) for d in self.include_dirs):
            raise InvalidArgumentError(f"{where}: include-dirs={self.include_dirs!r} must be a list of folders")
        object.__setattr__(self, "include_dirs", tuple(self.include_dirs))
        object.__setattr__(self, "limits", self._limits())
        object.__setattr__(self, "conventions", conventions_of(self.conventions))
        for dtype in self.limits.dtypes:  # a bad precision is a spec error now, not at the first run
            try:
                PrecisionModel.parse(self.precision, dtype)
            except (InvalidArgumentError, AttributeError, TypeError) as exc:
                raise InvalidArgumentError(f"{where}: precision={self.precision!r}: {exc}") from None

    # --- reading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, table: dict, origin: str = "spec") -> "KernelSpec":
        """A spec from a TOML-shaped table (keys with '-' or '_'); unknown keys are errors."""
        known = {f.name for f in fields(cls)} - {"origin"}
        values = {}
        for key, value in table.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise InvalidArgumentError(f"{origin}: {key!r} is not a spec key; keys: "
                                           f"{', '.join(sorted(k.replace('_', '-') for k in known))}")
            values[name] = value
        missing = [k for k in ("entry", "params", "grid", "block") if k not in values]
        if missing:
            raise InvalidArgumentError(f"{origin}: {', '.join(missing)} missing; a spec needs entry, params, "
                                       "grid and block")
        if "limits" in values:
            if not isinstance(values["limits"], dict):
                raise InvalidArgumentError(f"{origin}: limits must be a table ([limits])")
            values["limits"] = parse_limits(values["limits"], prefix=f"{origin}: limits.")
        if "conventions" in values:
            if not isinstance(values["conventions"], dict):
                raise InvalidArgumentError(f"{origin}: conventions must be a table ([conventions])")
            values["conventions"] = parse_conventions(values["conventions"], prefix=f"{origin}: conventions.")
        return cls(**values, origin=origin)

    @classmethod
    def from_toml(cls, path) -> "KernelSpec":
        path = Path(path)
        try:
            with open(path, "rb") as file:
                table = tomllib.load(file)
        except OSError as exc:
            raise InvalidArgumentError(f"--spec {path}: cannot read it ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgumentError(f"--spec {path}: not valid TOML ({exc})") from None
        spec = cls.from_dict(table, origin=str(path))
        base = path.resolve().parent  # relative paths in a spec are relative to the spec file
        return replace(spec, source=str(base / spec.source) if spec.source else None,
                       include_dirs=tuple(str(base / d) for d in spec.include_dirs))

    # --- what it says ---------------------------------------------------------------------------
    @property
    def arch_number(self) -> int:
        return int(self.arch.removeprefix("sm_"))

    @property
    def has_lse(self) -> bool:
        return "lse" in self.params

    def missing_entry(self, source_path) -> str | None:
        """Why `entry` names no kernel of the CUDA file at `source_path` (None: it does, or the file
        cannot be read here: building it will say why). Checked before anything is compiled, so a
        wrong name is a spec error, not hundreds of lines of compiler output."""
        try:
            source = Path(source_path).read_text(errors="replace")
        except OSError:
            return None
        name = re.split(r"[<(\s]", self.entry.strip(), maxsplit=1)[0]
        if re.search(rf"\b{re.escape(name)}\s*[(<]", source):
            return None
        kernels = sorted(set(re.findall(r"__global__[^;{(]*?\b(\w+)\s*\(", source)) - {"__launch_bounds__"})
        return (f"{self.origin}: entry={self.entry!r} names no kernel of {source_path} (no {name}( or {name}< in it)"
                + (f"; its __global__ functions: {', '.join(kernels)}" if kernels else ""))

    def entry_for(self, dtype: str, head_dim: int) -> str:
        return self.entry.format(D=head_dim, T=C_TYPES[dtype], dtype=dtype)

    def entries(self) -> list[tuple[str, int]]:
        """(dtype, D) of every instantiation the limits allow (D None when entry has no {D})."""
        dims = self.limits.head_dims if "{D}" in self.entry else (None,)
        return [(dtype, d) for dtype in self.limits.dtypes for d in dims]

    def signature(self) -> list[str]:
        """The parameter kinds, as CpuKernelModule takes them."""
        sample = self.names(_SAMPLE_SHAPE, "fp16")
        kinds = []
        for param in self.params:
            if param in BUFFERS or param == NULL:
                kinds.append("ptr")
            else:
                value = expressions.evaluate(param, sample, f"{self.origin}: params")
                kinds.append("float" if isinstance(value, float) else "int")
        return kinds

    def names(self, shape, dtype: str, causal: bool = False, scale: float | None = None) -> dict:
        """The values of NAMES for a problem of `shape` (B, H, Hkv, Nq, Nk, D) and `dtype`."""
        B, H, Hkv, Nq, Nk, D = shape
        values = {"B": B, "H": H, "Hkv": Hkv, "Nq": Nq, "Nk": Nk, "D": D,
                  "scale": 1.0 / math.sqrt(D) if scale is None else float(scale), "causal": int(bool(causal)),
                  "causal_offset": Nk - Nq if causal and self.causal_alignment == "bottom-right" else 0,
                  "group": H // Hkv, "itemsize": 4 if dtype == "fp32" else 2,
                  "lse_stride_b": H * Nq, "lse_stride_h": Nq}
        for tensor, heads, n in (("q", H, Nq), ("k", Hkv, Nk), ("v", Hkv, Nk), ("o", H, Nq)):
            strides = (heads * n * D, n * D, D) if self.layout == "bhsd" else (n * heads * D, D, heads * D)
            values.update({f"{tensor}_stride_{axis}": s for axis, s in zip("bhn", strides)})
        return values

    def uses(self, *names: str) -> bool:
        """Whether some scalar parameter's expression reads one of `names`."""
        import ast

        used = {n.id for p in self.params if not isinstance(p, str) for n in ast.walk(p) if isinstance(n, ast.Name)}
        return bool(used & set(names))

    # --- checks ---------------------------------------------------------------------------------
    def _parsed_params(self) -> tuple:
        where = f"{self.origin}: params"
        if isinstance(self.params, (str, bytes)) or not isinstance(self.params, (list, tuple)) or not self.params:
            raise InvalidArgumentError(f"{where}={self.params!r} must list every kernel parameter in order, "
                                       "e.g. ['q', 'k', 'v', 'o', 'Nq', 'Nk', 'scale']")
        parsed = []
        for index, param in enumerate(self.params):
            if param in BUFFERS or param == NULL:
                if param in parsed:
                    raise InvalidArgumentError(f"{where}[{index}]={param!r} is listed twice")
                parsed.append(param)
            else:
                parsed.append(expressions.parse(param, f"{where}[{index}]", NAMES))
        missing = [b for b in ("q", "k", "v", "o") if b not in parsed]
        if missing:
            raise InvalidArgumentError(f"{where} has no {', '.join(missing)}: a kernel reads q, k, v and writes o")
        return tuple(parsed)

    def _dims(self, key: str, value) -> tuple:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not 1 <= len(items) <= 3:
            raise InvalidArgumentError(f"{self.origin}: {key}={value!r} must be 1 to 3 expressions")
        return tuple(expressions.parse(item, f"{self.origin}: {key}[{i}]", NAMES) for i, item in enumerate(items))

    def _types(self) -> dict:
        where = f"{self.origin}: types"
        if not isinstance(self.types, dict):
            raise InvalidArgumentError(f"{where} must be a table such as {{o = 'fp32'}}")
        types = {}
        for name, value in self.types.items():
            if name not in BUFFERS:
                raise InvalidArgumentError(f"{where}.{name}: not a buffer; buffers: {', '.join(BUFFERS)}")
            if name == "lse" and value != "fp32":
                raise InvalidArgumentError(f"{where}.lse={value!r}: the LSE is float32 ('fp32')")
            if value != "input":
                try:
                    value = dtype_name(value)
                except InvalidArgumentError:
                    value = None
                if value not in DTYPE_NAMES:
                    raise InvalidArgumentError(f"{where}.{name}={self.types[name]!r}; use 'input' or one of "
                                               f"{', '.join(DTYPE_NAMES)}")
            types[name] = value
        return types

    def _limits(self) -> Limits:
        where, limits = self.origin, self.limits
        if not isinstance(limits, Limits):
            raise InvalidArgumentError(f"{where}: limits must be a table of limit options ([limits])")
        if limits.dtypes is None:
            raise InvalidArgumentError(f"{where}: limits.dtype missing: declare the dtypes the kernel runs, "
                                       "e.g. [limits] dtype = ['fp16']")
        if "{D}" in self.entry and limits.head_dims is None:
            raise InvalidArgumentError(f"{where}: entry uses {{D}} but limits.head-dims is missing; declare the "
                                       "head dims it is instantiated for, e.g. head-dims = [64, 128]")
        if limits.head_dims_v is not None:  # the expressions and instantiations name one D
            raise InvalidArgumentError(f"{where}: limits.head-dims-v is not supported in a kernel spec yet (its "
                                       "expressions and {D} name one head dim for q, k and v); drop it")
        if not self.has_lse:
            limits = replace(limits, lse=False) if limits.lse is None else limits
            if limits.lse:
                raise InvalidArgumentError(f"{where}: limits.lse = true but params has no 'lse'")
        elif limits.lse is False:
            raise InvalidArgumentError(f"{where}: params passes 'lse' but limits.lse = false")
        else:
            limits = replace(limits, lse=True)
        told = [(("causal", "causal_offset"), limits.causal != (False,), "causal", "causal = 'no'"),
                (("Hkv", "group", "k_stride_b", "k_stride_h", "v_stride_b", "v_stride_h"),
                 limits.heads != ("mha",), "Hkv", "heads = 'mha'"),
                (("Nk", "k_stride_b", "k_stride_h", "v_stride_b", "v_stride_h", "causal_offset"),
                 not limits.equal_seq, "Nk", "equal-seq = true")]
        for names, allowed, what, declare in told:
            if allowed and not self.uses(*names):
                raise InvalidArgumentError(
                    f"{where}: no parameter passes {what} (params use none of {', '.join(names)}), so the kernel "
                    f"cannot be told it: pass it in params, or declare [limits] {declare}")
        return limits


_SAMPLE_SHAPE = (1, 2, 1, 16, 16, 64)
