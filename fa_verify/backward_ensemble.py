"""How large an honest backward pass's error is: FA2's backward under a precision model, computed
by several correct implementations that round in different places (the gradients' counterpart of
`fa_verify.honest_ensemble`, whose arithmetic it uses).

Each `BackwardMember` computes dq, dk, dv (and dsinks) as a kernel of the precision model may
(DESIGN.md, "The backward pass"): S = q·kᵀ recomputed in `score_accumulation` from the input
dtype, the logits (softcap, ALiBi) and P = exp(z − LSE) from the GIVEN float32 lse in it; P
rounded to `p_rounding` for dV = Pᵀ·dO; dP = dO·Vᵀ and D in the score dtype, D = rowsum(dO∘O)
of the GIVEN out or rowsum(P∘dP); dS = P∘(dP − D (+ dlse)) (times the softcap's 1 − tanh²)
rounded to `p_rounding`; dQ = scale·dS·K and dK = scale·dSᵀ·Q; every GEMM accumulated in
`pv_accumulation`; the gradients stored in `output` (dsinks in float32). The members differ
where correct kernels differ: the order of every sum (forward, reversed, pairwise; FMA or a
rounded product), the key tiles whose dQ contributions are added by atomics and the order they
arrive in (ascending, descending, strided), the query tiles (and query heads of a group) summed
into dK, dV and their order, D from dO∘O or from P∘dP, exp(z − L) or FA2's exp2 with log2(e)
folded in, and GQA's reduction (FA2's mha_bwd: each query head's dK, dV stored in the output
dtype, then the group summed; or the group accumulated in fp32, as FA3).

No BLAS decides any bit, as in the forward's ensemble: every sum is an explicit sequence of
rounded numpy elementwise operations (`honest_ensemble.rounded_dot`), exp is `exp64`/`exp2_64`
from + − × only, so the members give the same bits on every machine
(tests/test_backward_ensemble.py runs them under several OpenBLAS core types and thread counts).

Errors are normalised per element by the **magnitude** of what was summed (`GradientMagnitudes`,
float64): with m_ij = P_ij (Σ_c |dO_ic||V_jc| + Σ_c |dO_ic O_ic| + |dlse_i|) (1 + tanh²_ij) (the
softcap's 1 − tanh² computed as a subtraction, of magnitude 1 + tanh²: the sizes of dS's terms
before they cancel),
    dq: scale Σ_j m_ij |K_jd|,  dk: scale Σ_{h,i} m_ij |Q_id|,  dv: Σ_{h,i} P_ij |dO_ic|,
    dsinks: Σ_{b,i} P_sink,i (Σ_c |dO_ic O_ic| + |dlse_i|);
the forward's row scale Σ_j p_ij |v_j| plays this part there. A magnitude is 0 only where every
product is 0, so the gradient is exactly 0 in any arithmetic (members' errors there count 0), and
a member's error is counted beyond the rule's absolute floor (`absolute_floor`: exact
probabilities below fp32's range, 1e-48, are 0 in every fp32 kernel).
`gradient_ensemble_errors` returns each member's max normalised error per tensor; the verdict's
"ensemble" rule (`backward_verdict`) allows K times the largest plus a floor.

Cost and large problems: a member costs about five GEMMs of elementwise numpy (S, dP, dV, dK,
dQ: 5·B·H·Nq·Nk·D multiply-adds, a few ns each in numpy's loops), so up to `FULL_WORK` (the ci
and thorough profiles' problems) every element is computed. Above it, dQ is computed on the
`MAX_ROWS` query rows and dK, dV on the `MAX_ROWS` keys (of a kv head) with the largest bound
relative to their magnitude plus ones spread evenly: a row's dQ needs that row's P, dP and dS
against every key, a key's dK, dV need that key's column against every row of its group, so
each costs |rows|·Nk·D or G·Nq·|keys|·D instead of the whole. D needs whole rows: members that
take D from P∘dP compute S and dP for every row of a head whose keys are evaluated (two of the
five GEMMs in full); D from dO∘O costs Nq·D.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_verify.dtypes import finfo, numpy_dtype
from fa_verify.error_model import _RowVariants
from fa_verify.honest_ensemble import (FULL_WORK, MAX_ROWS, Stage, exp_kind, gemm, largest_and_spread, logits,
                                       rounded_sum)
from fa_verify.oracle.backward import GradientReference, checked_upstream
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

TENSORS = ("dq", "dk", "dv", "dsinks")
DQ_ORDERS = ("ascending", "descending", "strided")


@dataclass(frozen=True)
class BackwardMember:
    """One honest FA2 backward of a precision model (see the module doc)."""

    name: str
    #: order of every sum: "forward", "reversed" or "pairwise" (read by honest_ensemble.rounded_dot)
    order: str
    #: multiply-add with one rounding (FMA)
    fused: bool = False
    #: key tile (None: one tile): dQ is summed per key tile, the tiles' parts added in dq_order
    block_n: int | None = 64
    #: query tile (None: one tile): dK, dV add one GEMM per query tile into their accumulator
    block_m: int | None = 64
    #: the order of the query tiles and of a group's query heads summed into dK, dV
    tile_order: str = "ascending"
    #: the order the key tiles' dQ parts arrive in (float32 atomics: any): one of DQ_ORDERS
    dq_order: str = "ascending"
    #: "out": D = rowsum(dO∘O) of the given out (FA2); "p_dp": rowsum(P∘dP), key tile by key tile
    d_from: str = "out"
    #: "exp": P = exp(z − L); "exp2": FA2's exp2(z·log2e − L·log2e)
    exp: str = "exp"
    #: "expanded": each query head's dK, dV rounded to the output dtype, then summed (FA2's
    #: mha_bwd); "fp32": the group accumulated in fp32 and rounded once
    gqa_reduce: str = "expanded"


#: The ensemble: every axis of variation in at least two members, crossed with different orders.
MEMBERS = (
    BackwardMember("sequential", "forward"),
    BackwardMember("reversed-pdp", "reversed", block_n=128, tile_order="descending", dq_order="descending",
                   d_from="p_dp"),
    BackwardMember("pairwise-exp2", "pairwise", block_m=128, dq_order="strided", exp="exp2"),
    BackwardMember("fma-exp2-pdp-fp32", "forward", fused=True, block_n=32, block_m=32, tile_order="descending",
                   d_from="p_dp", exp="exp2", gqa_reduce="fp32"),
    BackwardMember("untiled-fp32", "forward", block_n=None, block_m=None, gqa_reduce="fp32"),
    BackwardMember("reversed-fma-16", "reversed", fused=True, block_n=16, block_m=16, dq_order="strided"),
)


@dataclass(frozen=True, eq=False)
class GradientMagnitudes:
    """Per element, the magnitude errors are measured against (module doc); float64."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None

    def of(self, tensor: str) -> np.ndarray:
        return getattr(self, tensor)


