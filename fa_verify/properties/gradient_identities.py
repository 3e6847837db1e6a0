"""Identities of the backward pass that hold in exact arithmetic, as properties (kind "backward").

With P = exp(z - L) (0 where masked), dP = dO V^T, D_i = dO_i . O_i, dS = P o (dP - D + dlse)
(`fa_verify.backward`), and O_i = sum_j P_ij v_j:

* gradient_key_sum: sum_j dS_ij = sum_j P_ij dP_ij - (D_i - dlse_i) sum_j P_ij
  = D_i - (D_i - dlse_i)(1 - Ps_i) = dlse_i + Ps_i (D_i - dlse_i), Ps_i = exp(sink - L_i) the
  sink's weight (0 without sinks; a row that sees no key has r_i = 0). So
  sum_j dK_j = scale sum_i r_i q_i over the kv head's query heads: 0 without sinks and dlse. A
  kernel without the D term gives sum_j dK_j = scale sum_i D_i q_i. A softcap multiplies dS_ij
  by 1 - tanh^2, which does not sum to anything closed: not applicable there. Windows and ALiBi
  change P, not sum_j P_ij = 1 - Ps_i: the identity holds.
* gradient_value_sum: sum_j dV_j = sum_i (sum_j P_ij) dO_i = sum_i (1 - Ps_i) dO_i over the rows
  that see a key (every variant).
* gradient_gqa_group_sum: dK, dV of a GQA/MQA problem equal the sums over each group's query
  heads of the gradients of the same problem with k, v repeated per query head (MHA), both
  computed by the target.
* gradient_adjoint: <dQ, a> + <dK, b> + <dV, c> equals the directional derivative along a
  random (a, b, c) of the loss <dO, out> + <dlse, lse>, computed by forward mode from the
  certified forward (out' = sum_j P_ij (s'_ij - lse'_i) v_j + sum_j P_ij c_j, lse'_i =
  sum_j P_ij s'_ij, s' the logits' derivative along (a, b): softcap's and ALiBi's included),
  per tensor and head, so a failure names the gradient that is not the forward's derivative.
  With sinks and a fourth direction e [H]: <dsinks, e> per head equals e_h sum_{b,i} Ps_i
  (dlse_i - D_i), the sink moving every L_i by Ps_i e_h.
* gradient_key_shift: k_j + c for one vector c (exact in the dtype: `metamorphic.shifted_keys`)
  adds scale q_i.c to row i's scores, which the softmax ignores: dK, dV unchanged, dQ_i +
  scale r_i c with r_i = sum_j dS_ij = dlse_i (0 without dlse). A softcap and sinks (the sink's
  logit does not move) change the probabilities: not applicable. Windows, ALiBi, causal keep it.
* gradient_permutation (non-causal, no window, no ALiBi): keys with values permuted permute dK,
  dV alike and leave dQ; query rows with dout, out, lse, dlse permuted permute dQ and leave dK,
  dV (dsinks unchanged in both). Not bitwise: FA2 sums dK, dV over query rows and dQ over key
  tiles in order, and a permutation changes the order.
* gradient_linearity: dout and dlse times 2^k give the gradients times 2^k. Bitwise where every
  stage of an FA2 backward stays in the normal range (`bitwise_linearity`), within the error
  model otherwise (fp16: dS and small gradients are subnormal, and a subnormal does not scale).

The key shift, the permutations, the GQA sum and fp16 linearity compare two runs of the target:
each run within its own bound of its problem's exact gradients, which the law relates exactly,
so the tolerance is the sum of both bounds (plus float64 rounding where the law adds a term).

Tolerances, none of them a constant: the error model (`backward_error_model`) bounds every
element of a target's gradient, |g_hat - g| <= beta; the identities are linear in the gradients,
so |sum_j w_j (g_hat_j - g_j)| <= sum_j |w_j| beta_j (the triangle inequality: the worst case,
every error of one sign, which the error model's coherent terms reach, e.g. D from the rounded
out shifts every dS_ij of a row alike). Plus the float64 sums' own rounding (gamma_n of the
magnitudes) and, where the expected side uses the certified forward (L, D, Ps), that forward's
bound carried through. Every identity is implied by `gradient_agreement` in the worst case;
their value is the message (which law breaks names the bug) and speed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fa_verify.backward import BackwardProblem
from fa_verify.backward_error_model import gradient_error_bound
from fa_verify.dtypes import finfo
from fa_verify.error_model import _RowVariants
from fa_verify.oracle.backward import gradient_reference
from fa_verify.oracle.bounds import U64, gamma
from fa_verify.properties._compare import differing, exceeding
from fa_verify.properties._result import failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported
from fa_verify.properties.backward import _named
from fa_verify.properties.metamorphic import _shown, permuted_keys, permuted_queries, shifted_keys

#: Powers of two the linearity property scales dout by: |k| <= 2 keeps a gradient the
#: strategies hold below max / 16 in range (`strategies._backward`), and 2^-2 keeps
#: `bitwise_linearity`'s smallest stage normal.
LINEARITY_EXPONENTS = (-2, -1, 1, 2)
#: `bitwise_linearity`: inputs' nonzero magnitudes at least 2^-INPUT_FLOOR and probabilities at
#: least 2^-P_FLOOR keep every product and sum residue of FA2's stages normal (see there).
INPUT_FLOOR, P_FLOOR = 16, 32


def _judged(backend, problem):
    """(the target's gradients by name, the exact gradients, the error model's bounds)."""
    grads = _named(problem, backend, backend.run(problem))
    return grads, *_bounded(backend, problem)


def _bounded(backend, problem, reference=None):
    reference = reference or gradient_reference(problem.forward, problem.dout, problem.dlse)
    bound = gradient_error_bound(problem.forward, problem.dout, backend.precision(problem.dtype), reference,
                                 out_given=problem.out, lse_given=problem.lse, dlse=problem.dlse)
    return reference, bound


def _per_kv_head(problem, x):
    """[B, H, ...] summed over each kv head's query heads: [B, Hkv, ...]."""
    B, H = x.shape[:2]
    return x.reshape(B, problem.kv_heads, problem.group_size, *x.shape[2:]).sum(axis=2)


