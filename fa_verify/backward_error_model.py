"""The backward error model: how far from the exact gradients a correct FA2 backward may be.

The kernel (FA2's backward; `fa_verify.backward_emulation` is one) recomputes the scores S
from q, k in `precision.score_accumulation`, P = exp(z - LSE) from the GIVEN lse (float32,
itself the forward's rounded result), rounds P to `precision.p_rounding` for dV = P^T dO,
computes dP = dO V^T and D = rowsum(dO o O) from the GIVEN out (or rowsum(P o dP)) in the
score dtype, dS = P (dP - D + dlse) (times the softcap's derivative f = 1 - tanh^2(t / c)),
rounds dS to `precision.p_rounding` for dQ = scale dS K and dK = scale dS^T Q, accumulates
every GEMM in `precision.pv_accumulation` in any order, and stores the gradients in
`precision.output`. Notation per row i and key j of a head: p, g = dP - D + dlse, dS = p g f
exact (from the gradient oracle), A_ij = sum_d |q_id||k_jd|, B_ij = sum_c |dO_ic||v_jc|,
m_ij = p_ij (|dP_ij| + |D_i| + |dlse_i|) (the magnitudes of dS before the cancellation),
u_s, u_p, u_pv, u_out the unit roundoffs (`error_model._Units`: the same numbers as the forward).

P's relative error eps_ij is the sum of three parts; each dS error is a named term:
* scores       the q.k GEMM: eps = gamma_D(u_s) scale A_ij tanh'(t) (error_model's g_d), through
               P into dS as p eps |g| f, and with a softcap into f: 2 |tanh| f gamma_D scale A / c.
* softmax      the logits' fp32 arithmetic and exp: eps = u_s (|z| + 2|z - L| + 2|L| + own) +
               eps_exp + tanh's declared error eps_tanh |z| + tanh_abs c (error_model's
               `_RowVariants.logits` gives own and |z|; `_Units.tanh_error`), at least tiny_s
               absolute; with a softcap, f's own rounding 4 |tanh| f u_s |t / c| +
               2 |tanh| (eps_tanh |tanh| + tanh_abs) + u_s tanh^2 + u_s f (eps_tanh = eps_exp,
               tanh_abs = 0 for an accurate tanh).
* given_lse    P = exp(z - LSE_given): eps = |LSE_given - LSE| (+ the oracle's LSE bound).
* given_out    D's error: from the given out, sum_c |dO_ic| (|O_given - O| + out bound) +
               gamma_D(u_s) sum_c |dO_ic O_given_ic|; or, for a kernel that takes
               rowsum(P o dP), sum_j p (eps |dP| + gamma_D B) + gamma_Nk sum_j p |dP|:
               the larger of the two. Into dS: p |delta D| f.
* dp           dP = dO V^T (gamma_D(u_s) B_ij) and dS's own fp32 arithmetic (the subtraction,
               the dlse addition, the products with p and f: 4 u_s m_ij), times f. These are
               absolute errors on a difference that may cancel (dP ~ D on near-uniform rows):
               they are bounded with m_ij, never with |dS|.
* p_rounding   (dV only) u_p max(p, tiny_p) when P is stored narrower than it is computed.
* ds_rounding  (dQ, dK) u_p max(|dS|, tiny_p): the rounding is relative to dS itself.
The dS terms reach dQ as scale sum_j E_ij |k_jd| and dK as scale sum_i E_ij |q_id| (summed
over the group's query heads); P's terms reach dV as sum_i W_ij |dO_ic|. Then:
* accumulation gamma_n(u_pv) of the GEMMs' magnitudes, n the summed length + 2 (the scale's
               fp32 rounding and the product): Nk for dQ, G Nq for dK (the same without the
               scale for dV), B Nq for dsinks; plus (n + 1) tiny_pv for products below the
               normal range.
* second_order the first-order terms / (1 - 2 eps) minus themselves, eps the row's largest
               relative perturbation (P's, u_p, gamma_n), per row; infinite where eps >= 1/4.
               f's error is absolute: its products with dS's errors are covered by using
               f + |delta f| (at most 1) for f in the terms above.
* output_rounding half an ulp of the output dtype at |gradient| + every error above (dsinks:
               float32, as flash-attn returns the gradient of a float32 parameter); with GQA/MQA
               also half an ulp at each query head's |dK_h|, |dV_h| + the errors: FA2's mha_bwd
               stores every query head's dK, dV in the output dtype before summing the group.
* reference    the gradient oracle's own bound.
* flush_to_zero  only for a declared flush-to-zero (`precision.ftz`: XLA on the CPU, GPUs' .ftz):
               every subnormal input entry read as 0 moves it by less than tiny_in, the smallest
               normal of the input dtype (a given out entry: tiny_out). dP_ij by tiny_in
               (sum_c |dO_ic| + sum_c |v_jc|), D_i by tiny_out sum_c |dO_ic| + tiny_in
               sum_c |O_ic|: into dS as p (those) f; dQ by scale tiny_in sum_j |dS_ij| (k
               flushed), dK likewise (q), dV by tiny_in sum_i p_ij (dO); a stored gradient
               below the normal range by tiny_out. Flushed scores: `error_model._Units.t_abs`.
dsinks: dsink_h = -sum_{b,i} P_sink,i (D_i - dlse_i): P_sink's softmax and given_lse errors
times |D - dlse|, given_out's p_sink |delta D|, dp's 2 u_s p_sink (|D| + |dlse|).

Assumptions: those of `fa_verify.error_model` (IEEE round-to-nearest, exp and tanh within
EXP_ULPS, no overflow), and the given out and lse judged for what they are: a kernel's
gradients can be no better than the forward results it was handed, so their errors are terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_verify.dtypes import finfo, ulp
from fa_verify.error_model import DEFAULT_LAMBDA, _RowVariants, _scaled, _Units, gamma, gamma_times
from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle.backward import GradientReference, checked_upstream
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

TENSORS = ("dq", "dk", "dv", "dsinks")
#: The terms of every tensor (a term that does not reach a tensor is zero there).
TERMS = ("scores", "softmax", "given_lse", "given_out", "dp", "p_rounding", "ds_rounding", "flush_to_zero",
         "accumulation", "second_order", "output_rounding", "reference")
#: The terms that pass through dS, in the order they are stacked for the GEMMs.
_DS_TERMS = ("scores", "softmax", "given_lse", "given_out", "dp", "ds_rounding", "flush_to_zero")
#: The terms of P that reach dV.
_P_TERMS = ("scores", "softmax", "given_lse", "p_rounding")
#: Slack for the float64 arithmetic of the bound itself.
_SLACK = 1 + 1e-9
#: Entries of an [rows, Nk] temporary per chunk.
_CHUNK_ENTRIES = 1 << 18


@dataclass(frozen=True, eq=False)
class GradientBound:
    """Per-element bounds on |gradient - exact| for a backward of `precision`, with their terms."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None
    #: tensor -> term name -> array shaped like the tensor; a tensor's terms add up to it
    terms: dict = field(repr=False)
    precision: PrecisionModel
    accumulation: str

    def bound(self, tensor: str) -> np.ndarray:
        return getattr(self, tensor)

    def dominant_term(self, tensor: str, index) -> str:
        """Name of the largest term of `tensor`'s bound at `index`."""
        index = tuple(index)
        terms = self.terms[tensor]
        return max(terms, key=lambda name: terms[name][index])

    def as_dict(self) -> dict:
        """Largest value of every term, for records."""
        return {"precision": self.precision.as_dict(), "accumulation": self.accumulation,
                **{f"{t}_max": float(self.bound(t).max(initial=0.0)) for t in self.terms},
                "terms_max": {t: {n: float(a.max(initial=0.0)) for n, a in terms.items()}
                              for t, terms in self.terms.items()}}


