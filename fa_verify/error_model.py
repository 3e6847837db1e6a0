"""The error model: how far from exact attention a correct kernel of a given precision may be.

From a `PrecisionModel` (where the kernel rounds, and to what) and the problem itself, a
first-order bound on every output element and every LSE follows. Notation, per row i of a
head: t_ij = scale q_i.k_j (exact), p_ij the exact softmax, O_ic = sum_j p_ij v_jc,
D_ic = sum_j p_ij |v_jc| (the row scale), A_ij = sum_d |q_id||k_jd|, M_i = max_j |t_ij|,
x_ij = t_ij - max_j t_ij, n_i the keys row i attends; u_s, u_P, u_pv, u_out the unit
roundoffs of the score, P, P.V and output dtypes. D is q's and k's head dim (D_qk: the score
dot products' length); v and the output have D_v columns c, each a sum over the keys, so D_v
only sets how many columns there are (a problem with D_v != D_qk needs nothing else).

Every error source perturbs p, the row sum or the output; each is a named term:

* scores          dot products q.k in u_s (gamma_D, any order / FMA / blocking), and q, k
                  rounded to the score dtype if it is narrower than the input:
                  relative p error a_ij = scale gamma_D(u_s) A_ij (+ 2 u_s scale A_ij).
* softmax         scale (its fp32 rounding and the product, or FA2's fold into exp2 with
                  log2 e), the max subtraction and exp itself, one rounding each:
                  e_ij = u_s (|t_ij| + 3|x_ij| + M_i) + eps_exp, eps_exp = 2 EXP_ULPS u_s
                  (u_fp32, plus u_s for a 16-bit score dtype: exp rounded to it),
                  plus FAST_EXP_ERROR = 2^-12 when P is stored in fp16/bf16 (a fast exp
                  accurate to the 16-bit P, as torch's CPU flash kernel uses; not for the
                  rescale factors).
* online_rescale  each time the running max grows, earlier keys are multiplied by
                  exp(m_old - m_new): relative error eps_exp + 4 u_s M_i per rescale. Key j
                  sees at most R_ij rescales: the records (new maxima) of t_i. after j in
                  ascending key order or before j in descending order (FA2/FA3 walk causal
                  key tiles backwards), whichever is larger, plus one for a split-KV combine.
                  Tiles only merge records, so this holds for every tile size.
  A relative perturbation eps_j of p_j that reaches numerator and row sum alike moves the
  output by sum_j p_ij eps_j (v_jc - O_ic); |v_jc - O_ic| <= |v_jc| + |O_ic| keeps this at
  two GEMMs (the exact sum needs N^2 D work): term = sum_j p_ij eps_ij (|v_jc| + |O_ic|).
* p_rounding      P rounded to the p dtype before P.V (FA2: the input dtype). FA2 and torch
                  sum the *unrounded* P into the row sum, a naive softmax may sum the rounded
                  one; the union of both is u_P sum_j max(p_ij, tiny_P)(|v_jc| + |O_ic|)
                  (max with the smallest normal: below it the rounding error is absolute,
                  u_P tiny_P at most, whatever the normalisation of P). With an offset
                  (`precision.p_offset`, FA3's FP8: P times 2^8 before rounding) tiny_P is the
                  smallest normal times 2^-offset.
* accumulation    P.V and the row sum, n_i + R_i + 1 roundings in u_pv each (the rescale
                  multiplies and the final division included): gamma(u_pv)(D_ic + |O_ic|)
                  + u_pv |O_ic|.
* input_rounding  q, k, v rounded to `precision.input_rounding` inside the kernel (an fp32 API
                  over fp16 arithmetic): each entry moves by at most u_r |x| + h_r (h_r half the
                  rounding dtype's smallest subnormal), so a score by
                  c_ij = scale ((2 u_r + u_r^2) A_ij + h_r (1 + u_r)(|q_i|_1 + |k_j|_1) + D h_r^2),
                  a relative p perturbation weighted like the scores' (|v_jc| + |O_ic|), and the
                  values by u_r D_ic + h_r. Zero without the declaration.
* second_order    the terms above are first order in their relative errors; with the
                  largest relative perturbation eps_i of row i, the exact error is at most
                  the first-order one / (1 - 2 eps_i): this term is that difference. Rows with
                  eps_i >= 1/4 get an infinite bound: no first-order statement holds there
                  (e.g. bf16 score accumulation: gamma_64 = 1/3), and a verdict says so.
* output_rounding half an ulp of the output dtype at |O| + every error above.
* reference       the oracle's own bound.

LSE = m + log(l): score, softmax and rescale errors enter as sum_j p_ij eps_ij; rounded P
(when summed) as u_P sum_j max(p_ij, tiny_P); the row sum as gamma(u_pv); the log and the
addition as u_s (2 LOG_ULPS max(1, log l_i) + 2 M_i + |LSE_i|); the store as u_lse |LSE_i|
(fp32, or the dtype `precision.lse` declares; a base-2 LSE's rounding is the same relative
error); and the reference's bound.

Flush-to-zero (`precision.ftz`, a declared convention): subnormal q and k entries flushed move a
score by at most scale tiny_in (sum_d |q_id| + sum_d |k_jd| + D tiny_in), added to the absolute
score error; flushed V entries move an output by at most tiny_in, a flushed output by at most
tiny_out: the term flush_to_zero (zero without the convention).

Worst case vs probabilistic ("accumulation" argument). gamma_n = n u / (1 - n u) holds for
any summation order and any data, but real sums of n terms have errors near sqrt(n) u
(Higham & Mary 2019, "A new approach to probabilistic rounding error analysis"): with
independent mean-zero roundings, gamma~_n(lam) = exp(lam sqrt(n) u + n u^2/(1-u)) - 1 bounds
an inner product with probability >= 1 - 2n exp(-lam^2 (1-u)^2 / 2). It is no theorem about
a given input: sums of equal terms (constant V, uniform attention) have correlated roundings
and errors that grow like n u. Only the gamma terms (scores, accumulation) change with the
mode; single roundings (softmax, P, output) are bounded per element in both.
Default: "worst-case". Measured (tests/test_error_model.py, N <= 1024, D = 64): with it
correct kernels use at most 0.54 of the bound in fp16/bf16 (P rounding dominates) and 0.07
in fp32; the probabilistic mode moves 16-bit bounds by a few percent (gamma_D at D = 64 is
below lam^2, where the worst case is kept) and tightens fp32 at most 3x at N = 1024. That
does not pay for giving up a guarantee; fp32's looseness is what the verdict's ensemble rule
is for.

Underflow: exp results and products p v below the smallest normal carry absolute errors up
to that smallest normal (flush-to-zero included); q.k products likewise. These terms are
~1e-38 in fp32 but keep the bound valid for subnormal-scale inputs.

Declared accuracy of tanh and exp (`PrecisionModel.tanh`, `.exp`): softcap's logit z = c tanh(t/c)
errs by eps_tanh |z| + tanh_abs c: "accurate" eps_exp |z|; "absolute" TANH_ABSOLUTE_UNITS u_fp32 c
(1 - 2 / (e^{2x} + 1)); "approx" TANH_APPROX_ERROR |z| (tanh.approx.f32). exp "approx"
(ex2.approx.f32, EX2_APPROX_ERROR) is within EXP_ULPS already: it changes the ensemble only.

Assumptions: IEEE round-to-nearest in every stage; exp within EXP_ULPS ulp (torch's
CPU kernel uses Vectorized::exp_u20, documented at 20 ulp; CUDA's ex2.approx is 2 ulp);
log within LOG_ULPS; no overflow; keys processed in ascending or descending order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_verify.dtypes import finfo, ulp, unit_roundoff
from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle.bounds import gamma as worst_case_gamma
from fa_verify.oracle.result import Reference
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

ACCUMULATION_MODES = ("worst-case", "probabilistic")
#: exp's error in ulp of the score dtype: torch's CPU flash kernel uses exp_u20 ("ULP=20").
EXP_ULPS = 20.0
#: A kernel that stores P in a 16-bit dtype may evaluate exp only about as accurately: torch's
#: CPU flash kernel uses Vectorized::fexp_u20 for fp16/bf16 ("accurate within 1 ULP for FP16",
#: measured here: relative error up to 1.1e-4 ~ 2^-13). Allowed: 2^-12, twice the measured.
FAST_EXP_ERROR = 2.0 ** -12
#: tanh declared "absolute" (`PrecisionModel.tanh`): |error| <= TANH_ABSOLUTE_UNITS u_fp32, the
#: bound of tanh(x) = 1 - 2 / (e^{2x} + 1) in fp32 with an exp within EXP_ULPS ulp. With
#: E = e^{2x} (1 + e_E) (2x exact, |e_E| <= 2 EXP_ULPS u), D = fl(E + 1), Q = fl(2 / D),
#: R = fl(1 - Q): Q's relative error is e_E E / (E + 1) plus two roundings; times
#: Q = 2 / (E + 1) < 2 that is at most e_E 2E / (E + 1)^2 <= e_E / 2 = EXP_ULPS u, plus 4 u;
#: |R| <= 1 adds u. Near 0 the error is absolute, not relative: tanh(x) ~ x, R cancels.
TANH_ABSOLUTE_UNITS = EXP_ULPS + 5.0
#: tanh declared "approx": the hardware tanh.approx.f32, relative error <= 2^-10.987 (PTX ISA,
#: "Floating Point Instructions: tanh"; measured on sm_75+ at 1.1e-5 ~ 2^-16.5, so the documented
#: bound, not the measurement, is what a kernel may rely on).
TANH_APPROX_ERROR = 2.0 ** -10.987
#: exp declared "approx": ex2.approx.f32, 2 ulp (CUDA C Programming Guide, exp2f / ex2.approx),
#: a relative 2^-22. The error model's exp bound (EXP_ULPS = 20 ulp) already covers it; the
#: declaration changes the honest ensemble, whose members then err by up to this much in exp.
EX2_APPROX_ERROR = 2.0 ** -22
#: log's error in ulp (CUDA __logf: 2^-21.41 absolute near 1, a few ulp elsewhere).
LOG_ULPS = 4.0
#: lambda of the probabilistic mode: with 2 n exp(-lam^2/2) per inner product, lam = 9 leaves
#: a failure probability of about 2e-8 for 10^6 outputs of rows of 4096 keys (union bound).
DEFAULT_LAMBDA = 9.0
#: A split-KV kernel combines partial results once more: one extra rescale per key.
SPLIT_COMBINES = 1
#: Slack for the float64 arithmetic of the bound itself.
_SLACK = 1 + 1e-9
#: Entries of an [rows, Nk] temporary per chunk (8 MiB of float64).
_CHUNK_ENTRIES = 1 << 20

OUT_TERMS = ("scores", "softmax", "online_rescale", "p_rounding", "accumulation", "input_rounding",
             "second_order", "output_rounding", "reference", "flush_to_zero")
LSE_TERMS = ("scores", "softmax", "online_rescale", "p_rounding", "row_sum", "log", "input_rounding",
             "second_order", "lse_rounding", "reference")
#: The first-order terms: the second_order term scales their sum.
_FIRST_ORDER = OUT_TERMS[:6]
_LSE_FIRST_ORDER = LSE_TERMS[:7]


@dataclass(frozen=True, eq=False)
class Bound:
    """Per-element error bounds of a kernel of `precision` on one problem, with their parts."""

    #: [B, H, Nq, D_v]: |out - exact| allowed per element
    out: np.ndarray
    #: [B, H, Nq]: |lse - exact| allowed per row (0 at fully masked rows: -inf exactly)
    lse: np.ndarray
    #: name -> [B, H, Nq, D_v]; they add up to `out`
    out_terms: dict = field(repr=False)
    #: name -> [B, H, Nq]; they add up to `lse`
    lse_terms: dict = field(repr=False)
    precision: PrecisionModel
    accumulation: str

    def dominant_out_term(self, index) -> str:
        """Name of the largest term of the output bound at `index` (b, h, i, c)."""
        index = tuple(index)
        return max(self.out_terms, key=lambda name: self.out_terms[name][index])

    def dominant_lse_term(self, index) -> str:
        index = tuple(index)
        return max(self.lse_terms, key=lambda name: self.lse_terms[name][index])

    def as_dict(self) -> dict:
        """Largest value of every term (absolute), for records."""
        return {
            "precision": self.precision.as_dict(),
            "accumulation": self.accumulation,
            "out_max": float(self.out.max(initial=0.0)),
            "lse_max": float(self.lse.max(initial=0.0)),
            "out_terms_max": {k: float(v.max(initial=0.0)) for k, v in self.out_terms.items()},
            "lse_terms_max": {k: float(v.max(initial=0.0)) for k, v in self.lse_terms.items()},
        }


def _scaled(first_order, factor):
    """first_order * factor, where a zero first-order term stays zero even if no factor exists."""
    with np.errstate(invalid="ignore"):
        return np.where(first_order == 0, 0.0, first_order * factor)


def gamma_times(g, x) -> np.ndarray:
    """g x for gammas g: where g has no finite value there is no bound, also where x = 0 (inf x 0
    would be NaN, and an error compared with a NaN bound fails nowhere)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isinf(g), np.inf, g * x)