def _sink_weight(problem, reference):
    """(Ps [B, H, Nq], its bound): the sink's weight exp(sink - L) from the certified LSE (zeros
    without sinks); a row that sees no key has L = sink, Ps = 1."""
    if problem.sinks is None:
        zeros = np.zeros(problem.lse_shape)
        return zeros, zeros
    L = reference.lse
    with np.errstate(under="ignore"):
        ps = np.where(np.isfinite(L), np.exp(problem.sinks.astype(np.float64)[None, :, None] - L), 0.0)
    # |L_hat - L| <= lse_bound moves exp by a factor within expm1(lse_bound); exp's own rounding
    return ps, ps * (np.expm1(reference.forward.lse_bound) + 4 * U64)


def _sum_check(name, problem, got, expected, tolerance, what, hint):
    """Judge got ~ expected ([B, Hkv, D]) within tolerance; the failure names the index."""
    mismatch, worst = exceeding(got, expected, tolerance)
    if mismatch is not None:
        return failed(name, problem, f"{what} ([batch, kv head, column]) broken ({hint}): "
                                     + mismatch.describe(what), worst_ratio=worst)
    return passed(name, problem, worst_ratio=worst)


def _summed(x, bound, axis):
    """(sum of x over axis in float64, the bound on its error from x's bounds and the sum's own
    rounding: |sum (x_hat - x)| <= sum beta, plus gamma_n sum |x|)."""
    x = np.asarray(x).astype(np.float64)
    n = x.shape[axis]
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite gradient fails anyway (backends.watch)
        return x.sum(axis=axis), bound.sum(axis=axis) + float(gamma(n)) * np.abs(x).sum(axis=axis)


def key_sum_law(problem, grads, reference, bound):
    """(sum_j dK_j of the target's gradients, the identity's value, the tolerance), each
    [B, Hkv, D]: scale sum_i r_i q_i over the kv head's query heads (see the module's doc)."""
    got, tol = _summed(grads["dk"], bound.dk, axis=2)
    has_key = ~problem.masked_rows[None, None, :]
    dlse = np.zeros(problem.lse_shape) if problem.dlse is None else problem.dlse.astype(np.float64)
    ps, ps_bound = _sink_weight(problem, reference)
    delta, delta_bound = reference.delta, reference.delta_bound
    r = np.where(has_key, dlse + ps * (delta - dlse), 0.0)
    # r's error: Ps's (times |D - dlse| + D's bound) and D's (times Ps), then r's three roundings
    r_bound = np.where(has_key, ps_bound * (np.abs(delta - dlse) + delta_bound) + ps * delta_bound
                       + float(gamma(3)) * (np.abs(dlse) + ps * (np.abs(delta) + np.abs(dlse))), 0.0)
    q = problem.q64()
    scale = problem.scale_value
    expected = scale * _per_kv_head(problem, np.einsum("bhi,bhid->bhd", r, q))
    n = problem.group_size * problem.nq + 2
    tol = tol + scale * _per_kv_head(problem, np.einsum("bhi,bhid->bhd", r_bound, np.abs(q))) + float(gamma(n)) * (
        scale * _per_kv_head(problem, np.einsum("bhi,bhid->bhd", np.abs(r), np.abs(q))))
    return got, expected, tol


