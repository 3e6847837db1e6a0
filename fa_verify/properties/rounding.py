"""Unbiased rounding: the output's errors have no systematic sign.

A kernel that accumulates in fp32 and rounds the output to fp16/bf16 to nearest makes errors
of about +-1/2 ulp that average out; one that truncates (rounds toward zero) or rounds down
makes errors of one sign, 1/4 to 1/2 ulp on average. Two statistics over the errors in ulps
of the output dtype, e = (out - ref) / ulp(ref):
  * the signed mean of e (rounding down or up);
  * the mean of e * sign(ref) (rounding toward or away from zero: truncation's signature,
    invisible to the signed mean when outputs have both signs).
Outputs in the normal range take part, their errors clipped to +-CLIP ulp.
Elements of one row share that row's weights and rounding of the row sum, so errors within a
row are not independent: the test is a z-test over the per-row means (rows are independent
computations), failing when |z| > Z_THRESHOLD and the bias is at least MIN_BIAS ulp (a floor,
so that with many rows a tiny legitimate bias — an exp that is a little low in every
element, say — is not reported).

The statistic is about the kernel, not the data: with degenerate inputs (tied scores, constant
rows) a correct FA2 kernel rounds the same few P values the same way everywhere, which biases
its output legitimately. So the property keeps the problem's shape, dtype, mask and scale but
draws its own i.i.d. N(0, 1) inputs (from `seed`), on which every rounding is generic.

It applies only where output rounding dominates the error: a 16-bit output from a wider P.V
accumulation. For fp32 outputs, or outputs rounded from fp16/bf16 accumulators, other
errors dominate and no honest statement about rounding bias follows ("not applicable").
"""

from __future__ import annotations

import math

import numpy as np

from fa_verify.dtypes import finfo, ulp, unit_roundoff
from fa_verify.oracle import reference
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend
from fa_verify.strategies import Shape, make_problem

Z_THRESHOLD = 5.0
MIN_BIAS = 0.1
#: Errors are clipped to +-CLIP ulp: where an output cancels to far below its row scale,
#: P's rounding (relative to the row scale) is many ulps of the output; clipping that
#: symmetric noise keeps its mean 0 and stops it from drowning the statistic.
CLIP = 4.0
#: Fewer rows (or elements) than this: too little data for the test.
MIN_ROWS, MIN_ELEMENTS = 32, 512


def _z(row_means: np.ndarray) -> tuple[float, float]:
    """(mean, z) of a one-sample z-test of the row means against 0."""
    mean = float(row_means.mean())
    spread = float(row_means.std(ddof=1)) / math.sqrt(row_means.size)
    if spread == 0:
        return mean, 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean, mean / spread


def check_unbiased_rounding(backend, problem, *, seed: int = 0) -> PropertyResult:
    """On N(0, 1) inputs of the problem's shape, the output errors' signed mean and mean toward
    zero are statistically 0 (see the module doc)."""
    backend = as_backend(backend)
    problem = make_problem("normal", Shape.of(problem), problem.dtype, seed, causal=problem.causal,
                           causal_alignment=problem.causal_alignment, scale=problem.scale)
    precision = backend.precision(problem.dtype)
    if precision.output == "fp32" or unit_roundoff(precision.pv_accumulation) >= unit_roundoff(precision.output):
        return not_applicable("unbiased_rounding", problem,
                              f"output rounding does not dominate the error under {precision.describe()}")
    out, _ = backend.run(problem)
    ref = reference(problem)
    selected = (~problem.masked_rows)[None, None, :, None] & (
        np.abs(ref.out) >= float(finfo(precision.output).smallest_normal))
    rows = selected.any(axis=-1)
    if rows.sum() < MIN_ROWS or selected.sum() < MIN_ELEMENTS:
        return not_applicable("unbiased_rounding", problem,
                              f"too few normal-range outputs for a statistic ({int(selected.sum())} "
                              f"in {int(rows.sum())} rows; needs {MIN_ELEMENTS} in {MIN_ROWS})")
    got = out.astype(np.float64)
    bad = selected & ~np.isfinite(got)
    if bad.any():
        return failed("unbiased_rounding", problem, f"{int(bad.sum())} outputs are not finite")
    e = np.clip((got - ref.out) / ulp(ref.out, precision.output), -CLIP, CLIP)
    count = selected.sum(axis=-1)[rows]
    found, ratio = [], 0.0
    for label, values in (("signed mean error", e), ("mean error toward zero", -e * np.sign(ref.out))):
        row_means = np.where(selected, values, 0.0).sum(axis=-1)[rows] / count
        mean, z = _z(row_means)
        # both conditions must hold to fail, so the ratio to report is the smaller of the two
        ratio = max(ratio, min(abs(z) / Z_THRESHOLD, abs(mean) / MIN_BIAS))
        if abs(z) > Z_THRESHOLD and abs(mean) >= MIN_BIAS:
            found.append(f"{label} is {mean:+.3g} ulp of {precision.output} over {int(rows.sum())} rows "
                         f"(z = {z:+.3g}; allowed |z| <= {Z_THRESHOLD:g} or |mean| < {MIN_BIAS:g} ulp)")
    if found:
        return failed("unbiased_rounding", problem, "; ".join(found), ratio)
    return passed("unbiased_rounding", problem, worst_ratio=ratio)
