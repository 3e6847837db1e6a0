"""The property suite against one target, programmatically: what `fa_verify check` runs.

`check_backend(backend, selection)` searches every property of `fa_verify.properties` (or the
ones named) on the target and returns a `CheckOutcome`: per property passed, failed (with
the minimal counterexample, examples-to-failure and, given a folder, a reproducer script) or not
applicable; the properties about the kinds of problem the target runs (`properties_for`).
`results_recorder` turns the examples a user would count — the passing ones and the minimal
failing one per distinct failure — into records of a `ResultsStore`, for reports: one per part
of the problem (a ragged batch's sequence, named in the record), with the rounded reference's
error on it (the report's "× rounded").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fa_verify.backends import Backend
from fa_verify.problem import AttentionProblem
from fa_verify.properties import FAILED, NOT_APPLICABLE, PASSED, Selection, get_property, properties_for
from fa_verify.properties.precision_hint import run_precision_hint
from fa_verify.properties.preconditions import run_preconditions
from fa_verify.properties.reproduce import NotReproducible, Target
from fa_verify.properties.search import search_property


@dataclass
class CheckOutcome:
    backend: str
    properties: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """No property failed (not applicable ones do not count either way)."""
        return all(p.status != FAILED for p in self.properties)

    @property
    def examples(self) -> int:
        return sum(p.examples for p in self.properties)

    @property
    def checked(self) -> bool:
        """Some example was judged (every property not applicable checks nothing)."""
        return self.examples > 0

    def counts(self) -> dict:
        return {status: sum(p.status == status for p in self.properties)
                for status in (PASSED, FAILED, NOT_APPLICABLE)}

    def precision_hint(self) -> str:
        """Whether the run's failures are a matter of declared precision (`run_precision_hint`)."""
        return run_precision_hint(self.properties)

    def preconditions(self) -> list:
        """The limits that would explain failures found only on part of the shape space."""
        return run_preconditions(self.properties)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "passed": self.passed, "checked": self.checked,
                "examples": self.examples, "precision_hint": self.precision_hint() or None,
                "preconditions": [p.message() for p in self.preconditions()],
                "seconds": round(self.seconds, 3), "counts": self.counts(),
                "properties": [p.as_dict() for p in self.properties]}


def check_backend(backend: Backend, selection: Selection = Selection(), properties=None,
                  on_result=None, progress=None, repro_dir=None) -> CheckOutcome:
    """Search each property about what `backend` runs (or those named in `properties`) on it.

    progress(outcome) is called after each property; on_result and repro_dir (the folder for
    failures' reproducers) as in `search_property`.
    """
    props = properties_for(backend) if properties is None else [get_property(p) for p in properties]
    outcome = CheckOutcome(backend=backend.name)
    start = time.perf_counter()
    for prop in props:
        result = search_property(backend, prop, selection, on_result=on_result, repro_dir=repro_dir)
        outcome.properties.append(result)
        if progress is not None:
            progress(result)
    outcome.seconds = time.perf_counter() - start
    return outcome


def results_recorder(path, backend: Backend, source: str, seed: int | None = None) -> "_Recorder":
    """An `on_result` callback appending to the ResultsStore at `path` the examples a user
    would count: each passing example's oracle verdicts as they come, and when the search ends
    (`search_property` calls its `finish(outcome)`) the minimal failing example of each distinct
    failure — not every example the search judged while shrinking. A failing example records
    its oracle verdicts, and a failing record when no failing verdict stands for its failure:
    the target raised, crashed or timed out (rule RUN_ERROR), or a property without an oracle
    verdict failed (rule: the property's name); the cause is in the record's extra["error"].
    Passing examples of such properties measure no error against the oracle: nothing to record.
    A verdict's record carries the error of the certified reference rounded to the dtype on the
    same problem (`comparisons`), the report's "× rounded". One record per part of the problem
    (a ragged batch's sequence, named in the record).
    `seed` (the search's Hypothesis seed) goes into every record's extra, and so does how a
    report's reproducer rebuilds a function target (`Target.as_dict()`; a built-in backend's
    name is enough)."""
    return _Recorder(path, backend, source, seed)


