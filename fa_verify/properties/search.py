"""Searching for a counterexample to one property on one target, with Hypothesis.

`search_property(backend, prop, selection)` draws problems the property is meaningful on and
the target can run — of every kind both are about (`fa_verify.properties.kinds`: dense, varlen,
paged), the target's dtypes, head dims and causal alignments probed once —, runs the
check on each, and returns a `PropertyOutcome`: passed, failed with the minimal counterexample
Hypothesis shrank to (and, given a folder, a reproducer script written there: `reproduce`), or
not applicable (with the reason). It searches on after a first failure (Hypothesis'
report_multiple_bugs, one exception type per kind of failure: `failure_kind`), so failures of
other rules, dtypes or causal modes are shrunk and reported apart (`other_failures`). It is the
engine of `fa_verify check`, of the pytest plugin's `fa_search` fixture, and so of properties/.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from dataclasses import dataclass, field, replace

from hypothesis import Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky, Unsatisfiable

from fa_verify.errors import BackendOutputError, FaVerifyError, KernelRunError, KernelTimeoutError
from fa_verify.isolation import RAISED_AT
from fa_verify.problem import AttentionProblem
from fa_verify.profiles import RELAXED_HEALTH_CHECKS
from fa_verify.properties._result import FAILED, NOT_APPLICABLE, PASSED, PropertyFailure, PropertyResult
from fa_verify.properties._subject import as_backend
from fa_verify.properties.kinds import edge_problems, kind_reason, problem_strategy
from fa_verify.properties.precision_hint import passes_under
from fa_verify.properties.preconditions import Seen
from fa_verify.properties.registry import NON_FINITE, Property, get_property
from fa_verify.properties.reproduce import NotReproducible, Target, write_reproducer
from fa_verify.properties.selection import Selection
from fa_verify.properties.shape_budget import budget_note, property_seeds

if sys.version_info < (3, 11):  # Hypothesis depends on the backport there
    from exceptiongroup import BaseExceptionGroup


@dataclass
class PropertyOutcome:
    """The result of searching one property on one target."""

    property: str
    backend: str
    status: str = PASSED
    #: examples judged (edge cases included; not-applicable draws excluded)
    examples: int = 0
    #: of which fixed edge cases (run before the drawn ones)
    fixed_examples: int = 0
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
    #: the target's declared conventions it was judged under, in words ("" for fa_verify's)
    judged_under: str = ""
    #: failures of other kinds (another rule, dtype or causal mode) than `failure`'s, each as
    #: (problem, property seed, result), found by searching on after the first
    other_failures: list = field(default_factory=list)
    #: for a failure, the looser legitimate precision presets its example passes under
    #: (`precision_hint.passes_under`; None where precision was not judged)
    passes_under: tuple | None = None
    #: the null-model guard's power: per trivial output, on how many informative examples the
    #: tolerance rejected it
    null_rejected: dict = field(default_factory=dict)
    #: the search stopped drawing because Selection.stop_at (`check --budget`) was reached
    budget_spent: bool = False
    #: the shape of every judged example and whether it failed (`preconditions`)
    seen: list = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def uninformative_only(self) -> bool:
        """Failed only because no example was informative: a statement about the property's
        tolerance on these problems, not about any output of the target."""
        return self.status == FAILED and self.failure is None and self.informative == 0

    def example_count(self) -> str:
        """"59 examples (54 fixed edge cases, 5 drawn)", or "5 examples" without fixed ones."""
        fixed = (f" ({self.fixed_examples} fixed edge cases, {self.examples - self.fixed_examples} drawn)"
                 if self.fixed_examples else "")
        return f"{self.examples} examples{fixed}"

    def informative_count(self) -> str:
        """", 17 informative" (or "" where the null-model guard does not apply)."""
        return "" if self.informative is None else f", {self.informative} informative"

    def message(self, verbose: bool = False) -> str:
        """What happened; for a failure, the minimal counterexample and the reproducer; failures of
        other kinds one line each (in full with `verbose`)."""
        if self.status == NOT_APPLICABLE:
            return f"{self.property}: not applicable ({self.reason})"
        if self.status == PASSED:
            ratio = "" if self.worst_ratio is None else f"; worst error/tolerance {self.worst_ratio:.3g}"
            notes = "".join(f"; {n}" for n in self.notes)
            return (f"{self.property}: passed, {self.example_count()}{self.informative_count()} in "
                    f"{self.seconds:.1f}s{ratio}{notes}")
        if self.failure is None:
            return f"{self.property}: FAILED, {self.example_count()}{self.informative_count()}: {self.reason}"
        kinds = f"; {1 + len(self.other_failures)} distinct failures" if self.other_failures else ""
        others = "".join(f"\n  also failed ({_kind_words(*failure_kind(p, r))}):"
                         + ("\n" + _counterexample(p, r, s) if verbose else f" {r.problem}: {r.detail.splitlines()[0]}")
                         for p, s, r in self.other_failures)
        if others and not verbose:
            others += "\n  (each in full with -v)"
        return (f"{self.property}: FAILED after {self.examples_to_failure} examples ({self.seconds:.1f}s){kinds}\n"
                + (f"  judged under: {self.judged_under}\n" if self.judged_under else "")
                + _counterexample(self.problem, self.failure, self.seed)
                + (f"\n  reproduce: {self.reproducer}" if self.reproducer else "")
                + (f"\n  no reproducer: {self.no_reproducer}" if self.no_reproducer else "")
                + others)

    def as_dict(self) -> dict:
        return {"property": self.property, "backend": self.backend, "status": self.status,
                "examples": self.examples, "fixed_examples": self.fixed_examples,
                "examples_to_failure": self.examples_to_failure,
                "seconds": round(self.seconds, 3), "reason": self.reason,
                "failure": None if self.failure is None else self.failure.message(),
                "reproducer": self.reproducer or None, "reproducer_files": self.reproducer_files,
                "no_reproducer": self.no_reproducer or None, "worst_ratio": self.worst_ratio,
                "notes": list(self.notes), "informative": self.informative,
                "uninformative": self.uninformative, "judged_under": self.judged_under or None,
                "other_failures": [r.message() for _, _, r in self.other_failures],
                "passes_under": None if self.passes_under is None else list(self.passes_under),
                "null_rejected": dict(self.null_rejected), "budget_spent": self.budget_spent}


def _counterexample(problem, result: PropertyResult, seed) -> str:
    """A failing example: the problem, its tags and seeds, and what failed (indented lines)."""
    tags = dict(problem.tags) if problem is not None else {}
    seed = f", property seed {seed}" if seed is not None else ""
    return (f"  minimal counterexample: {result.problem} distribution={tags.get('distribution')} "
            f"seed={tags.get('seed')}{seed}\n" + "\n".join(f"  {line}" for line in result.detail.splitlines()))


def failure_kind(problem, result: PropertyResult) -> tuple:
    """What tells two failures apart: the verdict rule that failed (else the property; "finite"
    for non-finite outputs, as the verdict names them), the dtype and the causal mode; a target that raised: the exception's type alone (a crash is one
    failure whatever the problem, and searching on through crashes and hangs costs time)."""
    if result.detail.startswith(TARGET_RAISED):
        return f"raised {result.detail[len(TARGET_RAISED):].split(':')[0].strip()}", None, None
    if result.detail.startswith(NON_FINITE):  # the verdict's rule of the same name: never passed
        return "finite", problem.dtype, problem.causal
    rule = next((v.rule for v in result.verdicts if not v.passed), result.name)
    return rule, problem.dtype, problem.causal


def _kind_words(rule, dtype, causal) -> str:
    return rule if dtype is None else f"{rule}, {dtype}, {'causal' if causal else 'non-causal'}"


@functools.cache
def _failure_type(kind: tuple) -> type:
    """A PropertyFailure subclass per failure kind: Hypothesis tells failures apart by their
    exception's type and place, so with report_multiple_bugs it shrinks and reports each kind."""
    return type("PropertyFailure", (PropertyFailure,), {"kind": kind})


