"""How the statistics of several runs combine into one figure.

Maxima are maxima (missing values skipped); RMSE pools exactly, as
sqrt(Σ count·rmse² / Σ count); percentiles do not pool, so callers show the largest per-run
value and say so.

"× rounded" is the one figure that compares kernels of different precision models: the RMSE of
a kernel's output error over that of the exactly rounded reference on the same inputs. Rounding
to nearest minimises every element's error, so it is ≥ 1 whenever the kernel's output dtype is
the problem's, and 1 is the best any kernel can do. RMSE, not the maximum: the largest error
of both is usually the same half-ULP rounding of one large output (measured on the built-in
backends at fp16/bf16: max ratio 1.00 for FA2-style and correctly rounding kernels alike, RMSE
ratio 1.25–1.29 against 1.00), and RMSE pools exactly over runs and is FlashAttention-3's
Table 3 figure.
"""

from __future__ import annotations

import math

from fa_verify.results import EXACTLY_ROUNDED


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


def ratio(a, b):
    """a / b, None where either is missing or b is 0."""
    return None if a is None or not b else a / b


def vs_rounded(records) -> float | None:
    """× rounded of `records` pooled: the RMSE of their absolute output errors over that of the
    exactly rounded reference on the same problems (records without either are left out)."""
    paired = [r for r in records if r.out_errors is not None and EXACTLY_ROUNDED in (r.comparisons or {})]
    return ratio(pooled_rmse(r.out_errors["abs"] for r in paired),
                 pooled_rmse(r.comparisons[EXACTLY_ROUNDED]["abs"] for r in paired))


def geometric_mean(values) -> float | None:
    """The geometric mean of the values that are present and positive; inf if one is inf."""
    present = [v for v in values if v is not None and v > 0]
    if not present:
        return None
    if any(math.isinf(v) for v in present):
        return math.inf
    return math.exp(sum(math.log(v) for v in present) / len(present))
