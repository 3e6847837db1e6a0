"""What the report's figures measure a run against, stored with each sweep record.

- `rounded_comparison`: the error statistics of the certified reference rounded to the dtype,
  the denominator of "× rounded" (sweep records and `fa_verify check` / pytest records alike).
- `exactly_rounded`: how many output elements equal the certified reference rounded to the
  output dtype (the best any kernel can do, element by element). An error of exactly 0
  against the float64 reference is not that: it happens almost only where both are 0 (fully
  masked rows), which is why every backend's histogram once read "1% exact".
- the rounded reference's normalised error histogram on the same inputs (`histogram`, under
  ROUNDED_HISTOGRAM_KEY): the floor each backend's histogram is drawn against.
- `largest_bound`: the largest finite element of the error-model bound of the backend's
  precision model, normalised by the row scale like the curves' errors: the dash-dot line the
  error-vs-N curves draw, above which a kernel's largest error may not lie.
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import round_to
from fa_verify.metrics import OutputErrors
from fa_verify.report.histogram import histogram, merge
from fa_verify.results import EXACTLY_ROUNDED

#: Keys of Record.extra.
EXACTLY_ROUNDED_KEY = "exactly_rounded"
ROUNDED_HISTOGRAM_KEY = "rounded_histogram"
LARGEST_BOUND_KEY = "largest_bound"


def exactly_rounded(out, ref_out, dtype) -> dict:
    """{"count": elements of `out` equal to `ref_out` rounded to `dtype`, "of": all elements}."""
    got = np.asarray(out).astype(np.float64)
    rounded = round_to(ref_out, dtype).astype(np.float64)
    return {"count": int(np.count_nonzero(got == rounded)), "of": int(got.size)}


def rounded_errors(problem, reference) -> OutputErrors:
    """The errors of the certified reference rounded to the problem's dtype: the least any
    kernel can have, element by element."""
    return OutputErrors.compute(round_to(reference.out, problem.dtype), reference.out,
                                reference.row_scale, problem.dtype)


def error_stats(errors: OutputErrors) -> dict:
    """Record-ready statistics of each view of `errors`."""
    return {view: s.as_dict() for view, s in errors.stats().items()}


def rounded_comparison(problem, reference) -> dict:
    """Record.comparisons with the rounded reference's error stats, which the report's
    "× rounded" divides by."""
    return {EXACTLY_ROUNDED: error_stats(rounded_errors(problem, reference))}


def largest_bound(bound_out, row_scale) -> float | None:
    """The largest bound / row scale over the elements with a finite bound in a row that
    attends a key; None where there are none."""
    finite = np.isfinite(bound_out) & (row_scale > 0)
    return float((bound_out[finite] / row_scale[finite]).max()) if finite.any() else None


def run_figures(out, lse, verdict, reference, bound_out, output_dtype, rounded_hist) -> tuple[dict, dict]:
    """(histograms, extra) of one forward run whose output has the problem's shape: its
    normalised and ULP error histograms; its ULP errors where not tiny, exactly rounded count,
    the rounded reference's histogram, the largest bound and the worst element (Record.extra)."""
    from fa_verify.report.failure import KEY as FAILURE_KEY, worst_element
    from fa_verify.report.ulp import KEY as ULP_KEY, ulp_not_tiny

    errors = OutputErrors.compute(out, reference.out, reference.row_scale, output_dtype)
    histograms = {"normalised": histogram(errors.normalised), "ulp": histogram(errors.ulp)}
    extra = {ULP_KEY: ulp_not_tiny(errors, reference.out),
             EXACTLY_ROUNDED_KEY: exactly_rounded(out, reference.out, output_dtype),
             ROUNDED_HISTOGRAM_KEY: rounded_hist,
             LARGEST_BOUND_KEY: largest_bound(bound_out, reference.row_scale),
             FAILURE_KEY: worst_element(verdict, reference, out, lse)}
    return histograms, extra


def exactly_rounded_share(records) -> float | None:
    """The share of the records' output elements that are exactly rounded (None: not recorded)."""
    counts = [r.extra[EXACTLY_ROUNDED_KEY] for r in records if r.extra.get(EXACTLY_ROUNDED_KEY)]
    total = sum(c["of"] for c in counts)
    return sum(c["count"] for c in counts) / total if total else None


def merged_rounded_histogram(records) -> dict | None:
    """The rounded reference's histograms of the records' problems, summed (None: not recorded)."""
    return merge(r.extra.get(ROUNDED_HISTOGRAM_KEY) for r in records)