def check_gradient_key_sum(backend, problem):
    """sum_j dK_j = scale sum_i r_i q_i, r_i = sum_j dS_ij = dlse_i + Ps_i (D_i - dlse_i): 0 without sinks and dlse."""
    backend = as_backend(backend)
    name = "gradient_key_sum"
    if problem.softcap > 0:
        return not_applicable(name, problem, "a softcap multiplies dS_ij by 1 - tanh^2(t_ij / softcap): sum_j dS_ij "
                                             "has no closed form")
    hint = ("0 without sinks and dlse: the D term is missing?" if problem.sinks is None and problem.dlse is None
            else "scale sum_i (dlse_i + Ps_i (D_i - dlse_i)) q_i: the D, dlse or sink term is wrong?")
    return _sum_check(name, problem, *key_sum_law(problem, *_judged(backend, problem)), "sum_j dK_j", hint)


def value_sum_law(problem, grads, reference, bound):
    """(sum_j dV_j of the target's gradients, the identity's value, the tolerance), each
    [B, Hkv, D]: sum_i (1 - Ps_i) dO_i over the kv head's query heads' rows that see a key."""
    got, tol = _summed(grads["dv"], bound.dv, axis=2)
    ps, ps_bound = _sink_weight(problem, reference)
    has_key = ~problem.masked_rows[None, None, :]
    weight = np.where(has_key, 1.0 - ps, 0.0)
    weight_bound = np.where(has_key, ps_bound + U64 * np.abs(weight), 0.0)
    do = problem.dout.astype(np.float64)
    expected = _per_kv_head(problem, np.einsum("bhi,bhid->bhd", weight, do))
    n = problem.group_size * problem.nq + 1
    tol = tol + _per_kv_head(problem, np.einsum("bhi,bhid->bhd", weight_bound, np.abs(do))) + float(gamma(n)) * (
        _per_kv_head(problem, np.einsum("bhi,bhid->bhd", np.abs(weight), np.abs(do))))
    return got, expected, tol


def check_gradient_value_sum(backend, problem):
    """sum_j dV_j = sum_i (1 - Ps_i) dO_i over the rows that see a key (sum_i dO_i without sinks)."""
    backend = as_backend(backend)
    hint = "sum_i dO_i over rows that see a key" + (" times 1 - P_sink" if problem.sinks is not None else "")
    return _sum_check("gradient_value_sum", problem, *value_sum_law(problem, *_judged(backend, problem)),
                      "sum_j dV_j", hint + ": P not normalised by the LSE, a key or row lost or counted twice?")


def mha_twin(problem):
    """The backward problem with k, v repeated per query head (MHA): the same forward (out, lse)."""
    g = problem.group_size
    forward = problem.forward.replace(k=np.repeat(problem.k, g, axis=1), v=np.repeat(problem.v, g, axis=1))
    return problem.replace(forward=forward)


def check_gradient_gqa_group_sum(backend, problem):
    """dK, dV of a GQA problem equal the group sums of the target's own gradients with k, v repeated per query head."""
    backend = as_backend(backend)
    name = "gradient_gqa_group_sum"
    if problem.group_size == 1:
        return not_applicable(name, problem, "an MHA problem (one query head per kv head): no group to sum")
    twin = mha_twin(problem)
    reason = unsupported(backend, twin)
    if reason:
        return not_applicable(name, problem, reason)
    grads, _, bound = _judged(backend, problem)
    twin_grads, _, twin_bound = _judged(backend, twin)
    law = {}
    for tensor in ("dk", "dv"):
        per_head = np.asarray(twin_grads[tensor]).astype(np.float64)
        # each head's gradient within its bound; the group's sum within their sum + its rounding
        law[tensor] = (grads[tensor], _per_kv_head(problem, per_head), bound.bound(tensor) + _per_kv_head(
            problem, twin_bound.bound(tensor)) + float(gamma(problem.group_size)) * _per_kv_head(
            problem, np.abs(per_head)))
    return _judge(name, problem, law, "the GQA gradients are not the sums over each group's query heads of the "
                  f"same problem's MHA gradients (group of {problem.group_size}: one head taken, or a head counted "
                  "twice?)")


