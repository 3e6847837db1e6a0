"""The worst cases: one per failing backend and rule, and the passing runs nearest their bound,
each with a one-line reproducer (`fa_verify.check.reproducer` on the rebuilt problem) that
replays what judged the run: the property that sees its failure (`failure.property_of`: the
one recorded with it, or the oracle property of the tensor that failed), else oracle agreement
of the output and, when the run returned an LSE, of the LSE (a report sweep judges both)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fa_verify.report.aggregate import out_stat
from fa_verify.report.failure import KEY as FAILURE_KEY, property_of
from fa_verify.report.ulp import ulp_stat

#: How many passing runs with the largest bound ratios the worst-case list shows.
WORST_PASSING = 10


@dataclass
class Case:
    """A run worth reproducing."""

    backend: str
    problem: str
    rule: str | None
    bound_ratio: float | None
    ensemble_ratio: float | None
    normalised_max: float | None
    ulp_max: float | None
    error: str | None
    #: the element that failed the rule (`failure.worst_element`), None if not recorded
    element: dict | None
    #: the property that sees the failure, which the reproducer replays
    property: str | None
    reproducer: str | None
    #: how many failing runs share this backend and rule (1 for passing cases)
    count: int = 1


def replayed_properties(record) -> tuple:
    """The properties whose check judged `record`, to replay it."""
    seen_by = property_of(record)
    if seen_by:
        return (seen_by,)
    return ("oracle_agreement",) + (("lse_agreement",) if record.lse_errors is not None else ())


def _case(record, count: int = 1) -> Case:
    from fa_verify.check import reproducer

    p = record.problem
    try:
        command = reproducer(record.backend, p.rebuild(), replayed_properties(record),
                             record.extra.get("property_seed", 0))
    except Exception:  # noqa: BLE001 - no distribution/seed, or a MODULE:FUNC not importable here
        command = None
    return Case(backend=record.backend,
                problem=(f"{p.shape} {p.dtype} {'causal ' + p.causal_alignment if p.causal else 'full'}, "
                         f"{p.distribution} inputs, seed {p.seed}"),
                rule=record.rule, bound_ratio=record.bound_ratio,
                ensemble_ratio=record.ensemble_ratio,
                normalised_max=out_stat(record, "normalised", "max"),
                ulp_max=ulp_stat(record, "max"), error=record.extra.get("error"),
                element=record.extra.get(FAILURE_KEY), property=property_of(record),
                reproducer=command, count=count)


def _severity(record):
    return (record.bound_ratio or 0.0, record.ensemble_ratio or 0.0)


def worst_case(records) -> Case | None:
    """The worst of `records` (by bound, then ensemble ratio) as a Case; None if there are none."""
    return _case(max(records, key=_severity), len(records)) if records else None


def worst_cases(records) -> tuple[list, list]:
    """(one case per failing backend × rule, the worst of its runs; the passing runs with the
    largest bound ratios)."""
    failing = defaultdict(list)
    for r in records:
        if not r.passed:
            failing[r.backend, r.rule].append(r)
    failures = [worst_case(runs) for _, runs in sorted(failing.items())]
    passing = sorted((r for r in records if r.passed and r.bound_ratio is not None),
                     key=_severity, reverse=True)[:WORST_PASSING]
    return failures, [_case(r) for r in passing]
