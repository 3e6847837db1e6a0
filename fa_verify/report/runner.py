"""Run a sweep: every point on every backend, judged against the oracle, appended to the store.

Per point the problem is built once, and so are the things every backend is compared with (its
kind's comparators, `COMPARATORS`): for a forward problem the certified reference, naive
same-precision attention (FA3's "standard attention"), the reference rounded to the dtype (the
best any kernel can do), and per precision model the error-model bound and the honest ensemble
of the verdict's ensemble rule; for a backward problem their gradients' counterparts
(`gradients`), one record per gradient; for an FP8 problem the FP8 reference, its rounding to
the output dtype and FlashAttention-3's FP8 bound (`fp8`).
Each backend's run then costs its own run time plus its verdict.

Records are appended as they are made, so an interrupted run loses at most the run in
flight; `done` keys (from the store, for --resume) are skipped.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from fa_verify.backends.naive import naive_attention
from fa_verify.error_model import error_bound
from fa_verify.errors import InvalidArgumentError
from fa_verify.honest_ensemble import ensemble_errors
from fa_verify.metrics import OutputErrors
from fa_verify.oracle import reference
from fa_verify.precision import PrecisionModel
from fa_verify.report.budget import Budget
from fa_verify.report.deviations import KEY as DEVIATION_KEY, declared_deviation
from fa_verify.report.eta import REFERENCE
from fa_verify.report.fp8 import FP8Comparators
from fa_verify.report.gradients import GradientComparators
from fa_verify.report.histogram import histogram
from fa_verify.report.progress import Progress
from fa_verify.report.run_info import RunInfo, Skip
from fa_verify.report.yardsticks import error_stats, rounded_errors, run_figures
from fa_verify.results import (
    EXACTLY_ROUNDED,
    NAIVE_SAME_PRECISION,
    ProblemDescriptor,
    record_from_error,
    record_from_verdict,
    utc_now,
)
from fa_verify.verdict import check_attention


@dataclass(eq=False)
class Comparators:
    """What every backend's run of one problem is compared with."""

    problem: object
    reference: object
    naive_out: object
    #: out error stats of the exactly rounded reference and of naive same-precision attention
    comparisons: dict
    #: normalised error histogram of the exactly rounded reference (yardsticks)
    rounded_histogram: dict
    seconds: float
    _bounds: dict = field(default_factory=dict)

    _ensembles: dict = field(default_factory=dict)

    def bound(self, precision):
        """The error-model bound under `precision`, computed once per model: most backends
        of a dtype share one (the FA2 model), and the bound costs as much as the reference."""
        if precision not in self._bounds:
            self._bounds[precision] = error_bound(self.problem, precision, self.reference)
        return self._bounds[precision]

    def ensemble(self, precision):
        """The honest ensemble's errors under `precision` (the verdict's ensemble rule), once per model."""
        if precision not in self._ensembles:
            self._ensembles[precision] = ensemble_errors(self.problem, precision, self.reference,
                                                         self.bound(precision))
        return self._ensembles[precision]

    def records(self, backend, sweep: str) -> list:
        """The records of `backend`'s run of the problem: one, of its output (and LSE)."""
        return [compare(backend, self.problem, self, sweep)]

    @classmethod
    def of(cls, problem) -> "Comparators":
        start = time.perf_counter()
        ref = reference(problem)
        naive_out, _ = naive_attention(problem, PrecisionModel.same_precision(problem.dtype))
        rounded = rounded_errors(problem, ref)
        comparisons = {
            EXACTLY_ROUNDED: error_stats(rounded),
            NAIVE_SAME_PRECISION: error_stats(_errors(naive_out, ref, problem.dtype)),
        }
        return cls(problem, ref, naive_out, comparisons, histogram(rounded.normalised),
                   time.perf_counter() - start)


def _errors(out, ref, dtype) -> OutputErrors:
    return OutputErrors.compute(out, ref.out, ref.row_scale, dtype)


def compare(backend, problem, shared: Comparators, sweep: str):
    """One Record: `backend` on `problem`, judged under its precision model."""
    precision = backend.precision(problem.dtype)
    start = time.perf_counter()
    try:
        out, lse = backend.run(problem)
    except Exception as exc:  # noqa: BLE001 - a crashing kernel is a finding, not the sweep's end
        return record_from_error(problem, backend.name, precision, exc,
                                 time.perf_counter() - start, "report", sweep=sweep)
    run_s = time.perf_counter() - start
    start = time.perf_counter()
    ref = shared.reference

    def judge(out, lse):
        return check_attention(out, problem, lse=lse, precision=precision, reference=ref,
                               bound=shared.bound(precision), ensemble=shared.ensemble(precision))

    verdict = judge(out, lse)
    deviation = None if verdict.passed else declared_deviation(backend.deviations, problem,
                                                               out, lse, judge)
    histograms, extra = None, {}
    if verdict.summary is not None:  # the output has the problem's shape
        histograms, extra = run_figures(out, lse, verdict, ref, shared.bound(precision).out, precision.output,
                                        shared.rounded_histogram)
    if deviation:
        extra[DEVIATION_KEY] = deviation
    seconds = {"run": run_s, "check": time.perf_counter() - start, "reference": shared.seconds}
    return record_from_verdict(problem, backend.name, precision, verdict, seconds, "report",
                               {k: v for k, v in extra.items() if v is not None},
                               sweep=sweep, comparisons=shared.comparisons, histograms=histograms)


