"""The error model's input_rounding term: a kernel that rounds its fp32 q, k, v to fp16 inside.

The term is held from both sides on inputs built so that its worst case is reached: every
entry just below the midpoint between two fp16 neighbours of mantissa 1 (a relative rounding
error of u_fp16 (1 - 2^-9)), all rounding toward zero. Rounding V alone (q = 0: uniform
weights, exact scores) moves the output by u |v|; rounding q and k alone moves a score by
2 u |t| in the direction that the |v_j| + |O| weighting of the term follows exactly (the key
moved is the lighter of two, with v of the opposite sign to O). The error of exact attention
on the rounded inputs must stay under the term and use more than a quarter of it: a term 4x
tighter or 4x looser fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from fa_verify.dtypes import round_to
from fa_verify.error_model import error_bound
from fa_verify.oracle import reference
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

#: Rounds down to 1.0 in fp16, exactly representable in fp32: 1 + u_fp16 - 2^-20.
JUST_BELOW_MIDPOINT = 1 + 2.0 ** -11 - 2.0 ** -20
ROUNDING = PrecisionModel.parse("fp32-accumulate,inputs=fp16", "fp32")


def _rounded(problem: AttentionProblem) -> AttentionProblem:
    return problem.replace(**{name: round_to(getattr(problem, name), "fp16").astype(np.float32) for name in "qkv"})


def _used(problem: AttentionProblem) -> tuple[float, float]:
    """The largest share of the input_rounding term (output, LSE) that rounding the inputs uses."""
    exact, rounded = reference(problem), reference(_rounded(problem))
    bound = error_bound(problem, ROUNDING, exact)
    out_error = np.abs(rounded.out - exact.out)
    lse_error = np.abs(rounded.lse - exact.lse)
    assert np.all(out_error <= bound.out) and np.all(lse_error <= bound.lse)
    with np.errstate(invalid="ignore"):
        return (float(np.nanmax(out_error / bound.out_terms["input_rounding"])),
                float(np.nanmax(lse_error / bound.lse_terms["input_rounding"], initial=0.0)))


def _problem(q, k, v) -> AttentionProblem:
    return AttentionProblem.from_float(*(np.asarray(x, np.float64)[None, None] for x in (q, k, v)), "fp32")


def test_rounding_the_values_uses_the_term_whole():
    D, N = 8, 16
    problem = _problem(np.zeros((4, D)), np.ones((N, D)), np.full((N, D), JUST_BELOW_MIDPOINT))
    out_share, _ = _used(problem)
    assert 0.25 < out_share <= 1, out_share


@pytest.mark.parametrize("logit", [1.0, 2.0])
def test_rounding_the_scores_uses_the_term_within_4x(logit):
    D = 4  # scale 1/2: key 1's score is -2 x^2 |k| = -logit
    x = JUST_BELOW_MIDPOINT
    q = np.full((1, D), x)
    k = np.stack([np.zeros(D), -np.full(D, x * logit / 2)])  # key 0: score 0 exactly; key 1 shrinks toward 0
    assert np.all(round_to(k[1], "fp16") != k[1])
    v = np.stack([np.ones(D), -np.ones(D)])  # exact in fp16: only the scores move
    out_share, lse_share = _used(_problem(q, k, v))
    assert 0.25 < out_share <= 1 and 0.25 < lse_share <= 1, (out_share, lse_share)


def test_without_the_declaration_there_is_no_term():
    problem = _problem(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)))
    bound = error_bound(problem, PrecisionModel.fp32_accumulate("fp32"), reference(problem))
    assert not bound.out_terms["input_rounding"].any() and not bound.lse_terms["input_rounding"].any()
    assert PrecisionModel.parse("fp32-accumulate,inputs=fp16", "fp32") == PrecisionModel(
        input="fp32", input_rounding="fp16")
    assert "input_rounding" not in PrecisionModel.flash("fp16").as_dict()  # records stay as they were
