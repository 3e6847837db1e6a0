"""kernels/split_kv.cu as ragged backends: split-KV decode over varlen or paged K/V.

`split-kv-cpu` (paged) and `split-kv-varlen-cpu` run the kernel on the CUDA-on-CPU runner;
`split-kv-pycuda` and `split-kv-varlen-pycuda` through PyCUDA, in this process (on a GPU, or
on the fake driver of tests/fake_cuda_driver, which is no GPU). Every run is the two launches
of `fa_verify.kernels.split_kv.plan`: the split kernel writes fp32 partials into NaN-filled
scratch, the combine kernel merges them into out and LSE, which start filled with the
unwritten-output sentinel (`buffers.GuardedOutput`, inside guard bands): rows the kernel never
writes come back holding it (`RaggedProblem.unwritten_rows` names their sequences), and a write
outside out or LSE is a BackendOutputError.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from fa_verify.backends.base import Availability, Backend
from fa_verify.backends.buffers import GuardedOutput, output_buffers
from fa_verify.backends.cuda_kernels import _bits, cpu_runner_availability
from fa_verify.errors import BackendOutputError
from fa_verify.kernels import split_kv
from fa_verify.kernels.catalogue import kernels_dir
from fa_verify.limits import Limits
from fa_verify.precision import PrecisionModel


def _outputs(name: str, buffers: tuple[GuardedOutput, GuardedOutput]) -> tuple[np.ndarray, np.ndarray]:
    """out and LSE as the kernel left them; a write outside either raises BackendOutputError."""
    outside = [line for b in buffers for line in b.findings(unwritten=False)]
    if outside:
        raise BackendOutputError(f"target {name!r} " + "; ".join(outside))
    return buffers[0].view.copy(), buffers[1].view.copy()


class SplitKvBackend(Backend):
    """split_kv.cu on one runner, for one layout."""

    runner: str
    dtypes = split_kv.DTYPES
    features = split_kv.FEATURES
    splits = True
    writes_buffers = True
    limits = Limits(dtypes=split_kv.DTYPES, head_dims=tuple(split_kv.CONFIGS), lse=True)

    def __init__(self, layout: str = "paged"):
        # a paged kernel also runs FP8 KV caches (kind "paged-fp8": split_kv.FP8_DTYPES)
        self.kinds = (layout, "paged-fp8") if layout == "paged" else (layout,)
        if layout == "paged":
            self.dtypes = split_kv.DTYPES + split_kv.FP8_DTYPES
            self.limits = replace(self.limits, dtypes=self.dtypes)
        self.name = f"{split_kv.LABEL}{'' if layout == 'paged' else '-varlen'}-{self.runner}"

    def precision(self, dtype) -> PrecisionModel:
        return split_kv.precision(dtype)

    def supports(self, problem) -> str | None:
        return super().supports(problem) or split_kv.supports(problem)


# --- the CUDA-on-CPU runner ---------------------------------------------------------------------------

_MODULES: dict = {}
_MODULES_LOCK = threading.Lock()


def cpu_module(source=None, include_dir=None, sanitize: bool = False, racecheck: bool = False):
    """split_kv.cu (or a mutant's copy at `source`, beside its fa_common.cuh in `include_dir`)
    built for the CPU runner, once per process and mode."""
    from fa_verify.cuda_cpu import CpuKernelModule

    source = source or split_kv.SPLIT_KV.source_path
    include_dir = include_dir or kernels_dir()
    key = (str(source), sanitize, racecheck)
    with _MODULES_LOCK:
        if key not in _MODULES:
            _MODULES[key] = CpuKernelModule(source, entries=split_kv.signatures(), include_dirs=(str(include_dir),),
                                            sanitize=sanitize, racecheck=racecheck)
        return _MODULES[key]


def run_on_cpu(problem, inputs: dict, module, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Both launches of `problem` on `module` (a CpuKernelModule of split_kv.cu)."""
    from fa_verify.cuda_cpu import Inside

    buffers = output_buffers(problem, split_kv.precision(problem.dtype).output)
    o, lse = buffers
    plan = split_kv.plan(problem, inputs, Inside(_bits(o.buffer), o.offset), Inside(lse.buffer, lse.offset))
    for launch in plan.launches:
        args = [plan.buffers[a] if isinstance(a, str) else a for a in launch.args]
        module.launch(launch.entry, launch.grid, launch.block, launch.shared_bytes, args,
                      shared_opt_in=launch.shared_bytes)
    return _outputs(name, buffers)


class SplitKvCpuBackend(SplitKvBackend):
    """split_kv.cu compiled with g++ and run by the CUDA-on-CPU runner (sanitize: its
    AddressSanitizer build, named "...-asan")."""

    runner = "cpu"

    def __init__(self, layout: str = "paged", sanitize: bool = False):
        super().__init__(layout)
        self.sanitize = sanitize
        if sanitize:
            self.name += "-asan"

    def availability(self) -> Availability:
        return cpu_runner_availability()

    def module(self):
        return cpu_module(sanitize=self.sanitize)

    def build(self):
        """Build (or fetch) the kernel module this backend launches."""
        return self.module()

    def _run(self, problem):
        return run_on_cpu(problem, problem.inputs(), self.module(), self.name)


# --- PyCUDA ---------------------------------------------------------------------------------------------

class SplitKvPyCudaBackend(SplitKvBackend):
    """split_kv.cu compiled by nvcc for the device's arch and launched through PyCUDA in this
    process, in the selected device's primary context, synchronised after each launch."""

    runner = "pycuda"
    _gpu = None
    _gpu_lock = threading.Lock()

    def availability(self) -> Availability:
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        return pycuda_availability()

    def supports(self, problem) -> str | None:
        reason = super().supports(problem)
        if reason is None and self.availability().available:
            from fa_verify.kernels.pycuda_runner import device_properties

            reason = split_kv.supports(problem, shared_limit=device_properties()[2])
        return reason

    @classmethod
    def _loaded(cls):
        """(context, module), compiled (cached on disk) and loaded once per process."""
        with cls._gpu_lock:
            if cls._gpu is None:
                from fa_verify.kernels.pycuda_runner import cached_cubin, load_in_primary_context

                folder = kernels_dir()

                def load(cuda, arch):
                    return cuda.module_from_buffer(cached_cubin(
                        split_kv.SPLIT_KV.source_path.read_text(), split_kv.SOURCE, arch, [str(folder)],
                        key_parts=[(folder / "fa_common.cuh").read_text()]))

                cls._gpu = load_in_primary_context(load)
            return cls._gpu

    def _run(self, problem):
        from fa_verify.kernels.pycuda_runner import run_launches

        context, module = self._loaded()
        buffers = output_buffers(problem, self.precision(problem.dtype).output)
        o, lse = buffers
        plan = split_kv.plan(problem, problem.inputs(), o, lse)
        host = {name: (a.buffer if isinstance(a, GuardedOutput) else a) for name, a in plan.buffers.items()}
        run_launches(context, module, plan.launches, host, outputs=("out", "lse"),
                     offsets={"out": o.offset * o.buffer.itemsize, "lse": lse.offset * 4}, what=plan.split.entry)
        return _outputs(self.name, buffers)


def split_kv_backends() -> list[Backend]:
    """Both layouts on both runners; each paged one has its runner's varlen one as its contiguous
    twin (the property paged_contiguous compares them)."""
    backends = []
    for cls in (SplitKvCpuBackend, SplitKvPyCudaBackend):
        paged, varlen = cls("paged"), cls("varlen")
        paged.contiguous = varlen
        backends += [paged, varlen]
    return backends
