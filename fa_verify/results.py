"""The results store: one JSON line per comparison, appended as it happens.

Every comparison of a backend with the oracle — from `fa_verify report` sweeps,
`fa_verify check`, and pytest runs with `--fa-results` — becomes a `Record`: the problem,
the backend and its precision model, error statistics, bound and ensemble-rule ratios, the
verdict and timings. `ResultsStore(path).append(record)` writes it at once, so an
interrupted run keeps everything recorded so far, and `keys()` lets a run resume.

Why JSON lines with one `os.write` under `flock` on an O_APPEND descriptor: each record is a
single write at the end of the file, so several processes (pytest-xdist workers) can append
to one store without interleaving, and a reader never needs a lock. Non-finite floats (the
error of a NaN output is inf) are written as Python's json writes them (`Infinity`, `NaN`);
`summary.json`, meant for other tools, is strict JSON instead.

Format versions: a record carries `format_version`; `read()` skips (with a warning) lines of
another version, so an old store never crashes a newer reader.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import NO_WINDOW, used_features
from fa_verify.strategies import Shape, make_backward_problem, make_descaled_problem, make_problem

#: Version of the record format; bump it when a field changes meaning or disappears.
#: 2: the baseline rule's baseline_ratio became the ensemble rule's ensemble_ratio
#: 3: records gain `tensor` (what the errors are of: "out", or a gradient "dq", "dk", "dv",
#: "dsinks": a backward run records one per gradient) and problems `dout`, `dout_seed` (the
#: upstream gradient of a backward problem); a version 2 record reads as one of a forward problem
FORMAT_VERSION = 3
#: The versions `read()` accepts: version 2 records are version 3 ones of forward problems.
READ_VERSIONS = (2, 3)
#: Where a comparison came from.
SOURCES = ("report", "check", "pytest")
#: Names in Record.comparisons: the reference rounded to the dtype (the least error any kernel
#: can have) and naive same-precision attention (FA3's "standard attention"), same inputs.
EXACTLY_ROUNDED, NAIVE_SAME_PRECISION = "exactly-rounded", "naive-same-precision"


def utc_now() -> str:
    """The time now, as results and reports stamp it."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ResultsWarning(UserWarning):
    """A line of a results file was skipped (truncated, corrupt, or of another format version)."""


