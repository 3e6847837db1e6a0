"""The backend protocol: what every attention implementation under test looks like to fa_verify.

One protocol for every kind of problem (`fa_verify.kinds`: dense, varlen, paged). A backend has
a name, the kinds of problem it runs (`kinds`), the dtypes it runs, the precision model it
claims per dtype, whether it can run here (and why not), whether it can run a given problem
(and why not), and `run(problem) -> (out, lse | None)` in the problem's layout. `Backend.run`
checks availability and support, calls the subclass's `_run`, and validates what came back
against the problem's own shapes, so no backend skips the output checks, nor the check that
its inputs came back bitwise unchanged (`buffers.InputSnapshot`). The kind of problem is data:
nothing here branches on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from fa_verify.backends import watch
from fa_verify.backends.buffers import InputSnapshot
from fa_verify.conventions import Conventions
from fa_verify.dtypes import DTYPE_NAMES, round_to
from fa_verify.errors import BackendUnavailableError, InvalidArgumentError
from fa_verify.limits import Limits
from fa_verify.outputs import check_outputs
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine; `reason` says why not (empty when it can)."""

    available: bool
    reason: str = ""


AVAILABLE = Availability(True)


@dataclass(frozen=True)
class Deviation:
    """A known, deliberate difference between a backend's output and fa_verify's conventions.

    Data only: what differs, the verdict rule and the property that see it, and the value the
    backend returns instead. A run that fails only because of declared deviations is reported
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
    #: Declared deviations of a third-party backend from fa_verify's conventions (reported, not failures).
    deviations: tuple[Deviation, ...] = ()
    #: The problems it supports; strategies draw within them and `supports` enforces them.
    limits: Limits = Limits()
    #: The variants it implements (keys of fa_verify.problem.FEATURES); problems using others
    #: are not supported.
    features: tuple = ()
    #: The conventions it is judged under (declared by its author; `run` converts its outputs).
    judged_under: Conventions = Conventions()
    #: The kinds of problem it runs (`fa_verify.kinds.KINDS`: "dense", "varlen", "paged").
    kinds: tuple = ("dense",)
    #: The shapes (B, H, Hkv, Nq, Nk, D) of the task it was written for (a KernelBench module's
    #: get_inputs): the agreement properties' edge cases include each, with one batch and one
    #: K/V head, and shapes around it (`properties.draw.around_task_shapes`).
    task_shapes: tuple = ()
    #: Whether its precision model is declared by its user (a callable's --precision), so a
    #: failure may say which looser model would pass (`properties.precision_hint`).
    declared_precision: bool = False
    # --- what ragged targets (varlen, paged) declare beyond the limits of each sequence ---
    #: it honours RaggedProblem.num_splits (a split-KV kernel)
    splits: bool = False
    #: the page sizes it supports (paged KV), or None: any
    page_sizes: tuple | None = None
    #: a sequence's output is bitwise the same whatever else the batch holds (then "varlen ==
    #: each sequence alone" is checked bitwise)
    batch_invariant: bool = False
    #: it writes into sentinel-filled buffers it is given (`buffers.output_buffers`), so that
    #: rows it leaves unwritten show (the unwritten_rows property)
    writes_buffers: bool = False
    #: a paged target's twin taking the varlen layout, if it has one (paged_contiguous compares them)
    contiguous: "Backend | None" = None
    # --- what backward targets declare ---
    #: it takes an upstream LSE gradient (dlse): problems with one are drawn
    takes_dlse: bool = False
    #: its dq is bitwise the same from run to run (a deterministic mode; dk and dv always must be)
    deterministic_dq: bool = False

    @abstractmethod
    def precision(self, dtype) -> PrecisionModel:
        """The precision model this backend claims for inputs of `dtype`."""

    def availability(self) -> Availability:
        return AVAILABLE

    def supports(self, problem) -> str | None:
        """None if the backend can run `problem`, else the reason it cannot."""
        if problem.kind not in self.kinds:
            return f"{self.name} runs {' and '.join(self.kinds)} problems, not {problem.kind} ones"
        if problem.dtype not in self.dtypes:
            return f"{self.name} does not run dtype={problem.dtype} (it runs {', '.join(self.dtypes)})"
        rounding = self.precision(problem.dtype).input_rounding
        if rounding and not all(np.isfinite(round_to(x, rounding)).all() for x in (problem.q, problem.k, problem.v)):
            return (f"{self.name} rounds q, k, v to {rounding} (precision inputs={rounding}): this problem's inputs "
                    f"exceed {rounding}'s range")
        return problem.unsupported_by(self)

    def run(self, problem) -> tuple:
        """The problem's outputs (`problem.outputs`) in its layout: for a forward problem out and
        LSE (or None; dense: out [B,H,Nq,D], LSE [B,H,Nq]), out in the precision model's output
        dtype, in fa_verify's conventions (the target's declared ones, `judged_under`, converted
        part by part: a base-2 LSE comes back in base e as float64); for a backward problem
        (dq, dk, dv) and, with sinks, dsinks.

        Raises BackendOutputError if the run changed a bit of its inputs or returned the wrong
        shapes or dtypes."""
        availability = self.availability()
        if not availability.available:
            raise BackendUnavailableError(f"backend {self.name!r} is unavailable: {availability.reason}")
        reason = self.supports(problem)
        if reason is not None:
            raise InvalidArgumentError(
                f"backend {self.name!r} cannot run {problem.describe()}: {reason}")
        result = leaving_inputs_unchanged(self.name, problem.input_arrays(), lambda: self._run(problem))
        precision = self.precision(problem.dtype)
        result = check_outputs(self.name, problem, result, precision)
        watch.seen(problem, result, precision)
        if not self.judged_under.about_outputs.declared:  # flushing changes what is judged, not the outputs
            return result
        return problem.join([self.judged_under.normalise(part, *pair, precision)
                             for part, pair in zip(problem.parts(), problem.split(*result))])

    @abstractmethod
    def _run(self, problem) -> tuple:
        """Compute the problem's outputs in its layout (a forward problem: (out, lse | None); a
        ragged problem's arrays: `problem.inputs()`); `run` has checked availability and support."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def leaving_inputs_unchanged(name: str, arrays: dict, call):
    """call()'s result; BackendOutputError if it changed a bit of one of `arrays`."""
    snapshot = InputSnapshot.of(**arrays)
    result = call()
    snapshot.check(name, *arrays.values())
    return result


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
