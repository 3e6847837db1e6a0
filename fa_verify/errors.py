"""Exceptions. One root; user errors also inherit the builtin a caller would expect."""

from __future__ import annotations


class FaVerifyError(Exception):
    """Root of every error fa_verify raises on purpose."""


class InvalidArgumentError(FaVerifyError, ValueError):
    """An argument has a bad value (unknown dtype, negative tile size, ...)."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (scale='0.25', causal='no'): a TypeError as well."""


class InvalidProblemError(FaVerifyError, ValueError):
    """An attention problem is malformed: shapes, heads, dtype, or non-finite inputs."""


class BackendUnavailableError(FaVerifyError, RuntimeError):
    """A backend cannot run here; the message says why."""


class BackendOutputError(FaVerifyError, ValueError):
    """A backend returned something that is not an attention output of the problem's shape."""


class AttentionMismatch(FaVerifyError, AssertionError):
    """An output failed a rule of the error model; the message names the rule and the worst element."""

    def __init__(self, message: str, verdict=None):
        super().__init__(message)
        self.verdict = verdict


class KernelBuildError(FaVerifyError, RuntimeError):
    """A kernel source did not compile; the message carries the compiler's full output."""

    def __init__(self, message: str, *, log: str = "", command: tuple[str, ...] = ()):
        super().__init__(message)
        self.log = log
        self.command = command


class KernelUnsupportedError(KernelBuildError):
    """A kernel uses a construct that the CUDA-on-CPU runner cannot emulate (inline PTX, ...)."""


class KernelRunError(FaVerifyError, RuntimeError):
    """A launched kernel failed; `detail` holds what the runner saw (a sanitizer report, ...)."""

    def __init__(self, message: str, *, detail: str = ""):
        super().__init__(message)
        self.detail = detail


class KernelLaunchError(KernelRunError):
    """A launch a GPU would refuse (too much shared memory, a bad configuration): the kernel never ran."""


class KernelCrashError(KernelRunError):
    """The kernel crashed its process ("kernel crashed: SIGSEGV") or trapped."""


class KernelTimeoutError(KernelRunError):
    """The kernel did not finish within the time limit ("kernel timed out after N s")."""


class KernelSanitizerError(KernelRunError):
    """AddressSanitizer reported an invalid memory access (out of bounds, ...)."""


class KernelDeadlockError(KernelRunError):
    """The CPU runner found threads that can never leave their barriers."""


class KernelRaceError(KernelRunError):
    """The race detector (a racecheck build of the CUDA-on-CPU runner) saw conflicting accesses
    that nothing orders; `races` lists them (fa_verify.cuda_cpu.Race), the message says where."""

    def __init__(self, message: str, *, races: tuple = (), detail: str = ""):
        super().__init__(message, detail=detail)
        self.races = tuple(races)
