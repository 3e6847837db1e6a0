"""The built-in backends by name, of every kind of problem, and the table `fa_verify backends` prints."""

from __future__ import annotations

from fa_verify.backends.backward_kernel import backward_kernel_backends
from fa_verify.backends.base import Backend
from fa_verify.backends.cuda_kernels import CpuKernelBackend, PyCudaKernelBackend
from fa_verify.backends.naive import NaiveBackend
from fa_verify.backends.numpy_backward import NumpyBackwardBackend
from fa_verify.backends.numpy_fp8 import NumpyFP8Backend, NumpyPagedFP8Backend
from fa_verify.backends.numpy_ragged import numpy_ragged_backends
from fa_verify.backends.numpy_tiled import NumpyTiledBackend
from fa_verify.backends.split_kv import split_kv_backends
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
    lambda: CpuKernelBackend("fa3_fp8"),
    lambda: PyCudaKernelBackend("fa3_fp8"),
    NumpyBackwardBackend,
    NumpyFP8Backend,
    NumpyPagedFP8Backend,
)


def builtin_backends() -> list[Backend]:
    """Every built-in backend, of every kind of problem, available or not (check
    `availability()` before running one): the dense ones, then the numpy references and our
    split-KV kernel's for varlen / paged KV, and our backward kernel's."""
    return [make() for make in _BUILTINS] + numpy_ragged_backends() + split_kv_backends() + backward_kernel_backends()


def get_backend(name: str) -> Backend:
    """The built-in backend `name`."""
    backends = {backend.name: backend for backend in builtin_backends()}
    if name not in backends:
        raise InvalidArgumentError(f"backend={name!r} is unknown; built-in backends: {', '.join(backends)}")
    return backends[name]


def backend_table() -> list[dict]:
    """One JSON-ready row per built-in backend: availability, the kinds of problem it runs (and
    "layout", the one it takes), dtypes, precision per dtype, variants, split-KV, notes."""
    rows = []
    for backend in builtin_backends():
        availability = backend.availability()
        rows.append({"name": backend.name, "available": availability.available, "reason": availability.reason,
                     "kinds": list(backend.kinds), "layout": backend.kinds[0], "dtypes": list(backend.dtypes),
                     "precision": {dtype: backend.precision(dtype).as_dict() for dtype in backend.dtypes},
                     "features": list(backend.features), "splits": backend.splits, "notes": backend.notes})
    return rows
