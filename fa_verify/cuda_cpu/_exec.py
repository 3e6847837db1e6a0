"""One launch through a built module's C entry point, with arguments already flattened.

This file runs inside the worker process, which imports it by path with only the standard
library (no numpy, no fa_verify: the worker starts fast and cannot fail on the parent's imports),
and in-process for the unisolated mode. It reports statuses; the parent turns them into
exceptions.

Why the worker copies every array into its own allocation: AddressSanitizer can only report an
out-of-bounds access where an allocation ends. A numpy buffer may sit inside a larger block (a
view, pickled bytes); an exact-size posix_memalign buffer per argument makes one element past the
end an error, as one element past a cudaMalloc'd buffer is on the GPU (which also aligns to 256).
"""

from __future__ import annotations

import ctypes
import ctypes.util

STATUS_OK = 0
STATUS_BAD_LAUNCH = 2
STATUS_DEADLOCK = 3
STATUS_TRAP = 4
STATUS_BAD_ARGUMENT = 5

_MESSAGE_SIZE = 4096
_RACE_REPORT_SIZE = 16384
_ALIGNMENT = 256


class LaunchConfig(ctypes.Structure):
    """Mirrors fa_cpu::LaunchConfig in include/fa_cuda_cpu_runtime.h."""

    _fields_ = [
        ("grid", ctypes.c_int64 * 3),
        ("block", ctypes.c_int64 * 3),
        ("shared_bytes", ctypes.c_int64),
        ("order", ctypes.c_int64),
        ("seed", ctypes.c_int64),
        ("stack_bytes", ctypes.c_int64),
    ]


_libraries: dict[str, ctypes.CDLL] = {}


def _library(library: str) -> ctypes.CDLL:
    lib = _libraries.get(library)
    if lib is None:
        lib = _libraries[library] = ctypes.CDLL(library)
    return lib


def entry(library: str, name: str):
    fn = getattr(_library(library), "fa_cpu_launch_" + name)
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(LaunchConfig),
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    return fn


def launch(library: str, name: str, config: dict, slots: list[int], itemsizes: list[int]) -> tuple[int, str]:
    """Run the grid; `slots` hold pointers, int64s and double bit patterns, one per parameter."""
    fn = entry(library, name)
    cfg = LaunchConfig()
    cfg.grid[:] = config["grid"]
    cfg.block[:] = config["block"]
    cfg.shared_bytes = config["shared_bytes"]
    cfg.order = config["order"]
    cfg.seed = config["seed"]
    cfg.stack_bytes = config["stack_bytes"]
    n = len(slots)
    message = ctypes.create_string_buffer(_MESSAGE_SIZE)
    status = fn(
        (ctypes.c_uint64 * max(n, 1))(*slots),
        (ctypes.c_int64 * max(n, 1))(*itemsizes),
        ctypes.byref(cfg),
        message,
        _MESSAGE_SIZE,
    )
    return status, message.value.decode(errors="replace")


def register_buffers(library: str, buffers: list[tuple[int, int]]) -> None:
    """Tell a race build the launch's global memory: (address, size) of each argument buffer."""
    lib = _library(library)
    if hasattr(lib, "fa_cpu_race_buffers"):
        n = len(buffers)
        lib.fa_cpu_race_buffers((ctypes.c_uint64 * max(n, 1))(*(a for a, _ in buffers)),
                                (ctypes.c_uint64 * max(n, 1))(*(s for _, s in buffers)), n)


def race_report(library: str) -> dict | None:
    """A race build's findings in the last launch: {"total": races seen, "report": one line per
    distinct pair of instructions} (parsed by _race); None for other builds."""
    lib = _library(library)
    if not hasattr(lib, "fa_cpu_race_report"):
        return None
    lib.fa_cpu_race_report.restype = ctypes.c_long
    text = ctypes.create_string_buffer(_RACE_REPORT_SIZE)
    total = lib.fa_cpu_race_report(text, _RACE_REPORT_SIZE)
    return {"total": int(total), "report": text.value.decode(errors="replace")}


_libc = ctypes.CDLL(None)  # under LD_PRELOAD=libasan, malloc and friends resolve to the sanitizer's
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.posix_memalign.restype = ctypes.c_int
_libc.free.argtypes = [ctypes.c_void_p]
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memcmp.restype = ctypes.c_int


def launch_with_copies(request: dict, announce=None) -> dict:
    """Copy each array into an exact-size allocation, launch, and return the arrays it changed.

    request: library, name, config, slots (a pointer's byte offset where one goes), pointers (slot -> buffer
    index or None for a null pointer), buffers (bytes), itemsizes. A race build is told the
    allocations (its global memory) and its report is returned under "races". `announce` receives the
    allocations before the launch, so that a crash report can name the argument it concerns.
    """
    buffers: list[bytes] = request["buffers"]
    addresses: list[int] = []
    try:
        for data in buffers:
            ptr = ctypes.c_void_p()
            if _libc.posix_memalign(ctypes.byref(ptr), _ALIGNMENT, len(data)) != 0:
                raise MemoryError(f"cannot allocate {len(data)} bytes for a kernel argument")
            addresses.append(ptr.value or 0)
            if data:
                ctypes.memmove(ptr.value, data, len(data))
        slots = list(request["slots"])
        for slot, index in request["pointers"].items():  # a pointer slot holds its byte offset
            slots[slot] = 0 if index is None else addresses[index] + slots[slot]
        table = [(a, len(b)) for a, b in zip(addresses, buffers)]
        if announce is not None:
            announce(table)
        register_buffers(request["library"], table)
        status, message = launch(request["library"], request["name"], request["config"], slots, request["itemsizes"])
        changed = {}
        for index, (address, data) in enumerate(zip(addresses, buffers)):
            if data and _libc.memcmp(address, data, len(data)) != 0:
                changed[index] = ctypes.string_at(address, len(data))
        return {"status": status, "message": message, "changed": changed, "races": race_report(request["library"])}
    finally:
        for address in addresses:
            _libc.free(address)
