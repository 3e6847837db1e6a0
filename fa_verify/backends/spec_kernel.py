"""A published CUDA kernel file, launched on the CUDA-on-CPU runner as its kernel spec says.

`SpecKernelBackend(path, spec)` builds the file as published (its host code set aside: see
fa_verify.cuda_cpu._host_code) with one launcher per instantiation the spec's limits allow,
and runs each problem the way the spec describes: q, k, v in the spec's layout and element
types, o and lse in NaN-filled guarded buffers (an element left unwritten or written out of
bounds is reported), grid, block and dynamic shared memory evaluated from the problem, the 48 KiB
default and the arch's maximum held to the spec's opt-in as a GPU would.
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
        self.notes = f"{self.source.name} launched by its kernel spec on the CUDA-on-CPU runner ({self.spec.arch})"
        self._modules: dict = {}
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
        return reason

    def sanitized(self) -> "SpecKernelBackend":
        """The same kernels built with AddressSanitizer (the address_sanitizer property's twin)."""
        with self._lock:
            if self._sanitized is None:
                self._sanitized = self if self.sanitize else SpecKernelBackend(self.source, self.spec, sanitize=True)
            return self._sanitized

    def module(self, racecheck: bool = False):
        """The kernel module with a launcher per instantiation, or its race detector build (each
        built once; the runner caches builds)."""
        from fa_verify.cuda_cpu import CpuKernelModule

        with self._lock:
            if racecheck not in self._modules:
                signature = self.spec.signature()
                entries = {self.spec.entry_for(dtype, d or 0): signature for dtype, d in self.spec.entries()}
                self._modules[racecheck] = CpuKernelModule(
                    self.source, entries, include_dirs=self.spec.include_dirs, defines=self.spec.defines,
                    sanitize=self.sanitize and not racecheck, racecheck=racecheck, arch=self.spec.arch_number,
                    set_aside_host_code=True)
            return self._modules[racecheck]

    def build(self):
        """Build (or fetch) the kernel module this backend launches."""
        return self.module()

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

    # --- one launch ---------------------------------------------------------------------------------
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

    def _launch(self, problem: AttentionProblem, inputs: list, racecheck: bool = False):
        from fa_verify.cuda_cpu import Inside

        plan = self.plan(problem)
        o = GuardedOutput.allocate("o", plan.o_shape, plan.o_dtype)
        lse = GuardedOutput.allocate("lse", plan.lse_shape, np.float32) if plan.lse_shape else None
        args = plan.arguments({"q": inputs[0], "k": inputs[1], "v": inputs[2], "o": Inside(_bits(o.buffer), o.offset),
                               "lse": lse and Inside(lse.buffer, lse.offset), NULL: None})
        self.module(racecheck).launch(plan.entry, plan.grid, plan.block, plan.shared, args, shared_opt_in=plan.opt_in,
                                      arg_names=[str(p) for p in plan.params])
        check_written(f"{self.name} on the CUDA-on-CPU runner", *(b for b in (o, lse) if b is not None))
        return self.output(o.view), (lse.view if lse is not None else None)

    def output(self, o: np.ndarray) -> np.ndarray:
        """The kernel's o as [B, H, Nq, D]."""
        return o if self.spec.layout == "bhsd" else np.ascontiguousarray(o.transpose(0, 2, 1, 3))

    def plan(self, problem: AttentionProblem) -> "SpecLaunch":
        """The launch the spec describes for `problem`: entry, grid, block, shared memory, scalars, output shapes."""
        spec = self.spec
        B, H, Nq, D = problem.out_shape
        values = spec.names((B, H, problem.kv_heads, Nq, problem.nk, D), problem.dtype, causal=problem.causal,
                            scale=problem.scale_value)
        shared = self._dimension(spec.shared_bytes, values, "shared-bytes")
        block = [self._dimension(e, values, "block", i) for i, e in enumerate(spec.block)]
        geometry.check_threads(block, values)
        return SpecLaunch(
            entry=spec.entry_for(problem.dtype, D if "{D}" in spec.entry else 0),
            grid=[self._dimension(e, values, "grid", i) for i, e in enumerate(spec.grid)],
            block=block,
            shared=shared,
            opt_in=(shared if spec.shared_opt_in is True else None if spec.shared_opt_in is False
                    else self._dimension(spec.shared_opt_in, values, "shared-opt-in")),
            params=[p if isinstance(p, str) else expressions.evaluate(p, values, f"{spec.origin}: params")
                    for p in spec.params],
            o_shape=(B, Nq, H, D) if spec.layout == "bshd" else (B, H, Nq, D),
            o_dtype=numpy_dtype(self.precision(problem.dtype).output),
            lse_shape=(B, H, Nq) if spec.has_lse else None)

    def _dimension(self, tree, values, key: str, index: int = 0) -> int:
        value = expressions.evaluate(tree, values, f"{self.spec.origin}: {key}")
        return geometry.dimension(tree, value, key, index, values, self.spec.origin)


@dataclass
class SpecLaunch:
    """One launch as the spec describes it; `params` holds buffer names (str) and evaluated scalars."""

    entry: str
    grid: list
    block: list
    shared: int
    opt_in: int | None
    params: list
    o_shape: tuple
    o_dtype: np.dtype
    lse_shape: tuple | None

    def arguments(self, buffers: dict) -> list:
        """The kernel's arguments, each buffer name replaced by `buffers[name]`."""
        return [buffers[p] if isinstance(p, str) else p for p in self.params]


def _layout(x: np.ndarray, layout: str) -> np.ndarray:
    """[B, H, N, D] as the kernel takes it, contiguous."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "bshd" else x)

