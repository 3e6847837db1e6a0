"""Error distributions per dtype and backend: what the histogram small multiples draw.

Each backend's normalised error histogram over all its runs of the dtype, beside the exactly
rounded reference's on the same problems (the floor: no kernel's distribution can lie left of
it everywhere), and the share of its output elements that are exactly rounded; a backward
problem's gradients have a panel each (`Distribution.tensor`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fa_verify.report.buckets import REPORT_DTYPES, TENSORS
from fa_verify.report.families import FAMILIES, family_of
from fa_verify.report.histogram import merge
from fa_verify.report.yardsticks import exactly_rounded_share, merged_rounded_histogram


@dataclass
class Distribution:
    backend: str
    family: str
    runs: int
    #: share of the output elements equal to the reference rounded to the output dtype
    #: (None: the records predate that count)
    exactly_rounded: float | None
    #: {"backend": its normalised error histogram, "rounded": the exactly rounded
    #: reference's on the same problems, None where not recorded}
    histograms: dict
    #: what the errors are of (`Record.tensor`): the output, or a gradient
    tensor: str = "out"


@dataclass
class DtypeDistributions:
    dtype: str
    #: one per backend, by family then name
    panels: list


def distributions(records) -> list[DtypeDistributions]:
    """Per dtype (in REPORT_DTYPES order), one Distribution per backend and tensor with stored
    histograms."""
    groups = defaultdict(list)
    for r in records:
        if r.histograms and r.histograms.get("normalised"):
            groups[r.problem.dtype, r.backend, r.tensor].append(r)
    result = []
    for dtype in sorted({d for d, _, _ in groups}, key=REPORT_DTYPES.index):
        panels = sorted((key for key in groups if key[0] == dtype),
                        key=lambda key: (FAMILIES.index(family_of(key[1])), key[1], TENSORS.index(key[2])))
        result.append(DtypeDistributions(dtype, [_distribution(b, t, groups[dtype, b, t]) for _, b, t in panels]))
    return result


def _distribution(backend, tensor, runs) -> Distribution:
    return Distribution(
        backend, family_of(backend), len(runs), exactly_rounded_share(runs),
        {"backend": merge(r.histograms["normalised"] for r in runs),
         "rounded": merged_rounded_histogram(runs)}, tensor)
