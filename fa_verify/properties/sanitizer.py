"""AddressSanitizer pass: a CUDA target's kernel, built with ASan, runs without an invalid access.

The ordinary CPU-runner build places every argument between NaN-filled guard regions, so a read
past an argument shows as NaN in the output only if it reaches the output; AddressSanitizer
reports any out-of-bounds access to an argument, a `__shared__` array or the launch's dynamic
shared memory, with the file and line. It costs several times an ordinary run, so `check` runs it
on a bounded number of examples (SANITIZER_EXAMPLES) and says so.
"""

from __future__ import annotations

from fa_verify.properties._result import PropertyResult, not_applicable, passed
from fa_verify.properties._subject import as_backend, missing_runner_hook

#: Examples the AddressSanitizer pass runs per dtype selection (each also builds the ASan module once).
SANITIZER_EXAMPLES = 3


def not_checkable(backend) -> str | None:
    """Why fa_verify has no AddressSanitizer build of `backend` (None: it has)."""
    return missing_runner_hook(backend, "sanitized", "fa_verify has no AddressSanitizer build of it")


def check_address_sanitizer(backend, problem) -> PropertyResult:
    """The kernel's AddressSanitizer build runs the problem without an invalid memory access."""
    reason = not_checkable(backend)
    if reason is not None:
        return not_applicable("address_sanitizer", problem, reason)
    as_backend(backend).sanitized().run(problem)  # an ASan report raises KernelSanitizerError: a failing example
    return passed("address_sanitizer", problem)
