"""The backend protocol: what every attention implementation under test looks like to fa_verify.

A backend has a name, the dtypes it runs, the precision model it claims per dtype, whether it
can run here (and why not), whether it can run a given problem (and why not), and
`run(problem) -> (out, lse | None)`. `Backend.run` checks availability and support, calls the
subclass's `_run`, and validates what came back, so no backend skips the output checks, nor
the check that q, k and v came back bitwise unchanged (`buffers.InputSnapshot`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from fa_verify.backends.buffers import InputSnapshot
from fa_verify.conventions import Conventions
from fa_verify.dtypes import DTYPE_NAMES, dtype_name, numpy_dtype
from fa_verify.errors import (
    BackendOutputError,
    BackendUnavailableError,
    InvalidArgumentError,
)
from fa_verify.limits import Limits
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem, unsupported_features


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine; `reason` says why not (empty when it can)."""

    available: bool
    reason: str = ""


AVAILABLE = Availability(True)


@dataclass(frozen=True)
class Convention:
    """A known, deliberate difference between a backend's output and fa_verify's conventions.

    Data only: what differs, the verdict rule and the property that see it, and the value the
    backend returns instead. A run that fails only because of declared conventions is reported
    as a declared deviation, not as a failure (`fa_verify report --fail-on deviation` counts it).
    The conventions a target's author declares (`fa_verify.conventions.Conventions`,
    `Backend.judged_under`) are judged under instead: the run passes, and says under what.
    """

    #: short identifier, e.g. "masked-row-lse-zero"
    name: str
    #: what the backend does instead, in words
    differs: str
    #: the verdict rule that sees it (one of fa_verify.verdict.RULES)
    rule: str
    #: the property of fa_verify.properties that sees it
    property: str
    #: the LSE the backend returns for fully masked rows (fa_verify's convention: -inf)
    masked_row_lse: float


