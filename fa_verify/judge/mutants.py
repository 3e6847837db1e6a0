"""Mutants as backends: each one's source built by the CUDA-on-CPU runner, plain and with ASan.

`MutantBackend(mutant)` runs a mutated kernel (fa_verify.kernels.mutants) exactly as
`CpuKernelBackend` runs the original: same catalogue launch, same precision model, same runner,
only the module differs. A mutant of split_kv.cu runs as `RaggedMutantBackend`, the ragged
backend `SplitKvCpuBackend` of the mutant's layout with the mutated module; `mutant_backend` and
`unmutated_backend` pick the right one for any mutant.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from fa_verify.backends.cuda_kernels import CpuKernelBackend
from fa_verify.backends.split_kv import SplitKvCpuBackend
from fa_verify.kernels.mutants import Mutant


def _mutant_folder(mutant: Mutant, root: Path) -> Path:
    """A folder per mutant and source text, so an edited mutants.toml never reuses a stale copy."""
    digest = hashlib.sha256((mutant.find + "\0" + mutant.replace).encode()).hexdigest()[:12]
    return root / f"{mutant.name}-{digest}"


_MODULES: dict = {}
_ROOT: list = []


def _root() -> Path:
    if not _ROOT:
        _ROOT.append(tempfile.TemporaryDirectory(prefix="fa_verify_mutants_"))
    return Path(_ROOT[0].name)


def mutant_module(mutant: Mutant, sanitize: bool = False, racecheck: bool = False):
    """The CpuKernelModule of the mutated source (built once per process and mode; the runner's
    content-addressed cache makes later processes' builds instant)."""
    from fa_verify.cuda_cpu import CpuKernelModule

    key = (mutant.name, mutant.find, mutant.replace, sanitize, racecheck)
    if key not in _MODULES:
        folder = _mutant_folder(mutant, _root())
        source = mutant.materialise(folder)
        family = mutant.kernel_family
        _MODULES[key] = CpuKernelModule(source, entries=family.signatures(), include_dirs=(str(folder),),
                                        sanitize=sanitize, racecheck=racecheck)
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
    """The backend running `mutant`: dense (MutantBackend) or ragged (RaggedMutantBackend)."""
    return (RaggedMutantBackend if mutant.layout else MutantBackend)(mutant, sanitize=sanitize)


def unmutated_backend(mutant: Mutant):
    """The backend of the kernel `mutant` edits, unedited: the control its kills are judged against."""
    return SplitKvCpuBackend(mutant.layout) if mutant.layout else CpuKernelBackend(mutant.kernel_family)
