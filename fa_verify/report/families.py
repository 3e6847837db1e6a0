"""Backend families: the small multiples of the report's figures, one panel per family.

Eleven backends on one set of axes overlap into one line; a panel per family keeps each
readable and puts side by side what is compared (our kernels against each other, torch's two
kernels, the numpy models). Records carry only the backend's name, so the family comes from
it: our kernels are named "<kernel>-<runner>" (`backends.cuda_kernels`), torch's
"torch-...", the numpy models "numpy-..." and "naive-<compute>"; anything else (a
user's callable) is "other backends".
"""

from __future__ import annotations

from fa_verify.backends.cuda_kernels import RUNNERS

KERNELS = "our CUDA kernels"
NUMPY = "numpy models"
TORCH = "torch"
OTHER = "other backends"
#: The order of the panels.
FAMILIES = (KERNELS, NUMPY, TORCH, OTHER)


def family_of(backend: str) -> str:
    if backend.startswith("torch-"):
        return TORCH
    if any(backend.removesuffix("-asan").endswith(f"-{runner}") for runner in RUNNERS):
        return KERNELS
    if backend.startswith(("numpy-", "naive-")):
        return NUMPY
    return OTHER


def by_family(backends) -> dict:
    """{family: sorted backend names} of the families present, in FAMILIES order."""
    groups = {family: sorted({b for b in backends if family_of(b) == family}) for family in FAMILIES}
    return {family: names for family, names in groups.items() if names}
