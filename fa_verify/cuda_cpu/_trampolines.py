"""C++ launch trampolines appended to each kernel unit, one per entry point.

An entry is a kernel's name (any linkage: `extern "C"` is not needed, the trampoline calls the
kernel from C++) or a template instantiation written as in C++, ``flash_fwd<64, 32, __half>``:
the trampoline's use of it instantiates the template, and its exported launcher gets a C
identifier (`symbol`).

Macros are gone by the time these are appended (the unit is preprocessed), so they are spelled out.

Why generated C++ rather than calling the kernel through ctypes: a CUDA thread is a fiber that
the runtime starts, so the runtime needs a C function that unpacks the arguments and calls the
kernel; and the compiler, which knows the kernel's parameter types, is the right place to check
them against the Python-side signature — a mismatch fails the build with a message naming the
parameter, instead of running the kernel on garbage.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence

KINDS = {"ptr": "p", "int": "i", "float": "f"}
EXPORT_PREFIX = "fa_cpu_launch_"


def symbol(entry: str) -> str:
    """A C identifier for `entry`: the name itself, or for a template instantiation such as
    ``flash_fwd<64, 32, __half>`` its words joined by ``_`` and a hash of the exact spelling."""
    if re.fullmatch(r"[A-Za-z_]\w*", entry):
        return entry
    words = "_".join(re.findall(r"\w+", entry))
    return f"{words}_{hashlib.sha256(entry.encode()).hexdigest()[:8]}"


def generate(entries: Mapping[str, Sequence[str]], source_name: str) -> str:
    parts = [f'\n# 1 "<fa_verify launch trampolines for {source_name}>"\n']
    for name, signature in entries.items():
        parts.append(_one(name, tuple(signature)))
    return "".join(parts)


def _one(name: str, signature: tuple[str, ...]) -> str:
    listed = ", ".join(signature) or "no parameters"
    alias = symbol(name)  # a template instantiation is named by its C identifier from here on
    lines = [
        f"namespace fa_cpu_entry_{alias} {{",
        f"using F = decltype(&{name});",
        f"static_assert(::fa_cpu::signature<F>::arity == {len(signature)}, "
        f'"fa_verify: kernel {name} does not take {len(signature)} parameters as its signature '
        f'({listed}) says");',
    ]
    for index, kind in enumerate(signature):
        lines.append(
            f"static_assert(::fa_cpu::param_kind<F, {index}>() == '{KINDS[kind]}' || "
            f"::fa_cpu::param_kind<F, {index}>() == '-', "
            f'"fa_verify: parameter {index} of kernel {name} is not a {_noun(kind)}, '
            f"but the signature says '{kind}'\");"
        )
    lines += [
        "static void body(const std::uint64_t* slots) { ::fa_cpu::invoke(&" + name + ", slots); }",
        "}",
        f'extern "C" __attribute__((visibility("default"))) int {EXPORT_PREFIX}{alias}(',
        "        const std::uint64_t* slots, const std::int64_t* itemsizes,",
        "        const ::fa_cpu::LaunchConfig* config, char* message, int message_size) {",
        f"    if (!::fa_cpu::check_args(&{name}, slots, itemsizes, message, message_size))",
        "        return ::fa_cpu::kBadArgument;",
        f"    return fa_cpu_run_grid(&fa_cpu_entry_{alias}::body, slots, config, message, message_size);",
        "}",
        "",
    ]
    return "\n".join(lines)


def _noun(kind: str) -> str:
    return {"ptr": "pointer", "int": "integer", "float": "floating-point value"}[kind]
