"""One launch through a built module's C entry point, with arguments already flattened.

This file runs inside the worker process, which imports it by path with only the standard
library (no numpy, no fa_verify: the worker starts fast and cannot fail on the parent's imports),
and in-process for the unisolated mode. It reports statuses; the parent turns them into
exceptions.

Why the worker copies every array into its own allocation: a numpy buffer may sit inside a
larger block (a view, pickled bytes), so what lies past its ends is arbitrary. In the
AddressSanitizer build each argument gets an exact-size posix_memalign buffer, so one element
past the end is an error, as one element past a cudaMalloc'd buffer is on the GPU (which also
aligns to 256). In the ordinary build each argument sits between two GUARD_BYTES guard regions
filled with 0xFF bytes (a NaN in fp16, bf16 and fp32): a read past either end picks up NaN and
shows in the output, and a write there is reported with the argument and the offset.
"""

from __future__ import annotations

import ctypes
import ctypes.util

STATUS_OK = 0
STATUS_BAD_LAUNCH = 2
STATUS_DEADLOCK = 3
STATUS_TRAP = 4
STATUS_BAD_ARGUMENT = 5
#: Set by the parent, not the runtime: the kernel wrote into a guard region.
STATUS_OUT_OF_BOUNDS = 6

_MESSAGE_SIZE = 4096
_RACE_REPORT_SIZE = 16384
_ALIGNMENT = 256
#: NaN-filled bytes on each side of an argument outside sanitizer builds (a multiple of _ALIGNMENT).
GUARD_BYTES = 256 * 1024
_GUARD_FILL = 0xFF


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
    """Copy each array into its own allocation, launch, and return the arrays it changed.

    request: library, name, config, slots (a pointer's byte offset where one goes), pointers (slot -> buffer
    index or None for a null pointer), buffers (bytes), itemsizes, guard (bool: NaN-filled guard
    regions around each buffer; exact-size buffers otherwise, for AddressSanitizer). A race build
    is told the allocations (its global memory) and its report is returned under "races".
    `announce` receives the allocations before the launch, so that a crash report can name the
    argument it concerns. The result's "guard_writes" lists (buffer index, first byte offset
    written outside it, bytes written there), the offset counted from the buffer's start
    (negative: before it).
    """
    buffers: list[bytes] = request["buffers"]
    guard = GUARD_BYTES if request.get("guard") else 0
    blocks: list[int] = []
    intact: set[int] = set()  # guarded blocks whose guards the launch left alone go back to the pool
    try:
        for data in buffers:
            blocks.append(_allocate(len(data), guard))
            if data:
                ctypes.memmove(blocks[-1] + guard, data, len(data))
        addresses = [block + guard for block in blocks]
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
        guard_writes = []
        for index, (address, data) in enumerate(zip(addresses, buffers)):
            found = _guard_writes(index, address, len(data), guard)
            guard_writes += found
            if guard and not found:
                intact.add(index)
        return {"status": status, "message": message, "changed": changed, "guard_writes": guard_writes,
                "races": race_report(request["library"]), "buffers": table}
    finally:
        for index, (block, data) in enumerate(zip(blocks, buffers)):
            _release(block, len(data), guard, index in intact)


#: Guarded blocks kept for the next launch, by size: their guards are still the fill pattern, so
#: a launch of the same shapes costs one copy per argument, not a fill of its guards.
_POOL: dict[tuple[int, int], list[int]] = {}
_POOL_LIMIT = 32
_GUARD_PATTERN = ctypes.create_string_buffer(bytes([_GUARD_FILL]) * GUARD_BYTES, GUARD_BYTES)


def _allocate(size: int, guard: int) -> int:
    kept = _POOL.get((size, guard))
    if kept:
        return kept.pop()
    ptr = ctypes.c_void_p()
    if _libc.posix_memalign(ctypes.byref(ptr), _ALIGNMENT, size + 2 * guard) != 0:
        raise MemoryError(f"cannot allocate {size} bytes for a kernel argument")
    if guard:
        ctypes.memset(ptr.value, _GUARD_FILL, size + 2 * guard)
    return ptr.value or 0


def _release(block: int, size: int, guard: int, intact: bool) -> None:
    if intact and sum(len(v) for v in _POOL.values()) < _POOL_LIMIT:
        _POOL.setdefault((size, guard), []).append(block)
    else:
        _libc.free(block)


def _guard_writes(index: int, address: int, size: int, guard: int) -> list[tuple[int, int, int]]:
    found = []
    for start, offset in ((address - guard, -guard), (address + size, size)):
        if guard and _libc.memcmp(start, _GUARD_PATTERN, guard) != 0:  # the common case costs one memcmp
            region = ctypes.string_at(start, guard)
            written = [i for i, byte in enumerate(region) if byte != _GUARD_FILL]
            found.append((index, offset + written[0], len(written)))
    return found
