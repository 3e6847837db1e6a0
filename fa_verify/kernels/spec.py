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

`params` lists every kernel parameter in order: a buffer name (q, k, v, o, lse, or a scratch
buffer's), a struct's name, "null" (a null pointer) or an expression of NAMES
(fa_verify.kernels.expressions) whose value is passed as an `int` or, when it is a float, a `float`.

What a host does around the kernel is said too: `[scratch.NAME]` buffers it allocates and fills
(size an expression, dtype, fill), `o-fill` (the output zeroed before the launch), `[structs.NAME]`
arguments passed by value (fields with their C types; laid out by fa_verify.kernels.abi), and
`[[launch]]` tables for a host that launches several kernels in order, sharing the buffers. An
`entry` may name a template instantiation over any problem dimension (`attn<{Nk}, {D}, {T}>`):
one build per value drawn.
"""

from __future__ import annotations

import ast
import math
import re
import tomllib
from dataclasses import InitVar, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from fa_verify.conventions import Conventions, parse_conventions
from fa_verify.conventions import of as conventions_of
from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES, dtype_name, numpy_dtype
from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels import expressions
from fa_verify.kernels.abi import StructLayout
from fa_verify.limits import ANY_HEAD_DIM_V, Limits, parse_limits
from fa_verify.precision import PrecisionModel

#: The buffers a kernel may take, and their shapes' names.
BUFFERS = ("q", "k", "v", "o", "lse")
#: The descale buffers an FP8 kernel takes (float32; `fa_verify.fp8`): FlashAttention-3's
#: [B, Hkv] descales, or an FP8 KV cache's per-tensor k_scale / v_scale ([1]) for k and v.
DESCALE_BUFFERS = ("q_descale", "k_descale", "v_descale", "k_scale", "v_scale")
#: A null pointer in `params`.
NULL = "null"
LAYOUTS = ("bhsd", "bshd")
#: The C element type of each dtype, for {T} in `entry`.
C_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float", "e4m3": "__nv_fp8_e4m3",
           "e5m2": "__nv_fp8_e5m2"}
#: Names spec expressions may use (strides are in elements, of the layout's contiguous tensors;
#: Dv is v's and the output's head dim, D unless the limits declare head-dims-v).
NAMES = (
    "B", "H", "Hkv", "Nq", "Nk", "D", "Dv", "scale", "causal", "causal_offset", "group", "itemsize",
    *(f"{t}_stride_{axis}" for t in ("q", "k", "v", "o") for axis in ("b", "h", "n")),
    "lse_stride_b", "lse_stride_h",
)  # fmt: skip
#: Entry placeholders that are not expressions: the C element type and the dtype's name.
_ENTRY_TYPES = ("T", "dtype")
_ENTRY_FIELD = re.compile(r"\{([^{}]*)\}")
_CAUSAL_ALIGNMENTS = ("bottom-right", "top-left")
#: The single-launch keys; `[[launch]]` tables take the same ones.
LAUNCH_KEYS = ("entry", "params", "grid", "block", "shared_bytes", "shared_opt_in")
#: Element types of scratch buffers.
SCRATCH_DTYPES = ("fp32", "fp16", "bf16", "int32", "int64", "uint32")


@dataclass(frozen=True)
class Launch:
    """One kernel launch: entry (placeholders `{T}`, `{dtype}` or an expression such as `{Nk}`),
    params, grid and block (expressions), dynamic shared memory and the host's opt-in."""

    entry: str
    params: tuple
    grid: tuple
    block: tuple
    shared_bytes: object = 0
    shared_opt_in: object = False

    def entry_names(self) -> set:
        """The problem's names the entry's placeholders read."""
        return {n.id for f in _ENTRY_FIELD.findall(self.entry) if f.strip() not in _ENTRY_TYPES
                for n in ast.walk(expressions.parse(f, "entry", NAMES)) if isinstance(n, ast.Name)} - set(
            expressions.FUNCTIONS)

    def entry_for(self, values: dict, dtype: str) -> str:
        """The instantiation for a problem whose NAMES are `values` (only the names the entry reads are needed)."""

        def field(match):
            text = match.group(1).strip()
            if text in _ENTRY_TYPES:
                return C_TYPES[dtype] if text == "T" else dtype
            return str(expressions.evaluate(expressions.parse(text, "entry", NAMES), values, "entry"))

        return _ENTRY_FIELD.sub(field, self.entry)


@dataclass(frozen=True)
class Scratch:
    """A buffer the host allocates and fills before the first launch: `size` elements (an expression)."""

    size: object
    dtype: str
    fill: float | int

    def allocate(self, values: dict, where: str) -> np.ndarray:
        """The filled buffer for a problem whose NAMES are `values` (fp16/bf16 as their uint16 bits)."""
        size = expressions.evaluate(self.size, values, f"{where}.size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(f"{where}.size={ast.unparse(self.size)!r} gave {size!r}: an integer >= 1 "
                                       "(elements) is needed")
        buffer = np.full(size, self.fill, dtype=numpy_dtype(self.dtype) if self.dtype in DTYPE_NAMES else self.dtype)
        return buffer.view(np.uint16) if buffer.dtype.itemsize == 2 else buffer


def fill_value(value, where: str) -> float:
    """A fill: a number (TOML's inf, -inf and nan too) or one spelled as a string, e.g. '-inf'."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise InvalidArgumentError(f"{where}={value!r} must be a number or 'inf', '-inf', 'nan'")


@dataclass(frozen=True)
class KernelSpec:
    """How to launch one kernel of a CUDA file; the module docstring and the README give the format."""

    #: a single launch: its entry, params, grid, block, shared memory and opt-in (False: no opt-in,
    #: 48 KiB at most; True: the host opts in to what the launch asks; or the bytes, an expression,
    #: it passes to cudaFuncAttributeMaxDynamicSharedMemorySize). Or `launch` instead.
    entry: InitVar[str | None] = None
    params: InitVar[tuple | None] = None
    grid: InitVar[tuple | None] = None
    block: InitVar[tuple | None] = None
    shared_bytes: InitVar[object] = None
    shared_opt_in: InitVar[object] = None
    #: the launches in order (Launch objects or tables of the keys above); a single launch's keys fill it
    launch: tuple = ()
    #: name -> {size = expression (elements), dtype = "fp32", fill = 0 | "-inf" | "nan" | number}
    scratch: dict = field(default_factory=dict)
    #: name -> {fields = [[C name, C type, value], ...], align = n}: a struct passed by value
    structs: dict = field(default_factory=dict)
    #: what o holds before the first launch (the host zeroes it: 0); None: NaN, so an unwritten
    #: element is seen
    o_fill: object = None
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

    def __post_init__(self, entry, params, grid, block, shared_bytes, shared_opt_in):
        where = self.origin
        single = {k: v for k, v in zip(LAUNCH_KEYS, (entry, params, grid, block, shared_bytes, shared_opt_in))
                  if v is not None}
        if single and self.launch:
            raise InvalidArgumentError(f"{where}: {', '.join(k.replace('_', '-') for k in single)} and [[launch]] "
                                       "tables are both given: give one launch's keys, or a [[launch]] table per launch")
        launches = [single] if single else self.launch
        if isinstance(launches, (str, dict)) or not isinstance(launches, (list, tuple)) or not launches:
            raise InvalidArgumentError(f"{where}: entry, params, grid and block missing; a spec needs them, or a "
                                       "[[launch]] table with them per launch")
        object.__setattr__(self, "scratch", self._scratch())
        object.__setattr__(self, "structs", self._structs())
        object.__setattr__(self, "launch", tuple(self._launch(item, f"{where}: launch[{i}]." if len(launches) > 1
                                                                   or not single else f"{where}: ")
                                                 for i, item in enumerate(launches)))
        if self.o_fill is not None:
            object.__setattr__(self, "o_fill", fill_value(self.o_fill, f"{where}: o-fill"))
        missing = [b for b in ("q", "k", "v", "o") if not self._passes(b)]
        if missing:
            raise InvalidArgumentError(f"{where}: params has no {', '.join(missing)}: a kernel reads q, k, v and "
                                       "writes o")
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
        object.__setattr__(self, "types", self._types())
        if not isinstance(self.defines, dict) or not all(isinstance(k, str) for k in self.defines):
            raise InvalidArgumentError(f"{where}: defines={self.defines!r} must be a table NAME = value")
        if isinstance(self.include_dirs, str) or not all(isinstance(d, str) for d in self.include_dirs):
            raise InvalidArgumentError(f"{where}: include-dirs={self.include_dirs!r} must be a list of folders")
        object.__setattr__(self, "include_dirs", tuple(self.include_dirs))
        object.__setattr__(self, "limits", self._limits())
        self._check_descales()
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
        known = ({f.name for f in fields(cls)} | set(LAUNCH_KEYS)) - {"origin"}
        values = {}
        for key, value in table.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise InvalidArgumentError(f"{origin}: {key!r} is not a spec key; keys: "
                                           f"{', '.join(sorted(k.replace('_', '-') for k in known))}")
            values[name] = value
        missing = [k for k in ("entry", "params", "grid", "block") if k not in values]
        if missing and "launch" not in values:
            raise InvalidArgumentError(f"{origin}: {', '.join(missing)} missing; a spec needs entry, params, "
                                       "grid and block, or a [[launch]] table with them per launch")
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
        return self._passes("lse")

    def _passes(self, buffer: str) -> bool:
        """Whether some launch passes `buffer`, as a parameter or a struct's field."""
        return any(buffer in launch.params for launch in self.launch) or any(
            buffer in values for _, values in self.structs.values())

    @property
    def buffer_names(self) -> tuple:
        """What a pointer parameter may name: the problem's buffers (an FP8 kernel's descales
        too), the scratch buffers, null."""
        return (*BUFFERS, *DESCALE_BUFFERS, *self.scratch, NULL)

    @property
    def kinds(self) -> tuple:
        """The kind of problem the kernel runs: FP8 when its limits declare FP8 formats."""
        return ("fp8",) if set(self.limits.dtypes) <= set(FP8_DTYPES) else ("dense",)

    def descales_passed(self) -> dict:
        """{buffer name: the problem's descale it holds} of the descale buffers some launch passes:
        q_descale -> q_descale, k_scale -> k_descale (per tensor), ..."""
        return {b: f"{b[0]}_descale" for b in DESCALE_BUFFERS if self._passes(b)}

    def missing_entry(self, source_path) -> str | None:
        """Why some launch's entry names no kernel of the CUDA file at `source_path` (None: each does,
        or the file cannot be read here: building it will say why). Checked before anything is
        compiled, so a wrong name is a spec error, not hundreds of lines of compiler output."""
        try:
            source = Path(source_path).read_text(errors="replace")
        except OSError:
            return None
        for launch in self.launch:
            name = re.split(r"[<(\s]", launch.entry.strip(), maxsplit=1)[0]
            if re.search(rf"\b{re.escape(name)}\s*[(<]", source):
                continue
            kernels = sorted(set(re.findall(r"__global__[^;{(]*?\b(\w+)\s*\(", source)) - {"__launch_bounds__"})
            return (f"{self.origin}: entry={launch.entry!r} names no kernel of {source_path} (no {name}( or {name}< "
                    "in it)" + (f"; its __global__ functions: {', '.join(kernels)}" if kernels else ""))
        return None

    def instantiations(self) -> dict:
        """{entry: its Launch} of the entries known before any problem is drawn: those whose
        placeholders read only the head dims, for every dtype and (D, Dv) the limits allow (built
        together, once). An entry over another dimension, or over Dv drawn freely
        (head-dims-v = "any"), is instantiated per drawn value (`Launch.entry_for`)."""
        limits, found = self.limits, {}
        dims = [(d, dv) for d in limits.head_dims or (0,)
                for dv in dict.fromkeys((d, *(limits.head_dims_v if isinstance(limits.head_dims_v, tuple) else ())))]
        for launch in self.launch:
            if launch.entry_names() <= {"D", "Dv"} and not ("Dv" in launch.entry_names()
                                                           and limits.head_dims_v == ANY_HEAD_DIM_V):
                found.update({launch.entry_for({"D": d, "Dv": dv}, dtype): launch
                              for dtype in limits.dtypes for d, dv in dims})
        return found

    def signature(self, launch: Launch) -> list:
        """The parameter kinds of `launch`, as CpuKernelModule takes them (a StructLayout for a struct)."""
        sample = self.names(_SAMPLE_SHAPE, "fp16")
        kinds = []
        for param in launch.params:
            if param in self.structs:
                kinds.append(self.structs[param][0])
            elif isinstance(param, str):
                kinds.append("ptr")
            else:
                value = expressions.evaluate(param, sample, f"{self.origin}: params")
                kinds.append("float" if isinstance(value, float) else "int")
        return kinds

    def names(self, shape, dtype: str, causal: bool = False, scale: float | None = None,
              head_dim_v: int | None = None) -> dict:
        """The values of NAMES for a problem of `shape` (B, H, Hkv, Nq, Nk, D), v's head dim
        `head_dim_v` (default D) and `dtype`."""
        B, H, Hkv, Nq, Nk, D = shape
        Dv = D if head_dim_v is None else head_dim_v
        values = {"B": B, "H": H, "Hkv": Hkv, "Nq": Nq, "Nk": Nk, "D": D, "Dv": Dv,
                  "scale": 1.0 / math.sqrt(D) if scale is None else float(scale), "causal": int(bool(causal)),
                  "causal_offset": Nk - Nq if causal and self.causal_alignment == "bottom-right" else 0,
                  "group": H // Hkv, "itemsize": numpy_dtype(dtype).itemsize,
                  "lse_stride_b": H * Nq, "lse_stride_h": Nq}
        for tensor, heads, n, d in (("q", H, Nq, D), ("k", Hkv, Nk, D), ("v", Hkv, Nk, Dv), ("o", H, Nq, Dv)):
            strides = (heads * n * d, n * d, d) if self.layout == "bhsd" else (n * heads * d, d, heads * d)
            values.update({f"{tensor}_stride_{axis}": s for axis, s in zip("bhn", strides)})
        return values

    def uses(self, *names: str) -> bool:
        """Whether some scalar parameter, struct field or template argument reads one of `names`."""
        values = [p for launch in self.launch for p in launch.params] + [
            v for _, fields_ in self.structs.values() for v in fields_]
        used = {n.id for p in values if not isinstance(p, str) for n in ast.walk(p) if isinstance(n, ast.Name)}
        used |= {n for launch in self.launch for n in launch.entry_names()}
        return bool(used & set(names))

    # --- checks ---------------------------------------------------------------------------------
    def _launch(self, item, where: str) -> Launch:
        """One launch from a [[launch]] table (keys with '-' or '_') or a Launch, its expressions parsed."""
        if isinstance(item, Launch):
            item = {k: getattr(item, k) for k in LAUNCH_KEYS}
        if not isinstance(item, dict):
            raise InvalidArgumentError(f"{where.rstrip('. ')} must be a table of {', '.join(LAUNCH_KEYS)}")
        table = {str(k).replace("-", "_"): v for k, v in item.items()}
        unknown = sorted(set(table) - set(LAUNCH_KEYS))
        if unknown:
            raise InvalidArgumentError(f"{where}{unknown[0].replace('_', '-')}: not a launch key; keys: "
                                       f"{', '.join(k.replace('_', '-') for k in LAUNCH_KEYS)}")
        missing = [k for k in LAUNCH_KEYS[:4] if k not in table]
        if missing:
            raise InvalidArgumentError(f"{where}{', '.join(missing)} missing: each launch needs entry, params, grid "
                                       "and block")
        entry = table["entry"]
        if not isinstance(entry, str) or not entry.strip():
            raise InvalidArgumentError(f"{where}entry={entry!r} must name the kernel, e.g. "
                                       "'flash_fwd' or 'flash_fwd<{D}, 64, {T}>'")
        for text in _ENTRY_FIELD.findall(entry):
            if text.strip() not in _ENTRY_TYPES:
                expressions.parse(text, f"{where}entry={entry!r}: placeholder {{{text}}}", NAMES)
        opt_in = table.get("shared_opt_in", False)
        launch = Launch(entry=entry, params=self._parsed_params(table["params"], f"{where}params"),
                        grid=self._dims(f"{where}grid", table["grid"]),
                        block=self._dims(f"{where}block", table["block"]),
                        shared_bytes=expressions.parse(table.get("shared_bytes", 0), f"{where}shared-bytes", NAMES),
                        shared_opt_in=opt_in if isinstance(opt_in, bool)
                        else expressions.parse(opt_in, f"{where}shared-opt-in", NAMES))
        return launch

    def _parsed_params(self, params, where: str) -> tuple:
        if isinstance(params, (str, bytes)) or not isinstance(params, (list, tuple)) or not params:
            raise InvalidArgumentError(f"{where}={params!r} must list every kernel parameter in order, "
                                       "e.g. ['q', 'k', 'v', 'o', 'Nq', 'Nk', 'scale']")
        parsed = []
        for index, param in enumerate(params):
            if param in self.buffer_names or param in self.structs:
                if param in parsed and param != NULL:
                    raise InvalidArgumentError(f"{where}[{index}]={param!r} is listed twice")
                parsed.append(param)
            elif isinstance(param, str) and param.isidentifier() and param not in NAMES:
                descales = f"; an FP8 kernel's descales are {', '.join(DESCALE_BUFFERS)}" if "scale" in param else ""
                raise InvalidArgumentError(
                    f"{where}[{index}]={param!r} is no buffer ({', '.join((*BUFFERS, *self.scratch, NULL))}), struct "
                    f"or problem name: if the host allocates it, declare it: [scratch.{param}] size = ..., fill = ..."
                    + descales)
            else:
                parsed.append(expressions.parse(param, f"{where}[{index}]", NAMES))
        return tuple(parsed)

    def _dims(self, where: str, value) -> tuple:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not 1 <= len(items) <= 3:
            raise InvalidArgumentError(f"{where}={value!r} must be 1 to 3 expressions")
        return tuple(expressions.parse(item, f"{where}[{i}]", NAMES) for i, item in enumerate(items))

    def _tables(self, key: str, what: str):
        """(name, where, table) of each [KEY.NAME] table, its name checked."""
        tables = getattr(self, key)
        if not isinstance(tables, dict):
            raise InvalidArgumentError(f"{self.origin}: {key} must be tables [{key}.NAME] with {what}")
        for name, table in tables.items():
            if not isinstance(name, str) or not name.isidentifier() or name in (*BUFFERS, *DESCALE_BUFFERS, NULL,
                                                                                  *NAMES):
                raise InvalidArgumentError(f"{self.origin}: {key}.{name}: name it with an identifier that is not a "
                                           f"buffer ({', '.join(BUFFERS + DESCALE_BUFFERS)}), 'null' or a problem "
                                           "name")
            yield name, f"{self.origin}: {key}.{name}", table

    def _scratch(self) -> dict:
        parsed = {}
        for name, where, table in self._tables("scratch", "size, dtype, fill"):
            if isinstance(table, Scratch):
                table = {"size": table.size, "dtype": table.dtype, "fill": table.fill}
            if not isinstance(table, dict) or "size" not in table or set(table) - {"size", "dtype", "fill"}:
                raise InvalidArgumentError(f"{where} must be a table of size (elements, an expression), dtype and "
                                           "fill, e.g. {size = 'B * H * Nq', dtype = 'fp32', fill = '-inf'}")
            dtype = table.get("dtype", "fp32")
            if dtype not in SCRATCH_DTYPES:
                raise InvalidArgumentError(f"{where}.dtype={dtype!r}; use one of {', '.join(SCRATCH_DTYPES)}")
            fill = fill_value(table.get("fill", 0), f"{where}.fill")
            if dtype.startswith(("int", "uint")) and not float(fill).is_integer():
                raise InvalidArgumentError(f"{where}.fill={table.get('fill')!r} is not an integer, and dtype={dtype!r}")
            parsed[name] = Scratch(expressions.parse(table["size"], f"{where}.size", NAMES), dtype,
                                   int(fill) if dtype.startswith(("int", "uint")) else fill)
        return parsed

    def _structs(self) -> dict:
        """name -> (StructLayout, one value per field: a buffer name or a parsed expression)."""
        parsed = {}
        for name, where, table in self._tables("structs", "fields"):
            if name in self.scratch:
                raise InvalidArgumentError(f"{where}: a scratch buffer has that name too")
            if isinstance(table, tuple):  # already laid out
                parsed[name] = table
                continue
            rows = table.get("fields") if isinstance(table, dict) else None
            if not isinstance(rows, list) or not rows or set(table) - {"fields", "align"} or not all(
                    isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str)
                    for r in rows):
                raise InvalidArgumentError(f"{where} must be a table with fields = [[name, C type, value], ...] in "
                                           "declaration order, e.g. [['q', 'const half*', 'q'], ['n', 'int', 'Nq']]")
            layout = StructLayout.of([(r[0], r[1]) for r in rows], f"{where}.fields", table.get("align"))
            values = []
            for f, (field_name, _, value) in zip(layout.fields, rows):
                at = f"{where}.fields.{field_name}"
                if f.kind == "ptr":
                    if value not in self.buffer_names:
                        raise InvalidArgumentError(f"{at}={value!r}: a pointer field names a buffer "
                                                   f"({', '.join(self.buffer_names)})")
                    values.append(value)
                else:
                    values.append(expressions.parse(value, at, NAMES))
            parsed[name] = (layout, tuple(values))
        return parsed

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

    def _check_descales(self) -> None:
        """An FP8 spec (limits.dtype of FP8 formats only) passes a descale for each of q, k and v,
        and a spec of other dtypes passes none; o is written in bf16, the FP8 problem's output."""
        where, dtypes = self.origin, self.limits.dtypes
        fp8 = [d for d in dtypes if d in FP8_DTYPES]
        passed = list(self.descales_passed())
        if fp8 and len(fp8) < len(dtypes):
            others = ", ".join(d for d in dtypes if d not in fp8)
            raise InvalidArgumentError(
                f"{where}: limits.dtype={list(dtypes)!r} mixes FP8 formats with {others}: an FP8 kernel takes "
                "descales that a kernel of other dtypes does not; write one spec per kind")
        if passed and not fp8:
            raise InvalidArgumentError(
                f"{where}: params passes {passed[0]!r}, a descale of FP8 inputs, but limits.dtype={list(dtypes)!r}; "
                f"declare [limits] dtype = ['e4m3'] (or 'e5m2') for an FP8 kernel, or drop {passed[0]!r}")
        if not fp8:
            return
        for tensor in "qkv":
            names = [f"{tensor}_descale"] + ([f"{tensor}_scale"] if tensor != "q" else [])
            given = [n for n in names if n in passed]
            if len(given) > 1:
                raise InvalidArgumentError(f"{where}: params passes both {given[0]!r} and {given[1]!r}: one descale "
                                           f"per tensor; pass {given[0]!r} ([B, Hkv]) or {given[1]!r} (per tensor, "
                                           "[1])")
            if not given:
                shapes = "float32 [B, Hkv]" + (f", or {names[1]!r}: float32 [1], per tensor" if len(names) > 1 else "")
                raise InvalidArgumentError(
                    f"{where}: params has no {names[0]!r}: an FP8 kernel is given each descale (true value = stored "
                    f"value x descale); pass {names[0]!r} ({shapes}) in params or a struct's pointer field")
        written = self.types.get("o", "input")
        if written not in ("input", "bf16"):
            raise InvalidArgumentError(f"{where}: types.o={written!r}: an FP8 kernel's problems have a bf16 output "
                                       "(FlashAttention-3's); write o in bf16 (drop types.o or give 'bf16')")

    def _limits(self) -> Limits:
        where, limits = self.origin, self.limits
        if not isinstance(limits, Limits):
            raise InvalidArgumentError(f"{where}: limits must be a table of limit options ([limits])")
        if limits.dtypes is None:
            raise InvalidArgumentError(f"{where}: limits.dtype missing: declare the dtypes the kernel runs, "
                                       "e.g. [limits] dtype = ['fp16']")
        if any("D" in launch.entry_names() for launch in self.launch) and limits.head_dims is None:
            raise InvalidArgumentError(f"{where}: entry uses {{D}} but limits.head-dims is missing; declare the "
                                       "head dims it is instantiated for, e.g. head-dims = [64, 128]")
        if limits.head_dims_v is not None and not self.uses("Dv", "v_stride_b", "v_stride_h", "v_stride_n",
                                                            "o_stride_b", "o_stride_h", "o_stride_n"):
            raise InvalidArgumentError(f"{where}: limits.head-dims-v declares D_v != D but no parameter or entry "
                                       "reads Dv (or v's or o's strides), so the kernel cannot be told it: pass Dv "
                                       "(e.g. entry = 'attention<{T}, {D}, {Dv}>'), or drop head-dims-v")
        if not self.has_lse:
            limits = replace(limits, lse=False) if limits.lse is None else limits
            if limits.lse:
                raise InvalidArgumentError(f"{where}: limits.lse = true but params has no 'lse'")
        elif limits.lse is False:
            raise InvalidArgumentError(f"{where}: params passes 'lse' but limits.lse = false")
        else:
            limits = replace(limits, lse=True)
        # a kernel that is always causal needs no causal parameter: `causal = "yes"` declares it
        told = [(("causal", "causal_offset"), limits.causal == (False, True), "causal",
                 "causal = 'no' (never masked) or causal = 'yes' (always causal)"),
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
