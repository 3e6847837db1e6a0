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

A struct passed by value (a `fa_verify.kernels.abi.StructLayout` in the signature) travels as one
slot per field, in declaration order; the trampoline asserts that the compiler lays the struct out
as the layout says (`sizeof`, each field's `offsetof`), so the bytes PyCUDA packs from the same
layout are the ones the kernel reads, and writes each field's value at its offset.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence

from fa_verify.kernels.abi import StructLayout

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


def _one(name: str, signature: tuple) -> str:
    listed = ", ".join(k if isinstance(k, str) else "struct" for k in signature) or "no parameters"
    alias = symbol(name)  # a template instantiation is named by its C identifier from here on
    lines = [
        f"namespace fa_cpu_entry_{alias} {{",
        f"using F = decltype(&{name});",
        "using P = ::fa_cpu::signature<F>::params;",
        f"static_assert(::fa_cpu::signature<F>::arity == {len(signature)}, "
        f'"fa_verify: kernel {name} does not take {len(signature)} parameters as its signature '
        f'({listed}) says");',
    ]
    checks, values, slot = [], [], 0
    for index, kind in enumerate(signature):
        param = f"std::tuple_element_t<{index}, P>"
        if isinstance(kind, StructLayout):
            lines += _struct_asserts(name, index, param, kind)
            lines.append(f"static {param} make_{index}(const std::uint64_t* slots) {{")
            lines.append(f"    alignas({param}) unsigned char raw[sizeof({param})] = {{}};")
            for field in kind.fields:
                member = f"std::remove_cv_t<decltype({param}::{field.name})>"
                lines.append(f"    {{ const {member} value = ::fa_cpu::unpack<{member}>(slots[{slot}]); "
                             f"std::memcpy(raw + {field.offset}, &value, sizeof value); }}")
                checks.append(f"::fa_cpu::check_one<{member}>({slot}, slots[{slot}], itemsizes[{slot}], message, size)")
                slot += 1
            lines += [f"    {param} made; std::memcpy(static_cast<void*>(&made), raw, sizeof made);", "    return made;",
                      "}"]
            values.append(f"make_{index}(slots)")
            continue
        lines.append(
            f"static_assert(::fa_cpu::param_kind<F, {index}>() == '{KINDS[kind]}' || "
            f"::fa_cpu::param_kind<F, {index}>() == '-', "
            f'"fa_verify: parameter {index} of kernel {name} is not a {_noun(kind)}, '
            f"but the signature says '{kind}'\");"
        )
        checks.append(f"::fa_cpu::check_one<{param}>({slot}, slots[{slot}], itemsizes[{slot}], message, size)")
        values.append(f"::fa_cpu::unpack<{param}>(slots[{slot}])")
        slot += 1
    lines += [
        "static void body(const std::uint64_t* slots) { (&" + name + ")(" + ", ".join(values) + "); }",
        "static bool check(const std::uint64_t* slots, const std::int64_t* itemsizes, char* message, int size) {",
        "    return " + (" && ".join(checks) or "true") + ";",
        "}",
        "}",
        f'extern "C" __attribute__((visibility("default"))) int {EXPORT_PREFIX}{alias}(',
        "        const std::uint64_t* slots, const std::int64_t* itemsizes,",
        "        const ::fa_cpu::LaunchConfig* config, char* message, int message_size) {",
        f"    if (!fa_cpu_entry_{alias}::check(slots, itemsizes, message, message_size))",
        "        return ::fa_cpu::kBadArgument;",
        f"    return fa_cpu_run_grid(&fa_cpu_entry_{alias}::body, slots, config, message, message_size);",
        "}",
        "",
    ]
    return "\n".join(lines)


def _struct_asserts(name: str, index: int, param: str, layout: StructLayout) -> list[str]:
    """The compiler's layout of parameter `index` held to `layout`: a spec whose fields are not the
    struct's, in its order and with its types, fails the build naming the field."""
    fix = f"{layout.origin + ': ' if layout.origin else ''}list every field of the struct in declaration order " \
          "with its C type"
    fix = fix.replace("\\", "\\\\").replace('"', '\\"')  # a C string literal
    lines = [f"static_assert(std::is_class<{param}>::value, \"fa_verify: parameter {index} of kernel {name} is not "
             f"a struct, but the spec passes a struct there\");",
             f"static_assert(sizeof({param}) == {layout.size}, \"fa_verify: the struct parameter {index} of kernel "
             f"{name} is not {layout.size} bytes, as the spec's fields lay it out: {fix}\");"]
    for field in layout.fields:
        lines.append(f"static_assert(__builtin_offsetof({param}, {field.name}) == {field.offset}, \"fa_verify: field "
                     f"{field.name} of the struct parameter {index} of kernel {name} is not at byte {field.offset}, "
                     f"as the spec's fields lay it out: {fix}\");")
    return lines


def _noun(kind: str) -> str:
    return {"ptr": "pointer", "int": "integer", "float": "floating-point value"}[kind]
