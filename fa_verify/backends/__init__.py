"""Attention implementations under test, behind one protocol: `run(problem) -> (out, lse | None)`."""

from fa_verify.backends.base import Availability, Backend
from fa_verify.backends.naive import NaiveBackend, naive_attention
from fa_verify.backends.numpy_tiled import NumpyTiledBackend, tiled_attention
from fa_verify.backends.registry import backend_table, builtin_backends, get_backend
from fa_verify.backends.torch_sdpa import TorchSdpaBackend
from fa_verify.backends.user_callable import CallableBackend, load_callable

__all__ = [
    "Availability",
    "Backend",
    "CallableBackend",
    "NaiveBackend",
    "NumpyTiledBackend",
    "TorchSdpaBackend",
    "backend_table",
    "builtin_backends",
    "get_backend",
    "load_callable",
    "naive_attention",
    "tiled_attention",
]
