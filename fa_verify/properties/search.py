"""Searching for a counterexample to one property on one target, with Hypothesis.

`search_property(backend, prop, selection)` draws problems the property is meaningful on and
the target can run (its dtypes, head dims and causal alignments are probed once), runs the
check on each, and returns a `PropertyOutcome`: passed, failed with the minimal counterexample
Hypothesis shrank to (and, given a folder, a reproducer script written there: `reproduce`), or
not applicable (with the reason). It is the
engine of `fa_verify check`, of the pytest plugin's `fa_search` fixture, and so of properties/.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace

from hypothesis import Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky, Unsatisfiable

from fa_verify.errors import BackendOutputError, FaVerifyError, KernelRunError
from fa_verify.isolation import RAISED_AT
from fa_verify.problem import AttentionProblem
from fa_verify.profiles import RELAXED_HEALTH_CHECKS
from fa_verify.properties._result import FAILED, NOT_APPLICABLE, PASSED, PropertyFailure, PropertyResult
from fa_verify.properties._subject import as_backend
from fa_verify.properties.draw import capabilities, edge_problems, problem_strategy
from fa_verify.properties.precision_hint import precision_hint
from fa_verify.properties.registry import Property, get_property
from fa_verify.properties.reproduce import NotReproducible, Target, write_reproducer
from fa_verify.properties.selection import Selection
from fa_verify.properties.shape_budget import budget_note, property_seeds


@dataclass
class PropertyOutcome:
    """The result of searching one property on one target."""

    property: str
    backend: str
    status: str = PASSED
    #: examples judged (edge cases included; not-applicable draws excluded)
    examples: int = 0
    #: examples judged up to and including the first failing one (before shrinking)
    examples_to_failure: int | None = None
    seconds: float = 0.0
    #: not applicable: why
    reason: str = ""
    #: the minimal failing example's result, problem and property seed
    failure: PropertyResult | None = None
    problem: AttentionProblem | None = field(default=None, repr=False)
    seed: int | None = None
    #: the command that runs the reproducer written for the failure ("" when none was)
    reproducer: str = ""
    #: its script and inputs (absolute paths), or why none could be written
    reproducer_files: dict | None = None
    no_reproducer: str = ""
    worst_ratio: float | None = None
    notes: tuple = ()
    #: examples the null-model guard judged informative / uninformative (a trivial output
    #: passed too); informative is None for properties the guard does not apply to
    informative: int | None = None
    uninformative: int = 0

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def uninformative_only(self) -> bool:
        """Failed only because no example was informative: a statement about the property's
        tolerance on these problems, not about any output of the target."""
        return self.status == FAILED and self.failure is None and self.informative == 0

    def informative_count(self) -> str:
        """", 17 informative" (or "" where the null-model guard does not apply)."""
        return "" if self.informative is None else f", {self.informative} informative"

    def message(self) -> str:
        """What happened; for a failure, the minimal counterexample and the reproducer."""
        if self.status == NOT_APPLICABLE:
            return f"{self.property}: not applicable ({self.reason})"
        if self.status == PASSED:
            ratio = "" if self.worst_ratio is None else f"; worst error/tolerance {self.worst_ratio:.3g}"
            notes = "".join(f"; {n}" for n in self.notes)
            return (f"{self.property}: passed, {self.examples} examples{self.informative_count()} in "
                    f"{self.seconds:.1f}s{ratio}{notes}")
        if self.failure is None:
            return f"{self.property}: FAILED, {self.examples} examples{self.informative_count()}: {self.reason}"
        tags = dict(self.problem.tags) if self.problem is not None else {}
        seed = f", property seed {self.seed}" if self.seed is not None else ""
        return (f"{self.property}: FAILED after {self.examples_to_failure} examples ({self.seconds:.1f}s)\n"
                f"  minimal counterexample: {self.failure.problem} distribution={tags.get('distribution')} "
                f"seed={tags.get('seed')}{seed}\n"
                + "\n".join(f"  {line}" for line in self.failure.detail.splitlines())
                + (f"\n  reproduce: {self.reproducer}" if self.reproducer else "")
                + (f"\n  no reproducer: {self.no_reproducer}" if self.no_reproducer else ""))

    def as_dict(self) -> dict:
        return {"property": self.property, "backend": self.backend, "status": self.status,
                "examples": self.examples, "examples_to_failure": self.examples_to_failure,
                "seconds": round(self.seconds, 3), "reason": self.reason,
                "failure": None if self.failure is None else self.failure.message(),
                "reproducer": self.reproducer or None, "reproducer_files": self.reproducer_files,
                "no_reproducer": self.no_reproducer or None, "worst_ratio": self.worst_ratio,
                "notes": list(self.notes), "informative": self.informative,
                "uninformative": self.uninformative}


class _Namespaced(ExampleDatabase):
    """One Hypothesis database shared by every (property, target) search without mixing them:
    every search's inner test has the same source, hence the same key, so keys get a prefix."""

    def __init__(self, inner: ExampleDatabase, namespace: str):
        super().__init__()
        self.inner, self.prefix = inner, namespace.encode() + b"\0"

    def save(self, key, value):
        self.inner.save(self.prefix + key, value)

    def fetch(self, key):
        yield from self.inner.fetch(self.prefix + key)

    def delete(self, key, value):
        self.inner.delete(self.prefix + key, value)


