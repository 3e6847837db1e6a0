"""Backward problems: a forward problem, its upstream gradient, and where backward bugs live.

`backward_problems(forwards)` pairs each forward problem with an upstream gradient dout drawn
from `DOUT_DISTRIBUTIONS` (and, where the target takes one, sometimes dlse), and in a fixed
share (`ANTI_ALIGNED_SHARE`) first makes some query rows anti-aligned with every key
(`anti_aligned`): their logits sit near -ANTI_ALIGNED_LOGIT, so their LSE is very negative and a
key the kernel forgets to mask (a padded tile tail with k = 0 has logit 0) gets P = exp(0 - lse),
far past fp32's range: random inputs give LSE ~ log(Nk) > 0 and never show it.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from fa_verify.backward import BackwardProblem
from fa_verify.dtypes import finfo, round_to
from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import AttentionProblem


def _normal(rng, shape):
    return rng.standard_normal(shape)


def _uniform_positive(rng, shape):
    # torch.rand's dO: every entry positive, so dP_ij and D_i are close and dS = P (dP - D) cancels.
    return rng.random(shape)


def _sparse(rng, shape):
    # A loss on a few outputs: most rows of dO are exactly zero.
    return rng.standard_normal(shape) * (rng.random(shape[:-1] + (1,)) < 0.1)


def _loss_scaled(rng, shape):
    # A mixed-precision loss scale (2^12): gradients near the top of fp16's range.
    return rng.standard_normal(shape) * 2.0**12


#: name -> (rng, shape) -> float64 upstream gradient
DOUT_DISTRIBUTIONS = {"normal": _normal, "uniform-positive": _uniform_positive, "sparse": _sparse,
                      "loss-scaled": _loss_scaled}
#: Share of drawn problems with anti-aligned rows (the others keep their forward's values).
ANTI_ALIGNED_SHARE = 0.25
#: The anti-aligned rows' logits: about -100, so exp(0 - lse) overflows fp32 (e^88).
ANTI_ALIGNED_LOGIT = 100.0
#: Share of problems with an upstream LSE gradient, for targets that take dlse.
DLSE_SHARE = 0.25


def anti_aligned(problem: AttentionProblem, rows) -> AttentionProblem:
    """`problem` with the query `rows` (indices along Nq, in every batch entry and head) made
    anti-aligned with every key: all keys get a common component a·u (u = the unit diagonal, a
    shift that moves each row's logits by one constant and leaves softmax alone) and the rows
    become -a·u, so their logits are near -ANTI_ALIGNED_LOGIT. Values stay within the dtype."""
    D = problem.head_dim
    a = math.sqrt(ANTI_ALIGNED_LOGIT / problem.scale_value)
    u = np.full(D, 1.0 / math.sqrt(D))
    q, k = problem.q.astype(np.float64), problem.k.astype(np.float64)
    k = 0.1 * k + a * u
    q[:, :, list(rows)] = -a * u
    return problem.replace(q=round_to(q, problem.dtype), k=round_to(k, problem.dtype),
                           tags=problem.tags + (("anti_aligned_rows", len(rows)),))


#: A share is a number of slots of eight, drawn uniformly (Hypothesis' st.floats and st.integers
#: lean to their bounds, so `x < share` would not be drawn in that share); the last slots pick.
_SLOTS = 8
_SLOT = st.sampled_from(range(_SLOTS)[::-1])
#: Headroom below the dtype's largest value that the gradients' a-priori bound keeps.
GRADIENT_HEADROOM = 16.0


def fitting(forward: AttentionProblem, dout: np.ndarray, dlse):
    """(dout, dlse) scaled by one power of two (exact) so that the gradients and dS, by an a-priori
    bound, stay GRADIENT_HEADROOM times below the dtype's largest value: a loss-scaled dout on large
    inputs would otherwise ask for gradients no fp16 kernel can store. With m_i = |dO_i|_1 max|v|
    + |dlse_i|: |dS_ij| <= 2 P_ij m_i, |dQ_i| <= 2 scale m_i max|k|, |dK_j| <= 2 scale N max_i m_i
    max|q| and |dV_j| <= N max|dO| over the N = G Nq rows of a kv head."""
    big = float(finfo(forward.q.dtype).max) / GRADIENT_HEADROOM
    q, k, v = (np.abs(x.astype(np.float64)).max() for x in (forward.q, forward.k, forward.v))
    m = np.abs(dout).sum(axis=-1).max() * v + (0.0 if dlse is None else np.abs(dlse).max())
    rows = forward.group_size * forward.nq
    worst = max(2 * m, 2 * forward.scale_value * m * max(k, rows * q), rows * np.abs(dout).max())
    if worst <= big:
        return dout, dlse
    factor = 2.0 ** -math.ceil(math.log2(worst / big))
    return dout * factor, None if dlse is None else dlse * factor


@st.composite
def _backward(draw, forwards, with_dlse: bool):
    anti, upstream = draw(_SLOT), draw(_SLOT)  # first: the later draws' length varies
    forward = draw(forwards)
    if anti < ANTI_ALIGNED_SHARE * _SLOTS:
        rows = draw(st.sets(st.integers(0, forward.nq - 1), min_size=1, max_size=min(forward.nq, 4)))
        forward = anti_aligned(forward, sorted(rows))
    name = draw(st.sampled_from(sorted(DOUT_DISTRIBUTIONS)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dout = DOUT_DISTRIBUTIONS[name](rng, forward.out_shape)
    dlse = rng.standard_normal(forward.lse_shape) if with_dlse and upstream < DLSE_SHARE * _SLOTS else None
    return BackwardProblem.of(forward, *fitting(forward, dout, dlse), tags=(("dout", name),))


#: Added to a sweep point's seed for its dout draw, so that dout is not drawn from the stream
#: that drew q, k, v (the same seed would make dout a function of q).
DOUT_SEED_OFFSET = 0x5EED


def make_backward_problem(forward: AttentionProblem, dout: str, seed: int) -> BackwardProblem:
    """The backward of `forward` for an upstream gradient from DOUT_DISTRIBUTIONS[`dout`] drawn
    from `seed`, without Hypothesis (a report sweep's points, a record's rebuild): the same
    problem for the same arguments, scaled to fit like a drawn one (`fitting`), no dlse, tagged
    (("dout", dout), ("dout_seed", seed))."""
    if dout not in DOUT_DISTRIBUTIONS:
        raise InvalidArgumentError(f"dout={dout!r} is unknown; use one of {', '.join(DOUT_DISTRIBUTIONS)}")
    rng = np.random.default_rng(seed + DOUT_SEED_OFFSET)
    scaled, _ = fitting(forward, DOUT_DISTRIBUTIONS[dout](rng, forward.out_shape), None)
    return BackwardProblem.of(forward, scaled, tags=(("dout", dout), ("dout_seed", seed)))


def backward_problems(forwards, with_dlse: bool = False):
    """Strategy of `BackwardProblem`s over the forward problems `forwards` (a strategy of
    `AttentionProblem`), see the module's doc; `with_dlse`: sometimes with an upstream LSE gradient."""
    return _backward(forwards, with_dlse)
