"""The property suite as a mutant killer: who kills each mutant, after how many examples and seconds.

`run_suite(backend, selection)` searches every property of the suite on one target, one
property at a time through `fa_verify.check.check_backend` (what `fa_verify check` runs), in
the suite's order, and returns a `SuiteRun`:
whether a property failed, the first one that did (the *killer*), every property that fails,
the examples and wall seconds from the start of the suite to the first failing example, and
the minimal counterexample Hypothesis shrank the killer's failure to. Only the killer's
failure is shrunk; the properties after it search without shrinking (to list what else
catches the bug, cheaply), or not at all with `stop_at_first=True`.

A kill counts only on an example the unmutated kernel passes: with `control` (judge_mutant
passes the mutant's unmutated kernel), every example the target fails is run on the control
too, and where the control fails it as well the example is set aside (counted in
`SuiteRun.shared_failures`, not a kill) and the search goes on — otherwise a false positive of
the rules would be reported as a kill of every mutant of that kernel.

`judge_mutant` runs the suite on a mutant through the CUDA-on-CPU runner and, when no
property kills it, once more on its AddressSanitizer build (a kill there is "killed by
sanitizer", reported apart). `false_positive_runs` runs the suite on the unmutated kernels with
many Hypothesis seeds: any failure there is a false positive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from fa_verify.check import check_backend
from fa_verify.properties import FAILED, PROPERTIES, Property, Selection, get_property
from fa_verify.properties._result import not_applicable
from fa_verify.strategies import Shape

#: Where a kill came from.
BY_PROPERTY, BY_SANITIZER = "property", "sanitizer"
#: The suite a campaign searches: without `check`'s address_sanitizer pass, since judge_mutant runs
#: the whole suite on the AddressSanitizer build itself (kills there are counted BY_SANITIZER).
CAMPAIGN_PROPERTIES = tuple(p for p in PROPERTIES if p.name != "address_sanitizer")


@dataclass
class Counterexample:
    """The minimal failing problem of a kill, as its shape and options."""

    #: a problem of several parts' (a ragged batch's): B, H, Hkv, the longest part's Nq and Nk, and D
    shape: Shape
    dtype: str
    causal: str
    distribution: str | None
    scale: str
    #: the kind of a problem of several parts ("varlen" or "paged"), None for a dense one
    layout: str | None = None
    #: a problem of several parts' lengths per part: (seqlens_q, seqlens_k)
    seqlens: tuple | None = None

    @classmethod
    def of(cls, problem) -> "Counterexample":
        parts = problem.parts()
        whole = parts == (problem,)
        first = parts[0]
        shape = (Shape.of(problem) if whole else
                 Shape(len(parts), first.heads, first.kv_heads, max(p.nq for p in parts), max(p.nk for p in parts),
                       first.head_dim))
        return cls(shape, problem.dtype, first.causal_alignment if first.causal else "no",
                   dict(problem.tags).get("distribution"),
                   "1/sqrt(D)" if first.scale is None else f"{first.scale:g}",
                   layout=None if whole else problem.kind,
                   seqlens=None if whole else (tuple(p.nq for p in parts), tuple(p.nk for p in parts)))

    @property
    def size(self) -> str:
        """(B,H,Nq,Nk,D), with H/Hkv and D/D_v when they differ; a ragged problem's Nq and Nk per sequence."""
        s = self.shape
        heads = f"{s.heads}" if s.kv_heads == s.heads else f"{s.heads}/{s.kv_heads}"
        nq, nk = (s.nq, s.nk) if self.seqlens is None else (f"[{' '.join(map(str, n))}]" for n in self.seqlens)
        d = f"{s.head_dim}" if s.head_dim_v == s.head_dim else f"{s.head_dim}/{s.head_dim_v}"
        return f"({s.batch},{heads},{nq},{nk},{d})" + (f" {self.layout}" if self.layout else "")

    def as_dict(self) -> dict:
        s = self.shape
        return {"B": s.batch, "H": s.heads, "Hkv": s.kv_heads, "Nq": s.nq, "Nk": s.nk, "D": s.head_dim,
                "dtype": self.dtype, "causal": self.causal, "distribution": self.distribution,
                "scale": self.scale, "size": self.size,
                **({"layout": self.layout, "seqlens_q": list(self.seqlens[0]), "seqlens_k": list(self.seqlens[1])}
                   if self.layout else {})}


