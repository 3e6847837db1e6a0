"""Exceptions. One root; user errors also inherit the builtin a caller would expect."""

from __future__ import annotations


class FaVerifyError(Exception):
    """Root of every error fa_verify raises on purpose."""


class InvalidArgumentError(FaVerifyError, ValueError):
    """An argument has a bad value (unknown dtype, negative tile size, ...)."""


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