def _raised(exc: BaseException) -> tuple[set, set | None]:
    """The failure kinds in what Hypothesis (or an edge case) raised, and those of them whose
    failure did not repeat on replay (Flaky); None for the latter: a Flaky error that names no
    kind (every failure is then reported as not repeated)."""
    kinds, repeated_not, flaky = set(), set(), isinstance(exc, Flaky)
    stack = [(exc, flaky)]
    while stack:
        error, in_flaky = stack.pop()
        if isinstance(error, BaseExceptionGroup):
            stack.extend((e, in_flaky or isinstance(error, Flaky)) for e in error.exceptions)
        elif isinstance(error, PropertyFailure):
            kinds.add(getattr(error, "kind", None))
            if in_flaky:
                repeated_not.add(getattr(error, "kind", None))
    return kinds, None if flaky and not repeated_not else repeated_not


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


class _TimedOut(BaseException):
    """Stops Hypothesis at a target's first timeout: not an Exception, so Hypothesis neither
    shrinks nor replays it (each try would wait the whole time limit again)."""


#: Appended to a timeout's detail: why its example is the first that timed out, not a minimal one.
NOT_SHRUNK = ("(not shrunk: each smaller try would wait the whole time limit again; this is the first "
              "example that timed out)")


#: Examples drawn after a failing edge case, for failures of other kinds (Hypothesis bounds its own
#: search on after a failure it found: to twice the calls it took, at least 10, at most 10 s).
CONTINUED_EXAMPLES = 10
#: How the detail of a failure begins when the target raised (crashed, timed out) instead of
#: returning: records tell such failures from wrong numbers by it.
TARGET_RAISED = "the target raised"
#: What a search cut short by Selection.stop_at says.
BUDGET_SPENT = "the time budget (--budget) was spent"
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
    Backend or a run(problem) function). `on_result(problem, result, seconds)` sees every result
    (shrinking's included); its `finish(outcome)`, if it has one, is called when the search ends.
    A failing example's reproducer is written into the folder `repro_dir` (none when None).

    Failures of the target — wrong numbers, a broken output protocol, a crash or any exception
    it raises — are counterexamples; other fa_verify errors (setup, misuse) are raised. A failure
    that does not repeat when its example is run again (a nondeterministic target) is still a
    failure, reported at the last example that failed, with both runs' values where the
    property compares two runs (determinism).
    """
    backend, prop = as_backend(backend), get_property(prop)
    outcome = PropertyOutcome(property=prop.name, backend=backend.name)
    if backend.judged_under.declared:
        outcome.judged_under = backend.judged_under.describe()
    start = time.perf_counter()
    strategy = (kind_reason(prop, backend) or (prop.target_reason and prop.target_reason(backend))
                or problem_strategy(prop, backend, selection))
    if isinstance(strategy, str):
        outcome.status, outcome.reason = NOT_APPLICABLE, strategy
        return outcome
    # Without shrinking the search is for speed (Hypothesis then stops at its first failure too).
    distinct = selection.distinct_failures and selection.shrink
    reasons, notes, ratios, setup_error = collections.Counter(), set(), [], []
    found = {}  # failure kind -> (problem, seed, result) of its last failing example: the minimal one
    max_examples = selection.max_examples
    if prop.max_examples is not None and prop.max_examples < max_examples:
        max_examples = prop.max_examples
        notes.add(f"at most {max_examples} examples ({prop.max_examples_reason})")
    uninformative = []  # the first uninformative result, for the message when none was informative

    def judge(problem, seed=0) -> bool:
        """Run and judge one example; False when the property does not apply to it."""
        problem = backend.judged_under.problem(problem)  # e.g. the scale as the target rounds it
        began = time.perf_counter()
        timed_out = False
        try:
            result = prop(backend, problem, seed)
        except KernelTimeoutError as exc:
            result, timed_out = _target_failure(prop, problem, exc), True
            result = replace(result, detail=f"{result.detail}\n{NOT_SHRUNK}")
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
        seen = Seen.of(problem, result.failed)
        if seen is not None:
            outcome.seen.append(seen)
        for name in result.null_rejected if result.informative else ():
            outcome.null_rejected[name] = outcome.null_rejected.get(name, 0) + 1
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
            kind = failure_kind(problem, result)
            found[kind] = (problem, seed, result)
            if timed_out:
                raise _TimedOut
            raise _failure_type(kind)(result)
        return True

    def spent() -> bool:
        if selection.stop_at is not None and time.monotonic() >= selection.stop_at:
            outcome.budget_spent = True
        return outcome.budget_spent

    def example(drawn, seed):
        if spent():  # the budget is spent: every further draw is rejected unjudged
            reject()
        if backend.supports(drawn.problem) is not None or not judge(drawn.problem, seed):
            reject()

    # No explain phase: the failure message says what went wrong, and the phase costs examples.
    phases = tuple(p for p in Phase if p is not Phase.explain and (selection.shrink or p is not Phase.shrink))
    database = (None if selection.database is None
                else _Namespaced(selection.database, f"{prop.name}:{backend.name}"))

    def search(examples: int) -> None:
        test = given(drawn=strategy.map(_Drawn), seed=property_seeds(prop, selection.shapes))(example)
        test = settings(max_examples=examples, deadline=None, database=database, phases=phases,
                        suppress_health_check=RELAXED_HEALTH_CHECKS, report_multiple_bugs=distinct,
                        print_blob=False, verbosity=Verbosity.quiet)(test)
        if selection.seed is not None:
            test = hypothesis_seed(selection.seed)(test)
        test()

    not_repeated = set()
    try:
        edges, edge_notes = edge_problems(prop, backend, selection)
        notes.update(edge_notes)
        if selection.shapes is not None:
            notes.add(budget_note(prop, selection.shapes))
        budget, why = selection.max_edge_cases, f"--max-examples {selection.max_edge_cases}"
        if prop.max_examples is not None and (budget is None or prop.max_examples < budget):
            budget, why = prop.max_examples, prop.max_examples_reason  # a slow check's cap holds its edge cases too
        if budget is not None and len(edges) > budget:
            notes.add(f"{budget} of the {len(edges)} fixed edge cases, spread over them ({why})")
            edges = edges[::-(-len(edges) // budget)][:budget] if budget else []
        for problem in edges:
            if spent():
                break
            try:
                judge(problem)
            except PropertyFailure:
                if not distinct:
                    raise
            finally:
                outcome.fixed_examples = outcome.examples
        # After a failing edge case too, a shorter search: failures of other kinds are reported apart.
        if not spent():
            search(min(max_examples, CONTINUED_EXAMPLES) if found else max_examples)
    except _Abort:
        raise setup_error[0] from None
    except _TimedOut:
        pass  # found holds the timeout (and any failure before it)
    except (PropertyFailure, Flaky, BaseExceptionGroup) as exc:
        if setup_error:  # an _Abort among several failures
            raise setup_error[0] from None
        if not found:  # a Flaky error of Hypothesis' own (its strategy), not of the target
            raise
        # Hypothesis replays each kind's minimal example last, so it is the one recorded; a
        # Flaky error means the replay passed: the last example that failed is reported.
        raised, not_repeated = _raised(exc)
        if not distinct and raised:  # not kinds only met while shrinking
            found = {kind: found[kind] for kind in found if kind in raised}
    except Unsatisfiable:
        pass
    if found:
        failures = [(problem, seed if prop.seeded else None,
                     replace(result, detail=NOT_REPEATED + result.detail)
                     if not_repeated is None or kind in not_repeated else result)
                    for kind, (problem, seed, result) in found.items()]
        (problem, seed, result), outcome.other_failures = failures[0], failures[1:]
        outcome.passes_under = passes_under(backend, prop, problem, seed or 0, result)
        outcome.status, outcome.failure, outcome.problem, outcome.seed = FAILED, result, problem, seed
        if repro_dir is not None:
            _write_reproducer(outcome, backend, prop, repro_dir, selection.seed)
    outcome.seconds = time.perf_counter() - start
    if outcome.status == PASSED and outcome.examples == 0 and outcome.budget_spent:
        outcome.status, outcome.reason = NOT_APPLICABLE, f"not run: {BUDGET_SPENT} before its first example"
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
    if outcome.budget_spent and outcome.examples:
        notes.add(f"{BUDGET_SPENT}: stopped drawing after {outcome.examples} examples")
    outcome.notes = tuple(sorted(notes))
    if hasattr(on_result, "finish"):  # check.results_recorder: only now are the minimal failures known
        on_result.finish(outcome)
    return outcome