def gamma(n, unit: float, mode: str = "worst-case", lam: float = DEFAULT_LAMBDA) -> np.ndarray:
    """Relative error bound of n accumulated roundings of size `unit`.

    worst-case: n u / (1 - n u), inf once n u >= 1 (no bound exists then);
    probabilistic: exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1 (Higham & Mary 2019), or the
    worst case where that is smaller (n < lam^2 or so).
    """
    n = np.asarray(n, dtype=np.float64)
    worst = worst_case_gamma(n, unit)
    if mode == "worst-case":
        return worst
    # Never looser than the worst case, which always holds.
    return np.minimum(worst, np.expm1(lam * np.sqrt(n) * unit + n * unit * unit / (1 - unit)))


def _rescale_counts(t: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """R_ij: rescales key j of row i can see, ascending or descending key order, any tiling.

    Ascending: a later key j' > j that beats every key before it (a record) may trigger one.
    Descending: a key j' < j that beats every key after it.
    """
    s = np.where(allowed, t, -np.inf)
    prev_max = np.maximum.accumulate(s, axis=-1)
    prev_max = np.concatenate([np.full(s.shape[:-1] + (1,), -np.inf), prev_max[..., :-1]], axis=-1)
    record_fwd = allowed & (s > prev_max)
    later = record_fwd[..., ::-1].cumsum(axis=-1)[..., ::-1] - record_fwd  # records after j

    next_max = np.maximum.accumulate(s[..., ::-1], axis=-1)[..., ::-1]
    next_max = np.concatenate([next_max[..., 1:], np.full(s.shape[:-1] + (1,), -np.inf)], axis=-1)
    record_bwd = allowed & (s > next_max)
    earlier = record_bwd.cumsum(axis=-1) - record_bwd  # descending-order records before j
    return np.maximum(later, earlier) + SPLIT_COMBINES


@dataclass(frozen=True)
class _Units:
    """The precision model's numbers that the terms need."""

    u_s: float        # score / softmax dtype
    u_p: float        # P storage dtype
    u_pv: float       # P.V and row-sum dtype
    #: smallest normals: below them a result's error is absolute, up to the smallest normal
    #: itself if the hardware flushes subnormals to zero (GPUs' .ftz, torch's fast exp)
    tiny_s: float
    tiny_pv: float
    tiny_p: float     # smallest normal of the P dtype
    p_rounds: bool    # P is stored in a dtype narrower than the one it was computed in
    eps_exp: float    # relative error of exp (the rescale factors)
    eps_exp_p: float  # relative error of the exp that makes P (a fast exp when P is 16-bit)
    eps_tanh: float   # relative error of tanh (softcap), as declared
    tanh_abs: float   # absolute error of tanh, as declared ("absolute"; 0 otherwise)
    g_d: float        # relative error bound of a score dot product
    t_abs: float      # absolute score error from underflow of the products
    scale: float
    accumulation: str
    lam: float
    u_r: float = 0.0  # q, k, v rounded inside the kernel: unit roundoff (0: not rounded)
    h_r: float = 0.0  # and the absolute rounding error below its normal range

    def tanh_error(self, tanh_part, softcap: float):
        """The softcapped logit's error from tanh as declared: eps_tanh |z| (tanh_part = |z|, or
        |tanh| for tanh's own error) plus tanh_abs c (times the cap; 0 without a softcap)."""
        return self.eps_tanh * tanh_part + self.tanh_abs * softcap

    @classmethod
    def of(cls, problem, precision, accumulation, lam) -> "_Units":
        u_in = unit_roundoff(precision.input)
        u_s = unit_roundoff(precision.score_accumulation)
        u_p = unit_roundoff(precision.p_rounding)
        u_pv = unit_roundoff(precision.pv_accumulation)
        # Rounding P to a dtype no narrower than the one it was computed in changes nothing.
        p_rounds = u_p > u_s
        # exp in fp32 (or wider) within EXP_ULPS, then rounded to a narrower score dtype;
        # an ulp is at most 2u relative
        u_32 = unit_roundoff("fp32")
        eps_exp = 2 * EXP_ULPS * min(u_s, u_32) + (u_s if u_s > u_32 else 0.0)
        eps_exp_p = eps_exp + (FAST_EXP_ERROR if p_rounds and u_p >= FAST_EXP_ERROR else 0.0)
        # tanh in fp32 as declared (accurate: as exp), then rounded to a narrower score dtype
        narrow = u_s if u_s > u_32 else 0.0
        eps_tanh = {"accurate": eps_exp, "absolute": narrow, "approx": TANH_APPROX_ERROR + narrow}[precision.tanh]
        tanh_abs = TANH_ABSOLUTE_UNITS * u_32 if precision.tanh == "absolute" else 0.0
        D = problem.head_dim
        g_d = float(gamma(D, u_s, accumulation, lam))
        if u_s > u_in:  # q and k rounded to the score dtype first: relative u_s each
            g_d += 2 * u_s
        tiny_s = float(finfo(precision.score_accumulation).smallest_normal)
        t_abs = (D * problem.scale_value + 1) * tiny_s
        rounding = precision.input_rounding
        u_r = unit_roundoff(rounding) if rounding and unit_roundoff(rounding) > u_in else 0.0
        h_r = float(finfo(rounding).smallest_subnormal) / 2 if u_r else 0.0
        if precision.ftz:
            t_abs += problem.scale_value * flushed_score_error(problem)
        return cls(u_s=u_s, u_p=u_p, u_pv=u_pv, tiny_s=tiny_s,
                   tiny_pv=float(finfo(precision.pv_accumulation).smallest_normal),
                   tiny_p=precision.tiny_p, p_rounds=p_rounds,
                   eps_exp=eps_exp, eps_exp_p=eps_exp_p, eps_tanh=eps_tanh, tanh_abs=tanh_abs, g_d=g_d,
                   t_abs=t_abs,
                   scale=problem.scale_value, accumulation=accumulation, lam=lam, u_r=u_r, h_r=h_r)


def error_bound(problem: AttentionProblem, precision: PrecisionModel, reference: Reference,
                accumulation: str = "worst-case", lam: float = DEFAULT_LAMBDA) -> Bound:
    """Per-element bounds on |out - exact| and |lse - exact| for a kernel of `precision`."""
    if accumulation not in ACCUMULATION_MODES:
        raise InvalidArgumentError(f"accumulation={accumulation!r}; use one of {ACCUMULATION_MODES}")
    if not (isinstance(lam, (int, float)) and lam > 0):
        raise InvalidArgumentError(f"lam={lam!r} must be a positive number")
    if precision.input != problem.dtype:
        raise InvalidArgumentError(
            f"precision.input={precision.input!r} does not match the problem dtype {problem.dtype!r}; "
            f"use e.g. PrecisionModel.flash({problem.dtype!r})")
    if reference.out.shape != problem.out_shape:
        raise InvalidArgumentError(
            f"reference.out.shape={reference.out.shape!r} is not the problem's {problem.out_shape!r}")

    units = _Units.of(problem, precision, accumulation, lam)
    q = problem.q64()
    k, v = problem.kv64()
    abs_v = np.abs(v)
    mask = problem.mask
    B, H, Nq, _ = problem.out_shape
    abs_o = np.abs(reference.out)

    out_terms = {name: np.zeros(problem.out_shape) for name in OUT_TERMS}
    lse_terms = {name: np.zeros((B, H, Nq)) for name in LSE_TERMS}
    rows_per_chunk = max(1, _CHUNK_ENTRIES // problem.nk)
    for b in range(B):
        for h in range(H):
            for r0 in range(0, Nq, rows_per_chunk):
                rows = slice(r0, r0 + rows_per_chunk)
                _chunk(units, q[b, h, rows], k[b, h], abs_v[b, h], mask[rows], _RowVariants.of(problem, b, h, rows),
                       reference.lse[b, h, rows], abs_o[b, h, rows], reference.row_scale[b, h, rows],
                       {n: t[b, h, rows] for n, t in out_terms.items()},
                       {n: t[b, h, rows] for n, t in lse_terms.items()})

    live = np.isfinite(reference.lse)
    first_order = sum(out_terms[n] for n in _FIRST_ORDER)
    out_terms["second_order"] = _scaled(first_order, out_terms["second_order"])  # held the factor
    pre_rounding = first_order + out_terms["second_order"] + reference.out_bound
    out_terms["output_rounding"] = np.where(
        live[..., None], 0.5 * ulp(abs_o + pre_rounding, precision.output), 0.0)
    out_terms["reference"] = np.where(live[..., None], reference.out_bound, 0.0)
    if precision.ftz:
        out_terms["flush_to_zero"] = np.where(live[..., None] & np.ones(problem.out_shape, bool),
                                              flushed_output_error(precision), 0.0)

    lse_first = sum(lse_terms[n] for n in _LSE_FIRST_ORDER)
    lse_terms["second_order"] = _scaled(lse_first, lse_terms["second_order"])
    ref_lse = np.where(live, reference.lse, 0.0)
    lse_terms["lse_rounding"] = np.where(live, unit_roundoff(precision.lse) * (np.abs(ref_lse) + lse_first), 0.0)
    lse_terms["reference"] = np.where(live, reference.lse_bound, 0.0)

    out = sum(out_terms.values()) * _SLACK
    lse = sum(lse_terms.values()) * _SLACK
    return Bound(out=out, lse=lse, out_terms=out_terms, lse_terms=lse_terms,
                 precision=precision, accumulation=accumulation)


def flushed_score_error(problem) -> float:
    """Largest |q.k| change from flushing subnormal q and k entries to zero (unscaled)."""
    tiny = float(finfo(problem.dtype).smallest_normal)
    q, (k, _) = problem.q64(), problem.kv64()
    return tiny * (np.abs(q).sum(axis=-1).max() + np.abs(k).sum(axis=-1).max() + problem.head_dim * tiny)


def flushed_output_error(precision) -> float:
    """Largest output change from flushing subnormal V entries and the output itself to zero."""
    return float(finfo(precision.input).smallest_normal) + float(finfo(precision.output).smallest_normal)


@dataclass(frozen=True)
class _RowVariants:
    """The variants of a block of rows of one head: softcap, ALiBi bias [r, Nk], sink logit."""

    softcap: float = 0.0
    bias: np.ndarray | None = None
    sink: float | None = None

    @classmethod
    def of(cls, problem: AttentionProblem, b: int, h: int, rows: slice) -> "_RowVariants":
        return cls(problem.softcap, problem.alibi_bias(b, h, np.arange(problem.nq)[rows]),
                   None if problem.sinks is None else float(problem.sinks[h]))

    def logits(self, t):
        """(z = capped t + bias, the scores' error factor tanh'(t / c) <= 1, the logits' own
        relative rounding in units of u_s and eps_tanh per p: see `_chunk`)."""
        z, slope, own, tanh_part = t, 1.0, 0.0, 0.0
        if self.softcap > 0:
            arg = t / self.softcap
            z = self.softcap * np.tanh(arg)
            slope = 1.0 / np.cosh(np.minimum(np.abs(arg), 350.0)) ** 2
            own = own + np.abs(t) + np.abs(z)  # the quotient (carried by tanh' <= 1) and the product
            tanh_part = np.abs(z)  # a relative error of tanh, times |z|: the logit's error
        if self.bias is not None:
            z = z + self.bias
            own = own + 2 * np.abs(self.bias) + np.abs(z)  # the product, the addition
        return z, slope, own, tanh_part


def _input_rounding(U: _Units, q, k) -> np.ndarray:
    """c_ij [r, Nk]: how far rounding q and k to the kernel's input dtype moves each score."""
    if not U.u_r:
        return np.zeros((q.shape[0], k.shape[0]))
    abs_q, abs_k = np.abs(q), np.abs(k)
    return U.scale * ((2 * U.u_r + U.u_r ** 2) * (abs_q @ abs_k.T) + U.h_r * (1 + U.u_r) * (
        abs_q.sum(axis=-1)[:, None] + abs_k.sum(axis=-1)[None, :]) + q.shape[1] * U.h_r ** 2)


def _chunk(units: _Units, q, k, abs_v, allowed, variants: _RowVariants, lse, abs_o, row_scale,
           out_terms, lse_terms):
    """Fill the terms of rows `q` [r, D] of one head (views into the result arrays).

    Variants: the scores t become logits z (softcap, ALiBi) before the softmax; the scores'
    error reaches z times tanh'(t / c) <= 1, the logits' own roundings (u_s |t| for the
    quotient, u_s |z| per product or sum, 2 u_s |bias| + u_s |z| for the ALiBi product and sum, tanh's declared
    accuracy: eps_tanh |z| relative, tanh_abs c absolute) join the softmax term. A sink is one
    more term of the row sum only: its weight p_s = e^{sink - LSE} with relative error eps_s
    moves O by p_s eps_s |O| and the LSE by p_s eps_s (softmax term), and adds one rounding to
    the sum."""
    U = units
    live = np.isfinite(lse)
    allowed = allowed & live[:, None]
    scores = U.scale * (q @ k.T)
    t, score_factor, own, tanh_part = variants.logits(scores)
    a = U.scale * (np.abs(q) @ np.abs(k).T) * score_factor
    L = np.where(live, lse, 0.0)[:, None]
    with np.errstate(under="ignore"):
        p = np.where(allowed, np.exp(np.minimum(t - L, 0.0)), 0.0)
    m = np.where(live, np.where(allowed, t, -np.inf).max(axis=-1), 0.0)[:, None]
    M = np.where(allowed, np.abs(t), 0.0).max(axis=-1, keepdims=True)
    if variants.sink is not None:  # a kernel may start its running max at the sink
        m = np.where(live[:, None], np.maximum(m, variants.sink), 0.0)
        M = np.maximum(M, abs(variants.sink))
    x = np.where(allowed, t - m, 0.0)
    R = _rescale_counts(t, allowed)

    # Relative perturbations of p_ij (first order); times p they weight |v_j| (and |O|).
    with np.errstate(invalid="ignore"):  # 0 * inf where gamma_D has no finite value
        rel_scores = U.g_d * a + U.t_abs
        w_scores = p * rel_scores
    rel_softmax = (U.u_s * (np.abs(t) + 3 * np.abs(x) + M + own) + U.tanh_error(tanh_part, variants.softcap)
                   + U.eps_exp_p)
    rel_rescale = R * (U.eps_exp + 4 * U.u_s * M)
    # no bound is no bound, even for a masked entry of a live row; a row without keys has no terms
    w_scores = np.where(np.isnan(w_scores), np.where(live[:, None], np.inf, 0.0), w_scores)
    # Below the smallest normal an exp result's error is absolute (tiny_s with flush to zero).
    w_softmax = np.where(allowed, np.maximum(p * rel_softmax, U.tiny_s), 0.0)
    w_rescale = p * rel_rescale
    w_p = (U.u_p * np.where(allowed, np.maximum(p, U.tiny_p), 0.0) if U.p_rounds
           else np.zeros_like(p))
    rel_inputs = _input_rounding(U, q, k) * score_factor
    w_inputs = p * rel_inputs

    weights = np.concatenate([w_scores, w_softmax, w_rescale, w_p, w_inputs], axis=0)
    with np.errstate(invalid="ignore"):  # inf weights (no bound) times zero |v| or |O|
        through_v = (weights @ abs_v).reshape(5, *abs_o.shape)
        sums = weights.sum(axis=-1).reshape(5, -1, 1)
        for idx, name in enumerate(("scores", "softmax", "online_rescale", "p_rounding", "input_rounding")):
            term = through_v[idx] + abs_o * sums[idx]
            out_terms[name][...] = np.where(np.isnan(term), np.inf, term)
            lse_terms[name][...] = sums[idx, :, 0]
    eps_sink = 0.0
    if variants.sink is not None:
        with np.errstate(under="ignore"):
            p_sink = np.where(live, np.exp(np.minimum(variants.sink - L[:, 0], 0.0)), 0.0)
        # sink - m and its exp, rescaled like any key as the running max grows
        eps_sink = (U.u_s * (abs(variants.sink) + 2 * np.abs(m[:, 0]) + M[:, 0]) + U.eps_exp
                    + (R.max(axis=-1, initial=0) + 1) * (U.eps_exp + 4 * U.u_s * M[:, 0]))
        out_terms["softmax"][...] += (p_sink * eps_sink)[:, None] * abs_o + U.tiny_s
        lse_terms["softmax"][...] += p_sink * eps_sink + U.tiny_s

    # P.V and the row sum: n keys, the rescale multiplies, the division. Products p v below the
    # normal range carry an absolute error up to tiny_pv each (p <= 1 after the max shift).
    n = allowed.sum(axis=-1) + R.max(axis=-1, initial=0) + 1 + (variants.sink is not None)
    g_n = gamma(n, U.u_pv, U.accumulation, U.lam)[:, None]
    out_terms["accumulation"][...] = np.where(
        live[:, None], gamma_times(g_n, row_scale + abs_o) + U.u_pv * abs_o + (n[:, None] + 1) * U.tiny_pv, 0.0)
    if U.u_r:  # the values' own rounding: sum_j p_ij (u_r |v_jc| + h_r)
        out_terms["input_rounding"][...] += np.where(live[:, None], U.u_r * row_scale + U.h_r, 0.0)
    # |log(1 + theta)| <= -log(1 - |theta|) for the row sum's relative error theta
    with np.errstate(divide="ignore"):  # gamma >= 1: no bound, inf
        lse_terms["row_sum"][...] = np.where(live, -np.log1p(-np.minimum(g_n[:, 0], 1.0)), 0.0)
    log_l = np.where(live, lse - m[:, 0], 0.0)  # log of the row sum of exp(t - m)
    lse_terms["log"][...] = np.where(
        live, U.u_s * (2 * LOG_ULPS * np.maximum(1.0, log_l) + 2 * M[:, 0] + np.abs(L[:, 0])), 0.0)

    # Largest relative perturbation eps of any p of the row: the first-order expansion's
    # remainder is at most the first-order bound times 2 eps / (1 - 2 eps). (The absolute
    # underflow parts are additive, not relative: they do not enter eps.)
    rel = np.where(allowed, rel_scores + rel_softmax + rel_rescale + rel_inputs, 0.0)
    eps = np.maximum(rel.max(axis=-1, initial=0.0), eps_sink) + (U.u_p if U.p_rounds else 0.0) + g_n[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(eps < 0.25, 2 * eps / (1 - 2 * eps), np.inf)
    factor = np.where(live, factor, 0.0)
    out_terms["second_order"][...] = factor[:, None]
    lse_terms["second_order"][...] = factor
