"""The overview's rank: backends most accurate first by × rounded, compared on the same problems.

A backend's rank figure is the geometric mean over the ranking columns (dtype × causal, each
weighing alike) of its × rounded pooled over the problems of that column that every ranked
backend ran. Pooling each backend's own runs would let the time budget decide the rank: a
slow backend whose largest runs were skipped would be averaged over fewer, smaller problems.
The problems some ranked backend lacks are left out of the rank and listed (`LeftOut`).

The ranking columns are those with a problem every ranked backend ran: a backend without fp32
ranked on its 16-bit columns alone would beat every fp32-capable one (in fp32 every kernel is
~10x the rounded reference, in fp16 ~1). When no column has one (records of random problems:
pytest, `fa_verify check`; backends that ran different sweeps), each backend is ranked over its
own runs in the columns all have runs in, and the page says so.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fa_verify.report.aggregate import geometric_mean, vs_rounded
from fa_verify.report.buckets import column_of
from fa_verify.results import EXACTLY_ROUNDED


@dataclass
class LeftOut:
    """A problem of a ranking column left out of the rank: not every ranked backend ran it."""

    column: str
    #: the problem as the per-backend tables show it (`data.shape_label`)
    problem: str
    #: the ranked backends without a run of it (unsupported, or skipped by the time budget)
    missing: list


def ranked(sections, columns, records_by_backend: dict, label) -> tuple[list, list, list | None]:
    """(the sections most accurate first, the ranking columns, the LeftOut problems, None when
    no problem is shared and each backend is ranked over its own runs): by the rank figure,
    then by name; backends without the figure (no sweep records) last. Sets each section's
    vs_rounded. `label(problem)` names a left-out problem."""
    comparable = {s.name: _comparable(records_by_backend[s.name]) for s in sections}
    scored = [name for name, by_column in comparable.items() if by_column]
    common = {c: set.intersection(*(set(comparable[name].get(c, {})) for name in scored))
              for c in columns} if scored else {}
    on = [c for c in columns if common.get(c)]
    if not on:
        return _own_runs(sections, columns, scored)
    left_out = []
    for s in sections:
        s.vs_rounded = geometric_mean(
            vs_rounded([r for key in common[c] for r in comparable[s.name].get(c, {}).get(key, ())])
            for c in on) if s.name in scored else None
    for c in on:
        ran = defaultdict(set)  # problem key -> the ranked backends that ran it
        problems = {}
        for name in scored:
            for key, runs in comparable[name].get(c, {}).items():
                ran[key].add(name)
                problems[key] = runs[0].problem
        left_out += [LeftOut(c.label, label(problems[key]), sorted(set(scored) - ran[key]))
                     for key in sorted(ran, key=lambda k: _order(problems[k])) if key not in common[c]]
    return _order_of(sections), on, left_out


def _own_runs(sections, columns, scored) -> tuple[list, list, None]:
    """No problem is shared by every ranked backend: each is ranked over its own runs, in the
    columns all of them have runs in (all columns when none is common)."""
    index = {c: i for i, c in enumerate(columns)}
    on = [c for c in columns if all(s.overview[index[c]] and s.overview[index[c]].vs_rounded is not None
                                    for s in sections if s.name in scored)] or list(columns)
    for s in sections:
        s.vs_rounded = geometric_mean(s.overview[index[c]].vs_rounded for c in on if s.overview[index[c]])
    return _order_of(sections), on, None


def _order_of(sections) -> list:
    return sorted(sections, key=lambda s: (s.vs_rounded is None, s.vs_rounded or 0.0, s.name))


def _comparable(records) -> dict:
    """{column: {problem key: [records]}} of the records × rounded can be computed for."""
    found = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.out_errors is not None and EXACTLY_ROUNDED in (r.comparisons or {}):
            found[column_of(r.problem)][r.problem.key()].append(r)
    return found


def _order(problem) -> tuple:
    """Smallest first, as the sweeps run them."""
    return (problem.work, str(problem.key()))