@dataclass(frozen=True)
class ProblemDescriptor(Shape):
    """A problem without its q, k, v — its Shape, dtype, masking, scale, variants and value
    source — enough to rebuild it with `make_problem` (and, for a backward problem, its upstream
    gradient's source: `make_backward_problem`).

    The variants (fa_verify.problem) are kept by value: slopes and sinks as tuples of their
    float32 values (nested for [B, H] slopes), exact in JSON; the defaults are a dense problem,
    which is what records written before variants existed describe."""

    dtype: str
    causal: bool
    causal_alignment: str
    #: None means 1/sqrt(head_dim)
    scale: float | None
    #: the value distribution and seed of `fa_verify.strategies.make_problem` (None if unknown)
    distribution: str | None
    seed: int | None
    window_size: tuple = NO_WINDOW
    softcap: float = 0.0
    alibi_slopes: tuple | None = None
    sinks: tuple | None = None
    #: a backward problem's upstream gradient: its distribution (`DOUT_DISTRIBUTIONS`) and the
    #: seed of `make_backward_problem` (None if drawn otherwise); None for a forward problem
    dout: str | None = None
    dout_seed: int | None = None
    #: an FP8 problem's descale range (low, high) of `make_descaled_problem` (None if drawn
    #: otherwise) and its output dtype; None for a problem of fp16/bf16/fp32 inputs
    descales: tuple | None = None
    output_dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.descales is not None:
            object.__setattr__(self, "descales", tuple(float(x) for x in self.descales))
        # JSON gives lists; the key must be hashable
        object.__setattr__(self, "window_size", tuple(self.window_size))
        for name in ("alibi_slopes", "sinks"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _nested_tuple(getattr(self, name)))

    @classmethod
    def of(cls, problem) -> "ProblemDescriptor":
        """The descriptor of an AttentionProblem or a BackwardProblem; distribution and seeds
        come from its tags."""
        tags = dict(problem.tags)
        return cls(batch=problem.batch, heads=problem.heads, kv_heads=problem.kv_heads,
                   nq=problem.nq, nk=problem.nk, head_dim=problem.head_dim, head_dim_v=problem.head_dim_v,
                   dtype=problem.dtype,
                   causal=problem.causal, causal_alignment=problem.causal_alignment,
                   scale=problem.scale, distribution=tags.get("distribution"),
                   seed=tags.get("seed"), window_size=problem.window_size, softcap=problem.softcap,
                   alibi_slopes=_values(problem.alibi_slopes), sinks=_values(problem.sinks),
                   dout=tags.get("dout"), dout_seed=tags.get("dout_seed"), descales=tags.get("descales"),
                   output_dtype=getattr(problem, "output_dtype", None) if problem.kind == "fp8" else None)

    def key(self) -> tuple:
        """A hashable identity of the problem, for resuming and pairing records."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def shape(self) -> Shape:
        return Shape.of(self)

    @property
    def kind(self) -> str:
        """The kind of problem (`fa_verify.properties.kinds`): "backward" with an upstream
        gradient, "fp8" with an FP8 dtype, else "dense"."""
        return "fp8" if self.output_dtype is not None else "dense" if self.dout is None else "backward"

    @property
    def features(self) -> tuple:
        """The variants the problem uses (keys of fa_verify.problem.FEATURES), in their order."""
        return used_features(self.window_size, self.softcap, self.alibi_slopes, self.sinks)

    @property
    def variant(self) -> str:
        """The variants' parameters as text ("" for a dense problem), 3 significant digits."""
        shown = {"window": f"window_size={self.window_size}", "softcap": f"softcap={self.softcap:.3g}",
                 "alibi": f"alibi_slopes={_short(self.alibi_slopes or ())}",
                 "sinks": f"sinks={_short(self.sinks or ())}"}
        return " ".join(shown[name] for name in self.features)

    def rebuild(self):
        """The AttentionProblem (BackwardProblem) again (needs a known distribution and seed,
        and dout seed)."""
        if (self.distribution is None or self.seed is None or (self.dout is not None and self.dout_seed is None)
                or (self.kind == "fp8" and self.descales is None)):
            raise InvalidArgumentError(
                f"problem {self.shape} has no distribution/seed tags; it cannot be rebuilt")
        if self.kind == "fp8":
            return make_descaled_problem(self.distribution, self.shape, self.dtype, self.seed, self.descales,
                                         causal=self.causal, output_dtype=self.output_dtype)
        problem = make_problem(self.distribution, self.shape, self.dtype, self.seed,
                               causal=self.causal, causal_alignment=self.causal_alignment,
                               scale=self.scale)
        problem = problem.replace(
            window_size=self.window_size, softcap=self.softcap,
            **{name: None if getattr(self, name) is None else np.array(getattr(self, name), np.float32)
               for name in ("alibi_slopes", "sinks")})
        return problem if self.dout is None else make_backward_problem(problem, self.dout, self.dout_seed)


def _values(x) -> tuple | None:
    """A float32 array's values as (nested) tuples of floats; None stays None."""
    return None if x is None else _nested_tuple(x.tolist())


def _nested_tuple(x):
    return tuple(_nested_tuple(v) for v in x) if isinstance(x, (list, tuple)) else float(x)


def _short(values) -> str:
    """[0.25, 0.0625] (nested for [B, H]), 3 significant digits."""
    if isinstance(values, tuple):
        return "[" + ", ".join(_short(v) for v in values) + "]"
    return f"{values:.3g}"


