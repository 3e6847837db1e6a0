"""A published CUDA kernel file, launched on the CUDA-on-CPU runner as its kernel spec says.

`SpecKernelBackend(path, spec)` builds the file as published (its host code set aside: see
fa_verify.cuda_cpu._host_code) with one launcher per instantiation the spec's limits allow,
and runs each problem the way the spec describes: q, k, v in the spec's layout and element
types, o and lse in NaN-filled guarded buffers (an element left unwritten or written out of
bounds is reported; o filled as `o-fill` says when the host fills it), the scratch buffers
allocated and filled, then each launch in order — grid, block and dynamic shared memory evaluated
from the problem, the 48 KiB default and the arch's maximum held to the spec's opt-in as a GPU
would, struct arguments field by field — all sharing those buffers. `plan` is what both runners
launch; only `_run_plan` differs (fa_verify.backends.spec_pycuda).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fa_verify.backends.base import Backend, parse_precision
from fa_verify.backends.buffers import GuardedOutput, check_written
from fa_verify.backends.cuda_kernels import _bits, cpu_runner_availability
from fa_verify.dtypes import numpy_dtype
from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels import expressions, geometry
from fa_verify.kernels.spec import NULL, KernelSpec
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem


class SpecKernelBackend(Backend):
    """The kernels of `source` (a .cu file) as `spec` (a KernelSpec, or a TOML path) launches them."""

    #: where the launches run, in messages
    runs_on = "the CUDA-on-CPU runner"

    def __init__(self, source, spec: KernelSpec | str | os.PathLike, sanitize: bool = False):
        self.spec = spec if isinstance(spec, KernelSpec) else KernelSpec.from_toml(spec)
        source = source if source is not None else self.spec.source
        if source is None or not Path(source).is_file():
            raise InvalidArgumentError(f"source={str(source)!r} is not a .cu file (give the kernel file, or "
                                       "source = 'kernel.cu' in the spec)")
        self.source = Path(source)
        self.sanitize = sanitize
        self.name = (self.spec.name or self.source.stem) + ("-asan" if sanitize else "")
        self.limits = self.spec.limits
        self.judged_under = self.spec.conventions
        self.dtypes = self.limits.dtypes
        self.kinds = self.spec.kinds
        self.notes = f"{self.source.name} launched by its kernel spec on the CUDA-on-CPU runner ({self.spec.arch})"
        self._modules: dict = {}  # (racecheck, entry or None) -> CpuKernelModule
        self._sanitized = None
        self._lock = threading.Lock()

    def availability(self):
        return cpu_runner_availability()

    def precision(self, dtype) -> PrecisionModel:
        model = self.judged_under.precision(parse_precision(self.spec.precision, dtype))
        written = self.spec.types.get("o", "input")
        return model if written == "input" else replace(model, output=written)

    def supports(self, problem: AttentionProblem) -> str | None:
        reason = super().supports(problem)
        if reason is None and problem.scale is not None and not self.spec.uses("scale"):
            reason = (f"{self.name} takes no scale (no parameter uses 'scale'): it can only compute "
                      f"1/sqrt(D), not scale={problem.scale!r}")
        if reason is None and problem.causal and problem.nq != problem.nk \
                and problem.causal_alignment != self.spec.causal_alignment:
            reason = (f"{self.name} implements {self.spec.causal_alignment} causal masking; the problem needs "
                      f"{problem.causal_alignment}")
        for buffer, descale in self.spec.descales_passed().items():
            if reason is None and buffer.endswith("_scale") and getattr(problem, descale).size != 1:
                reason = (f"{self.name} takes {buffer} (one descale per tensor): the problem's {descale} is per "
                          f"(batch, kv head), shape {list(getattr(problem, descale).shape)}")
        return reason

    def sanitized(self) -> "SpecKernelBackend":
        """The same kernels built with AddressSanitizer (the address_sanitizer property's twin)."""
        with self._lock:
            if self._sanitized is None:
                self._sanitized = self if self.sanitize else SpecKernelBackend(self.source, self.spec, sanitize=True)
            return self._sanitized

    def module(self, racecheck: bool = False, launch: "SpecLaunch | None" = None):
        """The kernel module that runs `launch` (default: the module of the instantiations known
        before any problem is drawn, built together), or its race detector build. Each is built
        once; an entry over a drawn dimension gets a module of its own, one build per value (the
        runner caches builds across runs too)."""
        from fa_verify.cuda_cpu import CpuKernelModule

        static = self.spec.instantiations()
        key = (racecheck, None if launch is None or launch.entry in static else launch.entry)
        with self._lock:
            if key not in self._modules:
                entries = ({launch.entry: launch.signature} if key[1] else
                           {entry: self.spec.signature(of) for entry, of in static.items()})
                self._modules[key] = CpuKernelModule(
                    self.source, entries, include_dirs=self.spec.include_dirs, defines=self.spec.defines,
                    sanitize=self.sanitize and not racecheck, racecheck=racecheck, arch=self.spec.arch_number,
                    set_aside_host_code=True)
            return self._modules[key]

    def build(self):
        """Build (or fetch) the kernel module of the instantiations known before a problem is drawn
        (None when every entry is over a drawn dimension: those build at their first run)."""
        return self.module() if self.spec.instantiations() else None

    def run_racecheck(self, problem: AttentionProblem) -> None:
        """`races`' hook: run `problem` on the race detector's build; raises KernelRaceError."""
        self._launch(problem, self._inputs(problem), racecheck=True)

    def _run(self, problem: AttentionProblem):
        return self._launch(problem, self._inputs(problem))

    def run_padded(self, padded):
        """`nan_padding`'s hook: q, k, v are passed at their offsets inside NaN-filled buffers."""
        from fa_verify.cuda_cpu import Inside

        if self.spec.layout != "bhsd" or any(self.spec.types.get(t, "input") != "input" for t in "qkv"):
            raw = self._inputs(padded.problem)  # converted copies: the worker's NaN guards still surround them
        else:
            raw = [Inside(_bits(buffer), offset) for buffer, offset in zip(padded.buffers, padded.offsets)]
        return self._launch(padded.problem, raw)

    # --- a problem's launches ---------------------------------------------------------------------------
    def _inputs(self, problem: AttentionProblem) -> list:
        arrays = []
        for name, x in zip("qkv", (problem.q, problem.k, problem.v)):
            wanted = self.spec.types.get(name, "input")
            if wanted != "input":
                if numpy_dtype(wanted).itemsize < x.dtype.itemsize:
                    raise InvalidArgumentError(f"{self.spec.origin}: types.{name}={wanted!r} is narrower than the "
                                               f"problem's {problem.dtype}: inputs are passed exactly or not at all")
                x = x.astype(numpy_dtype(wanted))
            arrays.append(_bits(_layout(x, self.spec.layout)))
        return arrays

    def _descales(self, problem) -> dict:
        """The descale buffers the spec passes, float32: q_descale, k_descale, v_descale as
        [B, Hkv] (a per-tensor descale repeated), k_scale and v_scale as the one value ([1])."""
        return {buffer: np.ascontiguousarray(getattr(problem, descale) if buffer.endswith("_scale")
                                             else problem.descale(descale), dtype=np.float32)
                for buffer, descale in self.spec.descales_passed().items()}

    def _launch(self, problem: AttentionProblem, inputs: list, racecheck: bool = False):
        plan = self.plan(problem)
        o = GuardedOutput.allocate("o", plan.o_shape, plan.o_dtype)
        if self.spec.o_fill is not None:  # the host fills o before the first launch
            o.view[...] = self.spec.o_fill
        lse = GuardedOutput.allocate("lse", plan.lse_shape, np.float32) if plan.lse_shape else None
        self._run_plan(plan, {**dict(zip("qkv", inputs)), **self._descales(problem)}, o, lse, racecheck)
        check_written(f"{self.name} on {self.runs_on}", *(b for b in (o, lse) if b is not None))
        return self.output(o.view), (lse.view if lse is not None else None)

    def _run_plan(self, plan: "SpecPlan", inputs: dict, o: GuardedOutput, lse, racecheck: bool) -> None:
        """Every launch of `plan` in order on the CPU runner, all sharing the same buffers."""
        from fa_verify.cuda_cpu import Inside

        buffers = {**inputs, "o": Inside(_bits(o.buffer), o.offset), "lse": lse and Inside(lse.buffer, lse.offset),
                   NULL: None, **plan.scratch}
        for launch in plan.launches:
            self.module(racecheck, launch).launch(launch.entry, launch.grid, launch.block, launch.shared_bytes,
                                                  launch.arguments(buffers), shared_opt_in=launch.opt_in,
                                                  arg_names=launch.names)

    def output(self, o: np.ndarray) -> np.ndarray:
        """The kernel's o as [B, H, Nq, D]."""
        return o if self.spec.layout == "bhsd" else np.ascontiguousarray(o.transpose(0, 2, 1, 3))

    def plan(self, problem: AttentionProblem) -> "SpecPlan":
        """What the spec does for `problem`: its scratch buffers, filled, and each launch's entry, grid,
        block, shared memory and arguments; the outputs' shapes."""
        spec = self.spec
        B, H, Nq, Dv = problem.out_shape
        values = spec.names((B, H, problem.kv_heads, Nq, problem.nk, problem.head_dim), problem.dtype,
                            causal=problem.causal, scale=problem.scale_value, head_dim_v=Dv)
        return SpecPlan(
            launches=[self._planned(launch, values, problem.dtype) for launch in spec.launch],
            scratch={name: s.allocate(values, f"{spec.origin}: scratch.{name}") for name, s in spec.scratch.items()},
            o_shape=(B, Nq, H, Dv) if spec.layout == "bshd" else (B, H, Nq, Dv),
            o_dtype=numpy_dtype(self.precision(problem.dtype).output),
            lse_shape=(B, H, Nq) if spec.has_lse else None)

    def _planned(self, launch, values: dict, dtype: str) -> "SpecLaunch":
        spec = self.spec
        origin = spec.origin + (f": launch[{spec.launch.index(launch)}]" if len(spec.launch) > 1 else "")

        def scalar(tree, key):
            return expressions.evaluate(tree, values, f"{origin}: {key}")

        def argument(param):
            if param in spec.structs:
                layout, fields = spec.structs[param]
                return [v if isinstance(v, str) else scalar(v, f"structs.{param}.fields.{f.name}")
                        for f, v in zip(layout.fields, fields)]
            return param if isinstance(param, str) else scalar(param, "params")

        shared = self._dimension(launch.shared_bytes, values, origin, "shared-bytes")
        block = [self._dimension(e, values, origin, "block", i) for i, e in enumerate(launch.block)]
        geometry.check_threads(block, values)
        return SpecLaunch(
            entry=launch.entry_for(values, dtype),
            grid=[self._dimension(e, values, origin, "grid", i) for i, e in enumerate(launch.grid)],
            block=block,
            shared_bytes=shared,
            opt_in=(shared if launch.shared_opt_in is True else None if launch.shared_opt_in is False
                    else self._dimension(launch.shared_opt_in, values, origin, "shared-opt-in")),
            signature=spec.signature(launch),
            args=[argument(p) for p in launch.params],
            names=[str(p) for p in launch.params])

    @staticmethod
    def _dimension(tree, values, origin: str, key: str, index: int = 0) -> int:
        value = expressions.evaluate(tree, values, f"{origin}: {key}")
        return geometry.dimension(tree, value, key, index, values, origin)


@dataclass
class SpecLaunch:
    """One launch as the spec describes it; `args` holds buffer names (str), evaluated scalars and,
    for a struct, a list of its fields' values (the shape pycuda_runner.run_launches takes)."""

    entry: str
    grid: list
    block: list
    shared_bytes: int
    opt_in: int | None
    signature: list
    args: list
    #: what each parameter is in the spec ("q", "l", "null", a struct's name), for messages
    names: list

    def arguments(self, buffers: dict) -> list:
        """The kernel's arguments, each buffer name replaced by `buffers[name]` (in structs too)."""
        def one(value):
            return buffers[value] if isinstance(value, str) else value

        return [[one(v) for v in a] if isinstance(a, list) else one(a) for a in self.args]


@dataclass
class SpecPlan:
    """A problem's launches in order, the scratch buffers they share, and the outputs' shapes."""

    launches: list
    scratch: dict
    o_shape: tuple
    o_dtype: np.dtype
    lse_shape: tuple | None


def _layout(x: np.ndarray, layout: str) -> np.ndarray:
    """[B, H, N, D] as the kernel takes it, contiguous."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "bshd" else x)

