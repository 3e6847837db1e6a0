"""C++ launch trampolines appended to each kernel unit, one per entry point.

Macros are gone by the time these are appended (the unit is preprocessed), so they are spelled out.

Why generated C++ rather than calling the kernel through ctypes: a CUDA thread is a fiber that
the runtime starts, so the runtime needs a C function that unpacks the arguments and calls the
kernel; and the compiler, which knows the kernel's parameter types, is the right place to check
them against the Python-side signature — a mismatch fails the build with a message naming the
parameter, instead of running the kernel on garbage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

KINDS = {"ptr": "p", "int": "i", "float": "f"}
EXPORT_PREFIX = "fa_cpu_launch_"


def generate(entries: Mapping[str, Sequence[str]], source_name: str) -> str:
    parts = [f'\n# 1 "<fa_verify launch trampolines for {source_name}>"\n']
    for name, signature in entries.items():
        parts.append(_one(name, tuple(signature)))
    return "".join(parts)


def _one(name: str, signature: tuple[str, ...]) -> str:
    listed = ", ".join(signature) or "no parameters"
    lines = [
        f"namespace fa_cpu_entry_{name} {{",
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
        f'extern "C" __attribute__((visibility("default"))) int {EXPORT_PREFIX}{name}(',
        "        const std::uint64_t* slots, const std::int64_t* itemsizes,",
        "        const ::fa_cpu::LaunchConfig* config, char* message, int message_size) {",
        f"    if (!::fa_cpu::check_args(&{name}, slots, itemsizes, message, message_size))",
        "        return ::fa_cpu::kBadArgument;",
        f"    return fa_cpu_run_grid(&fa_cpu_entry_{name}::body, slots, config, message, message_size);",
        "}",
        "",
    ]
    return "\n".join(lines)


def _noun(kind: str) -> str:
    return {"ptr": "pointer", "int": "integer", "float": "floating-point value"}[kind]
