"""The report's data layer: plain dataclasses built from records, rendered elsewhere.

Everything a page, summary.json or summary.md shows is computed here (and in `fa3`, `curves`,
`distributions` and `cases`), once, so that the three agree and the templates only format.
A cell's "p99" is the largest per-run p99 (percentiles do not pool; with one run per cell it
is that run's). A cell's headline is "× rounded" (`aggregate.vs_rounded`), the one figure
comparable across backends; the overview lists backends most accurate first by it, over the
problems they all ran (`rank`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fa_verify.precision import PrecisionModel
from fa_verify.report.aggregate import largest, out_stat, vs_rounded
from fa_verify.report.anchor_rules import RuleTable, rule_table
from fa_verify.report.buckets import Bucket, bucket_of, column_of, variant_key, variant_name
from fa_verify.report.cases import Case, worst_case, worst_cases
from fa_verify.report.curves import curves
from fa_verify.report.deviations import deviation_of
from fa_verify.report.distributions import distributions
from fa_verify.report.fa3 import Fa3Table, fa3_table
from fa_verify.report.histogram import merge
from fa_verify.report.rank import ranked
from fa_verify.report.run_info import RunInfo
from fa_verify.report.ulp import ulp_stat
from fa_verify.results import ProblemDescriptor


@dataclass
class Cell:
    """One backend's runs of one shape bucket and one dtype × causal column."""

    runs: int
    #: failing runs, not counting declared deviations
    failed: int
    rules: list
    #: runs that fail only by the backend's declared conventions, and those conventions' names
    deviations: int
    conventions: list
    #: the headline: RMSE of the output error over the exactly rounded reference's (`aggregate`)
    vs_rounded: float | None
    #: largest and p99 ULP error where |O| >= NOT_TINY x the row scale (None: not measured)
    ulp_max: float | None
    ulp_p99: float | None
    normalised_max: float | None
    normalised_p99: float | None
    #: largest error / bound over the elements with a finite bound (relative to the backend's
    #: own precision model, so not comparable across backends)
    bound_ratio: float | None
    #: no run had an element with a finite error-model bound: the bound ratio is n/a
    no_finite_bound: bool
    ensemble_ratio: float | None
    #: elements without a finite error-model bound (bound_ratio does not cover them)
    unbounded: int
    #: merged histograms {"normalised": ..., "ulp": ...} (None where no run stored one)
    histograms: dict | None
    #: the exact shapes seen, "B×H/Hkv×Nq×Nk×D"
    shapes: list
    #: the worst failing run (else the worst declared deviation) as a cases.Case: its rule,
    #: worst element, the property that sees it and a reproducer; None when every run passed
    failure: Case | None = None

    @property
    def status(self) -> str:
        return _status(self.failed, self.deviations)

    @classmethod
    def of(cls, records, repro_dir=None) -> "Cell":
        """The cell of `records`; its failure's reproducer is written into `repro_dir` (none: None)."""
        failing = [r for r in records if not r.passed and not deviation_of(r)]
        deviating = [r for r in records if deviation_of(r)]
        measured = [r for r in records if r.out_errors is not None]
        bounded = [r for r in measured if has_finite_bound(r)]
        return cls(
            runs=len(records), failed=len(failing), rules=sorted({r.rule for r in failing}),
            deviations=len(deviating),
            conventions=sorted({c["name"] for r in deviating for c in deviation_of(r)}),
            vs_rounded=vs_rounded(records),
            ulp_max=largest(ulp_stat(r, "max") for r in records),
            ulp_p99=largest(ulp_stat(r, "p99") for r in records),
            normalised_max=largest(out_stat(r, "normalised", "max") for r in records),
            normalised_p99=largest(out_stat(r, "normalised", "p99") for r in records),
            bound_ratio=largest(r.bound_ratio for r in bounded),
            no_finite_bound=bool(measured) and not bounded,
            ensemble_ratio=largest(r.ensemble_ratio for r in records),
            unbounded=sum(r.unbounded for r in records),
            histograms=_merged_histograms(records),
            shapes=sorted({shape_label(r.problem) for r in records}),
            failure=worst_case(failing or deviating, repro_dir))


def has_finite_bound(record) -> bool:
    """Whether the run's bound ratio says something: some element that attends a key (of the
    record's tensor) has a finite error-model bound, and the ratio is not 0 for a tensor with
    errors (which only elements without a finite bound give: error / inf; records older than
    the `unbounded` count show it so)."""
    if record.bound_ratio is None:
        return False
    p = record.problem
    # bottom-right causal with Nq > Nk: the first Nq - Nk rows of each head attend nothing
    masked_rows = max(p.nq - p.nk, 0) if p.causal and p.causal_alignment == "bottom-right" else 0
    live = {"dk": p.batch * p.kv_heads * p.nk * p.head_dim, "dv": p.batch * p.kv_heads * p.nk * p.head_dim,
            "dsinks": p.heads}.get(record.tensor, p.batch * p.heads * (p.nq - masked_rows) * p.head_dim)
    erring = out_stat(record, "abs", "max")
    return record.unbounded < live and not (record.bound_ratio == 0 and erring)