def gradient_error_bound(problem: AttentionProblem, dout, precision: PrecisionModel, reference: GradientReference,
                         *, out_given, lse_given, dlse=None, accumulation: str = "worst-case",
                         lam: float = DEFAULT_LAMBDA) -> GradientBound:
    """Per-element bounds on the gradients of a backward of `precision` handed `out_given`
    (the output dtype) and `lse_given` (float32) by its forward."""
    if precision.input != problem.dtype:
        raise InvalidArgumentError(
            f"precision.input={precision.input!r} does not match the problem dtype {problem.dtype!r}; "
            f"use e.g. PrecisionModel.flash({problem.dtype!r})")
    dout, dlse = checked_upstream(problem, dout, dlse)
    if out_given is None or lse_given is None:
        raise InvalidArgumentError(
            "out_given and lse_given are required: pass the out (output dtype) and lse (float32) the backward "
            "was handed by its forward; their errors are terms of the bound")
    out_given = np.asarray(out_given).astype(np.float64)
    lse_given = np.asarray(lse_given).astype(np.float64)
    if out_given.shape != problem.out_shape or lse_given.shape != problem.lse_shape:
        raise InvalidArgumentError(
            f"out_given.shape={out_given.shape!r} and lse_given.shape={lse_given.shape!r} must be "
            f"{problem.out_shape!r} and {problem.lse_shape!r}")
    live = np.isfinite(reference.lse)
    if not (np.isfinite(out_given).all() and np.isfinite(lse_given[live]).all()):
        raise InvalidArgumentError(
            "out_given or lse_given holds NaN/Inf where the exact result is finite: the backward was handed a "
            "broken forward result, which bounds nothing; judge the forward first (check_attention)")
    U = _Units.of(problem, precision, accumulation, lam)
    # what reading a subnormal input, or storing one, as 0 can cost (0 without a declared ftz)
    flush = ((float(finfo(problem.dtype).smallest_normal), float(finfo(precision.output).smallest_normal))
             if precision.ftz else (0.0, 0.0))
    B, H, Nq, D = problem.out_shape
    G, Nk, Hkv = problem.group_size, problem.nk, problem.kv_heads
    shapes = {"dq": (B, H, Nq, D), "dk": (B, Hkv, Nk, D), "dv": (B, Hkv, Nk, D), "dsinks": (B, H, Nq)}
    terms = {t: {n: np.zeros(s) for n in TERMS} for t, s in shapes.items()}
    q = problem.q64()
    k, v = problem.kv64()
    fwd = reference.forward
    n_q, n_k, n_v = Nk + 2, G * Nq + 2, G * Nq
    g_q, g_k, g_v = (float(gamma(n, U.u_pv, accumulation, lam)) for n in (n_q, n_k, n_v))
    rows_per_chunk = max(1, _CHUNK_ENTRIES // Nk)
    # each query head's own dK, dV (float64), for the rounding of FA2's per-head gradients
    per_head = {"dk": np.zeros((B, H, Nk, D)), "dv": np.zeros((B, H, Nk, D))}
    for b, h in np.ndindex(B, H):
        for r0 in range(0, Nq, rows_per_chunk):
            rows = slice(r0, r0 + rows_per_chunk)
            at = (b, h, rows)
            dq, dk, dv, ds, own = _chunk(
                problem, U, (g_q, g_k, g_v), problem.mask[rows], _RowVariants.of(problem, b, h, rows),
                q[at], k[b, h], v[b, h], dout[at], None if dlse is None else dlse[at],
                (fwd.lse[at], fwd.lse_bound[at], fwd.out[at], fwd.out_bound[at]),
                (out_given[at], lse_given[at]), reference.delta[at], flush)
            hk = (b, h // G)
            for name, value in dq.items():
                terms["dq"][name][at] = value
            for name, value in dk.items():
                terms["dk"][name][hk] += value
            for name, value in dv.items():
                terms["dv"][name][hk] += value
            for name, value in ds.items():
                terms["dsinks"][name][at] = value
            for tensor, value in own.items():
                per_head[tensor][b, h] += value

    sinks = problem.sinks is not None
    sink_terms = terms.pop("dsinks")
    if sinks:  # per row -> per head, then the sum's own rounding
        n = B * Nq
        summed = {name: a.sum(axis=(0, 2)) for name, a in sink_terms.items()}
        summed["accumulation"] = gamma_times(float(gamma(n, U.u_pv, accumulation, lam)), summed["accumulation"]) + (
            (n + 1) * U.tiny_pv)
        terms["dsinks"] = summed
    references = {"dq": reference.dq_bound, "dk": reference.dk_bound, "dv": reference.dv_bound,
                  "dsinks": reference.dsinks_bound}
    values = {"dq": reference.dq, "dk": reference.dk, "dv": reference.dv, "dsinks": reference.dsinks}
    bounds = {}
    for tensor, named in terms.items():
        out_dtype = "fp32" if tensor == "dsinks" else precision.output
        for name, term in named.items():  # inf weights through a zero operand: still no bound
            named[name] = np.where(np.isnan(term), np.inf, term)
        named["reference"] = references[tensor]
        before = sum(named[n] for n in TERMS if n != "output_rounding")
        heads = 0.0
        if tensor in per_head and G > 1:  # FA2 stores each query head's dK, dV, then sums the group
            heads = 0.5 * ulp(np.abs(per_head[tensor]) + np.repeat(before, G, axis=1), out_dtype)
            heads = heads.reshape(B, Hkv, G, Nk, D).sum(axis=2)
        named["output_rounding"] = heads + 0.5 * ulp(np.abs(values[tensor]) + before + heads, out_dtype)
        if tensor != "dsinks":  # a gradient stored below the normal range may be flushed
            named["flush_to_zero"] = named["flush_to_zero"] + flush[1]
        if tensor == "dq":  # rows that see no key: dq is exactly 0, nothing to round
            named["output_rounding"] = np.where(np.isfinite(fwd.lse)[..., None] & (_has_key(problem)[:, None]),
                                                named["output_rounding"], 0.0)
        bounds[tensor] = sum(named.values()) * _SLACK
    return GradientBound(dq=bounds["dq"], dk=bounds["dk"], dv=bounds["dv"], dsinks=bounds.get("dsinks"),
                         terms=terms, precision=precision, accumulation=accumulation)


def _has_key(problem) -> np.ndarray:
    return ~problem.masked_rows


def _chunk(problem, U, gammas, allowed, variants: _RowVariants, q, k, v, do, up, fwd, given, delta, flush):
    """The terms contributed by rows `q` [r, D] of one query head (see the module's doc):
    (dq [r, D], dk and dv [Nk, D] to add into the kv head, dsinks [r] per row), each a dict, and
    this head's own dK and dV from these rows (float64)."""
    g_q, g_k, g_v = gammas
    L, L_bound, out, out_bound = fwd
    out_given, lse_given = given
    r, Nk = allowed.shape
    live = np.isfinite(L)
    allowed = allowed & live[:, None]
    L0 = np.where(live, L, 0.0)
    up = np.zeros(r) if up is None else up
    scale = U.scale

    scores = scale * (q @ k.T)
    z, slope, own, tanh_part = variants.logits(scores)
    a = scale * (np.abs(q) @ np.abs(k).T)
    x = np.where(allowed, z - L0[:, None], 0.0)
    with np.errstate(under="ignore"):
        p = np.where(allowed, np.exp(np.minimum(x, 0.0)), 0.0)
    with np.errstate(invalid="ignore"):
        d_lse = np.where(live, np.abs(lse_given - L0) + L_bound, 0.0)
    d_lse = np.where(np.isnan(d_lse), np.inf, d_lse)
    eps = {"scores": U.g_d * a * slope + U.t_abs,
           "softmax": U.u_s * (np.abs(z) + 2 * np.abs(x) + 2 * np.abs(L0)[:, None] + own)
           + U.eps_exp + U.tanh_error(tanh_part, problem.softcap),
           "given_lse": np.broadcast_to(d_lse[:, None], (r, Nk))}
    with np.errstate(invalid="ignore"):  # inf relative errors times p = 0 (masked)
        w = {name: np.where(allowed, p * e, 0.0) for name, e in eps.items()}
    w["softmax"] = np.where(allowed, np.maximum(w["softmax"], U.tiny_s), 0.0)
    w["p_rounding"] = U.u_p * np.where(allowed, np.maximum(p, U.tiny_p), 0.0) if U.p_rounds else np.zeros((r, Nk))

    dp = do @ v.T
    abs_dp = np.abs(dp)
    b_mag = np.abs(do) @ np.abs(v).T
    eps_p = sum(eps.values())
    with np.errstate(invalid="ignore"):
        d_from_out = (np.abs(do) * (np.abs(out_given - out) + out_bound)).sum(-1) + U.g_d * np.abs(do * out_given).sum(-1)
        d_from_pdp = (np.where(allowed, p * (eps_p * abs_dp + U.g_d * b_mag), 0.0).sum(-1)
                      + float(gamma(Nk, U.u_s, U.accumulation, U.lam)) * (p * abs_dp).sum(-1))
    tiny_in, tiny_out = flush
    abs_do_rows = np.abs(do).sum(-1)
    d_flush = np.where(live, tiny_out * abs_do_rows + tiny_in * np.abs(out_given).sum(-1), 0.0)
    d_delta = np.where(live, np.maximum(d_from_out, d_from_pdp), 0.0)
    d_delta = np.where(np.isnan(d_delta), np.inf, d_delta)

    g = dp - delta[:, None] + up[:, None]
    m = p * (abs_dp + np.abs(delta)[:, None] + np.abs(up)[:, None])
    pg = np.abs(p * g)
    if problem.softcap > 0:
        y = scores / problem.softcap
        th = np.abs(np.tanh(y))
        f = slope
        df = {"scores": 2 * th * f * (U.g_d * a + U.t_abs) / problem.softcap,
              "softmax": 4 * th * f * U.u_s * np.abs(y) + 2 * th * U.tanh_error(th, 1.0) + U.u_s * th * th
              + U.u_s * f}
        f_hi = np.minimum(1.0, f + df["scores"] + df["softmax"])
    else:
        f, df, f_hi = 1.0, {}, 1.0
    with np.errstate(invalid="ignore"):
        e = {name: w[name] * np.abs(g) * f_hi + pg * df.get(name, 0.0) for name in ("scores", "softmax", "given_lse")}
        e["given_out"] = p * d_delta[:, None] * f_hi
    e["dp"] = (p * U.g_d * b_mag + 4 * U.u_s * m) * f_hi
    dp_flush = tiny_in * (abs_do_rows[:, None] + np.abs(v).sum(-1)[None, :])
    e["flush_to_zero"] = p * (dp_flush + d_flush[:, None]) * f_hi
    signed_ds = p * g * f
    ds = np.abs(signed_ds)
    e["ds_rounding"] = (U.u_p * np.where(allowed, np.maximum(ds, U.tiny_p), 0.0) if U.p_rounds
                        else np.zeros((r, Nk)))
    e = {name: np.where(allowed, np.where(np.isnan(x), np.inf, x), 0.0) for name, x in e.items()}

    # Second order: the row's largest relative perturbation.
    rel = np.where(allowed, eps_p, 0.0).max(axis=-1, initial=0.0) + (U.u_p if U.p_rounds else 0.0) + max(g_q, g_k)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(live, np.where(rel < 0.25, 2 * rel / (1 - 2 * rel), np.inf), 0.0)

    abs_q, abs_k, abs_do = np.abs(q), np.abs(k), np.abs(do)
    stack = np.stack([e[name] for name in _DS_TERMS] + [ds])
    with np.errstate(invalid="ignore"):
        through_k = scale * (stack @ abs_k)
        through_q = scale * (stack.swapaxes(-1, -2) @ abs_q)
    dq = dict(zip(_DS_TERMS, through_k[:-1]))
    dk = dict(zip(_DS_TERMS, through_q[:-1]))
    dq["accumulation"] = gamma_times(g_q, through_k[-1]) + (Nk + 1) * U.tiny_pv
    # k (for dQ), q (for dK) read as 0 where subnormal: scale tiny_in per |dS|
    dq["flush_to_zero"] = dq["flush_to_zero"] + (scale * tiny_in * ds.sum(-1))[:, None]
    dk["flush_to_zero"] = dk["flush_to_zero"] + (scale * tiny_in * ds.sum(0))[:, None]
    dk["accumulation"] = gamma_times(g_k, through_q[-1]) + (len(L) + 1) * U.tiny_pv
    dq["second_order"] = _scaled(sum(dq.values()), factor[:, None])
    first_dk = np.stack([sum(e[name] for name in _DS_TERMS), gamma_times(g_k, ds)])
    with np.errstate(invalid="ignore"):
        dk["second_order"] = scale * (_scaled(first_dk, factor[:, None]).swapaxes(-1, -2) @ abs_q).sum(0)

    stack = np.stack([w[name] for name in _P_TERMS] + [p])
    with np.errstate(invalid="ignore"):
        through_do = stack.swapaxes(-1, -2) @ abs_do
    dv = dict(zip(_P_TERMS, through_do[:-1]))
    dv["accumulation"] = gamma_times(g_v, through_do[-1]) + (len(L) + 1) * U.tiny_pv
    dv["flush_to_zero"] = np.broadcast_to((tiny_in * np.where(allowed, p, 0.0).sum(0))[:, None], dv["accumulation"].shape)
    first_dv = sum(w[name] for name in _P_TERMS) + gamma_times(g_v, p)
    with np.errstate(invalid="ignore"):
        dv["second_order"] = _scaled(first_dv, factor[:, None]).T @ abs_do

    dsinks = {}
    if variants.sink is not None:
        sink = variants.sink
        with np.errstate(under="ignore"):
            ps = np.where(live, np.exp(np.minimum(sink - L0, 0.0)), 0.0)
        dd = np.abs(delta - up)
        rel_soft = U.u_s * (abs(sink) + np.abs(L0) + np.abs(sink - L0)) + U.eps_exp
        dsinks = {"softmax": ps * rel_soft * dd + U.tiny_s, "given_lse": ps * d_lse * dd,
                  "given_out": ps * d_delta, "dp": 2 * U.u_s * ps * (np.abs(delta) + np.abs(up)),
                  "flush_to_zero": ps * d_flush, "accumulation": ps * dd}  # times gamma_{B Nq} once summed
        first = sum(dsinks[n] for n in ("softmax", "given_lse", "given_out", "dp", "flush_to_zero"))
        dsinks["second_order"] = _scaled(first, factor)
    own = {"dk": scale * signed_ds.T @ q, "dv": p.T @ do}
    return dq, dk, dv, dsinks, own