class _Recorder:
    def __init__(self, path, backend: Backend, source: str, seed: int | None):
        from fa_verify.results import ResultsStore

        self.store, self.backend, self.source, self.seed = ResultsStore(path), backend, source, seed
        self._targets = {}  # per dtype (the precision model is the dtype's); None: not recorded
        #: per failure kind, the last failing example (problem, result, seconds): Hypothesis
        #: replays each kind's minimal example last, so it is the one `finish` may record
        self._failing = {}

    def __call__(self, problem, result, seconds) -> None:
        from fa_verify.properties.search import failure_kind

        if result.failed:
            self._failing[failure_kind(problem, result)] = (problem, result, seconds)
        else:
            self._write(problem, result, seconds)

    def finish(self, outcome) -> None:
        """The search ended: record its minimal failing examples, one per distinct failure."""
        minimal = [outcome.problem] + [problem for problem, _, _ in outcome.other_failures]
        for problem, result, seconds in self._failing.values():
            if any(problem is m for m in minimal):
                self._write(problem, result, seconds)
        self._failing = {}

    def _target(self, dtype):
        if dtype not in self._targets:
            try:
                found = Target.of(self.backend, dtype)
            except NotReproducible:
                found = None
            self._targets[dtype] = found.as_dict() if found is not None and found.kind != "builtin" else None
        return self._targets[dtype]

    def _write(self, problem, result, seconds) -> None:
        from fa_verify.properties.search import TARGET_RAISED
        from fa_verify.results import RUN_ERROR, record_from_failure, record_from_verdict

        extra = {"property": result.name}
        if self._target(problem.dtype) is not None:
            extra["target"] = self._target(problem.dtype)
        if result.seed is not None:
            extra["property_seed"] = result.seed
        if self.seed is not None:
            extra["search_seed"] = self.seed
        precision = self.backend.precision(problem.dtype)
        parts = problem.parts()

        def about(index):
            """The problem a record is about: the whole, or a part of it (a ragged batch's
            sequence), named in its extra."""
            if parts == (problem,):
                return problem, extra
            index = index or 0
            return parts[index], {**extra, "kind": problem.kind, "part": index, "parts": len(parts),
                                  "where": problem.part_label(index)}

        for index, verdict in zip(result.verdict_parts or [None] * len(result.verdicts), result.verdicts):
            part, part_extra = about(index)
            self.store.append(record_from_verdict(part, self.backend.name, precision, verdict, seconds,
                                                  self.source, extra=part_extra,
                                                  comparisons=_rounded(part, verdict)))
        if result.failed and all(v.passed for v in result.verdicts):
            rule = RUN_ERROR if result.detail.startswith(TARGET_RAISED) else result.name
            part, part_extra = about(result.part if result.part is not None else 0)
            self.store.append(record_from_failure(part, self.backend.name, precision, rule, result.detail,
                                                  seconds, self.source, extra=part_extra))


def _rounded(problem, verdict, ref=None) -> dict | None:
    """Record.comparisons of a verdict on `problem`: the certified reference rounded to the
    dtype (`ref`, computed when not given); None where the output was not measured."""
    from fa_verify.oracle import reference
    from fa_verify.report.yardsticks import rounded_comparison

    if verdict.summary is None:  # the output had another shape: no errors to compare
        return None
    return rounded_comparison(problem, ref if ref is not None else reference(problem))


class Oracle:
    """The certified reference and verdicts for tests, recording each verdict when `results` is
    a path (what the pytest plugin's `fa_oracle` fixture is)."""

    def __init__(self, results=None, source: str = "pytest"):
        self.results, self.source = results, source

    def reference(self, problem: AttentionProblem):
        from fa_verify.oracle import reference

        return reference(problem)

    def check(self, out, problem: AttentionProblem, lse=None, precision=None, name: str = "user"):
        """`check_attention`'s Verdict for `out` (and `lse`), recorded under backend `name`."""
        from fa_verify.precision import PrecisionModel
        from fa_verify.verdict import check_attention

        started = time.perf_counter()
        ref = self.reference(problem)  # once: the verdict's, and the rounded one's recorded
        verdict = check_attention(out, problem, lse=lse, precision=precision, reference=ref)
        if self.results is not None:
            from fa_verify.results import ResultsStore, record_from_verdict

            model = precision or PrecisionModel.flash(problem.dtype)
            if isinstance(model, str):
                model = PrecisionModel.parse(model, problem.dtype)
            ResultsStore(self.results).append(record_from_verdict(
                problem, name, model, verdict, {"check": time.perf_counter() - started}, self.source,
                comparisons=_rounded(problem, verdict, ref)))
        return verdict

    def assert_close(self, out, problem: AttentionProblem, lse=None, precision=None, name: str = "user"):
        """Like `assert_attention_close`: raise AttentionMismatch (with the verdict) unless it passes."""
        from fa_verify.errors import AttentionMismatch

        verdict = self.check(out, problem, lse=lse, precision=precision, name=name)
        if not verdict.passed:
            raise AttentionMismatch(verdict.message(), verdict)
        return verdict
