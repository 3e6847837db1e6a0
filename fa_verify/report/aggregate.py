"""How the statistics of several runs combine into one figure.

Maxima are maxima (missing values skipped); RMSE pools exactly, as
sqrt(Σ count·rmse² / Σ count); percentiles do not pool, so callers show the largest per-run
value and say so.
"""

from __future__ import annotations

import math


def largest(values):
    """The largest of the values that are present (not None, not NaN); None if none are."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return max(present) if present else None


def out_stat(record, view: str, stat: str):
    """One output error statistic of a record (None when the run produced no output)."""
    return None if record.out_errors is None else record.out_errors[view][stat]


def pooled_rmse(stats) -> float | None:
    """sqrt(Σ count·rmse² / Σ count) of ErrorStats dicts: the RMSE of all their elements."""
    stats = [s for s in stats if s and s["count"]]
    total = sum(s["count"] for s in stats)
    if not total:
        return None
    return math.sqrt(sum(s["count"] * s["rmse"] ** 2 for s in stats) / total)