@dataclass
class SuiteRun:
    """The property suite on one target."""

    target: str
    #: the Hypothesis seed of the search
    seed: int | None
    killed: bool = False
    #: "property" or "sanitizer" (a property failed on the ASan build because ASan reported)
    killed_by_kind: str | None = None
    #: the first property (in suite order) that failed
    killer: str | None = None
    #: every property that failed, in suite order
    killers: list = field(default_factory=list)
    #: examples judged from the start of the suite up to and including the first failing one
    examples_to_kill: int | None = None
    #: wall seconds from the start of the suite (after the build) to the first failing example
    seconds_to_kill: float | None = None
    counterexample: Counterexample | None = None
    #: the killer's failure, first lines
    detail: str = ""
    examples: int = 0
    seconds: float = 0.0
    #: per property: status, examples, examples to failure, seconds
    properties: list = field(default_factory=list)
    #: examples the target failed that the unmutated control failed too (set aside, not kills)
    shared_failures: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"target": self.target, "seed": self.seed, "killed": self.killed,
                "killed_by_kind": self.killed_by_kind, "killer": self.killer, "killers": list(self.killers),
                "examples_to_kill": self.examples_to_kill,
                "seconds_to_kill": None if self.seconds_to_kill is None else round(self.seconds_to_kill, 3),
                "counterexample": None if self.counterexample is None else self.counterexample.as_dict(),
                "detail": self.detail,
                "examples": self.examples, "seconds": round(self.seconds, 3),
                "properties": list(self.properties), "shared_failures": list(self.shared_failures)}


def _first_lines(text: str, n: int = 3, width: int = 240) -> str:
    return "\n".join(line[:width] for line in text.splitlines()[:n])


def _unless_control_fails(prop: Property, control, shared: list) -> Property:
    """`prop` whose failures count only where `control` passes the same example (and seed);
    where the control fails too, the example is not applicable and noted in `shared`."""

    def judge(backend, problem, seed):
        result = prop(backend, problem, seed)
        if not result.failed:
            return result
        try:
            control_result = prop(control, problem, seed)
        except Exception as exc:  # noqa: BLE001 - a control that raises fails the example too
            why = f"raised {type(exc).__name__}: {exc}"
        else:
            if not control_result.failed:
                return result
            why = _first_lines(control_result.detail, 1)
        shared.append(f"{prop.name}: {problem.describe()}: {why}")
        return not_applicable(prop.name, problem, f"the unmutated {control.name} fails this example too")

    if prop.seeded:
        def check(backend, problem, seed=0):
            return judge(backend, problem, seed)
    else:
        def check(backend, problem):
            return judge(backend, problem, 0)
    check.__doc__ = prop.check.__doc__
    return replace(prop, check=check)


def run_suite(backend, selection: Selection = Selection(), *, properties=None, stop_at_first: bool = False,
              progress=None, control=None) -> SuiteRun:
    """Search every property (or those named) on `backend`, in the suite's order.

    The first failing property's counterexample is shrunk (if `selection.shrink`); later ones
    search without shrinking, or are skipped when `stop_at_first`. progress(outcome) is called
    after each property. control: a backend (the unmutated kernel) that must pass an example
    for the target's failure on it to count.
    """
    props = ([p for p in CAMPAIGN_PROPERTIES if p.applies_to(backend)] if properties is None
             else [get_property(p) for p in properties])
    run = SuiteRun(target=backend.name, seed=selection.seed)
    start = time.perf_counter()
    before = 0  # examples judged by the properties already searched
    first_failure: list = []

    def on_result(problem, result, seconds):
        if result.failed and not first_failure:
            first_failure.append(time.perf_counter())

    for prop in props:
        search_selection = selection if not run.killed else replace(selection, shrink=False)
        searched = prop if control is None else _unless_control_fails(prop, control, run.shared_failures)
        outcome = check_backend(backend, search_selection, properties=[searched],
                                on_result=on_result).properties[0]
        run.properties.append({"property": outcome.property, "status": outcome.status,
                               "examples": outcome.examples, "examples_to_failure": outcome.examples_to_failure,
                               "seconds": round(outcome.seconds, 3)})
        run.examples += outcome.examples
        if progress is not None:
            progress(outcome)
        # a property that judged nothing (no informative example) says nothing about the kernel
        if outcome.status == FAILED and not outcome.uninformative_only:
            run.killers.append(outcome.property)
            if not run.killed:
                run.killed, run.killed_by_kind, run.killer = True, BY_PROPERTY, outcome.property
                run.examples_to_kill = before + (outcome.examples_to_failure or outcome.examples)
                run.seconds_to_kill = (first_failure[0] if first_failure else time.perf_counter()) - start
                if outcome.problem is not None:
                    run.counterexample = Counterexample.of(outcome.problem)
                detail = outcome.failure.detail if outcome.failure is not None else ""
                run.detail = _first_lines(detail)
                if stop_at_first:
                    break
        before += outcome.examples
    run.seconds = time.perf_counter() - start
    return run


def _sanitizer_report(run: SuiteRun) -> bool:
    return "KernelSanitizerError" in run.detail or "AddressSanitizer" in run.detail


