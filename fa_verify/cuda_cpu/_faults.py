"""Which argument a bad memory access was about, from its address.

A kernel that dereferences a null pointer, or runs far past an argument, kills the worker; the
runtime (or AddressSanitizer) writes the faulting address before the process dies. An emulated
PTX instruction (cp.async, ldmatrix) whose operand AddressSanitizer refuses stops the launch with
the address and the kernel's line. Compared with the launch's argument buffers and the
arguments passed as null pointers, the address says which one the kernel touched and how far
off; the usual cause of a null or wild one is a buffer the kernel's host allocates that the
caller (a kernel spec) did not provide.
"""

from __future__ import annotations

import re

#: The faulting address in the runtime's line ("fa_cpu: SIGSEGV at address 0x10", runtime/fiber_runtime.cpp),
#: an emulated instruction's (include/fa_cuda_cpu_ptx.h) or ASan's.
_ADDRESS = re.compile(r"\bat address 0x([0-9a-f]+)|SEGV on unknown address (?:0x)?([0-9a-f]+)")
#: Addresses below this are a null pointer plus an offset (Linux never maps the first page(s)).
NULL_PAGES = 1 << 16
#: Farther than this from every argument, an address is not said to be any argument's.
NEAR = 1 << 30
#: What to do about a buffer the kernel needs and was not given.
SCRATCH_HINT = ("if the kernel's host allocates a buffer for it (a running max or sum, a workspace), give the "
                "kernel one: a kernel spec declares it as [scratch.NAME] (size, dtype, fill) and names it in params")


def owner(output: str, buffers, buffer_names, null_names) -> str:
    """"; address 0x10 is 16 bytes past a null pointer: argument 5 `l` is passed as one; ..." for
    the faulting address in `output`, or "" when none is there. `buffers`: (address, size) of
    each argument buffer; `buffer_names` their descriptions; `null_names` the null arguments'."""
    if "fa_cpu: stack overflow" in output:  # the runtime saw the address in a stack's guard page
        return "; an emulated thread's stack overflowed (large per-thread arrays need a larger stack_kib)"
    found = _ADDRESS.search(output)
    if found is None:
        return ""
    address = int(found.group(1) or found.group(2), 16)
    where = f"; address {address:#x} is"
    if address < NULL_PAGES:
        offset = f"{address} bytes past a null pointer" if address else "a null pointer"
        which = (f": {' or '.join(null_names)} {'is' if len(null_names) == 1 else 'are'} passed as a null pointer"
                 if null_names else "")
        return f"{where} {offset}{which}; {SCRATCH_HINT}"
    # (distance, before the start?, words): at equal distances, past an end is the likelier reading
    nearest = []
    for (start, size), name in zip(buffers, buffer_names):
        if address >= start + size:
            nearest.append((address - start - size, False, f"{address - start - size} bytes past the end of {name}"))
        elif address < start:
            nearest.append((start - address, True, f"{start - address} bytes before the start of {name}"))
    if nearest and min(nearest)[0] < NEAR:
        return f"{where} {min(nearest)[2]}"
    return f"{where} outside every argument (a wild pointer, or a buffer the kernel expects: {SCRATCH_HINT})"