def _status(failed: int, deviations: int) -> str:
    return "fail" if failed else "deviation" if deviations else "pass"


def _runs(records) -> int:
    """Runs recorded: a forward run's record is its out's; a backward run writes one per gradient,
    dq among them (every backward problem has one)."""
    return sum(r.tensor in ("out", "dq") for r in records)


def _failed(records) -> int:
    """Failing runs, not counting declared deviations."""
    return sum(not r.passed and not deviation_of(r) for r in records)


def _deviating(records) -> int:
    return sum(bool(deviation_of(r)) for r in records)


def _merged_histograms(records) -> dict | None:
    views = {view: merge((r.histograms or {}).get(view) for r in records)
             for view in ("normalised", "ulp")}
    return views if any(views.values()) else None


def shape_label(p) -> str:
    """B×H×Nq×Nk×D, with H/Hkv where they differ, then the variants' parameters if any, and a
    backward problem's dout."""
    heads = f"{p.heads}" if p.heads == p.kv_heads else f"{p.heads}/{p.kv_heads}"
    return (f"{p.batch}×{heads}×{p.nq}×{p.nk}×{p.head_dim}" + (f" {p.variant}" if p.features else "")
            + (f" dout={p.dout}" if p.dout else ""))


@dataclass
class Row:
    bucket: Bucket
    #: one per column of the table, None where the backend has no run
    cells: list


@dataclass
class BackendSection:
    name: str
    runs: int
    failed: int
    deviations: int
    #: precision model per dtype, as PrecisionModel.describe() says it
    precision: dict
    columns: list
    rows: list
    bound_ratio: float | None
    #: one Cell over all the backend's runs per column of the whole report (None: no runs)
    overview: list
    #: what the overview ranks by (`rank`): × rounded over the problems every ranked backend
    #: ran, the geometric mean over the ranking columns (set by `build`)
    vs_rounded: float | None = None

    @property
    def status(self) -> str:
        return _status(self.failed, self.deviations)


def _precision_text(p: dict) -> str:
    return PrecisionModel(**p).describe()


def backend_section(name: str, records, report_columns, repro_dir=None) -> BackendSection:
    columns = sorted({column_of(r.problem) for r in records})
    by_cell, by_column = defaultdict(list), defaultdict(list)
    for r in records:
        by_cell[bucket_of(r.problem, r.tensor), column_of(r.problem)].append(r)
        by_column[column_of(r.problem)].append(r)
    buckets = sorted({b for b, _ in by_cell})
    rows = [Row(b, [Cell.of(by_cell[b, c], repro_dir) if (b, c) in by_cell else None for c in columns])
            for b in buckets]
    overview = [Cell.of(by_column[c], repro_dir) if c in by_column else None for c in report_columns]
    return BackendSection(
        name=name, runs=len(records), failed=_failed(records), deviations=_deviating(records),
        precision={r.problem.dtype: _precision_text(r.precision)
                   for r in sorted(records, key=lambda r: column_of(r.problem))},
        columns=columns, rows=rows,
        bound_ratio=largest(r.bound_ratio for r in records if has_finite_bound(r)),
        overview=overview)


@dataclass
class SkipGroup:
    backend: str
    kind: str
    count: int
    #: the reason of the first skip (the others differ only in numbers)
    reason: str


def skip_groups(info: RunInfo | None) -> list[SkipGroup]:
    return [] if info is None else _skip_groups(info.skips)


def _skip_groups(skips) -> list[SkipGroup]:
    groups = defaultdict(list)
    for s in skips:
        groups[s.backend, s.kind].append(s)
    return [SkipGroup(b, k, len(skips), skips[0].reason) for (b, k), skips in sorted(groups.items())]


@dataclass
class FeatureGroup:
    """The runs of one combination of variants ("window", "softcap", ..., "window + softcap +
    alibi + sinks"; "dense" for none): the overview table, curves and histograms of its records
    alone, the parameters they ran with, and the backends that do not implement it."""

    name: str
    #: the distinct variant parameters run (`ProblemDescriptor.variant`)
    parameters: list
    runs: int
    failed: int
    columns: list
    #: ranked like the report's, over the group's records
    sections: list
    ranked_on: list
    rank_left_out: list | None
    curves: list
    distributions: list
    #: SkipGroups of the backends that skipped the group's points as unsupported, with why
    not_applicable: list


