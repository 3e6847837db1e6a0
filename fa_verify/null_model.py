"""The null-model guard: would a trivial output pass the tolerance an example is judged by?

An example shows something about a kernel only if its tolerance rejects outputs that know
nothing about the problem. For each example a property judges by a tolerance, the guard
builds trivial outputs of the problem (`null_outputs`) and asks the property's own pass test
(`would_pass`, built from the verdict or the property's comparison) about each. When one
passes, the example is *uninformative*: it counts as neither a pass nor a fail.

The trivial outputs, each an (out, lse) pair following the masked-row convention (0, -inf):
  * zeros: O = 0, LSE = 0;
  * uniform attention over the attended keys: O = the mean of the attended V rows,
    LSE = log(number of attended keys), as if every score were 0;
  * queries shifted by one row: row i gets the exact answer of row i - 1 (cyclically), the
    output of another example's inputs, as a kernel that mixes up its rows gives;
  * another q: the answer for fresh queries of the same size and spread (float64).

A trivial output that is the right answer (uniform attention over one key, zeros with V = 0)
proves nothing about the tolerance, so where it agrees with the reference within the
reference's bound plus the float64 rounding of computing it (`(Nk + D + 4) u64` relative to
the largest attended |v| or |LSE|: every trivial output is an average of V rows or a
log-sum-exp of dot products), it is not tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fa_verify.dtypes import finfo, round_to
from fa_verify.oracle import Reference
from fa_verify.problem import AttentionProblem

_U64 = 2.0 ** -53
#: The fixed seed of the fresh queries: the guard of one example is reproducible on its own.
_SEED = 0x6E75


@dataclass(frozen=True, eq=False)
class NullOutput:
    """One trivial output of a problem; `exact_out` / `exact_lse` when it is the right answer."""

    name: str
    out: np.ndarray
    lse: np.ndarray
    exact_out: bool
    exact_lse: bool

    def exact(self, judged) -> bool:
        """Whether it is the right answer in every part (`"out"`, `"lse"`) a property judges."""
        return all(self.exact_out if part == "out" else self.exact_lse for part in judged)


@dataclass(frozen=True)
class NullGuard:
    """What the guard found on one example: the trivial outputs tried and those that passed."""

    tried: tuple
    passing: tuple

    @property
    def informative(self) -> bool:
        return not self.passing

    def describe(self) -> str:
        if self.informative:
            return f"informative: {len(self.tried)} trivial outputs fail the tolerance"
        return (f"uninformative: the trivial output{'s' if len(self.passing) > 1 else ''} "
                f"{', '.join(self.passing)} pass{'' if len(self.passing) > 1 else 'es'} the same "
                f"tolerance, so a pass here says nothing about the target")


def _attended_mean(problem: AttentionProblem) -> np.ndarray:
    """The mean of the V rows each query row attends, float64 [B,H,Nq,D_v] (0 where none)."""
    _, v = problem.kv64()
    start, limit = problem.key_start(), problem.key_limit()
    sums = np.concatenate([np.zeros_like(v[:, :, :1]), np.cumsum(v, axis=2)], axis=2)
    n = np.maximum(limit - start, 0)
    return (sums[:, :, np.maximum(limit, start)] - sums[:, :, start]) / np.maximum(n, 1)[:, None]


def _other_q(problem: AttentionProblem) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) in float64 of the problem with fresh queries of the same spread (root mean
    square; 1 where q is all zero, whose fresh queries would be zero again)."""
    from fa_verify.backends.naive import naive_attention
    from fa_verify.precision import PrecisionModel

    q = problem.q64()
    spread = float(np.sqrt(np.mean(q * q))) or 1.0
    largest = float(finfo(problem.dtype).max)  # a spread near the dtype's maximum must not overflow
    fresh = round_to(np.clip(np.random.default_rng(_SEED).standard_normal(q.shape) * spread, -largest, largest),
                     problem.dtype)
    model = PrecisionModel.parse("score=fp64,p=fp64,pv=fp64,out=fp64", problem.dtype)
    out, lse = naive_attention(problem.replace(q=fresh), model)
    return out, lse.astype(np.float64)