#: How each gradient's index reads in a failure message.
_INDEXED = {"dq": "([batch, head, query, column])", "dk": "([batch, kv head, key, column])",
            "dv": "([batch, kv head, key, column])", "dsinks": "([head])"}


def _judge(name, problem, law: dict, rule: str, label=lambda tensor: f"{tensor} {_INDEXED[tensor]}", note=""):
    """Judge law = {tensor: (got, expected, tolerance)}: a failure names the rule, then per
    tensor the elements beyond the tolerance and the worst of them (index, error / tolerance)."""
    worst, found = 0.0, []
    for tensor, (got, expected, tol) in law.items():
        mismatch, ratio = exceeding(got, expected, tol)
        worst = max(worst, ratio)
        if mismatch is not None:
            found.append(mismatch.describe(label(tensor)))
    if found:
        return failed(name, problem, f"{rule}: " + "; ".join(found), worst_ratio=worst)
    return passed(name, problem, worst_ratio=worst, note=note)


# --- the adjoint identity --------------------------------------------------------------------------

def directional_derivative(problem, reference, direction):
    """(the loss <dO, out> + <dlse, lse>'s derivative along direction = (a, b, c) (shaped q, k, v),
    split per tensor: {"dq": [B, H], "dk": [B, Hkv], "dv": [B, Hkv]}, and a bound on each's
    float64 error), by forward mode from the certified forward's P."""
    a, b, c = direction[:3]
    B, H, Nq, D = problem.out_shape
    G = problem.group_size
    q = problem.q64()
    k, v = problem.kv64()
    b_rows, c_rows = (np.repeat(x, G, axis=1) for x in (b, c))
    do = problem.dout.astype(np.float64)
    dlse = np.zeros(problem.lse_shape) if problem.dlse is None else problem.dlse.astype(np.float64)
    L = reference.lse
    scale = problem.scale_value
    parts = {t: np.zeros((B, H)) for t in ("dq", "dk", "dv")}
    magnitudes = {t: np.zeros((B, H)) for t in parts}
    mask = problem.mask
    rel = np.zeros((B, H))
    for bi, h in np.ndindex(B, H):
        live = np.isfinite(L[bi, h])
        allowed = mask & live[:, None]
        z, slope, _, _ = _RowVariants.of(problem, bi, h, slice(None)).logits(scale * (q[bi, h] @ k[bi, h].T))
        L0 = np.where(live, L[bi, h], 0.0)[:, None]
        with np.errstate(under="ignore"):
            p = np.where(allowed, np.exp(np.minimum(z - L0, 0.0)), 0.0)
        dp_abs = np.abs(do[bi, h]) @ np.abs(v[bi, h]).T
        o = p @ v[bi, h]
        d_abs = (np.abs(do[bi, h]) * (p @ np.abs(v[bi, h]))).sum(-1)
        for tensor, s_dir, s_abs in (
                ("dq", scale * slope * (a[bi, h] @ k[bi, h].T), scale * slope * (np.abs(a[bi, h]) @ np.abs(k[bi, h]).T)),
                ("dk", scale * slope * (q[bi, h] @ b_rows[bi, h].T),
                 scale * slope * (np.abs(q[bi, h]) @ np.abs(b_rows[bi, h]).T))):
            lse_dir = (p * s_dir).sum(-1)
            out_dir = (p * s_dir) @ v[bi, h] - lse_dir[:, None] * o
            parts[tensor][bi, h] = (do[bi, h] * out_dir).sum() + (dlse[bi, h] * lse_dir).sum()
            magnitudes[tensor][bi, h] = (p * s_abs * (dp_abs + d_abs[:, None] + np.abs(dlse[bi, h])[:, None])).sum()
        out_dir = p @ c_rows[bi, h]
        parts["dv"][bi, h] = (do[bi, h] * out_dir).sum()
        magnitudes["dv"][bi, h] = (np.abs(do[bi, h]) * (p @ np.abs(c_rows[bi, h]))).sum()
        # P's relative error: the certified LSE's bound, and z's float64 arithmetic (gamma_{D+8}
        # of the logits' magnitudes: the GEMM, the scale, softcap, ALiBi)
        z_abs = scale * (np.abs(q[bi, h]) @ np.abs(k[bi, h]).T) + 2 * np.abs(z) + np.abs(L0)
        rel[bi, h] = float(np.expm1(np.where(allowed, reference.forward.lse_bound[bi, h][:, None]
                                             + float(gamma(D + 8)) * z_abs, 0.0).max(initial=0.0)))
    # P enters each term up to three times (p, O, lse'): 3 rel, plus the sums' roundings
    n = D + problem.nk + G * Nq + 8
    bounds = {t: (3 * rel + 3 * U64 + float(gamma(n))) * m for t, m in magnitudes.items()}
    result = {"dq": (parts["dq"], bounds["dq"])}
    for t in ("dk", "dv"):
        result[t] = (_per_kv_head(problem, parts[t]), _per_kv_head(problem, bounds[t]))
    return result