def feature_groups(records, info: RunInfo | None, repro_dir=None) -> list[FeatureGroup]:
    """One group per combination of variants among the records and the run's unsupported skips,
    dense first; none when every record and skip is of a dense problem (a report of dense
    problems is unchanged)."""
    by_variant, skipped = defaultdict(list), defaultdict(list)
    for r in records:
        by_variant[r.problem.features].append(r)
    for s in (info.skips if info is not None else ()):
        if s.kind == "unsupported":
            skipped[ProblemDescriptor(**s.problem).features].append(s)
    if not any(by_variant.keys() | skipped.keys()):
        return []
    groups = []
    for features in sorted(by_variant.keys() | skipped.keys(), key=variant_key):
        mine = by_variant[features]
        columns = sorted({column_of(r.problem) for r in mine})
        backends = defaultdict(list)
        for r in mine:
            backends[r.backend].append(r)
        sections, ranked_on, left_out = ranked([backend_section(name, runs, columns, repro_dir)
                                                for name, runs in backends.items()],
                                               columns, backends, shape_label)
        groups.append(FeatureGroup(
            name=variant_name(features) or "dense", parameters=sorted({r.problem.variant for r in mine}),
            runs=len(mine), failed=_failed(mine), columns=columns, sections=sections,
            ranked_on=ranked_on, rank_left_out=left_out, curves=curves(mine),
            distributions=distributions(mine),
            not_applicable=_skip_groups(skipped[features])))
    return groups


@dataclass
class Deviation:
    """A backend's runs that deviate by one declared convention, and where to see it."""

    backend: str
    convention: str
    differs: str
    rule: str
    #: the property that sees it, and the command that runs it on the backend
    property: str
    command: str
    runs: int


def deviations(records) -> list[Deviation]:
    """One entry per backend and declared convention, with the number of runs it showed in."""
    groups = {}
    for r in records:
        for c in deviation_of(r) or ():
            key = (r.backend, c["name"])
            if key not in groups:
                groups[key] = Deviation(
                    r.backend, c["name"], c["differs"], c["rule"], c["property"],
                    f"python3 -m fa_verify check {r.backend} --property {c['property']}", 0)
            groups[key].runs += 1
    return [groups[key] for key in sorted(groups)]


@dataclass
class Totals:
    records: int
    #: runs recorded: a backward run writes one record per gradient (`_runs`)
    runs: int
    #: failing runs, not counting declared deviations
    failed: int
    #: runs that fail only by their backend's declared conventions
    deviations: int
    backends: int
    sources: dict
    sweeps: list
    first: str | None
    last: str | None


@dataclass
class ReportData:
    title: str
    generated: str
    totals: Totals
    columns: list
    sections: list
    #: the columns the overview's rank averages over, and the problems of theirs it leaves
    #: out as not every ranked backend ran them (`rank`); None: no problem is shared by every
    #: ranked backend, each is ranked over its own runs
    ranked_on: list
    rank_left_out: list | None
    fa3: Fa3Table | None
    curves: list
    #: per dtype, each backend's error distribution and share of exactly rounded elements
    distributions: list
    failures: list
    deviations: list
    worst_passing: list
    skips: list
    run: RunInfo | None
    environment: dict
    #: the environment is the run's (run.json), not the renderer's
    environment_of_run: bool
    notes: list = field(default_factory=list)
    #: per combination of variants, when some record or skip has one (`feature_groups`)
    features: list = field(default_factory=list)
    #: the gradient rules side by side (`anchor_rules`), when some gradient record carries them
    gradient_rules: RuleTable | None = None


def build(records, *, run: RunInfo | None = None, environment: dict | None = None,
          generated: str = "", title: str = "fa_verify report", repro_dir=None) -> ReportData:
    """The report of `records`; `run` adds skips and the environment of the run; the worst
    cases' reproducers are written into the folder `repro_dir` (none when None)."""
    by_backend = defaultdict(list)
    for r in records:
        by_backend[r.backend].append(r)
    sources = defaultdict(int)
    for r in records:
        sources[r.source] += 1
    stamps = sorted(r.timestamp for r in records)
    columns = sorted({column_of(r.problem) for r in records})
    failures, passing = worst_cases([r for r in records if not deviation_of(r)], repro_dir)
    sections, ranked_on, left_out = ranked([backend_section(name, by_backend[name], columns, repro_dir)
                                            for name in by_backend], columns, by_backend, shape_label)
    notes = []
    if run is not None and run.interrupted:
        notes.append("The run was interrupted: this report shows the runs recorded before it stopped.")
    return ReportData(
        title=title, generated=generated,
        totals=Totals(records=len(records), runs=_runs(records), failed=_failed(records),
                      deviations=_deviating(records),
                      backends=len(by_backend), sources=dict(sorted(sources.items())),
                      sweeps=sorted({r.sweep for r in records if r.sweep}),
                      first=stamps[0] if stamps else None, last=stamps[-1] if stamps else None),
        columns=columns, sections=sections, ranked_on=ranked_on, rank_left_out=left_out,
        fa3=fa3_table(records), curves=curves([r for r in records if not r.problem.features]),
        distributions=distributions(records),
        failures=failures, deviations=deviations(records), worst_passing=passing, skips=skip_groups(run), run=run,
        environment=(run.environment if run is not None and run.environment else environment or {}),
        environment_of_run=bool(run is not None and run.environment), notes=notes,
        features=feature_groups(records, run, repro_dir), gradient_rules=rule_table(records, shape_label))