def null_outputs(problem: AttentionProblem, ref: Reference, out_dtype) -> tuple[NullOutput, ...]:
    """The trivial outputs of `problem` (see the module doc): O in `out_dtype` and LSE in
    float32, as a kernel returns them."""
    masked = problem.masked_rows[None, None, :]
    n = problem.key_limit()
    with np.errstate(divide="ignore"):
        attended = np.maximum(n - problem.key_start(), 0).astype(np.float64)
        uniform_lse = np.broadcast_to(np.log(attended), ref.lse.shape)
    candidates = [("zeros", np.zeros(ref.out.shape), np.zeros(ref.lse.shape)),
                  ("uniform attention", _attended_mean(problem), uniform_lse)]
    if problem.nq > 1:
        candidates.append(("queries shifted by one row", np.roll(ref.out, 1, axis=2), np.roll(ref.lse, 1, axis=2)))
    candidates.append(("another q", *_other_q(problem)))

    _, v = problem.kv64()
    magnitude = np.maximum.accumulate(np.abs(v).max(axis=-1, keepdims=True), axis=2)[
        :, :, np.maximum(n - 1, 0)]
    slack = (problem.nk + problem.head_dim + 4) * _U64
    finite = np.isfinite(ref.lse)
    nulls = []
    for name, out, lse in candidates:
        out = np.where(masked[..., None], 0.0, out)
        lse = np.where(masked, ref.lse, lse)  # -inf, or the sink's logit
        # exact before rounding: the right answer rounded to the output dtype is a correct output
        exact_out = bool(np.all(np.abs(out - ref.out) <= ref.out_bound + slack * magnitude))
        with np.errstate(invalid="ignore"):
            lse_err = np.where(finite, np.abs(lse - ref.lse), 0.0)
        exact_lse = bool(np.all(lse_err <= ref.lse_bound + slack * (1 + np.abs(np.where(finite, ref.lse, 0)))))
        nulls.append(NullOutput(name, round_to(out, out_dtype), lse.astype(np.float32), exact_out, exact_lse))
    return tuple(nulls)


def guard(nulls, would_pass: Callable[[NullOutput], bool], judged=("out",)) -> NullGuard:
    """Ask `would_pass` about every trivial output that is not the right answer in the `judged`
    parts ("out", "lse")."""
    tried = tuple(null for null in nulls if not null.exact(judged))
    return NullGuard(tried=tuple(null.name for null in tried),
                     passing=tuple(null.name for null in tried if would_pass(null)))


def batch_guard(guards) -> NullGuard:
    """The guard of a problem judged part by part (a ragged batch's sequences): a trivial output
    passes the whole only if it passes every part where it was tried."""
    tried = tuple(dict.fromkeys(name for g in guards for name in g.tried))
    passing = tuple(name for name in tried
                    if all(name in g.passing for g in guards if name in g.tried))
    return NullGuard(tried=tried, passing=passing)


def fp8_null_outputs(problem, ref: Reference, out_dtype) -> tuple[NullOutput, ...]:
    """The trivial outputs of an FP8 problem (`fa_verify.fp8`), those of each (batch, kv head)
    group's dense problem of stored values (`oracle.fp8.groups`) with the group's output times
    its v descale, in `out_dtype`; one is the right answer only where it is in every group."""
    from fa_verify.oracle import reference
    from fa_verify.oracle.fp8 import groups

    per_group = [(g, null_outputs(g.dense, reference(g.dense), "fp32")) for g in groups(problem)]
    nulls = []
    for i, first in enumerate(per_group[0][1]):
        out, lse = np.zeros(ref.out.shape), np.zeros(ref.lse.shape)
        exact_out = exact_lse = True
        for g, found in per_group:
            out[g.b, g.heads] = found[i].out[0].astype(np.float64) * g.v_descale
            lse[g.b, g.heads] = found[i].lse[0]
            exact_out, exact_lse = exact_out and found[i].exact_out, exact_lse and found[i].exact_lse
        nulls.append(NullOutput(first.name, round_to(out, out_dtype), lse.astype(np.float32), exact_out, exact_lse))
    return tuple(nulls)
