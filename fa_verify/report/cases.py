"""The worst cases: one per failing backend and rule, and the passing runs nearest their bound,
each with a reproducer script (`fa_verify.properties.reproduce`, written into the report's
folder) that replays on the rebuilt problem what judged the run: the property that sees its
failure (`failure.property_of`: the one recorded with it, or the oracle property of the tensor
that failed), else the oracle property of the record's tensor (oracle agreement of the output
and, when the run returned an LSE, of the LSE: a report sweep judges both; gradient agreement of
a backward run's gradients)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fa_verify.errors import InvalidArgumentError
from fa_verify.properties.reproduce import NotReproducible, Target, write_reproducer
from fa_verify.report.aggregate import out_stat
from fa_verify.report.failure import KEY as FAILURE_KEY, PROPERTY_OF_TENSOR, property_of
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
    return (PROPERTY_OF_TENSOR[record.tensor],) + (("lse_agreement",) if record.lse_errors is not None else ())


def record_target(record) -> Target:
    """How to rebuild the target of `record`: as recorded (`fa_verify check --results`, the pytest
    plugin), else a built-in backend or MODULE:FUNC with the callable protocol's defaults."""
    from fa_verify.backends import builtin_backends

    if "target" in record.extra:
        return Target.from_dict(record.extra["target"])
    if ":" in record.backend:
        return Target(record.backend, "callable", reference=record.backend)
    if record.backend in {b.name for b in builtin_backends()}:
        return Target(record.backend)
    raise NotReproducible(f"{record.backend!r} is no built-in backend and recorded no target")


def _reproducer(record, folder) -> str | None:
    """The command of a reproducer of `record` written into `folder` (None without a folder, or
    when the problem has no distribution/seed or the target cannot be rebuilt)."""
    from fa_verify.properties import get_property

    if folder is None:
        return None
    try:
        written = write_reproducer(folder, record_target(record),
                                   [get_property(name) for name in replayed_properties(record)],
                                   record.problem.rebuild(), record.extra.get("property_seed", 0),
                                   failure=record.extra.get("error") or "")
    except (InvalidArgumentError, NotReproducible, OSError):
        return None
    return written.command


def _case(record, count: int = 1, repro_dir=None) -> Case:
    p = record.problem
    command = _reproducer(record, repro_dir)
    return Case(backend=record.backend,
                problem=(f"{p.shape} {p.dtype} {'causal ' + p.causal_alignment if p.causal else 'full'}"
                         f"{' ' + p.variant if p.features else ''}, {p.distribution} inputs, seed {p.seed}"
                         f"{f', dout {p.dout}' if p.dout else ''}"
                         f"{'' if record.tensor == 'out' else f': {record.tensor}'}"),
                rule=record.rule, bound_ratio=record.bound_ratio,
                ensemble_ratio=record.ensemble_ratio,
                normalised_max=out_stat(record, "normalised", "max"),
                ulp_max=ulp_stat(record, "max"), error=record.extra.get("error"),
                element=record.extra.get(FAILURE_KEY), property=property_of(record),
                reproducer=command, count=count)


def _severity(record):
    return (record.bound_ratio or 0.0, record.ensemble_ratio or 0.0)


def worst_case(records, repro_dir=None) -> Case | None:
    """The worst of `records` (by bound, then ensemble ratio) as a Case, its reproducer written
    into the folder `repro_dir` (none when None); None if there are no records."""
    return _case(max(records, key=_severity), len(records), repro_dir) if records else None


def worst_cases(records, repro_dir=None) -> tuple[list, list]:
    """(one case per failing backend × rule, the worst of its runs; the passing runs with the
    largest bound ratios), with reproducers written into the folder `repro_dir` (none: None)."""
    failing = defaultdict(list)
    for r in records:
        if not r.passed:
            failing[r.backend, r.rule].append(r)
    failures = [worst_case(runs, repro_dir) for _, runs in sorted(failing.items())]
    passing = sorted((r for r in records if r.passed and r.bound_ratio is not None),
                     key=_severity, reverse=True)[:WORST_PASSING]
    return failures, [_case(r, repro_dir=repro_dir) for r in passing]
