"""A published CUDA kernel file, launched on a GPU through PyCUDA as its kernel spec says.

The same spec as `SpecKernelBackend` (fa_verify.backends.spec_kernel), the same launch plan,
the same guarded outputs and scratch buffers, the launches in order (pycuda_runner.run_launches,
parameters packed by fa_verify.kernels.abi, structs included); only the runner differs. The
file's host code is set aside as for the CPU runner, and one line per instantiation the spec's
limits allow (and one cubin per entry over a drawn dimension) takes the entry's address, so nvcc
emits it. A template entry has a C++ (mangled) name in the cubin: the names
are read from the cubin's string table and demangled (c++filt, or nvcc's cu++filt) to find
the one the spec names. Launches run in this process, in the selected device's primary
context, synchronised after each so a fault is reported at its launch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading

from fa_verify.backends.spec_kernel import SpecKernelBackend
from fa_verify.errors import KernelBuildError
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
    """{spec entry: its symbol} for each entry, by demangling `symbols`: a C++ kernel (a template
    instantiation or not) by its demangled name, an extern "C" one (among no symbol) as it is."""
    demangled = subprocess.run(_demangler(), input="\n".join(symbols), capture_output=True, text=True,
                               check=True).stdout.splitlines() if symbols else []
    bare = {symbol: re.sub(r"\s+", "", text).removeprefix("void") for symbol, text in zip(symbols, demangled)}
    names = {}
    for entry in entries:
        wanted = re.sub(r"\s+", "", entry) + "("
        found = [symbol for symbol, text in bare.items() if text.startswith(wanted)]
        if not found and "<" not in entry:  # an extern "C" entry keeps its own name
            names[entry] = entry
            continue
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
    runs_on = "the GPU"

    def __init__(self, source, spec: KernelSpec | str):
        super().__init__(source, spec)
        self.name = self.name + "-pycuda"
        self.notes = f"{self.source.name} launched by its kernel spec on a GPU through PyCUDA"
        self._gpu = None
        self._functions: dict = {}  # entry -> pycuda Function
        self._gpu_lock = threading.RLock()

    def availability(self):
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        return pycuda_availability()

    def build(self):
        return self._loaded()

    def _loaded(self):
        """(context, arch, {entry: symbol}): the instantiations known before a problem is drawn built
        and loaded once; entries over a drawn dimension join at their first launch."""
        with self._gpu_lock:
            if self._gpu is None:
                from fa_verify.kernels.pycuda_runner import load_in_primary_context

                static = list(self.spec.instantiations())
                context, (arch, names) = load_in_primary_context(
                    lambda cuda, arch: (arch, self._load(cuda, arch, static) if static else {}))
                self._gpu = (context, arch, names)
            return self._gpu

    def _load(self, cuda, arch: str, entries: list[str]) -> dict:
        """Build `entries` into one cubin, load it into the current context: {entry: symbol}."""
        cubin = self._cubin(arch, entries)
        module = cuda.module_from_buffer(cubin)
        names = entry_names(cubin_symbols(cubin), entries)
        self._functions.update({entry: module.get_function(symbol) for entry, symbol in names.items()})
        return names

    def get_function(self, entry: str):
        """The loaded kernel of `entry` (run_launches' module protocol; called in the pushed context):
        an entry over a drawn dimension is built and loaded here, once."""
        import pycuda.driver as cuda

        with self._gpu_lock:
            _, arch, names = self._loaded()
            if entry not in self._functions:
                names.update(self._load(cuda, arch, [entry]))
            return self._functions[entry]

    def _cubin(self, arch: str, entries: list[str]) -> bytes:
        from fa_verify.cuda_cpu._build import default_cache_dir
        from fa_verify.cuda_cpu._host_code import device_only_copy
        from fa_verify.kernels.pycuda_runner import cached_cubin

        # the file and its project headers with their host code set aside, the copies found first
        copy, include_dirs = device_only_copy(self.source, default_cache_dir() / "device_only", self.spec.include_dirs)
        source = instantiating_source(copy.read_text(), entries)
        return cached_cubin(source, f"spec-{self.source.stem}", arch, [str(d) for d in include_dirs],
                            options=[f"-D{k}={v}" for k, v in self.spec.defines.items()])

    def _run_plan(self, plan, inputs: dict, o, lse, racecheck: bool) -> None:
        """Every launch of `plan` in order through PyCUDA, sharing the device copies of the buffers."""
        from fa_verify.kernels.pycuda_runner import run_launches

        context = self._loaded()[0]
        buffers = {**inputs, "o": o.buffer, "lse": lse and lse.buffer, NULL: None, **plan.scratch}
        offsets = {"o": o.offset * o.buffer.itemsize, "lse": lse.offset * 4 if lse is not None else 0}
        run_launches(context, self, plan.launches, buffers, outputs=[n for n in ("o", "lse") if buffers[n] is not None],
                     offsets=offsets, what=f"{self.name}")
