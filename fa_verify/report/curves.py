"""Error against sequence length: the records of one shape family at several N, per dtype.

The family (Nq = Nk, MHA, one head dim and distribution) is the one with the most distinct
N among the records, so that the curve shows N's effect and nothing else; the exactly rounded
reference and naive same-precision attention on the same inputs are drawn alongside.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.report.aggregate import out_stat
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION


@dataclass
class Series:
    label: str
    causal: bool
    #: (N, max normalised error) sorted by N
    points: list
    #: "backend" or "comparison"
    kind: str


@dataclass
class Curve:
    """Error against sequence length for one dtype, over one family of shapes."""

    dtype: str
    family: str
    series: list


def curves(records) -> list[Curve]:
    """Per dtype, max normalised error vs N (Nq = Nk, MHA) for the (D, distribution) family
    with the most distinct N, per backend and causal mode, with the comparisons alongside."""
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
        series = []
        for backend in sorted({r.backend for r in family}):
            for causal in (False, True):
                series.append(_series(backend, causal, "backend",
                                      [(r.problem.nq, out_stat(r, "normalised", "max")) for r in family
                                       if r.backend == backend and r.problem.causal == causal]))
        for name in (EXACTLY_ROUNDED, NAIVE_SAME_PRECISION):
            for causal in (False, True):
                series.append(_series(name, causal, "comparison",
                                      [(r.problem.nq, r.comparisons[name]["normalised"]["max"])
                                       for r in family if r.comparisons and r.problem.causal == causal]))
        result.append(Curve(dtype, f"Nq = Nk, D = {dim}, MHA, {dist} inputs",
                            [s for s in series if s.points]))
    return result


def _series(label, causal, kind, pairs) -> Series:
    best = {}
    for n, value in pairs:
        if value is not None:
            best[n] = max(value, best.get(n, value))
    return Series(label, causal, sorted(best.items()), kind)
