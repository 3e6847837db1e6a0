"""An FP8 sweep point's comparators and records: the forward's, for FP8 inputs.

Per point: the certified reference of the true inputs (`reference_fp8`), the reference rounded
to the output dtype (the floor the figures draw, as for the forward: the best any kernel can
do, element by element), and per precision model FlashAttention-3's FP8 bound
(`fp8_error_bound`). A backend's run is judged as `fp8_agreement` judges it (the bound, then
the FP8 ensemble rule, then the LSE's bound) and recorded as a forward run is: the output's
error statistics, histograms, the rounded reference's as the comparison, the largest bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fa_verify.dtypes import round_to
from fa_verify.metrics import OutputErrors, measure
from fa_verify.report.histogram import histogram
from fa_verify.report.yardsticks import error_stats, run_figures
from fa_verify.results import EXACTLY_ROUNDED, record_from_error, record_from_verdict
from fa_verify.verdict import Verdict


def rounded_floor(problem, ref) -> OutputErrors:
    """The errors of the exact output rounded to the problem's output dtype."""
    dtype = problem.output_dtype
    return OutputErrors.compute(round_to(ref.out, dtype), ref.out, ref.row_scale, dtype)


@dataclass(eq=False)
class FP8Comparators:
    """What every backend's run of one FP8 problem is compared with (`runner.Comparators`' FP8 twin)."""

    problem: object
    reference: object
    #: out error stats of the exactly rounded reference
    comparisons: dict
    #: normalised error histogram of the exactly rounded reference (the floor)
    rounded_histogram: dict
    seconds: float
    _bounds: dict = field(default_factory=dict)

    def bound(self, precision):
        from fa_verify.fp8_error_model import fp8_error_bound

        if precision not in self._bounds:
            self._bounds[precision] = fp8_error_bound(self.problem, precision, self.reference)
        return self._bounds[precision]

    def records(self, backend, sweep: str) -> list:
        return [_compare(backend, self, sweep)]

    @classmethod
    def of(cls, problem) -> "FP8Comparators":
        from fa_verify.oracle.fp8 import reference_fp8

        start = time.perf_counter()
        ref = reference_fp8(problem)
        rounded = rounded_floor(problem, ref)
        return cls(problem, ref, {EXACTLY_ROUNDED: error_stats(rounded)}, histogram(rounded.normalised),
                   time.perf_counter() - start)


def fp8_verdict(out, lse, problem, precision, ref, bound) -> Verdict:
    """The Verdict of `fp8_agreement` on one run: the output within the bound, then the FP8
    ensemble rule, then the LSE within its bound."""
    from fa_verify.properties._compare import exceeding
    from fa_verify.properties.fp8 import _agreement

    info = dict(problem=problem.describe(), precision=precision.describe())
    out = np.asarray(out)
    if out.shape != problem.out_shape:
        return Verdict(False, "shape", detail=f"out.shape={out.shape} but the problem needs {problem.out_shape}", **info)
    failure, worst = _agreement("fp8_agreement", problem, (out, lse), ref, bound)
    _, out_worst = exceeding(out, ref.out, bound.out)
    lse_worst = None if lse is None else exceeding(lse, ref.lse, bound.lse)[1]
    detail = "" if failure is None else failure.detail
    rule = (None if failure is None else "lse_bound" if detail.startswith("lse") else
            "ensemble" if "'ensemble'" in detail else "error_bound")
    return Verdict(failure is None, rule, detail=detail, summary=measure(out, ref, precision.output, lse=lse),
                   bound_ratio=out_worst, lse_bound_ratio=lse_worst,
                   unbounded_count=int(np.count_nonzero(~np.isfinite(bound.out))), **info)


def _compare(backend, shared: FP8Comparators, sweep: str):
    problem = shared.problem
    precision = backend.precision(problem.dtype).replace(output=problem.output_dtype)
    start = time.perf_counter()
    try:
        out, lse = backend.run(problem)
    except Exception as exc:  # noqa: BLE001 - a crashing kernel is a finding, not the sweep's end
        return record_from_error(problem, backend.name, precision, exc, time.perf_counter() - start, "report",
                                 sweep=sweep)
    run_s = time.perf_counter() - start
    start = time.perf_counter()
    ref, bound = shared.reference, shared.bound(precision)
    verdict = fp8_verdict(out, lse, problem, precision, ref, bound)
    histograms, extra = None, {}
    if verdict.summary is not None:
        histograms, extra = run_figures(out, lse, verdict, ref, bound.out, precision.output, shared.rounded_histogram)
    seconds = {"run": run_s, "check": time.perf_counter() - start, "reference": shared.seconds}
    return record_from_verdict(problem, backend.name, precision, verdict, seconds, "report",
                               {k: v for k, v in extra.items() if v is not None},
                               sweep=sweep, comparisons=shared.comparisons, histograms=histograms)
