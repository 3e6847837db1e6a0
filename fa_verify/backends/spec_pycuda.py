"""A published CUDA kernel file, launched on a GPU through PyCUDA as its kernel spec says.

The same spec as `SpecKernelBackend` (fa_verify.backends.spec_kernel), the same launch plan,
the same guarded outputs; only the runner differs. The file's host code is set aside as for
the CPU runner, and one line per instantiation the spec's limits allow takes the entry's
address, so nvcc emits it. A template entry has a C++ (mangled) name in the cubin: the names
are read from the cubin's string table and demangled (c++filt, or nvcc's cu++filt) to find
the one the spec names. Launches run in this process, in the selected device's primary
context, synchronised after each so a fault is reported at its launch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading

import numpy as np

from fa_verify.backends.spec_kernel import SpecKernelBackend
from fa_verify.errors import KernelBuildError, KernelRunError
from fa_verify.kernels.catalogue import DEFAULT_SHARED_LIMIT
from fa_verify.kernels.spec import NULL, KernelSpec


def instantiating_source(device_only: str, entries: list[str]) -> str:
    """The set-aside file plus one address-taking line per entry, so nvcc emits each instantiation."""
    lines = [f"static void *const fa_verify_entry_{i} = (void *)&{entry};" for i, entry in enumerate(entries)]
    return device_only + "\n" + "\n".join(lines) + "\n"


def _demangler() -> list[str]:
    from fa_verify.kernels.nvcc import find_nvcc

    found = shutil.which("c++filt") or shutil.which("cu++filt", path=str(find_nvcc().parent))
    if found is None:
        raise KernelBuildError("neither c++filt (binutils) nor nvcc's cu++filt is found: one is needed to find a "
                               "template entry's name in the cubin", log="")
    return [found]


def cubin_symbols(cubin: bytes) -> list[str]:
    """The C++ (mangled) names in a cubin's string tables."""
    return sorted({m.decode() for m in re.findall(rb"(_Z[\w$]+)\x00", cubin)})


def entry_names(symbols: list[str], entries: list[str]) -> dict[str, str]:
    """{spec entry: its symbol} for each entry: a template entry by demangling `symbols`, a plain one as it is."""
    demangled = subprocess.run(_demangler(), input="\n".join(symbols), capture_output=True, text=True,
                               check=True).stdout.splitlines() if symbols else []
    bare = {symbol: re.sub(r"\s+", "", text).removeprefix("void") for symbol, text in zip(symbols, demangled)}
    names = {}
    for entry in entries:
        if "<" not in entry:  # a plain or extern "C" entry keeps its own name
            names[entry] = entry
            continue
        wanted = re.sub(r"\s+", "", entry) + "("
        found = [symbol for symbol, text in bare.items() if text.startswith(wanted)]
        if len(found) != 1:
            raise KernelBuildError(f"the entry {entry!r} is not (or not once) among the kernels "
                                   f"({', '.join(sorted(bare.values())) or 'none'})", log="")
        names[entry] = found[0]
    return names


class SpecPyCudaBackend(SpecKernelBackend):
    """The kernels of `source` launched on a GPU through PyCUDA as `spec` describes."""

    # The CPU runner's hooks (race detector, ASan build, padded host buffers) have no GPU twin here.
    run_racecheck = None
    run_padded = None
    sanitized = None

    def __init__(self, source, spec: KernelSpec | str):
        super().__init__(source, spec)
        self.name = self.name + "-pycuda"
        self.notes = f"{self.source.name} launched by its kernel spec on a GPU through PyCUDA"
        self._gpu = None
        self._gpu_lock = threading.Lock()

    def availability(self):
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        return pycuda_availability()

    def build(self):
        return self._loaded()

    def _loaded(self):
        """(context, module, {entry: symbol}), built and loaded once."""
        with self._gpu_lock:
            if self._gpu is None:
                from fa_verify.kernels.pycuda_runner import load_in_primary_context

                entries = [self.spec.entry_for(dtype, d or 0) for dtype, d in self.spec.entries()]

                def load(cuda, arch):
                    cubin = self._cubin(arch, entries)
                    return cuda.module_from_buffer(cubin), cubin

                context, (module, cubin) = load_in_primary_context(load)
                self._gpu = (context, module, entry_names(cubin_symbols(cubin), entries))
            return self._gpu

    def _cubin(self, arch: str, entries: list[str]) -> bytes:
        from fa_verify.cuda_cpu._build import default_cache_dir
        from fa_verify.cuda_cpu._host_code import device_only_copy
        from fa_verify.kernels.pycuda_runner import cached_cubin

        # the file and its project headers with their host code set aside, the copies found first
        copy, include_dirs = device_only_copy(self.source, default_cache_dir() / "device_only", self.spec.include_dirs)
        source = instantiating_source(copy.read_text(), entries)
        return cached_cubin(source, f"spec-{self.source.stem}", arch, [str(d) for d in include_dirs],
                            options=[f"-D{k}={v}" for k, v in self.spec.defines.items()])

    def _launch(self, problem, inputs: list, racecheck: bool = False):
        import pycuda.driver as cuda

        from fa_verify.backends.buffers import GuardedOutput, check_written

        context, module, names = self._loaded()
        plan = self.plan(problem)
        o = GuardedOutput.allocate("o", plan.o_shape, plan.o_dtype)
        lse = GuardedOutput.allocate("lse", plan.lse_shape, np.float32) if plan.lse_shape else None
        host = {"q": inputs[0], "k": inputs[1], "v": inputs[2], "o": o.buffer, "lse": lse and lse.buffer}
        context.push()
        device = {}
        try:
            for name, array in host.items():
                if array is not None:
                    device[name] = cuda.mem_alloc(max(1, array.nbytes))
                    cuda.memcpy_htod(device[name], np.ascontiguousarray(array))
            pointers = {name: np.uintp(int(buf)) for name, buf in device.items()}
            pointers["o"] = np.uintp(int(device["o"]) + o.offset * o.buffer.itemsize)
            if lse is not None:
                pointers["lse"] = np.uintp(int(device["lse"]) + lse.offset * 4)
            pointers[NULL] = np.uintp(0)
            kinds = self.spec.signature()
            args = [np.float32(a) if kind == "float" else np.int32(a) if kind == "int" else a
                    for a, kind in zip(plan.arguments(pointers), kinds)]
            func = module.get_function(names[plan.entry])
            if plan.opt_in is not None and plan.opt_in > DEFAULT_SHARED_LIMIT:  # the host's opt-in, as published
                func.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, plan.opt_in)
            func(*args, grid=_three(plan.grid), block=_three(plan.block), shared=plan.shared)
            cuda.Context.synchronize()
            for guarded in (o, lse):
                if guarded is not None:
                    cuda.memcpy_dtoh(guarded.buffer, device[guarded.name])
        except cuda.Error as exc:
            raise KernelRunError(f"{plan.entry} failed on the GPU: {exc}") from None
        finally:
            for buf in device.values():
                buf.free()
            cuda.Context.pop()
        check_written(f"{self.name} on the GPU", *(b for b in (o, lse) if b is not None))
        return self.output(o.view), (lse.view if lse is not None else None)


def _three(dims) -> tuple:
    """grid or block as the three dimensions PyCUDA takes."""
    return tuple(int(n) for n in dims) + (1,) * (3 - len(dims))