class _Drawn:
    """A drawn problem whose repr is its description: Hypothesis reprs the examples it runs, and
    the arrays' repr is large, slow and unreadable. (Not a dataclass: Hypothesis would print
    a dataclass field by field.)"""

    def __init__(self, problem: AttentionProblem):
        self.problem = problem

    def __repr__(self) -> str:
        return f"{self.problem.describe()} {dict(self.problem.tags)}"


class _Abort(Exception):
    """Stops Hypothesis after a setup error, which is re-raised as itself."""


#: How the detail of a failure begins when the target raised (crashed, timed out) instead of
#: returning: records tell such failures from wrong numbers by it.
TARGET_RAISED = "the target raised"
#: Prefixed to a failure that did not repeat when Hypothesis replayed its example.
NOT_REPEATED = ("the failure did not repeat when the example was run again: the target's results vary "
                "from run to run (nondeterministic). When it failed: ")


def _target_failure(prop: Property, problem, exc: BaseException) -> PropertyResult:
    """A failed result for a target that raised: the exception and where it came from (the
    innermost frame), so that a bug in the target is told from one elsewhere."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    if getattr(exc, RAISED_AT, None):  # raised in the worker process of an isolated target
        where = f" (at {getattr(exc, RAISED_AT)})"
    what = (f"SystemExit({exc.code!r}): it called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
            else f"{type(exc).__name__}: {exc}")
    return PropertyResult(prop.name, FAILED, problem.describe(), detail=f"{TARGET_RAISED} {what}{where}")


def _write_reproducer(outcome: PropertyOutcome, backend, prop: Property, folder, search_seed) -> None:
    """The failing example's reproducer, in `folder`; or why there is none."""
    problem = outcome.problem
    try:
        written = write_reproducer(folder, Target.of(backend, problem.dtype), [prop], problem,
                                   outcome.seed or 0, failure=outcome.failure.detail, search_seed=search_seed)
    except (NotReproducible, OSError) as exc:
        outcome.no_reproducer = str(exc)
    else:
        outcome.reproducer, outcome.reproducer_files = written.command, written.files()


