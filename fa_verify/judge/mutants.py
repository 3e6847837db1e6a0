"""Mutants as backends: each one's source built by the CUDA-on-CPU runner, plain and with ASan.

`MutantBackend(mutant)` runs a mutated kernel (fa_verify.kernels.mutants) exactly as
`CpuKernelBackend` runs the original: same catalogue launch, same precision model, same runner,
only the module differs.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from fa_verify.backends.cuda_kernels import CpuKernelBackend
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