@dataclass(frozen=True, eq=False)
class GradientEnsemble:
    """Each member's max normalised error per tensor, over the elements evaluated."""

    #: tensor -> member name -> max over the evaluated elements of |gradient − exact| / magnitude
    errors: dict
    magnitudes: GradientMagnitudes = field(repr=False)
    #: query rows (flat over B, H, Nq) whose dq was evaluated, of all; keys (flat over B, Hkv, Nk)
    rows: int = 0
    total_rows: int = 0
    keys: int = 0
    total_keys: int = 0

    def worst_member(self, tensor: str) -> str | None:
        """The member with the largest finite error on `tensor` (None when every member overflowed)."""
        finite = {name: e for name, e in self.errors[tensor].items() if np.isfinite(e)}
        return max(finite, key=finite.get) if finite else None

    def max_error(self, tensor: str) -> float:
        """E of `tensor`: the largest finite member error (inf when every member overflowed)."""
        worst = self.worst_member(tensor)
        return float("inf") if worst is None else self.errors[tensor][worst]


# --- magnitudes ------------------------------------------------------------------------------------


def gradient_magnitudes(problem: AttentionProblem, dout, reference: GradientReference, dlse=None) -> GradientMagnitudes:
    """The magnitudes of the module doc, from the exact P, O and D of `reference`."""
    dout, dlse = checked_upstream(problem, dout, dlse)
    B, H, Nq, D = problem.out_shape
    G = problem.group_size
    q = problem.q64()
    k, v = (x.astype(np.float64) for x in (problem.k, problem.v))
    fwd = reference.forward
    mq = np.zeros(problem.out_shape)
    mk, mv = np.zeros(problem.k.shape), np.zeros(problem.k.shape)
    ms = None if problem.sinks is None else np.zeros(H)
    for b, h in np.ndindex(B, H):
        L = fwd.lse[b, h]
        live = np.isfinite(L)
        L0 = np.where(live, L, 0.0)
        z, slope, _, _ = _RowVariants.of(problem, b, h, slice(None)).logits(problem.scale_value * (q[b, h] @ k[b, h // G].T))
        allowed = problem.mask & live[:, None]
        with np.errstate(under="ignore", over="ignore", invalid="ignore"):
            p = np.where(allowed, np.exp(np.minimum(np.where(allowed, z - L0[:, None], 0.0), 0.0)), 0.0)
        do = np.abs(dout[b, h])
        d_mag = (do * np.abs(fwd.out[b, h])).sum(-1) + (0.0 if dlse is None else np.abs(dlse[b, h]))
        # the softcap's factor f = 1 − tanh² is a subtraction of magnitude 1 + tanh² = 2 − f: its
        # rounding errors are absolute, so where tanh → ±1 they are not small relative to f
        m = p * (do @ np.abs(v[b, h // G]).T + d_mag[:, None]) * (2.0 - slope if problem.softcap > 0 else 1.0)
        mq[b, h] = problem.scale_value * (m @ np.abs(k[b, h // G]))
        mk[b, h // G] += problem.scale_value * (m.T @ np.abs(q[b, h]))
        mv[b, h // G] += p.T @ do
        if ms is not None:
            with np.errstate(under="ignore"):
                ps = np.where(live, np.exp(np.minimum(float(problem.sinks[h]) - L0, 0.0)), 0.0)
            ms[h] += (ps * d_mag).sum()
    return GradientMagnitudes(mq, mk, mv, ms)


# --- one member on one kv head ---------------------------------------------------------------------


@dataclass
class _KvHead:
    """One kv head and its G query heads: q, do, o [G, Nq, D]; k, v [Nk, D]; L (given lse), up
    (dlse or None) [G, Nq]; mask [Nq, Nk]; bias [G, Nq, Nk] or None; sinks [G] or None."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    o: np.ndarray
    L: np.ndarray
    up: np.ndarray | None
    mask: np.ndarray
    scale: float
    softcap: float
    bias: np.ndarray | None
    sinks: np.ndarray | None


class _Stages:
    def __init__(self, precision: PrecisionModel, work):
        self.score = Stage(precision.score_accumulation, work)
        self.p = Stage(precision.p_rounding, work)
        self.pv = Stage(precision.pv_accumulation, work)
        self.out = Stage(precision.output, work)
        self.work = work
        #: the declared accuracy of (tanh, exp): the members compute them so (`honest_ensemble.logits`)
        self.accuracy = (precision.tanh, precision.exp)


def _tiles(n: int, size: int | None) -> list:
    size = size or max(n, 1)
    return [np.arange(s, min(s + size, n)) for s in range(0, n, size)]


def _ordered(parts: list, order: str) -> list:
    if order == "descending":
        return parts[::-1]
    if order == "strided":  # even-numbered tiles first, then odd ones: another atomics arrival
        return parts[0::2] + parts[1::2]
    return parts


def _probabilities(member: BackwardMember, st: _Stages, kv: _KvHead, g: int, rows, keys):
    """P (score dtype, unrounded), the softcap's tanh (or None) and dP on rows × keys of head g."""
    score = st.score
    q, do = kv.q[g, rows], kv.do[g, rows]
    s = gemm(q, kv.k[keys].T, member, score)
    bias = None if kv.bias is None else kv.bias[g][np.ix_(rows, keys)]
    t, th, unit, power = logits(s, member.exp, score, kv.scale, kv.softcap, bias, st.accuracy)
    L = kv.L[g, rows]
    live = np.isfinite(L)
    Lu = score(np.where(live, L, 0) * unit) if unit != 1.0 else np.where(live, L, 0).astype(st.work)
    p = score(power(score(t - Lu[:, None])))
    p = np.where(kv.mask[np.ix_(rows, keys)] & live[:, None], p, 0).astype(st.work)
    dp = gemm(do, kv.v[keys].T, member, score)
    return p, th, dp


def _delta(member: BackwardMember, st: _Stages, kv: _KvHead, g: int, rows, full=None):
    """D of `rows` of head g; `full`: (P, dP) of these rows against every key, when computed."""
    if member.d_from == "out":
        return rounded_sum(st.score(kv.do[g, rows] * kv.o[g, rows]), member.order, st.score)
    total = None
    for tile in _tiles(kv.k.shape[0], member.block_n):
        p, _, dp = _probabilities(member, st, kv, g, rows, tile) if full is None else (full[0][:, tile], None,
                                                                                       full[1][:, tile])
        part = rounded_sum(st.score(p * dp), member.order, st.score)
        total = part if total is None else st.score(total + part)
    return total


def _ds(member, st: _Stages, kv: _KvHead, g: int, rows, keys, delta, pdp=None):
    """(P, dS) on rows × keys of head g, both rounded to p_rounding; `delta` is D of `rows`."""
    p, th, dp = _probabilities(member, st, kv, g, rows, keys) if pdp is None else pdp
    score = st.score
    grad = score(dp - delta[:, None])
    if kv.up is not None:
        grad = score(grad + kv.up[g, rows, None])
    ds = score(p * grad)
    if th is not None:
        ds = score(ds * score(1 - score(th * th)))
    return st.p(p), st.p(ds)


def _member_kv_head(member: BackwardMember, st: _Stages, kv: _KvHead, rows_of: dict, keys) -> dict:
    """Gradients of one kv head: {"dq": {g: [len(rows_of[g]), D]}, "dk", "dv": [len(keys), D] or
    None, "sink_terms": {g: [Nq]}} (float64, rounded as stored). rows_of: query head -> rows
    whose dq is wanted; keys: the keys whose dk, dv are wanted."""
    G, Nq, D = kv.q.shape
    Nk = kv.k.shape[0]
    every_row, every_key = np.arange(Nq), np.arange(Nk)
    scale = st.pv(np.asarray(kv.scale))
    out = {"dq": {}, "dk": None, "dv": None, "sink_terms": {}}
    need_keys = len(keys) > 0
    full_keys = need_keys and len(keys) == Nk
    acc_k = acc_v = None
    total_k = total_v = None
    heads = list(range(G)) if member.tile_order == "ascending" else list(range(G))[::-1]
    for g in heads:
        rows = rows_of.get(g, every_row[:0])
        if not len(rows) and not need_keys and kv.sinks is None:
            continue
        whole = full_keys and len(rows) == Nq  # one [Nq, Nk] block serves dq and dk, dv
        need_all_rows = need_keys or kv.sinks is not None
        pdp_all = None
        if whole or (member.d_from == "p_dp" and need_all_rows):
            pdp_all = _probabilities(member, st, kv, g, every_row, every_key)
        if need_all_rows:
            delta = _delta(member, st, kv, g, every_row, None if pdp_all is None else pdp_all[::2])
            delta_rows = delta[rows]
        else:
            delta_rows = _delta(member, st, kv, g, rows)
        if len(rows):
            p_r, ds_r = _ds(member, st, kv, g, rows, every_key, delta_rows,
                            pdp_all if len(rows) == Nq and pdp_all is not None else None)
            parts = [gemm(ds_r[:, tile], kv.k[tile], member, st.pv)
                     for tile in _tiles(Nk, member.block_n)]
            acc = None
            for part in _ordered(parts, member.dq_order):
                acc = part if acc is None else st.pv(acc + part)
            out["dq"][g] = st.out(st.pv(acc * scale)).astype(np.float64)
        if need_keys:
            if whole:
                p_c, ds_c = p_r, ds_r
            else:
                pdp = None if pdp_all is None else tuple(None if x is None else x[:, keys] for x in pdp_all)
                p_c, ds_c = _ds(member, st, kv, g, every_row, keys, delta, pdp)
            if member.gqa_reduce == "expanded":
                acc_k = acc_v = None
            tiles = _tiles(Nq, member.block_m)
            for tile in (tiles if member.tile_order == "ascending" else tiles[::-1]):
                part_v = gemm(p_c[tile].T, kv.do[g, tile], member, st.pv)
                part_k = gemm(ds_c[tile].T, kv.q[g, tile], member, st.pv)
                acc_v = part_v if acc_v is None else st.pv(acc_v + part_v)
                acc_k = part_k if acc_k is None else st.pv(acc_k + part_k)
            if member.gqa_reduce == "expanded":  # this head's dK, dV stored, then the group summed in fp32
                dk_h, dv_h = st.out(st.pv(acc_k * scale)), st.out(acc_v)
                total_k = dk_h if total_k is None else st.pv(total_k + dk_h)
                total_v = dv_h if total_v is None else st.pv(total_v + dv_h)
        if kv.sinks is not None:
            out["sink_terms"][g] = _sink_terms(member, st, kv, g, delta)
    if need_keys:
        if member.gqa_reduce == "fp32":
            total_k, total_v = st.pv(acc_k * scale), acc_v
        out["dk"], out["dv"] = (st.out(x).astype(np.float64) for x in (total_k, total_v))
    return out


def _sink_terms(member, st: _Stages, kv: _KvHead, g: int, delta) -> np.ndarray:
    """P_sink,i (D_i − dlse_i) of head g's rows (score dtype), to be summed over the batch."""
    score = st.score
    unit, power = exp_kind(member.exp, st.accuracy[1])
    L = kv.L[g]
    live = np.isfinite(L)
    Lu = score(np.where(live, L, 0) * unit) if unit != 1.0 else np.where(live, L, 0).astype(st.work)
    sink = score(np.asarray(kv.sinks[g] * unit))
    ps = np.where(live, score(power(score(sink - Lu))), 0).astype(st.work)
    diff = delta if kv.up is None else score(delta - kv.up[g])
    return score(ps * diff)


def summed_length(problem: AttentionProblem, tensor: str) -> int:
    """How many products a gradient element sums: Nk for dq, G Nq for dk and dv, B Nq for dsinks."""
    return {"dq": problem.nk, "dk": problem.group_size * problem.nq, "dv": problem.group_size * problem.nq,
            "dsinks": problem.batch * problem.nq}[tensor]


def absolute_floor(problem: AttentionProblem, precision: PrecisionModel, tensor: str) -> float:
    """Where relative resolution is gone: one subnormal spacing of the stored dtype (dsinks: fp32)
    plus one of the accumulation dtype per product summed, and two more (n + 2)."""
    stored = "fp32" if tensor == "dsinks" else precision.output
    return (float(finfo(stored).smallest_subnormal)
            + (summed_length(problem, tensor) + 2) * float(finfo(precision.pv_accumulation).smallest_subnormal))


# --- the ensemble ----------------------------------------------------------------------------------


def _chosen(problem: AttentionProblem, magnitudes: GradientMagnitudes, bound):
    """(flat [B, H, Nq] rows for dq, flat [B, Hkv, Nk] keys for dk and dv): all of them up to FULL_WORK."""
    B, H, Nq, D = problem.out_shape
    n_rows, n_keys = B * H * Nq, B * problem.kv_heads * problem.nk
    if B * H * Nq * problem.nk * D <= FULL_WORK:
        return np.arange(n_rows), np.arange(n_keys)

    def relative(tensor, total):
        if bound is None:
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.nan_to_num(bound.bound(tensor) / magnitudes.of(tensor), nan=0.0, posinf=0.0)
        return r.max(axis=-1).reshape(total)

    rel_k = None if bound is None else np.maximum(relative("dk", n_keys), relative("dv", n_keys))
    return (largest_and_spread(relative("dq", n_rows), n_rows, MAX_ROWS),
            largest_and_spread(rel_k, n_keys, MAX_ROWS))


def ensemble_gradients(problem: AttentionProblem, out_given, lse_given, dout, dlse=None, *,
                       precision: PrecisionModel | None = None, rows=None, keys=None, members=MEMBERS) -> dict:
    """{member name: {"dq": [len(rows), D], "dk", "dv": [len(keys), D], "dsinks": [H] or None}}
    (float64 values of the stored gradients) on the flat [B, H, Nq] query rows `rows` and flat
    [B, Hkv, Nk] keys `keys` (all when None)."""
    precision = precision or PrecisionModel.flash(problem.dtype)
    dout, dlse = checked_upstream(problem, dout, dlse)
    B, H, Nq, D = problem.out_shape
    G, Hkv, Nk = problem.group_size, problem.kv_heads, problem.nk
    stages = (precision.score_accumulation, precision.p_rounding, precision.pv_accumulation)
    work = np.dtype(np.float64 if "fp64" in stages else np.float32)
    st = _Stages(precision, work)
    rows = np.arange(B * H * Nq) if rows is None else np.asarray(rows)
    keys = np.arange(B * Hkv * Nk) if keys is None else np.asarray(keys)
    rb, rh, ri = np.unravel_index(rows, (B, H, Nq))
    kb, kh, kj = np.unravel_index(keys, (B, Hkv, Nk))
    # the inputs as the kernel reads them: the input dtype (dout) and the given out and lse
    q, k, v = (x.astype(work) for x in (problem.q, problem.k, problem.v))
    do = dout.astype(numpy_dtype(problem.dtype)).astype(work)
    o = np.asarray(out_given).astype(work)
    L = np.asarray(lse_given).astype(np.float32).astype(work)
    up = None if dlse is None else dlse.astype(np.float32).astype(work)
    sinks = None if problem.sinks is None else problem.sinks.astype(np.float32).astype(np.float64)
    results = {m.name: {"dq": np.zeros((len(rows), D)), "dk": np.zeros((len(keys), D)),
                        "dv": np.zeros((len(keys), D)), "dsinks": None} for m in members}
    sink_terms = {m.name: np.zeros((B, H, Nq), work) for m in members}
    for b, hk in np.ndindex(B, Hkv):
        heads = slice(hk * G, hk * G + G)
        at_rows = np.flatnonzero((rb == b) & (rh // G == hk))
        at_keys = np.flatnonzero((kb == b) & (kh == hk))
        if not len(at_rows) and not len(at_keys) and sinks is None:
            continue
        rows_of = {g: ri[at_rows[rh[at_rows] == hk * G + g]] for g in range(G)}
        bias = problem.alibi_bias(b, np.arange(hk * G, hk * G + G)[:, None], np.arange(Nq)[None, :])
        kv = _KvHead(q[b, heads], k[b, hk], v[b, hk], do[b, heads], o[b, heads], L[b, heads],
                     None if up is None else up[b, heads], problem.mask, problem.scale_value, problem.softcap,
                     bias, None if sinks is None else sinks[heads])
        for member in members:
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                got = _member_kv_head(member, st, kv, rows_of, kj[at_keys])
            res = results[member.name]
            for g, dq in got["dq"].items():
                res["dq"][at_rows[rh[at_rows] == hk * G + g]] = dq
            if got["dk"] is not None:
                res["dk"][at_keys], res["dv"][at_keys] = got["dk"], got["dv"]
            for g, terms in got["sink_terms"].items():
                sink_terms[member.name][b, hk * G + g] = terms
    if sinks is not None:
        for member in members:  # dsink_h = −Σ_{b,i} P_sink (D − dlse), summed in pv_accumulation
            terms = np.moveaxis(sink_terms[member.name], 1, 0).reshape(H, B * Nq)
            total = rounded_sum(st.pv(terms), member.order, st.pv)
            results[member.name]["dsinks"] = (-total).astype(np.float32).astype(np.float64)
    return results


def gradient_ensemble_errors(problem: AttentionProblem, dout, precision: PrecisionModel, reference: GradientReference,
                             *, out_given, lse_given, dlse=None, bound=None, members=MEMBERS,
                             magnitudes: GradientMagnitudes | None = None) -> GradientEnsemble:
    """Every member's max normalised error per tensor against `reference` (the gradient oracle).

    bound: the problem's `backward_error_model.GradientBound`, to pick the rows and keys of a large
    problem (spread evenly only, when None)."""
    magnitudes = magnitudes or gradient_magnitudes(problem, dout, reference, dlse)
    rows, keys = _chosen(problem, magnitudes, bound)
    B, H, Nq, D = problem.out_shape
    flat = {"dq": rows, "dk": keys, "dv": keys}
    refs = reference.tensors()
    errors = {t: {} for t in refs}
    for name, got in ensemble_gradients(problem, out_given, lse_given, dout, dlse, precision=precision, rows=rows,
                                        keys=keys, members=members).items():
        for tensor in refs:
            ref, mag = refs[tensor][0], magnitudes.of(tensor)
            if tensor != "dsinks":
                ref, mag = ref.reshape(-1, D)[flat[tensor]], mag.reshape(-1, D)[flat[tensor]]
            # what the absolute floor covers (products below the normal range: an exact P of 1e-48
            # is 0 in fp32) is no error the rule's relative part must cover
            err = np.maximum(np.abs(got[tensor] - ref) - absolute_floor(problem, precision, tensor), 0.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                normalised = np.where(mag > 0, err / mag, 0.0)
            normalised[np.isnan(normalised)] = np.inf  # an overflowed member (16-bit accumulation)
            errors[tensor][name] = float(np.max(normalised, initial=0.0))
    return GradientEnsemble(errors, magnitudes, rows=len(rows), total_rows=B * H * Nq, keys=len(keys),
                            total_keys=B * problem.kv_heads * problem.nk)
