"""What a property runs: a Backend, or a bare `run(problem) -> (out, lse | None)` function."""

from __future__ import annotations

from fa_verify.backends.base import Backend, parse_precision
from fa_verify.dtypes import DTYPE_NAMES, dtype_name
from fa_verify.errors import InvalidArgumentError
from fa_verify.precision import PrecisionModel


class RunFunctionBackend(Backend):
    """`run(problem) -> out | (out, lse)` as a backend judged under `precision`
    (a preset or spec; default "flash", FlashAttention's model)."""

    def __init__(self, run, name: str | None = None, precision: str = "flash", dtypes=DTYPE_NAMES):
        if not callable(run):
            raise InvalidArgumentError(f"run={run!r} must be a Backend or a callable run(problem)")
        parse_precision(precision, "fp32")  # reject a bad spec now, not at the first run
        self._fn, self._precision = run, precision
        self.dtypes = tuple(dtype_name(d) for d in dtypes)
        self.name = name or getattr(run, "__qualname__", type(run).__qualname__)

    def precision(self, dtype) -> PrecisionModel:
        return parse_precision(self._precision, dtype)

    def _run(self, problem):
        result = self._fn(problem)
        return result if isinstance(result, tuple) else (result, None)


def as_backend(subject, **kwargs) -> Backend:
    """A Backend as it is; a run(problem) function wrapped (kwargs: name, precision, dtypes)."""
    if isinstance(subject, Backend):
        if kwargs:
            raise InvalidArgumentError(
                f"{sorted(kwargs)} only apply to run functions; {subject.name!r} is a Backend already")
        return subject
    return RunFunctionBackend(subject, **kwargs)


def unsupported(backend: Backend, *problems) -> str | None:
    """Why `backend` cannot run one of the (derived) `problems`, or None."""
    for problem in problems:
        reason = backend.supports(problem)
        if reason is not None:
            return f"{backend.name} cannot run the derived problem {problem.describe()}: {reason}"
    return None


def missing_runner_hook(backend, hook: str, why: str) -> str | None:
    """Why a property of CUDA kernels on the CPU runner cannot judge `backend`: it has no `hook`
    method (None: it has). `why` says what the property needs the kernel's build for."""
    backend = as_backend(backend)
    if getattr(backend, hook, None) is None:
        return f"{backend.name} is not a CUDA kernel run by the CUDA-on-CPU runner: {why}"
    return None