@dataclass
class MutantVerdict:
    """What our suite did to one mutant: the plain run, and the ASan run when the plain one survived."""

    name: str
    family: str
    bug_class: str
    description: str
    build_seconds: float
    plain: SuiteRun
    sanitizer: SuiteRun | None = None
    #: why the in-process suite cannot catch it (an exploit's `out_of_reach`; "" for a mutant)
    out_of_reach: str = ""

    @property
    def killed(self) -> bool:
        return self.plain.killed or (self.sanitizer is not None and self.sanitizer.killed)

    @property
    def kill(self) -> SuiteRun | None:
        """The run that killed it (the plain one if it did)."""
        if self.plain.killed:
            return self.plain
        if self.sanitizer is not None and self.sanitizer.killed:
            return self.sanitizer
        return None

    def _until_kill(self, what: str):
        """The killing run's `what` ("examples" or "seconds") until its kill; a kill on the ASan
        build adds the whole plain run's."""
        kill = self.kill
        if kill is None:
            return None
        return getattr(kill, f"{what}_to_kill") + (getattr(self.plain, what) if kill is not self.plain else 0)

    @property
    def examples_to_kill(self) -> int | None:
        return self._until_kill("examples")

    @property
    def seconds_to_kill(self) -> float | None:
        """Builds excluded."""
        return self._until_kill("seconds")

    @property
    def guard(self) -> str | None:
        """The guard behind the kill (inputs unchanged, unwritten or non-finite output, ...;
        fa_verify.judge.exploits.guard_of), None where a property's comparison failed."""
        from fa_verify.judge.exploits import guard_of

        kill = self.kill
        return None if kill is None else guard_of(kill.detail)

    @property
    def killed_by(self) -> str:
        kill = self.kill
        if kill is None:
            return "SURVIVED"
        if kill.killed_by_kind == BY_SANITIZER:
            return f"sanitizer ({kill.killer})"
        return kill.killer

    def as_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "bug_class": self.bug_class,
                "description": self.description, "killed": self.killed, "killed_by": self.killed_by,
                "examples_to_kill": self.examples_to_kill,
                "seconds_to_kill": None if self.seconds_to_kill is None else round(self.seconds_to_kill, 3),
                "guard": self.guard, "out_of_reach": self.out_of_reach or None,
                "build_seconds": round(self.build_seconds, 3), "plain": self.plain.as_dict(),
                "sanitizer": None if self.sanitizer is None else self.sanitizer.as_dict()}


def judge_mutant(mutant, selection: Selection = Selection(), *, sanitizer: bool = True,
                 stop_at_first: bool = False, progress=None) -> MutantVerdict:
    """Run the property suite on `mutant` (fa_verify.kernels.mutants.Mutant) through the CPU runner; if it
    survives and `sanitizer`, again on its AddressSanitizer build. Either kill counts only on an
    example the unmutated kernel passes."""
    from fa_verify.judge.mutants import mutant_backend, unmutated_backend

    backend = mutant_backend(mutant)
    control = unmutated_backend(mutant)
    began = time.perf_counter()
    getattr(backend, "build", lambda: None)()  # a callable exploit has nothing to build
    build_seconds = time.perf_counter() - began
    plain = run_suite(backend, selection, stop_at_first=stop_at_first, progress=progress, control=control)
    verdict = MutantVerdict(mutant.name, mutant.family, mutant.bug_class, mutant.description, build_seconds, plain,
                            out_of_reach=getattr(mutant, "out_of_reach", ""))
    asan = mutant_backend(mutant, sanitize=True) if not plain.killed and sanitizer else None
    if asan is not None:  # None: an exploit with no sanitizer build
        asan.build()
        run = run_suite(asan, selection, stop_at_first=True, progress=progress, control=control)
        if run.killed:
            run.killed_by_kind = BY_SANITIZER if _sanitizer_report(run) else BY_PROPERTY
        verdict.sanitizer = run
    return verdict


@dataclass
class FalsePositiveReport:
    """The suite on the unmutated kernels over many seeds."""

    runs: list = field(default_factory=list)

    @property
    def failures(self) -> list:
        return [r for r in self.runs if r.killed]

    @property
    def count(self) -> int:
        return len(self.failures)

    def as_dict(self) -> dict:
        return {"runs": len(self.runs), "false_positives": self.count,
                "examples": sum(r.examples for r in self.runs),
                "seconds": round(sum(r.seconds for r in self.runs), 3),
                "targets": sorted({r.target for r in self.runs}),
                "seeds": sorted({r.seed for r in self.runs if r.seed is not None}),
                "failures": [r.as_dict() for r in self.failures]}


def false_positive_runs(backends, selection: Selection = Selection(), seeds=range(20), progress=None
                        ) -> FalsePositiveReport:
    """The whole suite on every backend (the unmutated kernels) with each Hypothesis seed."""
    report = FalsePositiveReport()
    for seed in seeds:
        for backend in backends:
            run = run_suite(backend, replace(selection, seed=seed))
            report.runs.append(run)
            if progress is not None:
                progress(run)
    return report