def random_direction(problem, seed: int):
    """(a, b, c): standard normal directions shaped q, k, v (float64), and e [H] for the sink
    logits where the problem has sinks."""
    rng = np.random.default_rng(seed)
    arrays = (problem.q, problem.k, problem.v) + (() if problem.sinks is None else (problem.sinks,))
    return tuple(rng.standard_normal(x.shape) for x in arrays)


def sink_derivative(problem, reference, e):
    """(the loss's derivative along the sink logits' direction e [H], per head; its bound). The
    sink moves L_i by Ps_i e_h and so every P_ij by -P_ij Ps_i e_h: out_i by -Ps_i e_h O_i,
    lse_i by Ps_i e_h; the loss by e_h sum_{b,i} Ps_i (dlse_i - D_i) (a row that sees no key:
    Ps = 1, O = 0), from the certified forward's Ps and D."""
    ps, ps_bound = _sink_weight(problem, reference)
    dlse = np.zeros(problem.lse_shape) if problem.dlse is None else problem.dlse.astype(np.float64)
    delta, delta_bound = reference.delta, reference.delta_bound
    terms = ps * (dlse - delta)
    # Ps's error times |dlse - D| (+ D's error), D's error times Ps, the two roundings of each term
    term_bounds = ps_bound * (np.abs(dlse - delta) + delta_bound) + ps * delta_bound + float(gamma(2)) * np.abs(terms)
    n = problem.batch * problem.nq + 1  # the sum over rows and the product with e
    value = e * terms.sum(axis=(0, 2))
    return value, np.abs(e) * (term_bounds.sum(axis=(0, 2)) + float(gamma(n)) * np.abs(terms).sum(axis=(0, 2)))


def adjoint_law(problem, grads, reference, bound, direction) -> dict:
    """tensor -> (<gradient, its direction> per head, the forward's directional derivative along
    it, the tolerance): [B, H] for dq, [B, Hkv] for dk and dv, [H] for dsinks (with sinks and a
    fourth direction, e for the sink logits)."""
    expected = directional_derivative(problem, reference, direction)
    law = {}
    for tensor, x in zip(("dq", "dk", "dv"), direction[:3]):
        g = np.asarray(grads[tensor]).astype(np.float64)
        axes = (2, 3)
        with np.errstate(invalid="ignore", over="ignore"):
            got = (g * x).sum(axis=axes)
            # |<g_hat - g, x>| <= <beta, |x|>, plus the float64 dot product's rounding
            tol = (bound.bound(tensor) * np.abs(x)).sum(axis=axes) + float(gamma(x.shape[2] * x.shape[3])) * np.abs(
                g * x).sum(axis=axes)
        value, value_bound = expected[tensor]
        law[tensor] = (got, value, tol + value_bound)
    if len(direction) == 4 and problem.sinks is not None:
        e = direction[3]
        got = np.asarray(grads["dsinks"]).astype(np.float64) * e
        value, value_bound = sink_derivative(problem, reference, e)
        law["dsinks"] = (got, value, bound.bound("dsinks") * np.abs(e) + U64 * np.abs(got) + value_bound)
    return law


