"""The error model of an FP8 problem: how far a correct FP8 kernel of a precision model may be.

FlashAttention-3's FP8 forward (`PrecisionModel.fa3_fp8`, the default for FP8 inputs) computes,
per (batch, kv head) group: scores q.k of the stored values in fp32 (products of FP8 values are
exact in fp32) with the q.k descales folded into the softmax scale, P = exp(s - m) 2^8 rounded
once to e4m3, the row sum from the fp32 P, P.V in fp32, the output divided by the row sum and
multiplied by v's descale, then stored in bf16; LSE = m + log(l) - 8 ln 2.

So a group is the dense model (`fa_verify.error_model`) of the stored values with the scale
s dq dk (`fa_verify.oracle.fp8.groups`), P rounded to the declared P format with its offset,
output in fp32; its terms, times dv, are this bound's, with P's rounding named in two parts and
the FP8 steps added:
* p_quantisation  P's rounding where 2^offset exp(s - m) is a normal number of the P format:
                  u_P sum_j p_ij (|v_jc| + |O_ic|);
* p_underflow     where it is not (subnormal, or flushed to zero below half the smallest
                  subnormal): an absolute u_P tiny_P 2^-offset per probability. Without the
                  offset (or with e5m2's wider range) this is the term that grows;
* descale_fold    the two fp32 roundings of fl(fl(scale dq) dk): each logit moves by
                  DESCALE_FOLD_ROUNDINGS u_s |t_ij|, a probability by up to that plus the row's
                  maximum: sum_j p_ij eps_ij (|v_jc| + |O_ic|), eps_ij = 2 u_s (|t_ij| + M_i),
                  in the LSE sum_j p_ij eps_ij;
* v_descale       the product O dv in the accumulation dtype: u_pv (|O| + the error before it);
* output_rounding half an ulp of the output dtype at |O| + everything before it;
* offset          the LSE's compensation m + log(l) - offset ln 2: one more rounding,
                  u_s (|LSE| + offset ln 2);
* reference       the FP8 oracle's bound (`oracle.fp8.reference_fp8`).
The dense terms (scores, softmax, online_rescale, accumulation, second_order, flush_to_zero)
keep their names; the dense reference term is replaced by the FP8 oracle's. The row sum is
FlashAttention-3's, from the fp32 P, so P's rounding does not reach the LSE: the dense model's
LSE p_rounding term (which also allows a row sum of the rounded P) is left out, and an LSE that
sums the e4m3 P (u_P = 1/16 per probability) fails. (The LSE's second-order term is the dense
model's remainder factor on the first-order terms that remain.)

Assumption (beyond the dense model's): the FP8 tensor-core accumulation is fp32 (declare
score=... otherwise); descales are applied as FlashAttention-3 does (q.k folded into the
scale, v at the end).
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import ulp, unit_roundoff
from fa_verify.error_model import DEFAULT_LAMBDA, Bound, error_bound
from fa_verify.oracle import reference
from fa_verify.oracle.fp8 import groups, reference_fp8
from fa_verify.oracle.result import Reference

#: fl(fl(scale dq) dk): the two roundings of the descales folded into the softmax scale.
DESCALE_FOLD_ROUNDINGS = 2
_SLACK = 1 + 1e-9

OUT_TERMS = ("scores", "softmax", "online_rescale", "p_quantisation", "p_underflow", "descale_fold",
             "accumulation", "second_order", "v_descale", "output_rounding", "reference", "flush_to_zero")
LSE_TERMS = ("scores", "softmax", "online_rescale", "descale_fold", "row_sum", "log", "second_order", "offset",
             "lse_rounding", "reference")
#: dense terms carried over (times dv for the output)
_DENSE_OUT = ("scores", "softmax", "online_rescale", "accumulation", "second_order", "flush_to_zero")
_DENSE_LSE = ("scores", "softmax", "online_rescale", "row_sum", "log", "lse_rounding")


def fp8_error_bound(problem, precision, reference_result: Reference | None = None,
                    accumulation: str = "worst-case", lam: float = DEFAULT_LAMBDA) -> Bound:
    """Per-element bounds on |out - exact| and |lse - exact| of an FP8 problem for a kernel of
    `precision` (its input an FP8 format; the output dtype is the problem's)."""
    ref = reference_fp8(problem) if reference_result is None else reference_result
    precision = precision.replace(output=problem.output_dtype)
    # A group is the dense model of the stored values (exact in fp16), output kept in fp32.
    group_precision = precision.replace(input="fp16", output="fp32")
    u_s, u_pv = unit_roundoff(precision.score_accumulation), unit_roundoff(precision.pv_accumulation)
    u_p = unit_roundoff(precision.p_rounding)
    tiny_p = precision.tiny_p
    p_rounds = u_p > u_s
    out_terms = {name: np.zeros(problem.out_shape) for name in OUT_TERMS}
    lse_terms = {name: np.zeros(problem.lse_shape) for name in LSE_TERMS}
    for g in groups(problem):
        dense = g.dense
        group_bound = error_bound(dense, group_precision, reference(dense), accumulation, lam)
        index = (g.b, g.heads)
        for name in _DENSE_OUT:
            out_terms[name][index] = group_bound.out_terms[name][0] * g.v_descale
        for name in _DENSE_LSE:
            lse_terms[name][index] = group_bound.lse_terms[name][0]
        lse = ref.lse[index]
        abs_o = np.abs(ref.out[index]) / g.v_descale  # the group's output, before dv
        q, (k, v) = dense.q64()[0], (x[0] for x in dense.kv64())
        t = dense.scale_value * (q @ k.swapaxes(-1, -2))
        allowed = dense.mask & np.isfinite(lse)[..., None]
        with np.errstate(under="ignore", invalid="ignore"):
            p = np.where(allowed, np.exp(np.minimum(t - np.where(np.isfinite(lse), lse, 0.0)[..., None], 0.0)), 0.0)
            # e^(t - m) 2^offset below the smallest normal: P's rounding error is absolute there
            m = np.where(allowed, t, -np.inf).max(axis=-1, keepdims=True)
            small = allowed & (np.exp(np.minimum(t - m, 0.0)) < tiny_p)
        abs_v = np.abs(v)
        if p_rounds:
            under = u_p * tiny_p * small
            out_terms["p_underflow"][index] = (under @ abs_v + abs_o * under.sum(-1, keepdims=True)) * g.v_descale
            out_terms["p_quantisation"][index] = np.maximum(
                group_bound.out_terms["p_rounding"][0] * g.v_descale - out_terms["p_underflow"][index], 0.0)
        M = np.where(allowed, np.abs(t), 0.0).max(axis=-1, keepdims=True)
        eps = DESCALE_FOLD_ROUNDINGS * u_s * (np.abs(t) + M)
        w = np.where(allowed, p * eps, 0.0)
        # first order in eps; the remainder is at most 2 eps / (1 - 2 eps) of it (none past 1/4)
        worst = np.where(allowed, eps, 0.0).max(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            second = np.where(worst < 0.25, 1 + 2 * worst / (1 - 2 * worst), np.inf)
        out_terms["descale_fold"][index] = (w @ abs_v + abs_o * w.sum(-1, keepdims=True)) * second * g.v_descale
        lse_terms["descale_fold"][index] = w.sum(-1) * second[..., 0]
        # the dense remainder factor, on the first-order LSE terms without P's rounding
        dense_lse = group_bound.lse_terms
        first = sum(dense_lse[name][0] for name in ("scores", "softmax", "online_rescale", "p_rounding", "row_sum", "log"))
        with np.errstate(invalid="ignore", divide="ignore"):
            factor = np.where(first > 0, dense_lse["second_order"][0] / first, 0.0)
        kept = first - dense_lse["p_rounding"][0]
        lse_terms["second_order"][index] = np.where(kept > 0, factor * kept, 0.0)
    live = np.isfinite(ref.lse)
    abs_out = np.abs(ref.out)
    before = sum(out_terms[name] for name in OUT_TERMS[:8]) + ref.out_bound
    out_terms["v_descale"] = np.where(live[..., None], u_pv * (abs_out + before), 0.0)
    out_terms["output_rounding"] = np.where(
        live[..., None], 0.5 * ulp(abs_out + before + out_terms["v_descale"], precision.output), 0.0)
    out_terms["reference"] = np.where(live[..., None], ref.out_bound, 0.0)
    finite_lse = np.where(live, ref.lse, 0.0)
    lse_terms["offset"] = np.where(live & (precision.p_offset > 0),
                                   u_s * (np.abs(finite_lse) + precision.p_offset * np.log(2)), 0.0)
    lse_terms["reference"] = np.where(live, ref.lse_bound, 0.0)
    out = sum(out_terms.values()) * _SLACK
    lse = sum(lse_terms.values()) * _SLACK
    return Bound(out=out, lse=lse, out_terms=out_terms, lse_terms=lse_terms, precision=precision,
                 accumulation=accumulation)