def search_property(backend, prop, selection: Selection = Selection(), on_result=None,
                    repro_dir=None) -> PropertyOutcome:
    """Search for a counterexample to `prop` (a Property, its name or check) on `backend` (a
    Backend or a run(problem) function). `on_result(problem, result, seconds)` sees every result.
    A failing example's reproducer is written into the folder `repro_dir` (none when None).

    Failures of the target — wrong numbers, a broken output protocol, a crash or any exception
    it raises — are counterexamples; other fa_verify errors (setup, misuse) are raised. A failure
    that does not repeat when its example is run again (a nondeterministic target) is still a
    failure, reported at the last example that failed, with both runs' values where the
    property compares two runs (determinism).
    """
    backend, prop = as_backend(backend), get_property(prop)
    outcome = PropertyOutcome(property=prop.name, backend=backend.name)
    start = time.perf_counter()
    strategy = (prop.target_reason and prop.target_reason(backend)) or problem_strategy(
        prop, capabilities(backend), selection)
    if isinstance(strategy, str):
        outcome.status, outcome.reason = NOT_APPLICABLE, strategy
        return outcome
    reasons, notes, ratios, last, setup_error = collections.Counter(), set(), [], [], []
    max_examples = selection.max_examples
    if prop.max_examples is not None and prop.max_examples < max_examples:
        max_examples = prop.max_examples
        notes.add(f"at most {max_examples} examples ({prop.max_examples_reason})")
    uninformative = []  # the first uninformative result, for the message when none was informative

    def judge(problem, seed=0) -> bool:
        """Run and judge one example; False when the property does not apply to it."""
        began = time.perf_counter()
        try:
            result = prop(backend, problem, seed)
        except (BackendOutputError, KernelRunError) as exc:
            result = _target_failure(prop, problem, exc)
        except FaVerifyError as exc:
            setup_error[:] = [exc]
            raise _Abort from None
        # SystemExit too: a target calling sys.exit() must not end fa_verify's process.
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever the target raises is a finding
            result = _target_failure(prop, problem, exc)
        if prop.seeded:
            result = replace(result, seed=seed)
        if on_result is not None:
            on_result(problem, result, time.perf_counter() - began)
        if not result.applicable:
            reasons[result.detail] += 1
            return False
        outcome.examples += 1
        if result.informative is not None:
            outcome.informative = (outcome.informative or 0) + result.informative
            outcome.uninformative += not result.informative
            if not result.informative and not uninformative:
                uninformative.append(result)
        if result.note:
            notes.add(result.note)
        if result.worst_ratio is not None:
            ratios.append(result.worst_ratio)
        if result.failed:
            if outcome.examples_to_failure is None:
                outcome.examples_to_failure = outcome.examples
            last[:] = [problem, seed, result]
            raise PropertyFailure(result)
        return True

    def example(drawn, seed):
        if backend.supports(drawn.problem) is not None or not judge(drawn.problem, seed):
            reject()

    # No explain phase: the failure message says what went wrong, and the phase costs examples.
    phases = tuple(p for p in Phase if p is not Phase.explain and (selection.shrink or p is not Phase.shrink))
    database = (None if selection.database is None
                else _Namespaced(selection.database, f"{prop.name}:{backend.name}"))
    search = given(drawn=strategy.map(_Drawn), seed=property_seeds(prop, selection.shapes))(example)
    search = settings(max_examples=max_examples, deadline=None, database=database, phases=phases,
                      suppress_health_check=RELAXED_HEALTH_CHECKS, report_multiple_bugs=False,
                      print_blob=False, verbosity=Verbosity.quiet)(search)
    if selection.seed is not None:
        search = hypothesis_seed(selection.seed)(search)
    try:
        edges, edge_notes = edge_problems(prop, backend, selection)
        notes.update(edge_notes)
        if selection.shapes is not None:
            notes.add(budget_note(prop, selection.shapes))
        for problem in edges:
            judge(problem)
        search()
    except _Abort:
        raise setup_error[0] from None
    except (PropertyFailure, Flaky) as exc:
        if not last:  # a Flaky error of Hypothesis' own (its strategy), not of the target
            raise
        # Hypothesis replays the minimal example last, so it is the one recorded; a Flaky
        # error means the replay passed: the last example that failed is reported.
        problem, seed, result = last
        if isinstance(exc, Flaky):
            result = replace(result, detail=NOT_REPEATED + result.detail)
        hint = precision_hint(backend, prop, problem, seed, result)
        result = replace(result, detail=f"{result.detail}\n{hint}") if hint else result
        outcome.status, outcome.failure, outcome.problem = FAILED, result, problem
        outcome.seed = seed if prop.seeded else None
        if repro_dir is not None:
            _write_reproducer(outcome, backend, prop, repro_dir, selection.seed)
    except Unsatisfiable:
        pass
    outcome.seconds = time.perf_counter() - start
    if outcome.status == PASSED and outcome.examples == 0:
        common = [f"{why} ({n}x)" for why, n in reasons.most_common(2)]
        outcome.status = NOT_APPLICABLE
        outcome.reason = "; ".join(common) if common else "no problem the target runs was drawn"
    if outcome.status == PASSED and outcome.informative == 0:
        first = uninformative[0]
        outcome.status = FAILED
        outcome.reason = (f"no informative example: on every one a trivial output passes the same "
                          f"tolerance (first: {first.problem}: {first.detail})")
    outcome.worst_ratio = max(ratios) if ratios else None
    outcome.notes = tuple(sorted(notes))
    return outcome