def adjoint_check(backend, problem, direction, name: str = "gradient_adjoint"):
    """The adjoint identity along `direction`, per tensor and head."""
    return _judge(name, problem, adjoint_law(problem, *_judged(backend, problem), direction),
                  "the gradients are not the derivative of the forward's loss <dO, out> + <dlse, lse> along a "
                  "random direction (the adjoint identity)",
                  lambda tensor: f"<{tensor}, direction> ({'[head]' if tensor == 'dsinks' else '[batch, head]'})")


def check_gradient_adjoint(backend, problem, *, seed: int = 0):
    """<dQ, a> + <dK, b> + <dV, c> equals the forward's directional derivative of <dO, out> + <dlse, lse> along (a, b, c)."""
    backend = as_backend(backend)
    return adjoint_check(backend, problem, random_direction(problem, seed))


# --- linearity in dO ---------------------------------------------------------------------------------

def bitwise_linearity(problem, reference, k: int) -> str | None:
    """Why scaling dout by 2^k may change more than the exponent of an FA2 backward's gradients
    (None: it must not). Every stage then stays normal: inputs >= 2^-16 (nonzero) make every
    product dO v, q k >= 2^-32 and a sum residue >= 2^-55 (a multiple of the smallest term's
    ulp); P >= 2^-32 makes dS = P (dP - D) >= 2^-87, its products with q, k >= 2^-103 and their
    residues >= 2^-126, fp32's smallest normal, before the scaling by 2^k (k >= -2: 2^-128 is
    exact too, a multiple of 2^-149). fp16 has no such room (its smallest normal is 2^-14)."""
    if problem.dtype == "fp16":
        return "fp16's dS and small gradients are subnormal (below 2^-14), and a subnormal does not scale exactly"
    arrays = [problem.q, problem.k, problem.v, problem.dout] + ([] if problem.dlse is None else [problem.dlse])
    for x in arrays:
        x = np.abs(np.asarray(x).astype(np.float64))
        if ((x > 0) & (x < 2.0 ** -INPUT_FLOOR)).any():
            return f"an input has a nonzero magnitude below 2^-{INPUT_FLOOR}: a stage may leave the normal range"
    forward = problem.forward
    L = reference.lse
    scale = forward.scale_value
    q = forward.q64()
    kk, _ = forward.kv64()
    for b, h in np.ndindex(forward.batch, forward.heads):
        z, *_ = _RowVariants.of(forward, b, h, slice(None)).logits(scale * (q[b, h] @ kk[b, h].T))
        allowed = forward.mask & np.isfinite(L[b, h])[:, None]
        if (allowed & (z - np.where(np.isfinite(L[b, h]), L[b, h], 0.0)[:, None] < -P_FLOOR * np.log(2) + 1)).any():
            return f"some probability is below 2^-{P_FLOOR}: dS = P (dP - D) may be subnormal"
    return None


def _scaled(problem, k: int):
    factor = 2.0 ** k
    dlse = None if problem.dlse is None else (problem.dlse * np.float32(factor)).astype(np.float32)
    return problem.replace(dout=(problem.dout.astype(np.float32) * factor).astype(problem.dout.dtype), dlse=dlse)


