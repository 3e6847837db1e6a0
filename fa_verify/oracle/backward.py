"""The gradient oracle: the exact gradients of attention with rigorous per-element bounds.

Conventions (flash-attn's; fa_verify.problem for the variants). With z the logits (scaled,
softcapped, ALiBi-biased scores), L the exact LSE and O the exact output,
    P = exp(z - L) (0 where masked), dV = P^T dO, dP = dO V^T, D_i = sum_c dO_ic O_ic,
    dS = P (dP - D + dlse) (the dlse term only when given), times 1 - tanh^2(t / softcap) with a
    softcap (t the scaled score before the cap), dQ = scale dS K, dK = scale dS^T Q,
    dsink_h = -sum_{b, i} P_sink,i (D_i - dlse_i);
dK and dV of a kv head sum its query heads. The exact gradient is that of exact attention of
the given q, k, v: O and L come from the certified forward (`oracle.reference`), not from a
kernel's rounded out and lse.

Two paths, one contract (`GradientReference`):
- "certified": float64, the bound propagated a posteriori. Every probability
  P_hat = exp(fl(z_hat - L_hat)) carries relative error r_i <= expm1(beta_i) + eps_exp e^beta_i,
  beta_i = (the logits' error, as in certified.py) + (the forward's LSE bound) + u |x|max, and
  an absolute tau below the normal range (underflow). Then, elementwise,
      g_hat = fl(fl(dP_hat - D_hat) + dlse):  |g_hat - g| <= e_dP + e_D + 2u (|dP| + |D| + |dlse|)
      dS_hat = fl(P_hat g_hat):  |dS_hat - dS| <= (rho P_hat + tau) |g_hat| + ((1 + rho) P_hat + tau)
                                                  |g_hat - g| + u |dS_hat|,   rho = r / (1 - r),
  with e_dP = gamma_D |dO_i| |V_j| (norms: Cauchy-Schwarz, which also bounds the 2u |dP|) and
  e_D = sum_c |dO_ic| out_bound_ic + gamma_D sum_c |dO_ic O_ic|; a softcap's factor f = 1 - tanh^2(y), y = fl(t_hat / c), is
  within e_f = 2 (e_y + eps_exp)(1 + e_y + eps_exp) + 2u, e_y = (e_t + u |t|) / c, since
  |d tanh / dy| <= 1 and |tanh| <= 1. The GEMMs dS K, dS^T Q, P^T dO add gamma_n (n the
  summed length, + 1 for the scale, + the scale's own roundings) of the magnitudes; every
  sum of |errors| x |values| is bounded by (sum of |errors|) x (max of |values|), which costs
  no GEMM, only row sums and matrix-vector products (the bound is then ~1e-13 of the terms'
  magnitudes, far below any fp32 kernel's error). A product rounded into the subnormal range
  (dO O, P g, P dO, dS K, dS^T Q, the scale's and the softcap factor's products) errs by up to half a
  spacing whatever its factors, which no relative term covers: tau per such rounding, carried
  by the factors after it (`_underflow`). Query heads are
  summed into kv heads with gamma_G more. The bound arithmetic's own rounding is covered by
  _SLACK; first order in r is exact here (r enters through rho, not linearised).
- "mpmath": the definition, row by row at `digits` digits (small problems). Its bound: every
  value is a composition of at most n = G Nq + Nk + D + 40 operations on magnitudes bounded by
  the |.|-versions of the same sums, each rounding at 2^-prec, amplified by at most
  1 + 4 max|z| + scale max A (a rounding of x - m is relative to |x - m| in exp's argument);
  times 8 for safety, plus the final rounding to float64.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mpmath
import numpy as np
from mpmath.libmp import dps_to_prec

from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle import mp_path
from fa_verify.oracle.bounds import U64, gamma
from fa_verify.oracle.certified import (_CHUNK_ENTRIES, EPS_EXP, _gemm_magnitude, _norm_magnitude, _Variants,
                                        certified_reference, scale_roundings)
from fa_verify.problem import AttentionProblem

METHODS = ("certified", "mpmath")
#: An absolute error per probability below the normal range: exp within 4 ulp (EPS_EXP, as the
#: forward assumes), where an ulp is the subnormal spacing 2^-1074 (the forward's underflow term
#: counts 4 of them too). Also the allowance per product rounded there (half a spacing each).
_TAU = EPS_EXP / (2 * U64) * 2.0 ** -1074
#: Rows whose probabilities' relative error the free norm bound leaves above this get the GEMM one.
_TIGHT_REL = 1e-11
#: Slack for the float64 arithmetic of the bound itself.
_SLACK = 1 + 1e-9


@dataclass(frozen=True, eq=False)
class GradientReference:
    """The gradients of one problem for an upstream dout (and dlse); float64 arrays.

    Guarantee: |dq - exact| <= dq_bound elementwise, and likewise dk, dv, dsinks. Rows that see
    no key have dq = 0 exactly and contribute nothing to dk, dv (bound 0 there too)."""

    dq: np.ndarray            # [B, H, Nq, D]
    dk: np.ndarray            # [B, Hkv, Nk, D]
    dv: np.ndarray            # [B, Hkv, Nk, D]
    dsinks: np.ndarray | None  # [H] with sinks, else None
    dq_bound: np.ndarray
    dk_bound: np.ndarray
    dv_bound: np.ndarray
    dsinks_bound: np.ndarray | None
    #: the certified forward (`oracle.Reference`) whose exact out and LSE the gradients use
    forward: object
    #: D_i = sum_c dO_ic O_ic of the exact O, [B, H, Nq], and its bound
    delta: np.ndarray
    delta_bound: np.ndarray
    method: str

    @property
    def out(self) -> np.ndarray:
        return self.forward.out

    @property
    def lse(self) -> np.ndarray:
        return self.forward.lse

    def tensors(self) -> dict:
        """name -> (value, bound) of every gradient this problem has."""
        named = {"dq": (self.dq, self.dq_bound), "dk": (self.dk, self.dk_bound), "dv": (self.dv, self.dv_bound)}
        if self.dsinks is not None:
            named["dsinks"] = (self.dsinks, self.dsinks_bound)
        return named


def checked_upstream(problem: AttentionProblem, dout, dlse):
    """dout [B, H, Nq, D] and dlse [B, H, Nq] (or None) as float64 arrays of finite values."""
    arrays = []
    for name, x, shape in (("dout", dout, problem.out_shape), ("dlse", dlse, problem.lse_shape)):
        if x is None and name == "dlse":
            arrays.append(None)
            continue
        x = np.asarray(x).astype(np.float64)
        if x.shape != shape:
            raise InvalidArgumentError(f"{name}.shape={x.shape!r} must be {shape!r} for this problem")
        if not np.isfinite(x).all():
            raise InvalidArgumentError(f"{name} holds non-finite values; upstream gradients must be finite")
        arrays.append(x)
    return arrays


def gradient_reference(problem: AttentionProblem, dout, dlse=None, method: str = "certified",
                       digits: int = mp_path.DEFAULT_DIGITS) -> GradientReference:
    """The exact gradients of `problem` for the upstream `dout` (and `dlse`), with rigorous bounds."""
    if not isinstance(problem, AttentionProblem):
        raise InvalidArgumentError(f"problem must be an AttentionProblem, got {type(problem).__name__}")
    if method not in METHODS:
        raise InvalidArgumentError(f"method={method!r}; use one of {METHODS}")
    dout, dlse = checked_upstream(problem, dout, dlse)
    forward = certified_reference(problem, digits=digits)
    if method == "mpmath":
        return _mp_gradients(problem, dout, dlse, forward, digits)
    return _certified_gradients(problem, dout, dlse, forward)


def _certified_gradients(problem, dout, dlse, forward) -> GradientReference:
    B, H, Nq, D = problem.out_shape
    Nk = problem.nk
    q = problem.q64()
    k, v = problem.kv64()
    mask = problem.mask if problem.is_masked else None
    scale = problem.scale_value
    n_scale = 1 if problem.scale_is_exact else scale_roundings(scale, D)
    scale_hi = scale / (1 - (0 if problem.scale_is_exact else n_scale * U64))
    u = U64
    g_d, g_t = float(gamma(D + 1)), float(gamma(D + 2 + n_scale))
    g_q, g_k, g_v = float(gamma(Nk + 1 + n_scale)), float(gamma(Nq + 1 + n_scale)), float(gamma(Nq))
    keys_per_row = np.maximum(problem.key_limit() - problem.key_start(), 0)
    rows_per_key = problem.mask.sum(axis=0)
    slack = (1 - gamma(D + 1)) ** 2  # two norms, each a sum of D squares and a sqrt

    dq, dq_b = np.zeros((B, H, Nq, D)), np.zeros((B, H, Nq, D))
    dk_h, dk_hb, dv_h, dv_hb = (np.zeros((B, H, Nk, D)) for _ in range(4))
    delta, delta_b = np.zeros((B, H, Nq)), np.zeros((B, H, Nq))
    sinks = problem.sinks is not None
    sink_terms, sink_err = (np.zeros((B, H, Nq)) for _ in range(2)) if sinks else (None, None)
    limits = problem.key_limit()
    heads_per_chunk = max(1, _CHUNK_ENTRIES // (Nq * Nk))  # memory: a few [heads, Nq, Nk] arrays
    for b, h0 in itertools.product(range(B), range(0, H, heads_per_chunk)):
        hs = slice(h0, h0 + heads_per_chunk)
        at = (b, hs)
        qb, kb, vb, do = q[at], k[at], v[at], dout[at]
        L, Lb = forward.lse[at], forward.lse_bound[at]
        Lz = np.where(np.isfinite(L), L, 0.0)  # rows with LSE -inf see no key: p = 0 by the mask
        up = np.zeros(L.shape) if dlse is None else dlse[at]

        # P = exp(z - L) and its relative error rho per row (module doc)
        t = np.matmul(qb * scale, kb.swapaxes(-1, -2))
        magnitude = _norm_magnitude(qb, kb, limits)
        raw = t.copy() if problem.softcap > 0 else None
        if problem.features:  # the logits' largest magnitude, read off (it only enters as u |x|)
            extra = _Variants(problem, b, hs).apply(t, mask)
            z_max = np.maximum(t.max(axis=-1), -t.min(axis=-1))
        else:  # |t_ij| <= (1 + g_t) scale_hi A_i over the keys row i attends
            extra, z_max = 0.0, (1 + g_t) * scale_hi * magnitude
        x_max = (z_max + np.abs(Lz)) * (1 + u)
        beta = g_t * scale_hi * magnitude + extra + Lb + u * x_max
        loose = np.nonzero(~(beta <= _TIGHT_REL))
        if loose[0].size:  # the free norm bound is too loose there: the |q||K|^T GEMM row
            magnitude[loose] = np.minimum(magnitude[loose], _gemm_magnitude(qb, kb, mask, loose))
        e_t = g_t * scale_hi * magnitude  # the scores' error, per row
        beta = e_t + extra + Lb + u * x_max
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.expm1(beta) + EPS_EXP * np.exp(beta)
            rho = np.where(r < 1, r / (1 - r), np.inf)
        t -= Lz[..., None]
        if mask is not None:
            t[:, ~mask] = -np.inf
        with np.errstate(under="ignore"):
            p = np.exp(t, out=t)

        # D from the certified output, and dP = dO V^T: |dP_ij error| <= g_d |dO_i| |V_j|
        out, out_b = forward.out[at], forward.out_bound[at]
        delta[at] = (do * out).sum(axis=-1)
        delta_b[at] = (((np.abs(do) * out_b).sum(axis=-1) + g_d * np.abs(do * out).sum(axis=-1)) * (1 + g_d)
                       + _TAU * D * (keys_per_row > 0))  # D products dO O's underflow
        n_do = np.sqrt((do * do).sum(-1)) / slack
        n_v = np.sqrt((vb * vb).sum(-1))
        dp = np.matmul(do, vb.swapaxes(-1, -2))
        w = 1 + rho
        # e_g = |g_hat - g| <= g_d n_do_i n_v_j + c_i + 2u |dP_ij| <= g_dp n_do_i n_v_j + c_i,
        # g_dp = g_d + 2u (Cauchy-Schwarz for |dP|), c_i = delta_b + 2u (|D| + |dlse|)
        g_dp = g_d + 2 * u
        c = delta_b[at] + 2 * u * (np.abs(delta[at]) + np.abs(up))
        dp -= delta[at][..., None]
        if dlse is not None:
            dp += up[..., None]
        ds = np.multiply(p, dp, out=dp)  # dS before the softcap's factor
        abs_ds = np.abs(ds)
        s1_rows, s1_cols = abs_ds.sum(-1), abs_ds.sum(-2)
        rho_ds_cols = _column_sums(rho / (1 - u), abs_ds)
        # dS_hat's error summed over keys (rows) and over rows (columns), see the module doc; the
        # tau part uses |g_hat| + e_g <= 2 (n_do n_v + |D| + |dlse| + delta_b)
        p_rows = p.sum(-1)
        p_nv = np.matmul(p, n_v[..., None])[..., 0]
        p_nd_cols, p_c_cols, dv_cols = (_column_sums(x, p) for x in (w * n_do, w * c, rho + g_v * w))
        rest = np.abs(delta[at]) + np.abs(up) + delta_b[at]
        err_rows = (rho / (1 - u) * s1_rows + w * (g_dp * n_do * p_nv + c * p_rows)
                    + u * s1_rows + 2 * _TAU * keys_per_row * (n_do * n_v.max(axis=-1, keepdims=True) + rest))
        err_cols = (rho_ds_cols + u * s1_cols + g_dp * n_v * p_nd_cols + p_c_cols
                    + 2 * _TAU * (n_do.sum(-1, keepdims=True) * n_v + rest.sum(-1, keepdims=True)) * (rows_per_key > 0))
        if raw is not None:  # times f = 1 - tanh^2(t / c), within e_f (module doc), per head
            cap = problem.softcap
            th = np.tanh(raw / cap, out=raw)
            f = np.subtract(1.0, th * th, out=th)
            e_y = (e_t + u * (1 + g_t) * scale_hi * magnitude) / cap  # u |t|, |t| <= (1 + g_t) scale A
            e_f = (2 * (e_y + EPS_EXP) * (1 + e_y + EPS_EXP) + 2 * u).max(axis=-1)
            ds *= f
            abs_ds = np.abs(ds, out=abs_ds)
            # |fl(ds f_hat) - dS f| <= e (1 + e_f) + (|ds| + e) e_f + u |dS_hat|, |f| <= 1
            err_rows = err_rows * (1 + 2 * e_f[:, None]) + e_f[:, None] * s1_rows + u * abs_ds.sum(-1)
            err_cols = err_cols * (1 + 2 * e_f[:, None]) + e_f[:, None] * s1_cols + u * abs_ds.sum(-2)
            s1_rows, s1_cols = abs_ds.sum(-1), abs_ds.sum(-2)

        # dQ = scale dS K over Nk keys (+1 the product with the scale, + the scale's roundings);
        # sums of |errors| |K| bounded by (sum of |errors|) max |K| (no GEMM)
        dq[at] = np.matmul(ds, kb) * scale
        k_max, q_max = np.abs(kb).max(axis=-2)[:, None, :], np.abs(qb).max(axis=-2)[:, None, :]
        ds_products = 1 if raw is None else 2  # P g, and times f with a softcap
        dq_b[at] = (scale_hi * (err_rows + g_q * s1_rows)[..., None] * k_max
                    + _underflow(keys_per_row[:, None], ds_products, scale_hi * k_max))
        dk_h[at] = np.matmul(ds.swapaxes(-1, -2), qb) * scale
        dk_hb[at] = (scale_hi * (err_cols + g_k * s1_cols)[..., None] * q_max
                     + _underflow(rows_per_key[:, None], ds_products, scale_hi * q_max))
        dv_h[at] = np.matmul(p.swapaxes(-1, -2), do)
        dv_hb[at] = ((dv_cols + _TAU * rows_per_key)[..., None] * np.abs(do).max(axis=-2)[:, None, :]
                     + _TAU * rows_per_key[:, None])  # each product p dO's underflow

        if sinks:
            sink = problem.sinks[hs].astype(np.float64)[:, None]
            xs = sink - Lz
            bs = Lb + u * np.abs(xs)
            with np.errstate(over="ignore", invalid="ignore"):
                rs = np.expm1(bs) + EPS_EXP * np.exp(bs)
                rhos = np.where(rs < 1, rs / (1 - rs), np.inf)
            with np.errstate(under="ignore"):
                ps = np.exp(xs)
            dd = delta[at] - up
            term = ps * dd
            sink_terms[at] = -term
            with np.errstate(invalid="ignore"):  # rhos inf where ps is 0: NaN, made inf below
                sink_err[at] = ((rhos * ps + _TAU) * np.abs(dd) + ((1 + rhos) * ps + _TAU) * (delta_b[at] + u * np.abs(dd))
                               + u * np.abs(term) + _TAU)  # the product's underflow

    dk, dk_b = _group_sum(problem, dk_h, dk_hb)
    dv, dv_b = _group_sum(problem, dv_h, dv_hb)
    dsinks = dsinks_b = None
    if sinks:
        dsinks = sink_terms.sum(axis=(0, 2))
        g_n = float(gamma(B * Nq))
        dsinks_b = _no_nan(sink_err.sum(axis=(0, 2)) * (1 + g_n) + g_n * np.abs(sink_terms).sum(axis=(0, 2))) * _SLACK
    return GradientReference(dq=dq, dk=dk, dv=dv, dsinks=dsinks, dq_bound=_no_nan(dq_b) * _SLACK,
                             dk_bound=dk_b * _SLACK, dv_bound=dv_b * _SLACK, dsinks_bound=dsinks_b,
                             forward=forward, delta=delta, delta_bound=delta_b, method="certified")


def _underflow(terms, products, factor):
    """The absolute error of a gradient from products rounded into the subnormal range: each of
    the `terms` summed carries `products` such roundings of dS, carried by `factor` (the scale
    times the largest |K| or |Q|; at least 1, as the bound's own arithmetic underflows there too),
    then one of its own product; and the scale's product (none where nothing is summed)."""
    return _TAU * (terms * (products * np.maximum(factor, 1.0) + 1) + (terms > 0))


def _column_sums(weights, x):
    """sum_i weights[h, i] x[h, i, j], [H, Nk]: one matrix-vector product per vector (a GEMM with
    a few rows is many times slower in OpenBLAS than that many of them)."""
    return np.matmul(weights[:, None, :], x)[:, 0]


def _no_nan(bound):
    """inf where an inf error met a zero magnitude (0 * inf): no bound is no bound."""
    return np.where(np.isnan(bound), np.inf, bound)


def _group_sum(problem, per_head, bound):
    """Per-query-head [B, H, Nk, D] values and bounds summed into kv heads [B, Hkv, Nk, D]:
    G - 1 more additions, gamma_G of the magnitudes."""
    B, H, Nk, D = per_head.shape
    G = problem.group_size
    shaped = per_head.reshape(B, H // G, G, Nk, D)
    bound = bound.reshape(B, H // G, G, Nk, D)
    total = shaped.sum(axis=2)
    b = bound.sum(axis=2)
    if G > 1:
        b = b + float(gamma(G)) * (np.abs(shaped).sum(axis=2) + b)
    return total, _no_nan(b)


def _mp_gradients(problem, dout, dlse, forward, digits) -> GradientReference:
    """The definition in mpmath, row by row, with the bound of the module's doc."""
    B, H, Nq, D = problem.out_shape
    G, Nk, Hkv = problem.group_size, problem.nk, problem.kv_heads
    shapes = {"dq": (B, H, Nq, D), "dk": (B, Hkv, Nk, D), "dv": (B, Hkv, Nk, D), "delta": (B, H, Nq)}
    mags = {name: np.zeros(shape) for name, shape in shapes.items()}
    mags["dsinks"] = np.zeros(H)
    amp = 1.0
    starts, limits = problem.key_start(), problem.key_limit()
    with mpmath.workdps(digits):
        scale = mp_path.mp_scale(problem)
        acc = {name: np.full(shape, mpmath.mpf(0), dtype=object) for name, shape in shapes.items()}
        acc["dsinks"] = np.full(H, mpmath.mpf(0), dtype=object)
        for b, h in np.ndindex(B, H):
            hk = h // G
            keys, values = mp_path.as_mp(problem.k[b, hk]), mp_path.as_mp(problem.v[b, hk])
            abs_k, abs_v = np.abs(problem.k[b, hk].astype(np.float64)), np.abs(problem.v[b, hk].astype(np.float64))
            queries, grads = mp_path.as_mp(problem.q[b, h]), mp_path.as_mp(dout[b, h])
            sink = None if problem.sinks is None else mpmath.mpf(float(problem.sinks[h]))
            for i in range(Nq):
                lo, hi = int(starts[i]), max(int(starts[i]), int(limits[i]))
                up = mpmath.mpf(0) if dlse is None else mpmath.mpf(float(dlse[b, h, i]))
                if lo == hi:  # no key: only a sink's LSE depends on anything
                    if sink is not None:
                        acc["dsinks"][h] += up
                        mags["dsinks"][h] += abs(float(up))
                    continue
                bias = problem.alibi_bias(b, h, i)
                t, z = mp_path.logits(queries[i], keys[lo:hi], scale, problem.softcap,
                                      None if bias is None else bias[lo:hi])
                logits = z + ([] if sink is None else [sink])
                m = max(logits)
                e = [mpmath.exp(x - m) for x in logits]
                total = mpmath.fsum(e)
                p = [x / total for x in e]
                abs_q = np.abs(problem.q[b, h, i].astype(np.float64))
                abs_do = np.abs(dout[b, h, i])
                amp = max(amp, 4 * float(max(abs(x) for x in logits)) + 4
                          + float(scale) * float((abs_k[lo:hi] @ abs_q).max()))
                o = [mpmath.fdot(p[:hi - lo], [values[j][c] for j in range(lo, hi)]) for c in range(D)]
                d_i = mpmath.fdot(grads[i], o)
                acc["delta"][b, h, i] = d_i
                mags["delta"][b, h, i] = float(abs_do @ np.abs(np.array([float(x) for x in o])))
                p_f = np.array([float(x) for x in p[:hi - lo]])
                g_mag = p_f * (abs_v[lo:hi] @ abs_do + mags["delta"][b, h, i] + abs(float(up)))
                ds = []
                for n, j in enumerate(range(lo, hi)):
                    d = p[n] * (mpmath.fdot(grads[i], values[j]) - d_i + up)
                    if problem.softcap > 0:
                        d *= 1 - mpmath.tanh(t[n] / problem.softcap) ** 2
                    ds.append(d)
                    acc["dk"][b, hk, j] += [scale * d * x for x in queries[i]]
                    acc["dv"][b, hk, j] += [p[n] * x for x in grads[i]]
                acc["dq"][b, h, i] = [scale * mpmath.fdot(ds, [keys[j][c] for j in range(lo, hi)])
                                      for c in range(D)]
                mags["dq"][b, h, i] = float(scale) * (g_mag @ abs_k[lo:hi])
                mags["dk"][b, hk, lo:hi] += float(scale) * g_mag[:, None] * abs_q
                mags["dv"][b, hk, lo:hi] += p_f[:, None] * abs_do
                if sink is not None:
                    acc["dsinks"][h] -= p[-1] * (d_i - up)
                    mags["dsinks"][h] += float(p[-1]) * (mags["delta"][b, h, i] + abs(float(up)))
        values = {name: np.vectorize(float, otypes=[np.float64])(x) for name, x in acc.items()}

    coefficient = 8 * (G * Nq + Nk + D + 40) * 2.0 ** -dps_to_prec(digits) * amp
    # the rounding to float64: half an ulp, or below the normal range half a subnormal spacing
    # (2^-1075 itself rounds to 0 in float64: a whole spacing); none for a structural zero
    bounds = {name: coefficient * mags[name] + U64 * np.abs(values[name]) + np.where(mags[name] > 0, 2.0 ** -1074, 0.0)
              for name in values}
    sinks = problem.sinks is not None
    return GradientReference(
        dq=values["dq"], dk=values["dk"], dv=values["dv"], dsinks=values["dsinks"] if sinks else None,
        dq_bound=bounds["dq"], dk_bound=bounds["dk"], dv_bound=bounds["dv"],
        dsinks_bound=bounds["dsinks"] if sinks else None, forward=forward, delta=values["delta"],
        delta_bound=bounds["delta"], method="mpmath")
