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

A failure names its likely cause. Truncation is not the only way to bias errors toward zero:
a kernel whose scale (or whose scores) is rounded computes attention with scale s(1 + rho),
whose error rho s dO/ds is flatter attention for rho < 0, hence outputs nearer the mean of V,
nearer zero for N(0, 1) values. The two differ in shape: truncation costs every output about
half an ulp whatever its row, a scale error is proportional to dO/ds = sum_j p_ij (t_ij -
tbar_i) v_j (t the unscaled scores). So the errors are fitted, by least squares over the rows'
elements, as e = c + b (-sign(ref)) + eps dO/ds / ulp(ref), and each term whose |z| exceeds
Z_THRESHOLD (standard errors clustered by row) is named: c rounding down or up, b rounding
toward zero, eps a rounded scale or rounded scores (with the relative scale error, and the
dtype whose rounding of the scale it matches, within MATCH_SHARE). The fit only names causes; passing or failing
is the two statistics' decision alone. Elements whose output cancels to below CAUSE_SHARE of
the row scale stay out of the fit: their ulp is far below the row scale's, so dO/ds in their
ulps is blown up.

It applies only where output rounding dominates the error: a 16-bit output from a wider P.V
accumulation. For fp32 outputs, or outputs rounded from fp16/bf16 accumulators, other
errors dominate and no honest statement about rounding bias follows ("not applicable").
"""

from __future__ import annotations

import math

import numpy as np

from fa_verify.dtypes import DTYPE_NAMES, finfo, round_to, ulp, unit_roundoff
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
#: Elements whose |reference| is below this share of their row scale stay out of the fit that
#: names a failure's cause (see the module doc).
CAUSE_SHARE = 0.25
#: A fitted scale error matches a dtype's rounding of the scale within 3 standard errors or this
#: share of it: output rounding's quantised, clipped errors bias the fitted slope by up to ~10%
#: (measured: 0.90-1.06 of the true error for a scale rounded to fp16, 4 shapes x 10 seeds).
MATCH_SHARE = 0.15


def _z(row_means: np.ndarray) -> tuple[float, float]:
    """(mean, z) of a one-sample z-test of the row means against 0."""
    mean = float(row_means.mean())
    spread = float(row_means.std(ddof=1)) / math.sqrt(row_means.size)
    if spread == 0:
        return mean, 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean, mean / spread


def _scale_derivative(problem, ref) -> np.ndarray:
    """dO/ds at the reference, float64 [B, H, Nq, D]: sum_j p_ij (t_ij - tbar_i) v_j, t = q.k
    unscaled, p the reference's weights exp(s t - lse), tbar_i their mean of t."""
    k, v = problem.kv64()
    t = np.where(problem.mask, problem.q64() @ np.swapaxes(k, -1, -2), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):  # fully masked rows: exp(-inf + inf)
        p = np.where(problem.mask, np.exp(problem.scale_value * t - ref.lse[..., None]), 0.0)
    t_mean = (p * t).sum(axis=-1, keepdims=True)
    return (p * np.where(problem.mask, t - t_mean, 0.0)) @ v


def _fit(columns, e, selected) -> tuple[np.ndarray, np.ndarray]:
    """(coefficients, their z) of the least-squares fit of e by `columns` over the selected
    elements, standard errors clustered by row (elements of a row share its rounding)."""
    rows = np.broadcast_to(np.arange(np.prod(e.shape[:-1])).reshape(e.shape[:-1])[..., None], e.shape)[selected]
    x = np.stack([np.broadcast_to(c, e.shape)[selected] for c in columns], axis=1)
    y = e[selected]
    inverse = np.linalg.pinv(x.T @ x)
    coefficients = inverse @ (x.T @ y)
    per_row = np.zeros((rows.max() + 1, x.shape[1]))
    np.add.at(per_row, rows, x * (y - x @ coefficients)[:, None])
    se = np.sqrt(np.diag(inverse @ (per_row.T @ per_row) @ inverse))
    with np.errstate(divide="ignore", invalid="ignore"):
        return coefficients, np.where(se > 0, coefficients / se, 0.0)


def _likely_cause(problem, ref, e, selected, dtype) -> str:
    """What the fit of the module doc names as the bias's cause."""
    selected = selected & (np.abs(ref.out) >= CAUSE_SHARE * ref.row_scale)
    if selected.any(axis=-1).sum() < MIN_ROWS or selected.sum() < MIN_ELEMENTS // 4:
        return ""  # too little data to name anything
    (c, b, eps), (zc, zb, zeps) = _fit((1.0, -np.sign(ref.out), _scale_derivative(problem, ref) / ulp(ref.out, dtype)),
                                       e, selected)
    causes = []
    if abs(zeps) > Z_THRESHOLD:
        scale = problem.scale_value
        relative = eps / scale
        matches = [name for name in DTYPE_NAMES
                   if (rounded := float(round_to(np.float64(scale), name)) / scale - 1) != 0
                   and abs(rounded - relative) <= max(3 * abs(relative / zeps), MATCH_SHARE * abs(rounded))]
        match = f", as rounding the scale to {' or '.join(matches)} gives" if matches else ""
        causes.append(f"the errors follow dO/dscale: this is attention with the scale off by {relative:+.2g} "
                      f"(± {abs(relative / zeps):.1g}) relative{match} (z = {zeps:+.3g}) — a rounded scale or "
                      f"rounded scores, not output rounding")
    if abs(zb) > Z_THRESHOLD:
        causes.append(f"outputs rounded toward zero (truncation): {b:+.2g} ulp per element beyond any scale "
                      f"error (z = {zb:+.3g})")
    if abs(zc) > Z_THRESHOLD:
        causes.append(f"outputs rounded {'down' if c < 0 else 'up'}: {c:+.2g} ulp per element (z = {zc:+.3g})")
    return "likely cause: " + ("; ".join(causes) if causes else "none of truncation, directed rounding or a "
                               "scale error explains it alone")


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
        cause = _likely_cause(problem, ref, e, selected, precision.output)
        return failed("unbiased_rounding", problem, "; ".join(found + [cause] if cause else found), ratio)
    return passed("unbiased_rounding", problem, worst_ratio=ratio)
