"""The whole campaign: our suite and the other rules on every mutant and on the unmutated kernels.

`run_campaign(...)` returns a `CampaignReport`; `.text()` is the table `fa_verify mutants`
prints, `.as_dict()` its JSON document, `.passed` whether every mutant was killed by our
suite (a property, or the sanitizer) and no correct kernel failed it. The same campaign judges
the exploit catalogue (`fa_verify.judge.exploits`, `fa_verify mutants --exploits`): an exploit
is a "mutant" of the correct callable, and one declared out of reach of the in-process suite
may survive without failing the campaign (it is listed as surviving).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

from fa_verify.judge.campaign import FalsePositiveReport, MutantVerdict, false_positive_runs, judge_mutant
from fa_verify.properties import Selection

FORMAT_VERSION = 1
#: Properties whose verdict is a statistic over many elements (a z-test), not a bound or identity.
STATISTICAL_PROPERTIES = frozenset({"unbiased_rounding"})
#: Our suite's column name in the comparison.
OURS = "fa_verify"


@dataclass
class RuleResults:
    """One other rule on every mutant (stopping at its first failing case) and, in full, on the
    unmutated kernels (a failure there is a false positive)."""

    name: str
    title: str
    mutants: dict = field(default_factory=dict)      # mutant name -> RuleOutcome
    unmutated: dict = field(default_factory=dict)    # backend name -> RuleOutcome

    def as_dict(self) -> dict:
        return {"name": self.name, "title": self.title,
                "mutants": {k: v.as_dict() for k, v in self.mutants.items()},
                "unmutated": {k: v.as_dict() for k, v in self.unmutated.items()}}


@dataclass
class CampaignReport:
    selection: Selection
    profile: str
    mutants: list = field(default_factory=list)           # MutantVerdict
    false_positives: FalsePositiveReport | None = None
    rules: list = field(default_factory=list)             # RuleResults
    seconds: float = 0.0
    #: the targets are the exploit catalogue's (the table says "exploit" and shows the guard)
    exploits: bool = False
    #: (name, why) of the exploits that cannot run here
    skipped: list = field(default_factory=list)

    # --- summary ---------------------------------------------------------------------------------
    @property
    def survivors(self) -> list:
        return [m for m in self.mutants if not m.killed]

    @property
    def sanitizer_only(self) -> list:
        return [m for m in self.mutants if m.killed and not m.plain.killed]

    @property
    def statistical_only(self) -> list:
        return [m for m in self.mutants
                if m.plain.killed and set(m.plain.killers) <= STATISTICAL_PROPERTIES]

    @property
    def out_of_reach(self) -> list:
        """Survivors declared out of reach of the in-process suite (exploits that detect it, ...)."""
        return [m for m in self.survivors if m.out_of_reach]

    @property
    def passed(self) -> bool:
        fp = self.false_positives.count if self.false_positives is not None else 0
        return len(self.survivors) == len(self.out_of_reach) and fp == 0

    def _ours_summary(self) -> dict:
        killed = [m for m in self.mutants if m.killed]
        return {"rule": OURS, "title": "fa_verify property suite (+ ASan build for survivors)",
                "mutants": len(self.mutants), "killed": len(killed),
                "kill_rate": len(killed) / len(self.mutants) if self.mutants else None,
                "false_positive_runs": None if self.false_positives is None else len(self.false_positives.runs),
                "false_positives": None if self.false_positives is None else self.false_positives.count,
                "mean_seconds_to_kill": _mean([m.seconds_to_kill for m in killed]),
                "median_seconds_to_kill": _median([m.seconds_to_kill for m in killed]),
                "mean_examples_to_kill": _mean([m.examples_to_kill for m in killed])}

    def _rule_summary(self, rule: RuleResults) -> dict:
        kills = [o for o in rule.mutants.values() if o.killed]
        fps = [o for o in rule.unmutated.values() if o.killed]
        return {"rule": rule.name, "title": rule.title, "mutants": len(rule.mutants), "killed": len(kills),
                "kill_rate": len(kills) / len(rule.mutants) if rule.mutants else None,
                "false_positive_runs": len(rule.unmutated), "false_positives": len(fps),
                "false_positive_kernels": sorted(fps_name for fps_name, o in rule.unmutated.items() if o.killed),
                "mean_seconds_to_kill": _mean([o.seconds for o in kills]),
                "median_seconds_to_kill": _median([o.seconds for o in kills]),
                "mean_examples_to_kill": _mean([o.cases for o in kills])}

    def summary(self) -> list:
        return [self._ours_summary()] + [self._rule_summary(r) for r in self.rules]

    def as_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "passed": self.passed, "profile": self.profile,
                "max_examples": self.selection.max_examples, "max_seq": self.selection.max_seq,
                "seed": self.selection.seed, "seconds": round(self.seconds, 1),
                "summary": self.summary(),
                "exploits": self.exploits, "skipped": [list(x) for x in self.skipped],
                "survivors": [m.name for m in self.survivors],
                "out_of_reach": [m.name for m in self.out_of_reach],
                "killed_only_by_sanitizer": [m.name for m in self.sanitizer_only],
                "killed_only_by_statistical_property": [m.name for m in self.statistical_only],
                "mutants": [m.as_dict() for m in self.mutants],
                "false_positives": None if self.false_positives is None else self.false_positives.as_dict(),
                "rules": [r.as_dict() for r in self.rules]}

    # --- tables (text, or Markdown for the README) ---------------------------------------------
    def mutant_table(self, markdown: bool = False) -> list[str]:
        head = ["exploit" if self.exploits else "mutant", "bug class", "killed by"] + (["guard"] if self.exploits else [])
        head += ["examples", "seconds", "minimal counterexample (B,H,Nq,Nk,D)"] + [r.name for r in self.rules]
        rows = []
        for m in self.mutants:
            kill = m.kill
            bug_class = m.bug_class.replace("_", "\\_") if markdown else m.bug_class  # not bold
            row = [f"`{m.name}`" if markdown else m.name, bug_class, _killed_by(m, markdown)]
            if self.exploits:
                row.append("-" if kill is None else m.guard or "none (the property's comparison)")
            row += ["-" if kill is None else str(m.examples_to_kill),
                   "-" if kill is None else f"{m.seconds_to_kill:.2f}",
                   "-" if kill is None or kill.counterexample is None else _ce_text(kill.counterexample)]
            for rule in self.rules:
                outcome = rule.mutants.get(m.name)
                row.append("-" if outcome is None else
                           f"{outcome.cases} ({outcome.seconds:.1f} s)" if outcome.killed else
                           "no case" if not outcome.total_cases else "survived")
            rows.append(row)
        return (_markdown if markdown else _table)(head, rows)

    def summary_table(self, markdown: bool = False) -> list[str]:
        head = ["rule", "mutants killed", "false positives", "mean s to kill", "median s to kill",
                "mean examples (cases) to kill"]
        rows = []
        for s in self.summary():
            rate = "-" if s["kill_rate"] is None else f"{s['killed']}/{s['mutants']} ({100 * s['kill_rate']:.0f}%)"
            fp = ("-" if s["false_positives"] is None else
                  f"{s['false_positives']} of {s['false_positive_runs']} "
                  + ("suite runs" if s["rule"] == OURS else "kernels")
                  + (f" ({', '.join(s['false_positive_kernels'])})" if s.get("false_positive_kernels") else ""))
            rows.append([s["rule"], rate, fp, _num(s["mean_seconds_to_kill"], 2), _num(s["median_seconds_to_kill"], 2),
                         _num(s["mean_examples_to_kill"], 1)])
        return (_markdown if markdown else _table)(head, rows)

    def markdown(self) -> str:
        """The two tables in Markdown, as the README shows them."""
        return "\n".join(self.mutant_table(markdown=True) + [""] + self.summary_table(markdown=True))

    def text(self) -> str:
        what = "exploits" if self.exploits else "mutants"
        lines = [f"fa_verify mutants: {len(self.mutants)} {what}, property suite profile {self.profile!r} "
                 f"({self.selection.max_examples} examples per property, N <= {self.selection.max_seq}, "
                 f"seed {self.selection.seed}); {self.seconds:.0f}s", ""]
        lines += self.mutant_table()
        lines.append("")
        if self.false_positives is not None:
            fp = self.false_positives
            targets = sorted({r.target for r in fp.runs})
            seeds = sorted({r.seed for r in fp.runs})
            correct = "correct targets" if self.exploits else "unmutated kernels"
            lines.append(f"false positives of the property suite on the {correct} ({', '.join(targets)}; "
                         f"{len(seeds)} seeds, {len(fp.runs)} suite runs, "
                         f"{sum(r.examples for r in fp.runs)} examples): {fp.count}")
            for run in fp.failures:
                lines.append(f"  {run.target} seed {run.seed}: {run.killer}: {run.detail.splitlines()[0] if run.detail else ''}")
            lines.append("")
        lines += self.summary_table()
        lines.append("")
        for rule in self.rules:
            for name, o in rule.unmutated.items():
                if o.killed:
                    lines.append(f"{rule.name} rejects the correct kernel {name}: {o.failure}")
        shared = {m.name: len(m.plain.shared_failures) + len(m.sanitizer.shared_failures if m.sanitizer else [])
                  for m in self.mutants}
        if any(shared.values()):
            lines.append("failing examples set aside because the unmutated kernel fails them too (not kills): "
                         + ", ".join(f"{name} ({n})" for name, n in shared.items() if n))
        if self.sanitizer_only:
            lines.append("killed only by the sanitizer: " + ", ".join(m.name for m in self.sanitizer_only))
        if self.statistical_only:
            lines.append("killed only by a statistical property: "
                         + ", ".join(f"{m.name} ({', '.join(m.plain.killers)})" for m in self.statistical_only))
        for name, why in self.skipped:
            lines.append(f"not run here: {name} ({why})")
        for m in self.out_of_reach:
            lines.append(f"SURVIVED, out of reach of the in-process suite: {m.name}: {m.out_of_reach}")
        if len(self.survivors) > len(self.out_of_reach):
            lines.append("SURVIVED our suite: " + ", ".join(m.name for m in self.survivors if not m.out_of_reach))
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict}: {len(self.mutants) - len(self.survivors)}/{len(self.mutants)} {what} killed by "
                     f"the property suite"
                     + (f", {self.false_positives.count} false positives" if self.false_positives is not None else ""))
        return "\n".join(lines)


def _killed_by(m: MutantVerdict, markdown: bool) -> str:
    """The killer; "(+n)": n more properties fail too; a sanitizer-only or statistical-only kill
    stands out."""
    kill = m.kill
    if kill is None:
        return ("**SURVIVED**" if markdown else "SURVIVED") + (" (out of reach)" if m.out_of_reach else "")
    if kill is not m.plain:
        return ("**sanitizer**" if markdown else "sanitizer") + f" (ASan build, {kill.killer})"
    more = len(kill.killers) - 1
    if set(kill.killers) <= STATISTICAL_PROPERTIES:
        return (f"**{kill.killer}**" if markdown else kill.killer) + " only"
    return kill.killer + (f" (+{more})" if more else "")


def _ce_text(ce) -> str:
    causal = "" if ce.causal == "no" else f" causal {ce.causal}"
    return f"{ce.size} {ce.dtype}{causal} {ce.distribution or ''}".rstrip()


def _num(x, digits) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _table(head, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*map(str, r)) for r in rows]


def _markdown(head, rows) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def unmutated_backends(families):
    """The CPU-runner backends of the unmutated kernel families (split_kv: its paged and varlen
    ragged backends; fa2_bwd: the backward kernel's; the exploits': the correct callables)."""
    from fa_verify.backends.backward_kernel import BackwardKernelBackend
    from fa_verify.backends.cuda_kernels import CpuKernelBackend
    from fa_verify.backends.split_kv import SplitKvCpuBackend
    from fa_verify.kernels.backward import FA2_BWD
    from fa_verify.kernels.split_kv import SPLIT_KV

    from fa_verify.judge.exploits import CORRECT, FAMILY

    special = {SPLIT_KV.name: lambda: [SplitKvCpuBackend("paged"), SplitKvCpuBackend("varlen")],
               FA2_BWD.name: lambda: [BackwardKernelBackend("cpu")],
               FAMILY: lambda: [make() for make in CORRECT.values()]}
    return [backend for f in families for backend in special.get(f, lambda: [CpuKernelBackend(f)])()]


def run_campaign(mutants, selection: Selection, *, profile: str = "ci", seeds=range(20), families=None,
                 rules=(), sanitizer: bool = True, stop_at_first: bool = False, quiet: bool = False,
                 exploits: bool = False, skipped=()) -> CampaignReport:
    """Our suite on every mutant (then ASan for survivors), on the unmutated `families` with each
    seed, and every rule in `rules` on each mutant and unmutated family. With `exploits`, the
    "mutants" are exploits of fa_verify.judge.exploits (`skipped`: (name, why) of those left out)."""
    start = time.perf_counter()
    report = CampaignReport(selection=selection, profile=profile, exploits=exploits, skipped=list(skipped))
    families = list(dict.fromkeys(families if families is not None else (m.family for m in mutants)))
    for i, mutant in enumerate(mutants, 1):
        verdict: MutantVerdict = judge_mutant(mutant, selection, sanitizer=sanitizer, stop_at_first=stop_at_first)
        report.mutants.append(verdict)
        kill = verdict.kill
        _log(f"[{i}/{len(mutants)}] {mutant.name}: "
             + (f"killed by {verdict.killed_by} after {verdict.examples_to_kill} examples, "
                f"{verdict.seconds_to_kill:.2f}s"
                if kill else "SURVIVED") + f" (suite {verdict.plain.seconds:.1f}s)", quiet)
    seeds = list(seeds)
    if seeds:
        backends = unmutated_backends(families)
        _log(f"false positives: the suite on {', '.join(b.name for b in backends)} with {len(seeds)} seeds ...", quiet)
        report.false_positives = false_positive_runs(
            backends, selection, seeds,
            progress=lambda run: _log(f"  {run.target} seed {run.seed}: "
                                      + (f"FAILED {run.killer}" if run.killed else "passed")
                                      + f" ({run.examples} examples, {run.seconds:.1f}s)", quiet))
    from fa_verify.judge.mutants import mutant_backend

    for rule in rules:
        # The correct kernels first, every case: a case one of them fails is a false positive,
        # and a mutant failing it says nothing about the mutant, so mutants skip it.
        results = RuleResults(rule.name, rule.title)
        false_alarms = {}
        # A rule judges the targets of its kind only ("-" in the table for the others).
        for family in families:
            for backend in unmutated_backends([family]):
                if rule.kind not in backend.kinds:
                    continue
                outcome = rule.run(backend, stop_at_first=False)
                results.unmutated[backend.name] = outcome
                false_alarms[family] = frozenset(outcome.failed_cases)
                _log(f"{rule.name} on the correct {backend.name}: "
                     + (f"FAILS {len(outcome.failed_cases)} of {outcome.cases} cases, first {outcome.failure}"
                        if outcome.killed else f"passes {outcome.cases} cases") + f" ({outcome.seconds:.1f}s)", quiet)
        for mutant in mutants:
            target = mutant_backend(mutant)
            if rule.kind not in target.kinds:
                continue
            skip = false_alarms.get(mutant.family, frozenset())
            outcome = rule.run(target, stop_at_first=True, skip=skip)
            results.mutants[mutant.name] = outcome
            skipped = f"; {outcome.skipped} cases the correct kernel fails left out" if outcome.skipped else ""
            _log(f"{rule.name} on {mutant.name}: "
                 + (f"killed after {outcome.cases} cases, {outcome.seconds:.1f}s" if outcome.killed
                    else f"survived {outcome.cases} cases ({outcome.seconds:.1f}s)") + skipped, quiet)
        report.rules.append(results)
    report.seconds = time.perf_counter() - start
    return report