def check_gradient_linearity(backend, problem, *, seed: int = 0):
    """dout and dlse times 2^k give the gradients times 2^k: bitwise where every stage stays normal, within the error model otherwise."""
    backend = as_backend(backend)
    name = "gradient_linearity"
    k = int(np.random.default_rng(seed).choice(LINEARITY_EXPONENTS))
    limit = float(finfo(problem.dtype).max) / 2.0 ** max(k, 0)
    if np.abs(problem.dout.astype(np.float64)).max(initial=0.0) >= limit:
        return not_applicable(name, problem, f"dout times 2^{k} would overflow {problem.dtype}")
    scaled = _scaled(problem, k)
    if scaled.dout.astype(np.float64).tolist() != (problem.dout.astype(np.float64) * 2.0 ** k).tolist():
        return not_applicable(name, problem, f"dout times 2^{k} is not exact in {problem.dtype} (subnormal values)")
    grads, ref, bound = _judged(backend, problem)
    again = _named(scaled, backend, backend.run(scaled))
    factor = 2.0 ** k
    why = f"dout{' and dlse' if problem.dlse is not None else ''} times 2^{k}"
    reason = bitwise_linearity(problem, ref, k)
    names = [t for t in grads if t != "dq" or backend.deterministic_dq]
    if reason is None:
        for tensor in names:
            mismatch = differing(again[tensor], np.asarray(grads[tensor]).astype(np.float64) * factor)
            if mismatch is not None:
                return failed(name, problem, f"{why} did not scale the gradients by exactly 2^{k} (every stage "
                                             f"stays normal here, so FA2's arithmetic is exact under the scaling): "
                                             + mismatch.describe(tensor))
        if "dq" in names:
            return passed(name, problem, worst_ratio=0.0)
    # within the error model: each run within its own bound of the exact gradients, which scale
    scaled_ref = dataclasses.replace(
        ref, **{f: None if getattr(ref, f) is None else getattr(ref, f) * factor
                for f in ("dq", "dk", "dv", "dsinks", "dq_bound", "dk_bound", "dv_bound", "dsinks_bound", "delta",
                          "delta_bound")})
    _, scaled_bound = _bounded(backend, scaled, scaled_ref)
    worst, found = 0.0, []
    for tensor in grads if reason is not None else ["dq"]:
        tol = scaled_bound.bound(tensor) + factor * bound.bound(tensor)
        mismatch, ratio = exceeding(again[tensor], np.asarray(grads[tensor]).astype(np.float64) * factor, tol)
        worst = max(worst, ratio)
        if mismatch is not None:
            found.append(mismatch.describe(tensor))
    if found:
        return failed(name, problem, f"{why} did not scale the gradients by 2^{k} within the error model: "
                      + "; ".join(found), worst_ratio=worst)
    return passed(name, problem, worst_ratio=worst, note="" if reason is None else f"not bitwise: {reason}")


# --- key shift and permutations: two problems with related exact gradients -------------------------

def with_forward(problem, forward):
    """The backward problem of `forward` for the same upstream gradients (out and lse from its
    own certified forward)."""
    return BackwardProblem.of(forward, problem.dout, problem.dlse, tags=problem.gradient_tags)


def key_shift_problems(problem, seed: int):
    """(the problem with its keys on a grid, the same with every key shifted by c, c [B, Hkv, D]),
    both exact in the dtype (`metamorphic.shifted_keys`), or why the keys cannot be shifted."""
    shifted = shifted_keys(problem.forward, np.random.default_rng(seed))
    if isinstance(shifted, str):
        return shifted
    grid, moved, _, _ = shifted
    c = moved.k[:, :, 0].astype(np.float64) - grid.k[:, :, 0].astype(np.float64)  # exact: both on c's grid
    return with_forward(problem, grid), with_forward(problem, moved), c


def key_shift_law(grid, moved, c, grads, moved_grads, bound, moved_bound) -> dict:
    """tensor -> (the shifted problem's gradient, the value the grid problem's gives it, the
    tolerance): dK, dV unchanged; dQ_i + scale r_i c, r_i = sum_j dS_ij = dlse_i on a row that
    sees a key (no sinks). Each run within its bound of its exact gradients, which the law
    relates exactly; plus the float64 rounding of scale r_i c and its sum with dQ_i."""
    law = {t: (moved_grads[t], np.asarray(grads[t]).astype(np.float64), bound.bound(t) + moved_bound.bound(t))
           for t in ("dk", "dv")}
    dq = np.asarray(grads["dq"]).astype(np.float64)
    r = np.zeros(grid.lse_shape) if grid.dlse is None else np.where(
        grid.masked_rows[None, None, :], 0.0, grid.dlse.astype(np.float64))
    moves = grid.scale_value * r[..., None] * np.repeat(c, grid.group_size, axis=1)[:, :, None, :]
    law["dq"] = (moved_grads["dq"], dq + moves, bound.dq + moved_bound.dq
                 + float(gamma(3)) * (np.abs(dq) + np.abs(moves)))
    return law


