"""The built-in backends by name, and the tables `fa_verify backends` prints."""

from __future__ import annotations

from fa_verify.backends.base import Backend
from fa_verify.backends.cuda_kernels import CpuKernelBackend, PyCudaKernelBackend
from fa_verify.backends.naive import NaiveBackend
from fa_verify.backends.numpy_tiled import NumpyTiledBackend
from fa_verify.backends.torch_sdpa import TorchSdpaBackend
from fa_verify.errors import InvalidArgumentError

#: One factory per built-in backend, listed whether or not it can run here; add a line to add one.
_BUILTINS = (
    NumpyTiledBackend,
    lambda: NaiveBackend("same-precision"),
    lambda: NaiveBackend("fp32"),
    lambda: TorchSdpaBackend("math"),
    lambda: TorchSdpaBackend("flash-cpu"),
    lambda: CpuKernelBackend("fa2"),
    lambda: PyCudaKernelBackend("fa2"),
    lambda: CpuKernelBackend("wmma"),
    lambda: PyCudaKernelBackend("wmma"),
    lambda: CpuKernelBackend("mma_ptx"),
    lambda: PyCudaKernelBackend("mma_ptx"),
    lambda: CpuKernelBackend("naive"),
    lambda: PyCudaKernelBackend("naive"),
    lambda: CpuKernelBackend("naive16"),
    lambda: PyCudaKernelBackend("naive16"),
)


def builtin_backends() -> list[Backend]:
    """Every built-in backend, available or not (check `availability()` before running one)."""
    return [make() for make in _BUILTINS]


def builtin_ragged() -> list:
    """Every built-in ragged backend (varlen / paged KV), available or not: the numpy references
    and our split-KV kernel's."""
    from fa_verify.backends.ragged_base import builtin_ragged_backends
    from fa_verify.backends.split_kv import split_kv_backends

    return builtin_ragged_backends() + split_kv_backends()


def get_backend(name: str, ragged: bool = False):
    """The built-in backend `name`; with `ragged`, the ragged ones are looked up too."""
    backends = {backend.name: backend for backend in builtin_backends()}
    if ragged and name not in backends:
        backends.update((backend.name, backend) for backend in builtin_ragged())
    if name not in backends:
        raise InvalidArgumentError(f"backend={name!r} is unknown; built-in backends: {', '.join(backends)}")
    return backends[name]


def backend_table() -> list[dict]:
    """One JSON-ready row per built-in backend: availability, dtypes, precision per dtype, notes."""
    return [{**_row(backend), "notes": backend.notes} for backend in builtin_backends()]


def ragged_backend_table() -> list[dict]:
    """One JSON-ready row per built-in ragged backend (varlen / paged KV): as `backend_table`'s
    rows, plus its layout, the variants it implements and whether it splits the keys: the numpy
    reference ones and our split-KV kernel's."""
    return [{**_row(backend), "layout": backend.layout, "features": list(backend.features), "splits": backend.splits}
            for backend in builtin_ragged()]


def _row(backend) -> dict:
    availability = backend.availability()
    return {"name": backend.name, "available": availability.available, "reason": availability.reason,
            "dtypes": list(backend.dtypes),
            "precision": {dtype: backend.precision(dtype).as_dict() for dtype in backend.dtypes}}
