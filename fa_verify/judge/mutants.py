"""Mutants as backends: each one's source built by the CUDA-on-CPU runner, plain and with ASan.

`MutantBackend(mutant)` runs a mutated kernel (fa_verify.kernels.mutants) exactly as
`CpuKernelBackend` runs the original: same catalogue launch, same precision model, same runner,
only the module differs. A mutant of split_kv.cu runs as `RaggedMutantBackend`, the ragged
backend `SplitKvCpuBackend` of the mutant's layout with the mutated module; a mutant of
fa2_bwd.cu as `BackwardKernelBackend` with the mutated text; `mutant_backend` and
`unmutated_backend` pick the right one for any mutant.
"""

from __future__ import annotations

from pathlib import Path

from fa_verify.backends.backward_kernel import BackwardKernelBackend
from fa_verify.backends.cuda_kernels import CpuKernelBackend
from fa_verify.backends.split_kv import SplitKvCpuBackend
from fa_verify.judge.exploits import Exploit
from fa_verify.judge.fp8_mutants import EmulatedMutant
from fa_verify.kernels.catalogue import cached_source, kernels_dir
from fa_verify.kernels.mutants import Mutant


def mutant_source(mutant: Mutant) -> Path:
    """The mutated source, in a folder of the runner's cache named by the mutant and the text it
    builds from (`cached_source`)."""
    family = mutant.kernel_family
    return cached_source(mutant.name, family.source, mutant.mutate((kernels_dir() / family.source).read_text()),
                         includes=getattr(family, "includes", ()))


_MODULES: dict = {}


def mutant_module(mutant: Mutant, sanitize: bool = False, racecheck: bool = False):
    """The CpuKernelModule of the mutated source (built once per process and mode; the runner's
    content-addressed cache makes later processes' builds instant)."""
    from fa_verify.cuda_cpu import CpuKernelModule

    key = (mutant.name, mutant.find, mutant.replace, sanitize, racecheck)
    if key not in _MODULES:
        source = mutant_source(mutant)
        _MODULES[key] = CpuKernelModule(source, entries=mutant.kernel_family.signatures(),
                                        include_dirs=(str(source.parent),), sanitize=sanitize, racecheck=racecheck)
    return _MODULES[key]


class MutantBackend(CpuKernelBackend):
    """A mutant run through the CUDA-on-CPU runner, as `CpuKernelBackend` runs its kernel family.

    Named "<mutant>-cpu" (or "-asan"); precision model and supported problems are the family's,
    so the property suite judges it exactly as it judges the unmutated kernel.
    """

    def __init__(self, mutant: Mutant, sanitize: bool = False):
        super().__init__(mutant.kernel_family, sanitize=sanitize)
        self.mutant = mutant
        self.name = f"{mutant.name}-cpu" + ("-asan" if sanitize else "")

    def module(self, racecheck: bool = False):
        """The mutated kernel's module, or its race detector build."""
        return mutant_module(self.mutant, sanitize=self.sanitize and not racecheck, racecheck=racecheck)


class RaggedMutantBackend(SplitKvCpuBackend):
    """A mutant of split_kv.cu, run as `SplitKvCpuBackend` runs the kernel in the mutant's layout."""

    def __init__(self, mutant: Mutant, sanitize: bool = False):
        super().__init__(mutant.layout, sanitize=sanitize)
        self.mutant = mutant
        self.name = f"{mutant.name}-cpu" + ("-asan" if sanitize else "")

    def module(self):
        return mutant_module(self.mutant, sanitize=self.sanitize)


def mutant_backend(mutant: Mutant, sanitize: bool = False):
    """The backend running `mutant`: dense (MutantBackend), ragged (RaggedMutantBackend), or the
    backward kernel's (BackwardKernelBackend running the mutated text); an exploit's own target
    (fa_verify.judge.exploits) or an emulated FP8 mutant's (fa_verify.judge.fp8_mutants): None
    where it has no sanitizer build."""
    if isinstance(mutant, (Exploit, EmulatedMutant)):
        return mutant.backend(sanitize)
    if mutant.backward:
        text = mutant.mutate((kernels_dir() / mutant.kernel_family.source).read_text())
        return BackwardKernelBackend("cpu", source=text, name=f"{mutant.name}-cpu", sanitize=sanitize)
    return (RaggedMutantBackend if mutant.layout else MutantBackend)(mutant, sanitize=sanitize)


def unmutated_backend(mutant: Mutant):
    """The backend of the kernel `mutant` edits, unedited: the control its kills are judged against
    (an exploit's: the correct callable of its form; an emulated FP8 mutant's: the honest numpy
    FP8 forward)."""
    if isinstance(mutant, (Exploit, EmulatedMutant)):
        return mutant.control_backend()
    if mutant.backward:
        return BackwardKernelBackend("cpu")
    return SplitKvCpuBackend(mutant.layout) if mutant.layout else CpuKernelBackend(mutant.kernel_family)