@dataclass(frozen=True)
class Record:
    """One comparison of a backend's output with the certified reference."""

    source: str
    backend: str
    #: PrecisionModel.as_dict() of the model the backend was judged under
    precision: dict
    problem: ProblemDescriptor
    #: ErrorSummary.as_dict() without the LSE part: dtype, abs/normalised/ulp stats
    #: (max, p99, median, rmse, mean, count) and worst_index; None when the shape was wrong
    out_errors: dict | None
    #: ErrorStats.as_dict() of the absolute LSE errors; None without LSE
    lse_errors: dict | None
    bound_ratio: float | None
    lse_bound_ratio: float | None
    #: the verdict's ensemble rule: error / its allowance (fails above 1)
    ensemble_ratio: float | None
    passed: bool
    #: the first rule that failed, None when passed
    rule: str | None
    #: e.g. {"run": backend seconds, "check": verdict seconds, "reference": oracle seconds
    #: (shared by the backends that ran the same problem)}
    seconds: dict
    #: UTC, ISO 8601
    timestamp: str
    #: name of the report sweep that produced it (None outside sweeps)
    sweep: str | None = None
    #: out error stats (abs/normalised/ulp) of other results on the same inputs, by name
    #: (EXACTLY_ROUNDED, NAIVE_SAME_PRECISION)
    comparisons: dict | None = None
    #: counts of the elementwise "normalised" and "ulp" errors on the fixed log bins of
    #: `fa_verify.report.histogram` (None when not measured)
    histograms: dict | None = None
    #: output elements where the error model gives no finite bound (the bound rule cannot
    #: judge them; bound_ratio covers only the others)
    unbounded: int = 0
    #: free-form, JSON-ready labels from the caller (test id, hypothesis example, ...)
    extra: dict = field(default_factory=dict)
    #: the tensor the errors are of: "out" (out_errors; lse_errors beside it), or one gradient
    #: of a backward problem ("dq", "dk", "dv", "dsinks": out_errors are that tensor's, and its
    #: run's other gradients are records of their own, written with it)
    tensor: str = "out"
    format_version: int = FORMAT_VERSION

    def key(self) -> tuple:
        """(backend, problem key): what a resumed run skips."""
        return (self.backend, self.problem.key())

    def to_json(self) -> str:
        """One line of JSON, without a newline."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "Record":
        data = json.loads(line)
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"a record is a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version not in READ_VERSIONS:
            raise UnknownFormatError(version)
        data["problem"] = ProblemDescriptor(**data["problem"])
        data["format_version"] = FORMAT_VERSION  # an older version's record is one of this version
        return cls(**data)


class UnknownFormatError(InvalidArgumentError):
    """A record of a format version this fa_verify does not read."""

    def __init__(self, version):
        super().__init__(f"format_version={version!r}; this fa_verify reads "
                         f"{', '.join(map(str, READ_VERSIONS))}")
        self.version = version


def _number(x) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


#: The rule of a record whose backend raised instead of returning an output.
RUN_ERROR = "run_error"


def record_from_verdict(problem, backend_name: str, precision, verdict, seconds, source: str,
                        extra: dict | None = None, *, sweep: str | None = None,
                        comparisons: dict | None = None, histograms: dict | None = None) -> Record:
    """A Record of `verdict` (from `check_attention`) for `problem` run by `backend_name`.

    precision: the PrecisionModel it was judged under (or its as_dict()).
    seconds: a mapping such as {"run": 0.1, "check": 0.02}, or one number (stored as "run").
    """
    summary = verdict.summary.as_dict() if verdict.summary is not None else None
    lse = summary.pop("lse_abs") if summary else None
    if summary:
        summary.pop("lse_worst_index")
    return record_of(problem, backend_name, precision, seconds, source, extra,
                     out_errors=summary, lse_errors=lse,
                     bound_ratio=_number(verdict.bound_ratio),
                     lse_bound_ratio=_number(verdict.lse_bound_ratio),
                     ensemble_ratio=_number(verdict.ensemble_ratio),
                     passed=bool(verdict.passed), rule=verdict.rule,
                     unbounded=int(verdict.unbounded_count),
                     sweep=sweep, comparisons=comparisons, histograms=histograms)


def record_from_error(problem, backend_name: str, precision, error: BaseException, seconds,
                      source: str, extra: dict | None = None, *, sweep: str | None = None,
                      tensor: str = "out") -> Record:
    """A failing Record (rule RUN_ERROR) for a run that raised `error` instead of returning."""
    return record_from_failure(problem, backend_name, precision, RUN_ERROR, f"{type(error).__name__}: {error}",
                               seconds, source, extra, sweep=sweep, tensor=tensor)


def record_from_failure(problem, backend_name: str, precision, rule: str, cause: str, seconds,
                        source: str, extra: dict | None = None, *, sweep: str | None = None,
                        tensor: str = "out") -> Record:
    """A failing Record without error measurements: `rule` failed (RUN_ERROR: the run raised;
    or a property judged without the oracle), `cause` says how (kept in extra["error"]);
    `tensor`: which of the run's tensors it stands for."""
    extra = {"error": cause, **(extra or {})}
    return record_of(problem, backend_name, precision, seconds, source, extra,
                     out_errors=None, lse_errors=None, bound_ratio=None, lse_bound_ratio=None,
                     ensemble_ratio=None, passed=False, rule=rule, sweep=sweep, tensor=tensor)