class Backend(ABC):
    """An attention implementation: metadata plus `run(problem) -> (out, lse | None)`."""

    #: Unique name, used on the command line and in records.
    name: str
    #: Problem dtypes it runs, a subset of DTYPE_NAMES.
    dtypes: tuple[str, ...] = DTYPE_NAMES
    #: Known deviations from its precision model or from fa_verify's conventions, for the table.
    notes: str = ""
    #: Conventions of a third-party backend that differ from fa_verify's (declared, not failures).
    conventions: tuple[Convention, ...] = ()
    #: The problems it supports; strategies draw within them and `supports` enforces them.
    limits: Limits = Limits()
    #: The variants it implements (keys of fa_verify.problem.FEATURES); problems using others
    #: are not supported.
    features: tuple = ()
    #: The conventions it is judged under (declared by its author; `run` converts its outputs).
    judged_under: Conventions = Conventions()

    @abstractmethod
    def precision(self, dtype) -> PrecisionModel:
        """The precision model this backend claims for inputs of `dtype`."""

    def availability(self) -> Availability:
        return AVAILABLE

    def supports(self, problem: AttentionProblem) -> str | None:
        """None if the backend can run `problem`, else the reason it cannot."""
        if problem.dtype not in self.dtypes:
            return f"{self.name} does not run dtype={problem.dtype} (it runs {', '.join(self.dtypes)})"
        return unsupported_features(self.name, problem, self.features) or self.limits.check(problem)

    def run(self, problem: AttentionProblem) -> tuple[np.ndarray, np.ndarray | None]:
        """out [B,H,Nq,D] in the precision model's output dtype, and LSE [B,H,Nq] or None, in
        fa_verify's conventions (the target's declared ones, `judged_under`, converted: a base-2
        LSE comes back in base e as float64).

        Raises BackendOutputError if the run changed a bit of q, k or v."""
        availability = self.availability()
        if not availability.available:
            raise BackendUnavailableError(f"backend {self.name!r} is unavailable: {availability.reason}")
        reason = self.supports(problem)
        if reason is not None:
            raise InvalidArgumentError(
                f"backend {self.name!r} cannot run {problem.describe()}: {reason}")
        inputs = InputSnapshot.of(q=problem.q, k=problem.k, v=problem.v)
        out, lse = self._run(problem)
        inputs.check(self.name, problem.q, problem.k, problem.v)
        precision = self.precision(problem.dtype)
        check_output(self.name, problem, out, lse, precision.output, lse_dtype=precision.lse)
        return self.judged_under.normalise(problem, out, lse, precision)

    @abstractmethod
    def _run(self, problem: AttentionProblem) -> tuple[np.ndarray, np.ndarray | None]:
        """Compute (out, lse | None); `run` has checked availability and support."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_output(name: str, problem: AttentionProblem, out, lse, out_dtype,
                 layout: str = "bhsd", lse_dtype="fp32") -> None:
    """Raise BackendOutputError unless out / lse have the shapes and dtypes the protocol fixes.

    `layout` only changes the expected shape of `out` ("bshd": [B, Nq, H, D]); LSE is always
    [B, H, Nq], float32 unless a convention declares `lse_dtype`. Values are not checked: NaN or
    wrong numbers are findings, not misuse.
    """
    B, H, Nq, D = problem.out_shape
    out_shape = (B, Nq, H, D) if layout == "bshd" else (B, H, Nq, D)
    out_dtype = numpy_dtype(out_dtype)
    if not isinstance(out, np.ndarray):
        raise BackendOutputError(
            f"backend {name!r} returned out of type {type(out).__name__}; expected a numpy array")
    if out.shape != out_shape or out.dtype != out_dtype:
        raise BackendOutputError(
            f"backend {name!r} returned out with shape={out.shape} dtype={_dtype_label(out.dtype)}; "
            f"expected shape={out_shape} ([{','.join(layout.upper())}]) dtype={dtype_name(out_dtype)} "
            f"for {problem.describe()}")
    if lse is None:
        return
    if not isinstance(lse, np.ndarray):
        raise BackendOutputError(
            f"backend {name!r} returned lse of type {type(lse).__name__}; expected a numpy array or None")
    if lse.shape != (B, H, Nq) or lse.dtype != numpy_dtype(lse_dtype):
        in_input_dtype = lse.dtype == numpy_dtype(problem.dtype) != numpy_dtype(lse_dtype)
        raise BackendOutputError(
            f"backend {name!r} returned lse with shape={lse.shape} dtype={_dtype_label(lse.dtype)}; "
            f"expected shape={(B, H, Nq)} ([B,H,Nq]) dtype={dtype_name(lse_dtype)} for {problem.describe()}"
            + (" (an LSE in the input dtype is declared with --lse-dtype input)" if in_input_dtype else ""))


def _dtype_label(dtype: np.dtype) -> str:
    try:
        return dtype_name(dtype)
    except InvalidArgumentError:
        return str(dtype)


def parse_precision(spec: str, dtype) -> PrecisionModel:
    """PrecisionModel.parse, with errors that name the `precision` argument."""
    try:
        return PrecisionModel.parse(spec, dtype)
    except InvalidArgumentError as exc:
        named = str(exc).startswith(f"precision={spec!r}")  # PrecisionModel.parse's own messages do
        raise InvalidArgumentError(str(exc) if named else f"precision={spec!r}: {exc}") from None


def grouped(problem: AttentionProblem, work: np.dtype):
    """q as [B, Hkv, G, Nq, D] and k, v as [B, Hkv, 1, Nk, D] in the float dtype `work`.

    Query head h = kv_head * G + g reads kv head h // G; broadcasting over the G axis gives
    GQA without copying k and v. Reshape results [B, Hkv, G, ...] back to [B, H, ...].
    """
    B, H, Nq, D = problem.q.shape
    q = problem.q.astype(work).reshape(B, problem.kv_heads, problem.group_size, Nq, D)
    return q, problem.k.astype(work)[:, :, None], problem.v.astype(work)[:, :, None]


def grouped_variants(problem: AttentionProblem, work: np.dtype):
    """The ALiBi bias as [B, Hkv, G, Nq, Nk] and the sinks as [1, Hkv, G, 1] in `work` (each None
    when the problem has none), shaped like `grouped`'s arrays."""
    B, H, Nq, _ = problem.out_shape
    shape = (problem.kv_heads, problem.group_size)
    bias = problem.alibi_bias(np.arange(B)[:, None, None], np.arange(H)[None, :, None], np.arange(Nq))
    return (None if bias is None else bias.astype(work).reshape(B, *shape, Nq, problem.nk),
            None if problem.sinks is None else problem.sinks.astype(work).reshape(1, *shape, 1))
