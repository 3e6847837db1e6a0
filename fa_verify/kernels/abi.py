"""Kernel arguments in bytes, as the C ABI (x86-64 SysV and CUDA's, the same for these types) lays them out.

A struct passed by value is laid out from its fields' C types: each field at the next offset
that is a multiple of its alignment, the struct's alignment the largest of its fields' (or the
`__align__(n)` the author gave), its size rounded up to that alignment. A launch's parameter
buffer (what cuLaunchKernel's CU_LAUNCH_PARAM_BUFFER_POINTER takes) follows the same rule, each
parameter at a multiple of its alignment. The CPU runner's build asserts every offset and the
size against the compiler's `offsetof`/`sizeof` (fa_verify.cuda_cpu._trampolines), so a layout
derived here that the compiler disagrees with fails the build naming the field.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from fa_verify.errors import InvalidArgumentError

#: C scalar type -> (kind the runner passes it as, struct-module format); size and alignment are
#: the format's native ones. Any type spelled with a trailing `*` is a pointer ("P").
SCALARS = {
    "bool": ("int", "?"), "char": ("int", "b"), "signed char": ("int", "b"), "unsigned char": ("int", "B"),
    "int8_t": ("int", "b"), "uint8_t": ("int", "B"), "short": ("int", "h"), "unsigned short": ("int", "H"),
    "int16_t": ("int", "h"), "uint16_t": ("int", "H"), "int": ("int", "i"), "unsigned": ("int", "I"),
    "unsigned int": ("int", "I"), "int32_t": ("int", "i"), "uint32_t": ("int", "I"), "long": ("int", "q"),
    "unsigned long": ("int", "Q"), "long long": ("int", "q"), "unsigned long long": ("int", "Q"),
    "int64_t": ("int", "q"), "uint64_t": ("int", "Q"), "size_t": ("int", "Q"), "float": ("float", "f"),
    "double": ("float", "d"), "__half": ("float", "e"), "half": ("float", "e"),
}  # fmt: skip
#: The kinds of kernel parameters a spec passes directly, with their format.
PARAM_FORMATS = {"ptr": "P", "int": "i", "float": "f"}


def c_scalar(ctype: str, where: str) -> tuple[str, str]:
    """(kind, format) of a field's C type, e.g. 'const float *' -> ('ptr', 'P')."""
    spelled = re.sub(r"\s+", " ", re.sub(r"\b(const|volatile|__restrict__|__restrict|restrict)\b", "", ctype)).strip()
    if spelled.endswith("*"):
        return "ptr", "P"
    if spelled.removeprefix("std::") in SCALARS:
        return SCALARS[spelled.removeprefix("std::")]
    raise InvalidArgumentError(f"{where}={ctype!r} is not a C type the spec can lay out; use a pointer "
                               f"('const float*') or one of {', '.join(SCALARS)}")


@dataclass(frozen=True)
class Field:
    name: str
    kind: str     # "ptr" | "int" | "float": how the runners pass its value
    format: str   # struct-module format of its bytes
    offset: int


@dataclass(frozen=True)
class StructLayout:
    """A struct passed by value: its fields in declaration order, size and alignment."""

    fields: tuple
    size: int
    align: int
    #: where it is declared, for the build's messages (e.g. "kernel.toml: structs.args")
    origin: str = ""

    @classmethod
    def of(cls, fields: list[tuple[str, str]], where: str, align: int | None = None) -> "StructLayout":
        """From (name, C type) pairs in declaration order; `align` an `__align__(n)` of the struct."""
        laid, offset, largest = [], 0, 1
        for name, ctype in fields:
            kind, fmt = c_scalar(ctype, f"{where}.{name}")
            size = struct.calcsize(fmt)  # native size = native alignment for these scalars
            offset = -(-offset // size) * size
            laid.append(Field(name, kind, fmt, offset))
            offset, largest = offset + size, max(largest, size)
        if align is not None:
            if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
                raise InvalidArgumentError(f"{where}.align={align!r} must be a power of two (the struct's __align__)")
            largest = max(largest, align)
        return cls(tuple(laid), -(-offset // largest) * largest, largest, where.removesuffix(".fields"))

    def pack(self, values: list) -> bytes:
        """The struct's bytes from one value per field (pointers as integers); padding is zero."""
        data = bytearray(self.size)
        for f, value in zip(self.fields, values):
            struct.pack_into(f.format, data, f.offset, value)
        return bytes(data)

    def unpack(self, data: bytes) -> list:
        """One value per field from the struct's bytes (a bool field as the int the runners pass)."""
        values = [struct.unpack_from(f.format, data, f.offset)[0] for f in self.fields]
        return [int(v) if f.kind == "int" else v for f, v in zip(self.fields, values)]


def parameter_offsets(kinds: list) -> tuple[list[int], int]:
    """(offset of each parameter, total bytes) of a launch's parameter buffer: each parameter (a
    PARAM_FORMATS kind or a StructLayout) at a multiple of its alignment."""
    offsets, offset = [], 0
    for kind in kinds:
        size, align = (kind.size, kind.align) if isinstance(kind, StructLayout) else \
            (struct.calcsize(PARAM_FORMATS[kind]),) * 2
        offset = -(-offset // align) * align
        offsets.append(offset)
        offset += size
    return offsets, offset


def pack_parameters(kinds: list, values: list) -> bytes:
    """A launch's parameter buffer: ints and floats as 32 bits, pointers as 64, structs as laid out
    (their values: one per field)."""
    offsets, size = parameter_offsets(kinds)
    data = bytearray(size)
    for kind, value, offset in zip(kinds, values, offsets):
        if isinstance(kind, StructLayout):
            data[offset:offset + kind.size] = kind.pack(value)
        else:
            struct.pack_into(PARAM_FORMATS[kind], data, offset, value)
    return bytes(data)


def unpack_parameters(kinds: list, data: bytes) -> list:
    """pack_parameters' inverse (the fake CUDA driver reads a launch's buffer with it)."""
    offsets, size = parameter_offsets(kinds)
    if len(data) != size:
        raise InvalidArgumentError(f"the parameter buffer has {len(data)} bytes; these parameters take {size}")
    return [kind.unpack(data[offset:offset + kind.size]) if isinstance(kind, StructLayout)
            else struct.unpack_from(PARAM_FORMATS[kind], data, offset)[0] for kind, offset in zip(kinds, offsets)]