def record_of(problem, backend_name, precision, seconds, source, extra, **outcome) -> Record:
    """The fields every record has, around the outcome's (Record's other fields, by name)."""
    if source not in SOURCES:
        raise InvalidArgumentError(f"source={source!r}; use one of {SOURCES}")
    if not isinstance(seconds, dict):
        seconds = {"run": seconds}
    return Record(
        source=source, backend=backend_name,
        precision=precision if isinstance(precision, dict) else precision.as_dict(),
        problem=ProblemDescriptor.of(problem),
        seconds={k: float(v) for k, v in seconds.items()},
        timestamp=utc_now(),
        extra=dict(extra or {}), **outcome)


class ResultsStore:
    """A JSON-lines file of Records, safe for concurrent appenders."""

    def __init__(self, path):
        self.path = Path(path)

    def append(self, *records: Record) -> None:
        """Append records, one line each, in one write: atomically with respect to other
        appenders, and an interruption keeps all of them or none (a backward run's gradients
        are one record each: a resumed run finds all of them or reruns it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = "".join(record.to_json() + "\n" for record in records).encode()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # An interrupted writer may have left a line without its newline; start a new
            # line so this record is not glued onto the broken one.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
        finally:
            os.close(fd)  # closing releases the lock

    def read(self) -> list[Record]:
        """Every readable record, in file order; a missing file is an empty store.

        Skipped with a ResultsWarning: a truncated last line (an interrupted run), lines that
        are not records, and records of another format version.
        """
        if not self.path.exists():
            return []
        records = []
        lines = self.path.read_bytes().split(b"\n")
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                records.append(Record.from_json(raw.decode()))
            except UnknownFormatError as exc:
                warnings.warn(f"{self.path}:{number}: skipped a record of {exc}", ResultsWarning,
                              stacklevel=2)
            except (ValueError, TypeError, KeyError) as exc:
                what = "a truncated last line" if number == len(lines) else "an unreadable line"
                warnings.warn(f"{self.path}:{number}: skipped {what} ({exc})", ResultsWarning,
                              stacklevel=2)
        return records

    def keys(self, *, sweep: str | None = None) -> set:
        """(backend, problem key) of the records already stored, optionally of one sweep."""
        return {r.key() for r in self.read() if sweep is None or r.sweep == sweep}