def check_gradient_key_shift(backend, problem, *, seed: int = 0):
    """Adding one vector c to every key changes dK and dV not at all and dQ_i by scale dlse_i c (0 without dlse)."""
    backend = as_backend(backend)
    name = "gradient_key_shift"
    if problem.softcap > 0:
        return not_applicable(name, problem, "a softcap does not commute with shifting a row's scores: the shift "
                                             "changes the probabilities")
    if problem.sinks is not None:
        return not_applicable(name, problem, "the sink's logit does not move with the keys' scores: the shift "
                                             "changes the probabilities")
    shifted = key_shift_problems(problem, seed)
    if isinstance(shifted, str):
        return not_applicable(name, problem, shifted)
    grid, moved, c = shifted
    if problem.dlse is not None:
        largest = float(grid.scale_value * np.abs(grid.dlse).max(initial=0.0) * np.abs(c).max(initial=0.0))
        if largest >= float(finfo(problem.dtype).max) / 16:
            return not_applicable(name, problem, f"scale dlse c (up to {largest:.3g}) would take dQ near "
                                                 f"{problem.dtype}'s largest value")
    reason = unsupported(backend, grid, moved)
    if reason:
        return not_applicable(name, problem, reason)
    grads, _, bound = _judged(backend, grid)
    moved_grads, _, moved_bound = _judged(backend, moved)
    coords = [int(d) for d in np.flatnonzero(np.abs(c).max(axis=(0, 1)))]
    return _judge(name, problem, key_shift_law(grid, moved, c, grads, moved_grads, bound, moved_bound),
                  f"every key shifted by c on coordinates {coords} (|c| up to {float(np.abs(c).max()):.3g}) changed "
                  f"the gradients{'' if problem.dlse is None else ' beyond dQ_i + scale dlse_i c'} (the shift moves "
                  "each row's scores alike, which the softmax ignores: sum_j dS_ij != 0, the D term wrong?)")


def permuted_problems(problem, key_perm, query_perm):
    """(keys and values permuted by key_perm, query rows with dout, out, lse, dlse by query_perm):
    the backward problems of the same exact attention, rearranged."""
    rows = (slice(None), slice(None), query_perm)
    keys = problem.replace(forward=permuted_keys(problem.forward, key_perm))
    queries = problem.replace(forward=permuted_queries(problem.forward, query_perm), dout=problem.dout[rows],
                              out=problem.out[rows], lse=problem.lse[rows],
                              dlse=None if problem.dlse is None else problem.dlse[rows])
    return keys, queries


def permutation_law(grads, bound, permuted_grads, permuted_bound, key_perm, query_perm) -> dict:
    """tensor -> (the permuted problem's gradient, the original's rearranged alike, the tolerance:
    both runs' bounds): dQ's rows follow query_perm, dK's and dV's key_perm (dsinks stays)."""
    law = {}
    for tensor, g in grads.items():
        at = () if tensor == "dsinks" else (slice(None), slice(None), query_perm if tensor == "dq" else key_perm)
        law[tensor] = (permuted_grads[tensor], np.asarray(g).astype(np.float64)[at],
                       bound.bound(tensor)[at] + permuted_bound.bound(tensor))
    return law


def check_gradient_permutation(backend, problem, *, seed: int = 0):
    """Permuting keys with values (non-causal) permutes dK, dV alike; permuting query rows with dout permutes dQ."""
    backend = as_backend(backend)
    name = "gradient_permutation"
    for broken, why in ((problem.causal, "a causal mask"), (problem.window_size != (-1, -1), "a window"),
                        (problem.alibi_slopes is not None, "ALiBi")):
        if broken:
            return not_applicable(name, problem, f"{why} depends on the positions of queries and keys")
    rng = np.random.default_rng(seed)
    key_perm, query_perm = rng.permutation(problem.nk), rng.permutation(problem.nq)
    keys, queries = permuted_problems(problem, key_perm, query_perm)
    reason = unsupported(backend, keys, queries)
    if reason:
        return not_applicable(name, problem, reason)
    grads, _, bound = _judged(backend, problem)
    law = {}
    for derived, kp, qp, what in ((keys, key_perm, np.arange(problem.nq), "keys"),
                                  (queries, np.arange(problem.nk), query_perm, "queries")):
        derived_grads, _, derived_bound = _judged(backend, derived)
        for tensor, judged in permutation_law(grads, bound, derived_grads, derived_bound, kp, qp).items():
            law[f"{tensor} {_INDEXED[tensor]} with the {what} permuted"] = judged
    return _judge(name, problem, law, f"permuting the keys with the values by {_shown(key_perm)} or the queries "
                  f"with dout, out, lse by {_shown(query_perm)} did not permute the gradients alike (a "
                  "gradient written to another row, or a key or query's tile read at the wrong place?)", str)
