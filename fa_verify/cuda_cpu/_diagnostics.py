"""Hints in front of g++'s output when a kernel does not build for the CPU runner, and that
output with the author's own errors first.

g++ says "'__ldcs_v2' was not declared in this scope"; the kernel author needs to read that the
CUDA-on-CPU shim does not emulate it (rather than hunt for a typo), or that an entry point named
in the signature table is missing. A typo in a kernel template's parameter list also breaks every
launch trampoline the runner generates for it (a hundred errors after the author's five): those
are counted, not shown, when the author's own errors are there (`own_errors_first`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: The file name the generated launch code carries in diagnostics (`_trampolines`).
GENERATED = "<fa_verify launch trampolines"
_ERROR = re.compile(r": (?:fatal )?error: ")

# g++ quotes with ‘…’ in a UTF-8 locale and '…' otherwise.
_UNDECLARED = re.compile(
    r"[‘']([A-Za-z_]\w*)[’'] (?:was not declared in this scope|is not a member of [‘']([\w:]+)[’'])"
)
_NO_MATCH = re.compile(r"no matching function for call to [‘']([A-Za-z_][\w:]*)\(")
_SHIM_REFUSAL = re.compile(r"fa_verify CUDA-on-CPU: ([^\"\n]+)")
_MISSING_HEADER = re.compile(r"fatal error: ([^:\s]+): No such file or directory")
_CUDA_LIKE = re.compile(
    r"^(__\w+|atomic\w+|cuda\w+|tex\w+|surf\w+|make_\w+|h2?\w+|nvcuda|wmma|cooperative_groups)$"
)


def hints(output: str, entries: Iterable[str]) -> list[str]:
    entries = set(entries)
    found: list[str] = []

    def add(text: str) -> None:
        if text not in found:
            found.append(text)

    for match in _UNDECLARED.finditer(output):
        name, scope = match.group(1), match.group(2)
        if name in entries and not scope:
            add(f"entry point `{name}` is not defined in the source "
                "(name a `__global__` function of the file, or a template instantiation such as `flash_fwd<64, 32, __half>`)")
        elif scope and ("wmma" in scope or "nvcuda" in scope):
            add(f"`{scope}::{name}` is not emulated by the CUDA-on-CPU shim's <mma.h>")
        elif _CUDA_LIKE.match(name):
            add(f"`{name}` is not emulated by the CUDA-on-CPU shim (fa_verify/cuda_cpu/include); "
                "see fa_verify.cuda_cpu.SUPPORTED for what is")
    for match in _NO_MATCH.finditer(output):
        name = match.group(1).split("::")[-1]
        if _CUDA_LIKE.match(name):
            add(f"`{name}` is not emulated by the CUDA-on-CPU shim for these argument types")
    for match in _MISSING_HEADER.finditer(output):
        add(f"header <{match.group(1)}> is neither provided by the CUDA-on-CPU shim nor found in include_dirs")
    for match in _SHIM_REFUSAL.finditer(output):  # the shim's own #error / static_assert texts
        add(match.group(1).strip())
    return found


def own_errors_first(output: str) -> tuple[str, int]:
    """The diagnostics before the first about the generated launch code, and how many errors were
    left out (0 when the output is returned whole: nothing of the author's comes first, or nothing
    generated). The trampolines close the unit, so g++ reaches them last: what it says from there on
    (their errors and the notes on the shim's candidates) follows from the errors before."""
    lines = output.splitlines()
    first = next((n for n, line in enumerate(lines) if line.startswith(GENERATED)), None)
    if first is None or not any(_ERROR.search(line) for line in lines[:first]):
        return output, 0
    return "\n".join(lines[:first]), sum(bool(_ERROR.search(line)) for line in lines[first:])
