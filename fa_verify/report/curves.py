"""Error against sequence length: the records of one shape family at several N, per dtype.

The shape family (Nq = Nk, MHA, one head dim and distribution) is the one with the most
distinct N among the records, so that the curve shows N's effect and nothing else. Each
backend's series carries the largest element of its error-model bound
(`yardsticks.largest_bound`); the exactly rounded reference on the same inputs is the floor.
Naive same-precision attention is drawn as a comparison only when it is not itself among the
backends (it would appear twice).
Nothing here knows a sweep: any records with several N of one family give curves.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.report.aggregate import out_stat
from fa_verify.report.families import by_family
from fa_verify.report.yardsticks import LARGEST_BOUND_KEY
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION


@dataclass
class Series:
    label: str
    causal: bool
    #: (N, max normalised error) sorted by N
    points: list
    #: "backend", "floor" (the exactly rounded reference) or "comparison"
    kind: str
    #: (N, largest element of the normalised error-model bound), where some element has a
    #: finite one (backends only)
    bound: list = field(default_factory=list)


@dataclass
class Curve:
    """Error against sequence length for one dtype, over one family of shapes."""

    dtype: str
    shape_family: str
    series: list
    #: {backend family: its backends' labels}: one column of panels each (`families`)
    groups: dict

    @property
    def lengths(self) -> int:
        """How many sequence lengths the curves have."""
        return len({n for s in self.series for n, _ in s.points})


def curves(records) -> list[Curve]:
    """Per dtype, max normalised error vs N (Nq = Nk, MHA) for the (D, distribution) family
    with the most distinct N, per backend and causal mode, with the floor and the largest bounds."""
    result = []
    for dtype in sorted({r.problem.dtype for r in records}, key=DTYPE_NAMES.index):
        square = [r for r in records if r.problem.dtype == dtype and r.out_errors is not None
                  and r.problem.nq == r.problem.nk and r.problem.heads == r.problem.kv_heads]
        families = defaultdict(list)
        for r in square:
            families[r.problem.head_dim, r.problem.distribution].append(r)
        if not families:
            continue
        (dim, dist), family = max(
            families.items(), key=lambda kv: (len({r.problem.nq for r in kv[1]}), -kv[0][0]))
        if len({r.problem.nq for r in family}) < 2:
            continue
        backends = sorted({r.backend for r in family})
        comparisons = [EXACTLY_ROUNDED] + [NAIVE_SAME_PRECISION] * (NAIVE_SAME_PRECISION not in backends)
        series = []
        for causal in (False, True):
            mode = [r for r in family if r.problem.causal == causal]
            for backend in backends:
                runs = [r for r in mode if r.backend == backend]
                series.append(Series(
                    backend, causal, _largest((r.problem.nq, out_stat(r, "normalised", "max")) for r in runs),
                    "backend", _largest((r.problem.nq, r.extra.get(LARGEST_BOUND_KEY)) for r in runs)))
            for name in comparisons:
                series.append(Series(
                    name, causal, _largest((r.problem.nq, r.comparisons[name]["normalised"]["max"])
                                           for r in mode if r.comparisons),
                    "floor" if name == EXACTLY_ROUNDED else "comparison"))
        result.append(Curve(dtype, f"Nq = Nk, D = {dim}, MHA, {dist} inputs",
                            [s for s in series if s.points], by_family(backends)))
    return result


def _largest(pairs) -> list:
    """(N, the largest value at N) sorted by N, missing values skipped."""
    best = {}
    for n, value in pairs:
        if value is not None:
            best[n] = max(value, best.get(n, value))
    return sorted(best.items())

