"""Our CUDA kernels (kernels/*.cu) as backends: each kernel family x runner.

Runners: "pycuda" (a GPU, through a restartable PyCUDA worker process on the device
$FA_VERIFY_CUDA_DEVICE names) and "cpu" (the same
source compiled by g++ through fa_verify's CUDA-on-CPU runner). Backend names are
"<label>-<runner>": fa2-pycuda, fa2-cpu, wmma-pycuda, wmma-cpu, mma-ptx-pycuda, mma-ptx-cpu, naive-cuda-pycuda,
naive-cuda-cpu, naive16-cuda-pycuda, naive16-cuda-cpu. The launch (entry, grid, block, dynamic shared memory) and the precision model
come from the kernel catalogue, fa_verify.kernels.catalogue.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np

from fa_verify.backends.base import AVAILABLE, Availability, Backend
from fa_verify.backends.buffers import GuardedOutput, check_written
from fa_verify.dtypes import numpy_dtype
from fa_verify.kernels.catalogue import FAMILIES, KernelFamily, kernels_dir
from fa_verify.limits import Limits
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

RUNNERS = ("pycuda", "cpu")


def _bits(x: np.ndarray) -> np.ndarray:
    """A contiguous array as the kernel reads it: fp16/bf16 as their uint16 bits, the FP8
    formats as their uint8 bits."""
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 1: np.uint8}[x.dtype.itemsize]) if x.dtype.itemsize in (1, 2) else x


class KernelBackend(Backend):
    """One kernel family on one runner."""

    runner: str

    def __init__(self, family: KernelFamily | str):
        self.family = FAMILIES[family] if isinstance(family, str) else family
        self.name = f"{self.family.label}-{self.runner}"
        self.dtypes = self.family.dtypes
        self.features = self.family.features
        self.notes = self.family.notes
        # D_v != D where the family instantiates it (fa2's 192/128): the strategies draw those pairs
        self.limits = Limits(head_dims_v=self.family.head_dims_v)

    def precision(self, dtype) -> PrecisionModel:
        return self.family.precision(dtype)

    def supports(self, problem: AttentionProblem) -> str | None:
        return self.family.supports(problem)

    def _outputs(self, problem: AttentionProblem, o_bits: np.ndarray, lse: np.ndarray):
        out = o_bits.view(numpy_dtype(problem.dtype)).reshape(problem.out_shape)
        return out, lse.reshape(problem.out_shape[:3])


class PyCudaKernelBackend(KernelBackend):
    """A kernel family compiled by PyCUDA and run on the GPU, in a worker process."""

    runner = "pycuda"

    def availability(self) -> Availability:
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        return pycuda_availability()

    def supports(self, problem: AttentionProblem) -> str | None:
        if not self.availability().available:
            return self.family.supports(problem)
        from fa_verify.kernels.pycuda_runner import arch_problem, device_properties

        arch, _, limit = device_properties()
        return arch_problem(self.family, arch) or self.family.supports(problem, shared_limit=limit)

    def _run(self, problem: AttentionProblem):
        from fa_verify.kernels.pycuda_runner import shared_worker

        launch = self.family.launch(problem)
        o, lse = shared_worker().run(self.family, launch, _bits(problem.q), _bits(problem.k), _bits(problem.v))
        return self._outputs(problem, o, lse)


# --- the CUDA-on-CPU runner -------------------------------------------------------------------------

_CPU_MODULES: dict = {}
_CPU_LOCK = threading.Lock()


def cpu_runner_availability() -> Availability:
    if shutil.which("g++") is None:
        return Availability(False, "g++ is not installed (the CUDA-on-CPU runner compiles kernels with it)")
    try:
        from fa_verify.cuda_cpu import CpuKernelModule  # noqa: F401
    except ImportError as exc:
        return Availability(False, f"the CUDA-on-CPU runner cannot be imported: {exc}")
    return AVAILABLE


def cpu_module(family: KernelFamily, sanitize: bool = False, racecheck: bool = False):
    """The family's CpuKernelModule (built once per process and mode: plain, AddressSanitizer or
    race detector; the runner caches builds)."""
    from fa_verify.cuda_cpu import CpuKernelModule

    key = (family.name, str(family.source_path), sanitize, racecheck)
    with _CPU_LOCK:
        if key not in _CPU_MODULES:
            _CPU_MODULES[key] = CpuKernelModule(family.source_path, entries=family.signatures(),
                                                include_dirs=(str(kernels_dir()),), sanitize=sanitize,
                                                racecheck=racecheck)
        return _CPU_MODULES[key]


def run_on_cpu(family: KernelFamily, problem: AttentionProblem, module=None,
               sanitize: bool = False, inputs=None) -> tuple[np.ndarray, np.ndarray]:
    """(o as uint16 bits or float32, lse) of `problem` run by `module` (default: the family's).

    The outputs start NaN-filled inside guard bands (`buffers.GuardedOutput`): an element the
    kernel never writes, or a write past either end of o or lse, raises BackendOutputError
    with its index. `inputs`: the q, k, v pointers to pass instead of the problem's arrays
    (`Inside` pointers into NaN-padded buffers, for `nan_padding`).
    """
    from fa_verify.cuda_cpu import Inside

    module = module or cpu_module(family, sanitize=sanitize)
    launch = family.launch(problem)
    q, k, v = inputs if inputs is not None else (_bits(x) for x in (problem.q, problem.k, problem.v))
    o = GuardedOutput.allocate("o", problem.out_shape, _bits(problem.q).dtype)
    lse = GuardedOutput.allocate("lse", problem.out_shape[:3], np.float32)
    args = [q, k, v, Inside(o.buffer, o.offset), Inside(lse.buffer, lse.offset), *launch.scalars]
    if launch.scratch_dtype:
        scratch = np.zeros(max(1, launch.scratch_elements), dtype=numpy_dtype(launch.scratch_dtype))
        args.append(_bits(scratch))
    args += launch.variant_arguments()  # None: a null pointer
    # Opted in to what the launch needs, as the PyCUDA runner sets the attribute on the GPU.
    module.launch(launch.entry, launch.grid, launch.block, launch.shared_bytes, args,
                  shared_opt_in=launch.shared_bytes)  # writes o, lse
    check_written(f"{family.label} on the CUDA-on-CPU runner", o, lse)
    return o.view, lse.view


class CpuKernelBackend(KernelBackend):
    """A kernel family compiled with g++ and run by the CUDA-on-CPU runner (fibers per thread)."""

    runner = "cpu"

    def __init__(self, family: KernelFamily | str, sanitize: bool = False):
        super().__init__(family)
        self.sanitize = sanitize
        if sanitize:
            self.name += "-asan"

    def availability(self) -> Availability:
        return cpu_runner_availability()

    def module(self, racecheck: bool = False):
        """The kernel module this backend launches, or its race detector build."""
        return cpu_module(self.family, sanitize=self.sanitize and not racecheck, racecheck=racecheck)

    def sanitized(self) -> "CpuKernelBackend":
        """The same family built with AddressSanitizer (the address_sanitizer property's twin)."""
        return self if self.sanitize else CpuKernelBackend(self.family, sanitize=True)

    def build(self):
        """Build (or fetch) the kernel module this backend launches."""
        return self.module()

    def run_racecheck(self, problem: AttentionProblem) -> None:
        """`races`' hook: run `problem` on the race detector's build of the kernel; raises
        KernelRaceError for conflicting accesses that nothing orders."""
        run_on_cpu(self.family, problem, module=self.module(racecheck=True))

    def _run(self, problem: AttentionProblem):
        o, lse = run_on_cpu(self.family, problem, module=self.build())
        return self._outputs(problem, o, lse)

    def run_padded(self, padded):
        """`nan_padding`'s hook: the kernel reads q, k, v at their offsets inside the NaN-filled
        buffers of `padded` (a PaddedInputs), so a read past either end picks up NaN."""
        from fa_verify.cuda_cpu import Inside

        inputs = [Inside(_bits(buffer), offset) for buffer, offset in zip(padded.buffers, padded.offsets)]
        o, lse = run_on_cpu(self.family, padded.problem, module=self.build(), inputs=inputs)
        return self._outputs(padded.problem, o, lse)


def kernel_backends() -> list[Backend]:
    """Every family x runner, as the registry lists them."""
    return [cls(family) for family in FAMILIES.values() for cls in (CpuKernelBackend, PyCudaKernelBackend)]
