"""Error against sequence length: the records of one shape family at several lengths, per dtype.

Two kinds of family: Nq = Nk (error against N), and decode, Nq = 1 (error against the key
length Nk). Within a kind, the family (MHA, one head dim, distribution and set of variant
parameters) is the one with the most distinct lengths among the records, so that the curve
shows the length's effect and nothing else. Each backend's series carries the largest element
of its error-model bound (`yardsticks.largest_bound`); the exactly rounded reference on the
same inputs is the floor.
Naive same-precision attention is drawn as a comparison only when it is not itself among the
backends (it would appear twice). Backends of one panel whose curves coincide are named
together (`coinciding`), so the figure can say that one line is several.
Records of a backward problem's gradients give one curve per gradient (`Curve.tensor`).
Nothing here knows a sweep: any records with several lengths of one family give curves.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from fa_verify.report.aggregate import out_stat
from fa_verify.report.buckets import REPORT_DTYPES, TENSORS, descale_label
from fa_verify.report.families import by_family
from fa_verify.report.yardsticks import LARGEST_BOUND_KEY
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION


@dataclass
class Series:
    label: str
    causal: bool
    #: (length, max normalised error) sorted by length
    points: list
    #: "backend", "floor" (the exactly rounded reference) or "comparison"
    kind: str
    #: (N, largest element of the normalised error-model bound), where some element has a
    #: finite one (backends only)
    bound: list = field(default_factory=list)

    @property
    def bound_ends(self) -> int | None:
        """The last length with a finite bound where the errors go on past it (the bound stops:
        beyond it the precision model's relative error reaches 1/4 and no first-order bound
        holds, as for 16-bit accumulation over many keys); None where it does not stop."""
        if self.bound and self.points and self.bound[-1][0] < self.points[-1][0]:
            return self.bound[-1][0]
        return None


@dataclass
class Curve:
    """Error against sequence length for one dtype, over one family of shapes."""

    dtype: str
    shape_family: str
    series: list
    #: {backend family: its backends' labels}: one column of panels each (`families`)
    groups: dict
    #: what the x axis is: "sequence length N" (Nq = Nk) or "key length Nk" (decode)
    axis: str = "sequence length N"
    #: the family's variant parameters (`ProblemDescriptor.variant`), "" when dense
    variant: str = ""
    #: groups of backends of one panel whose curves coincide (`coinciding`): drawn on top of
    #: one another, they would read as one
    coinciding: list = field(default_factory=list)
    #: what the errors are of (`Record.tensor`): the output, or a gradient
    tensor: str = "out"

    @property
    def lengths(self) -> int:
        """How many sequence lengths the curves have."""
        return len({n for s in self.series for n, _ in s.points})


#: The kinds of family: (name, whether a problem belongs, its length, the x axis).
KINDS = (("Nq = Nk", lambda p: p.nq == p.nk, lambda p: p.nq, "sequence length N"),
         ("Nq = 1 (decode)", lambda p: p.nq == 1 < p.nk, lambda p: p.nk, "key length Nk"))


def curves(records) -> list[Curve]:
    """Per kind of family, tensor and dtype, max normalised error vs length (MHA) for the (D,
    distribution, variant) family with the most distinct lengths, per backend and causal mode,
    with the floor and the largest bounds."""
    result = []
    for kind, belongs, length, axis in KINDS:
        for tensor in sorted({r.tensor for r in records}, key=TENSORS.index):
            for dtype in sorted({r.problem.dtype for r in records}, key=REPORT_DTYPES.index):
                # FP8 problems: a curve per descale range (None for the others)
                for descales in sorted({r.problem.descales for r in records}, key=lambda d: d or ()):
                    runs = [r for r in records if r.problem.dtype == dtype and r.tensor == tensor
                            and r.problem.descales == descales and r.out_errors is not None
                            and belongs(r.problem) and r.problem.heads == r.problem.kv_heads]
                    curve = _curve(runs, kind, dtype, length, axis, tensor)
                    if curve is not None:
                        result.append(curve)
    return result


def _curve(runs, kind: str, dtype: str, length, axis: str, tensor: str) -> Curve | None:
    families = defaultdict(list)
    for r in runs:
        families[r.problem.head_dim, f"{r.problem.distribution} inputs"
                 + (f", dout {r.problem.dout}" if r.problem.dout else "")
                 + (f", {descale_label(r.problem.descales)}" if r.problem.descales else ""),
                 r.problem.variant].append(r)
    if not families:
        return None
    (dim, dist, variant), family = max(
        families.items(), key=lambda kv: (len({length(r.problem) for r in kv[1]}), not kv[0][2], -kv[0][0]))
    if len({length(r.problem) for r in family}) < 2:
        return None
    backends = sorted({r.backend for r in family})
    comparisons = [EXACTLY_ROUNDED] + [NAIVE_SAME_PRECISION] * (NAIVE_SAME_PRECISION not in backends)
    series = []
    for causal in (False, True):
        mode = [r for r in family if r.problem.causal == causal]
        for backend in backends:
            mine = [r for r in mode if r.backend == backend]
            series.append(Series(
                backend, causal, _largest((length(r.problem), out_stat(r, "normalised", "max")) for r in mine),
                "backend", _largest((length(r.problem), r.extra.get(LARGEST_BOUND_KEY)) for r in mine)))
        for name in comparisons:
            series.append(Series(
                name, causal, _largest((length(r.problem), r.comparisons[name]["normalised"]["max"])
                                       for r in mode if name in (r.comparisons or {})),
                "floor" if name == EXACTLY_ROUNDED else "comparison"))
    series = [s for s in series if s.points]
    groups = by_family(backends)
    return Curve(dtype, f"{kind}, D = {dim}, MHA, {dist}", series, groups, axis, variant,
                 [g for names in groups.values() for g in coinciding(series, names)], tensor)


#: Two markers closer than this (relative) lie on top of each other on the figures' log axes.
COINCIDE = 0.02


def coinciding(series, backends) -> list:
    """Groups (two or more, in `backends`' order) of the backends whose curves coincide: the
    same lengths in every causal mode, each error within COINCIDE of the other's."""
    curves = {b: {s.causal: s.points for s in series if s.kind == "backend" and s.label == b}
              for b in backends}
    groups = []
    for b in backends:
        group = next((g for g in groups if _same(curves[g[0]], curves[b])), None)
        if group is None:
            groups.append([b])
        else:
            group.append(b)
    return [g for g in groups if len(g) > 1]


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for mode, points in a.items():
        other = b[mode]
        if [n for n, _ in points] != [n for n, _ in other]:
            return False
        for (_, x), (_, y) in zip(points, other):
            if x != y and not (x > 0 and y > 0 and abs(math.log(x / y)) < COINCIDE):
                return False
    return True


def _largest(pairs) -> list:
    """(length, the largest value at it) sorted by length, missing values skipped."""
    best = {}
    for n, value in pairs:
        if value is not None:
            best[n] = max(value, best.get(n, value))
    return sorted(best.items())