#: Per kind of problem, what its runs are compared with: `of(problem)`, then
#: `records(backend, sweep name)` per backend (the records of one run, appended together).
COMPARATORS = {"dense": Comparators, "backward": GradientComparators, "fp8": FP8Comparators}


def run_sweep(sweep, backends, store, *, done=frozenset(), out_dir=None, stream=None,
              plan=None, history=()) -> RunInfo:
    """Run `sweep` on `backends`, appending to `store`; returns what ran and what was skipped.

    done: (backend, problem key) pairs already in the store (skipped: --resume).
    history: records timed before (--resume: the store's), from which the progress bar's
    time left is predicted until this run has timed its own.
    out_dir: where run.json is written when the sweep ends, or is interrupted.
    plan: `plan_sweep(sweep, backends, done)` when the caller made it already (done unused).
    """
    from fa_verify.report.environment import collect

    info = RunInfo(sweep=sweep.name, sweep_description=sweep.description,
                   backends=[b.name for b in backends], budget_s=sweep.budget_s,
                   started=utc_now(), environment=collect())
    budgets = {b.name: Budget(sweep.budget_s) for b in backends}
    warmed = set()
    plans = plan_sweep(sweep, backends, done) if plan is None else plan
    points = [point for point, _, _ in plans]
    plans = [(descriptor, todo) for _, descriptor, todo in plans]
    planned = [(name, descriptor.key(), point.work) for point, (descriptor, todo) in zip(points, plans)
               for name, skip in todo.items() if skip is None]
    progress = Progress(planned, stream, budgets=budgets,
                        history=[(r.backend, r.problem.key(), r.problem.work, r.seconds) for r in history])
    try:
        for point, (descriptor, todo) in zip(points, plans):
            for name, skip in todo.items():
                if skip is RECORDED:
                    progress.skip("already recorded")
                elif skip is not None:
                    info.skips.append(Skip(name, asdict(descriptor), "unsupported", skip))
                    progress.skip("unsupported")
            if all(skip is not None for skip in todo.values()):
                continue
            problem = point.problem()
            shared = None  # computed for the first backend that runs the point
            for backend in backends:
                if todo[backend.name] is not None:
                    continue
                budget = budgets[backend.name]
                refusal = budget.refusal(point.work)
                if refusal:
                    info.skips.append(Skip(backend.name, asdict(descriptor), "budget", refusal))
                    progress.skip("budget", (backend.name, descriptor.key()))
                    continue
                progress.begin(f"{backend.name} {point.dtype} "
                               f"{'causal' if point.causal else 'full'} {_seq(point.shape)} "
                               f"D={point.shape.head_dim} {point.label}".rstrip())
                if backend.name not in warmed:  # untimed: the first run may compile a kernel
                    warmed.add(backend.name)
                    _warm_up(backend, problem)
                shared = shared or COMPARATORS[problem.kind].of(problem)
                records = shared.records(backend, sweep.name)
                store.append(*records)  # one write: a resumed run finds all of them or none
                seconds = records[0].seconds  # the run's, shared by its records
                budget.charge(point.work, seconds["run"])
                # a run that raised records no comparators' time, yet they were computed
                progress.finish(backend.name, descriptor.key(), point.work,
                                {REFERENCE: shared.seconds, **seconds})
    except KeyboardInterrupt:
        info.interrupted = True
        raise
    finally:
        progress.close()
        info.finished = utc_now()
        if out_dir is not None:
            info.save(out_dir)
    return info


#: A planned skip: the store already holds the run (--resume).
RECORDED = object()


def plan_sweep(sweep, backends, done=frozenset()) -> list:
    """[(point, its ProblemDescriptor, {backend name: None to run it, RECORDED, or why the backend
    does not support it})], cheapest point first, known before anything runs; a usage error
    (InvalidArgumentError) when no backend supports any point."""
    plan = [(point, *_plan(point, backends, done)) for point in sweep.ordered()]
    _check_applicable(sweep, plan)
    return plan


def _plan(point, backends, done):
    """(the point's ProblemDescriptor, {backend name: None to run it, RECORDED, or why the
    backend does not support it}), known before anything runs."""
    problem = point.problem()
    descriptor = ProblemDescriptor.of(problem)
    return descriptor, {
        b.name: RECORDED if (b.name, descriptor.key()) in done else b.supports(problem)
        for b in backends}


def unsupported_everywhere(plan) -> dict:
    """{backend name: why} of the backends that support no point of the plan (the first
    point's reason)."""
    why = {}
    for _, _, todo in plan:
        for name, skip in todo.items():
            why.setdefault(name, skip)
            if not isinstance(skip, str):  # it runs the point, or already has
                why[name] = None
    return {name: reason for name, reason in why.items() if reason is not None}


def _check_applicable(sweep, plan) -> None:
    """A usage error when no backend supports any point of the sweep: nothing would run, and
    an empty report reads as a pass."""
    why = unsupported_everywhere(plan)
    if not plan or len(why) < len(plan[0][2]):
        return
    reasons = "; ".join(f"{name}: {reason}" for name, reason in why.items())
    raise InvalidArgumentError(
        f"no point of the {sweep.name} sweep runs on {', '.join(why)} ({reasons}); choose a "
        f"backend that runs it ('fa_verify backends' lists each one's dtypes and variants) "
        f"or another --sweep")


def _seq(shape) -> str:
    return f"N={shape.nq}" if shape.nq == shape.nk else f"Nq={shape.nq} Nk={shape.nk}"


def _warm_up(backend, problem) -> None:
    try:
        backend.run(problem)
    except Exception:  # noqa: BLE001 - the timed run that follows records the failure
        pass


