"""CpuKernelModule: a CUDA C source built for the CPU runner, launched like a GPU module.

Arrays behave as device buffers that are copied in before and out after each launch: the kernel
sees each numpy array as a contiguous buffer of its size between NaN-filled guard regions (exactly
its size in sanitizer builds: see _exec), and what it writes lands back in the same array. The launch itself runs in a worker process (see _process), so a crash, a hang or
a sanitizer report becomes an exception here.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from pathlib import Path

from fa_verify.cuda_cpu import _build, _exec, _faults, _host_code, _process, _race, _shared_limits
from fa_verify.cuda_cpu._trampolines import KINDS, symbol
from fa_verify.errors import (
    InvalidArgumentError,
    KernelCrashError,
    KernelDeadlockError,
    KernelRaceError,
    KernelRunError,
)
from fa_verify.kernels.abi import StructLayout

ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
DEFAULT_TIMEOUT = 60.0
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
#: A kernel's name, optionally qualified, optionally a template instantiation: `ns::f<64, __half>`.
_ENTRY = re.compile(r"^(::)?[A-Za-z_]\w*(::[A-Za-z_]\w*)*(\s*<.+>)?$", re.S)


class CpuKernelModule:
    """Build `source_path` for the CPU and launch its ``__global__`` entry points.

    entries: {entry: signature}. An entry is a kernel's name (``extern "C"`` or not, qualified
    or not) or a template instantiation written as in C++, ``"flash_fwd<64, 32, __half>"``
    (the build instantiates it: no alias line in the source is needed). A signature lists
    'ptr' | 'int' | 'float' per parameter, or a `fa_verify.kernels.abi.StructLayout` for a struct
    passed by value (the build checks it against the kernel's parameter types and the struct's
    layout; its argument is one value per field). defines: ``"NAME"``/``"NAME=VALUE"``
    strings or a {name: value} mapping. sanitize: build with AddressSanitizer and report
    out-of-bounds accesses to arrays and shared memory. racecheck: build with the race detector
    and raise KernelRaceError for conflicting accesses to shared or global memory that no barrier
    orders (not with sanitize). timeout: seconds a launch may take.
    isolated=False runs in this process (faster, but a crash kills it; not with sanitize).
    arch sets __CUDA_ARCH__ (80 -> 800) and the shared-memory maximum launches are held to;
    stack_kib is each emulated thread's stack. set_aside_host_code builds a copy of the file
    without its host code (launchers, main, torch extension glue, host-only includes; see
    _host_code), so a published file builds as it is.
    """

    def __init__(
        self,
        source_path: str | os.PathLike,
        entries: Mapping[str, Sequence[str]],
        include_dirs: Sequence[str | os.PathLike] = (),
        defines: Sequence[str] | Mapping[str, object] = (),
        sanitize: bool = False,
        *,
        racecheck: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        isolated: bool = True,
        arch: int = 80,
        stack_kib: int = 256,
        cache_dir: str | os.PathLike | None = None,
        set_aside_host_code: bool = False,
    ):
        if not os.path.isfile(source_path):
            raise InvalidArgumentError(f"source_path={str(source_path)!r} is not a file")
        self.entries = _check_entries(entries)
        if sanitize and not isolated:
            raise InvalidArgumentError("sanitize=True needs isolated=True: AddressSanitizer runs in a worker process")
        _check_positive("timeout", timeout)
        _check_positive("stack_kib", stack_kib)
        self.source_path = os.fspath(source_path)
        self.sanitize = bool(sanitize)
        self.racecheck = bool(racecheck)
        self.isolated = bool(isolated)
        self.timeout = float(timeout)
        self.stack_bytes = int(stack_kib) * 1024
        _shared_limits.arch_maximum(arch)  # an unknown arch is refused before the build
        self.arch = arch
        self.last_output = ""  # what the last launch printed (device printf)
        built, include_dirs = source_path, tuple(include_dirs)
        if set_aside_host_code:  # the copies of the file and its headers, found before the originals
            folder = Path(cache_dir) if cache_dir is not None else _build.default_cache_dir()
            built, include_dirs = _host_code.device_only_copy(Path(source_path), folder / "device_only", include_dirs)
        self.build = _build.build(
            built,
            self.entries,
            include_dirs=include_dirs,
            defines=_normalise_defines(defines),
            sanitize=self.sanitize,
            racecheck=self.racecheck,
            arch=arch,
            cache_dir=cache_dir,
        )

    @property
    def library_path(self) -> str:
        return str(self.build.library)

    def launch(
        self,
        name: str,
        grid,
        block,
        shared_bytes: int = 0,
        args: Sequence[object] = (),
        *,
        timeout: float | None = None,
        order: str = "forward",
        seed: int = 0,
        shared_opt_in: int | None = None,
        arg_names: Sequence[str] | None = None,
    ) -> None:
        """Run kernel `name` over `grid` x `block` with `shared_bytes` of dynamic shared memory.

        args follow the entry's signature: numpy arrays (or None, a null pointer, or
        Inside(array, offset), a pointer into an array) for 'ptr',
        Python/numpy integers for 'int', reals for 'float'. Arrays the kernel writes are updated
        in place. order: "forward" | "reverse" | "shuffle" (with seed) is the order in which the
        threads of a block run between synchronisation points; a race that one order hides,
        another shows. shared_opt_in: the bytes the host gives cudaFuncAttributeMaxDynamicSharedMemorySize
        (None: no opt-in, 48 KiB at most), held to the arch's maximum like a GPU (KernelLaunchError).
        arg_names: what each parameter is to the caller (a spec's "q", "l", "null"), for messages.
        Raises KernelLaunchError, KernelCrashError, KernelTimeoutError, KernelSanitizerError,
        KernelDeadlockError, KernelRaceError (a racecheck build), InvalidArgumentError.
        """
        if name not in self.entries:
            raise InvalidArgumentError(f"name={name!r} is not an entry of this module; entries: {sorted(self.entries)}")
        signature = self.entries[name]
        if len(args) != len(signature):
            raise InvalidArgumentError(
                f"args has {len(args)} values but kernel {name} takes {len(signature)}: {list(signature)}"
            )
        if order not in ORDERS:
            raise InvalidArgumentError(f"order={order!r} must be one of {sorted(ORDERS)}")
        timeout = self.timeout if timeout is None else timeout
        _check_positive("timeout", timeout)
        shared_bytes = _nonnegative("shared_bytes", shared_bytes)
        if shared_opt_in is not None:
            _nonnegative("shared_opt_in", shared_opt_in)
        _shared_limits.check_dynamic_shared(name, shared_bytes, self.arch, shared_opt_in)
        config = {
            "grid": _dims("grid", grid),
            "block": _dims("block", block),
            "shared_bytes": shared_bytes,
            "order": ORDERS[order],
            "seed": int(seed),
            "stack_bytes": self.stack_bytes,
        }
        slots, itemsizes, arrays, pointers, null_positions = _flatten(name, signature, args)
        what = f"{name} in {os.path.basename(self.source_path)}, grid {config['grid']}, block {config['block']}"
        def label(position) -> str:  # a parameter's index, or "index.field" inside a struct
            if arg_names is None:
                return ""
            index, _, field = str(position).partition(".")
            return f" `{arg_names[int(index)]}{'.' + field if field else ''}`"

        names = [f"argument {positions[0]}{label(positions[0])} ({a.dtype}{list(a.shape)}, {a.nbytes} bytes)"
                 for a, positions in arrays]
        nulls = [f"argument {position}{label(position)}" for position in null_positions]
        if self.isolated:
            result, self.last_output = self._run_in_worker(
                symbol(name), config, slots, itemsizes, arrays, pointers, timeout, what, names, nulls
            )
        else:
            result, self.last_output = self._run_here(symbol(name), config, slots, itemsizes, arrays, pointers), ""
        if self.last_output:
            sys.stdout.write(self.last_output)
        message = result["message"]
        if result["status"] == _exec.STATUS_TRAP:  # an emulated instruction's bad address: whose memory
            message += _faults.owner(message, result["buffers"], names, nulls)
        _raise_for_status(result["status"], message, name, args)
        races = result.get("races")
        if races and races["total"]:
            found = _race.parse(races["report"], self.library_path,
                                [(n, a.dtype.itemsize) for n, (a, _) in zip(names, arrays)])
            raise KernelRaceError(_race.describe(found, races["total"], what), races=found, detail=races["report"])

    def _run_in_worker(self, name, config, slots, itemsizes, arrays, pointers, timeout, what, names, nulls):
        buffers = [np.ascontiguousarray(a).tobytes() for a, _ in arrays]
        request = {
            "library": self.library_path,
            "name": name,
            "config": config,
            "slots": slots,
            "pointers": pointers,
            "buffers": buffers,
            "itemsizes": itemsizes,
            "guard": not self.sanitize,  # NaN-filled guard regions; ASan needs exact-size buffers
        }
        worker = _process.worker(self.sanitize)
        result, output = worker.run(request, timeout, what, names, nulls)
        for index, data in result["changed"].items():
            array, positions = arrays[index]
            if not array.flags.writeable:
                raise InvalidArgumentError(f"kernel {name} wrote to argument {positions[0]}, a read-only array")
            np.copyto(array, np.frombuffer(data, dtype=array.dtype).reshape(array.shape))
        for index, offset, count in result["guard_writes"]:
            where = f"{offset - arrays[index][0].nbytes} bytes past its end" if offset >= 0 else f"{-offset} bytes before its start"
            result = {"status": _exec.STATUS_OUT_OF_BOUNDS,
                      "message": f"{count} bytes changed outside {names[index]}, the first {where}"}
            break
        return result, output

    def _run_here(self, name, config, slots, itemsizes, arrays, pointers):
        contiguous = [np.ascontiguousarray(a) for a, _ in arrays]
        slots = list(slots)
        for slot, index in pointers.items():  # a pointer slot holds its byte offset into the array
            slots[slot] = 0 if index is None else contiguous[index].ctypes.data + slots[slot]
        table = [(b.ctypes.data, b.nbytes) for b in contiguous]
        _exec.register_buffers(self.library_path, table)
        status, message = _exec.launch(self.library_path, name, config, slots, itemsizes)
        for (array, _), buffer in zip(arrays, contiguous):
            if buffer is not array and array.flags.writeable:
                np.copyto(array, buffer)
        return {"status": status, "message": message, "races": _exec.race_report(self.library_path), "buffers": table}


@dataclass(frozen=True, eq=False)
class Inside:
    """A pointer argument `offset` elements into `array`. The kernel's buffer is all of `array`,
    so what it writes before or after the part it should use lands in `array` (guard bands)."""

    array: np.ndarray
    offset: int


def _flatten(name, signature, args):
    """Slots (int64 / double bits / a pointer's byte offset into its array), element sizes,
    distinct arrays, pointers, and the positions of the null pointers. A struct argument (a
    StructLayout in the signature) is a sequence of its fields' values, one slot each; its
    fields' positions are "index.field"."""
    slots: list[int] = []
    itemsizes: list[int] = []
    arrays: list[tuple[np.ndarray, list[int]]] = []
    pointers: dict[int, int | None] = {}
    null_positions: list = []
    seen: dict[int, int] = {}

    def one(kind, value, position):
        if kind == "ptr":
            offset = 0
            if isinstance(value, Inside):
                value, offset = value.array, value.offset * value.array.dtype.itemsize
            slots.append(offset)
            if value is None:
                pointers[len(slots) - 1] = None
                null_positions.append(position)
                itemsizes.append(0)
                return
            if not isinstance(value, np.ndarray):
                raise InvalidArgumentError(
                    f"argument {position} of {name} is a pointer: pass a numpy array or None, not {type(value).__name__}"
                )
            index = seen.get(id(value))
            if index is None:  # the same array passed twice is one buffer, as on the GPU
                index = seen[id(value)] = len(arrays)
                arrays.append((value, []))
            arrays[index][1].append(position)
            pointers[len(slots) - 1] = index
            itemsizes.append(value.dtype.itemsize)
        elif kind == "int":
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
                raise InvalidArgumentError(f"argument {position} of {name} is an 'int', got {value!r}")
            value = int(value)
            if not -(2**63) <= value < 2**63:
                raise InvalidArgumentError(f"argument {position} of {name}={value} does not fit in 64 bits")
            slots.append(value & 0xFFFFFFFFFFFFFFFF)
            itemsizes.append(0)
        else:
            if not isinstance(value, Real):
                raise InvalidArgumentError(f"argument {position} of {name} is a 'float', got {value!r}")
            slots.append(struct.unpack("<Q", struct.pack("<d", float(value)))[0])
            itemsizes.append(0)

    for position, (kind, value) in enumerate(zip(signature, args)):
        if isinstance(kind, StructLayout):
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != len(kind.fields):
                raise InvalidArgumentError(f"argument {position} of {name} is a struct: pass one value per field "
                                           f"({', '.join(f.name for f in kind.fields)})")
            for field, item in zip(kind.fields, value):
                one(field.kind, item, f"{position}.{field.name}")
        else:
            one(kind, value, position)
    return slots, itemsizes, arrays, pointers, null_positions


def _raise_for_status(status: int, message: str, name: str, args) -> None:
    if status == _exec.STATUS_OK:
        return
    if status == _exec.STATUS_BAD_ARGUMENT:
        found = re.match(r"argument (\d+)", message)
        if found and int(found.group(1)) < len(args) and isinstance(args[int(found.group(1))], np.ndarray):
            message += f" (dtype {args[int(found.group(1))].dtype})"
        raise InvalidArgumentError(f"kernel {name}: {message}")
    if status == _exec.STATUS_BAD_LAUNCH:
        raise InvalidArgumentError(f"launch of {name}: {message}")
    if status == _exec.STATUS_DEADLOCK:
        raise KernelDeadlockError(f"{name}: {message}", detail=message)
    if status == _exec.STATUS_OUT_OF_BOUNDS:
        raise KernelRunError(f"kernel {name} wrote out of bounds (a GPU may corrupt other data or fault): {message}",
                             detail=message)
    if status == _exec.STATUS_TRAP:
        raise KernelCrashError(f"kernel trapped: {message} ({name})", detail=message)
    raise KernelRunError(f"kernel {name} failed with status {status}: {message}", detail=message)


def _check_entries(entries) -> dict[str, tuple[str, ...]]:
    if not isinstance(entries, Mapping) or not entries:
        raise InvalidArgumentError(
            f"entries={entries!r} must be a non-empty mapping {{kernel name: ['ptr' | 'int' | 'float', ...]}}"
        )
    checked = {}
    for name, signature in entries.items():
        if not isinstance(name, str) or not _ENTRY.match(name.strip()):
            raise InvalidArgumentError(
                f"entry name {name!r} is neither a kernel's name nor a template instantiation such as "
                "'flash_fwd<64, 32, __half>'")
        name = name.strip()
        if isinstance(signature, str):
            raise InvalidArgumentError(f"signature of {name}={signature!r} must be a sequence such as ['ptr', 'int']")
        signature = tuple(signature)
        bad = [k for k in signature if not isinstance(k, StructLayout) and k not in KINDS]
        if bad:
            raise InvalidArgumentError(f"signature of {name} has {bad!r}; each parameter is one of {sorted(KINDS)}")
        checked[name] = signature
    return checked


def _normalise_defines(defines) -> tuple[str, ...]:
    if isinstance(defines, Mapping):
        items = [f"{k}={v}" if v is not None else str(k) for k, v in defines.items()]
    elif isinstance(defines, str):
        raise InvalidArgumentError(f"defines={defines!r} must be a sequence of 'NAME' or 'NAME=VALUE' strings")
    else:
        items = [f"{d[0]}={d[1]}" if isinstance(d, tuple) else str(d) for d in defines]
    for item in items:
        if not _IDENTIFIER.match(item.split("=", 1)[0]):
            raise InvalidArgumentError(f"define {item!r} does not start with a macro name")
    return tuple(items)


def _dims(label: str, value) -> list[int]:
    dims = [value] if isinstance(value, Integral) else list(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, Integral) and d >= 1 for d in dims):
        raise InvalidArgumentError(f"{label}={value!r} must be 1 to 3 positive integers")
    return [int(d) for d in dims] + [1] * (3 - len(dims))


def _nonnegative(label: str, value) -> int:
    if not isinstance(value, Integral) or value < 0:
        raise InvalidArgumentError(f"{label}={value!r} must be a non-negative integer")
    return int(value)


def _check_positive(label: str, value) -> None:
    if not isinstance(value, Real) or not value > 0:
        raise InvalidArgumentError(f"{label}={value!r} must be a positive number")
