"""How large an honest implementation's error is: attention under a precision model, computed by
several correct implementations that round in different places.

Each `Member` computes the problem exactly as a kernel of the precision model may: q·k
accumulated in `score_accumulation`, softmax and exp in it, P rounded to `p_rounding`, the row
sum and P·V accumulated in `pv_accumulation`, the output rounded to `output`, q, k, v rounded to
`input_rounding` first where the model says so — and differs
from the others where correct kernels differ: the order of the q·k and P·V sums (forward,
reversed, pairwise; a fused multiply-add or a rounded product), a two-pass softmax with the
row's max or an online softmax over key tiles with FA2's rescale (tiles of 16 and 64, in
either order), exp(x) or FA2's exp2(s·c − m·c) with the product s·c rounded, and a row sum of
P before or after its rounding. tanh (softcap) and exp are computed as the precision model
declares them (`PrecisionModel.tanh`, `.exp`): correctly rounded when "accurate"; tanh as
1 − 2/(e^{2x} + 1) with every operation rounded when "absolute"; tanh or exp rounded to the
significant bits whose rounding error reaches the documented bound of tanh.approx.f32 or
ex2.approx.f32 when "approx" (11 and 22 bits: up to 2^-11 and 2^-22 relative), so that the
ensemble's allowance covers a kernel that uses them. `ensemble_errors(problem, precision,
reference)` runs them and returns each member's max normalised error (`EnsembleErrors`); the
verdict's "ensemble" rule allows a kernel K times the largest of them plus a floor (see
`fa_verify.verdict`).

No BLAS decides any bit: every sum is an explicit sequence of numpy elementwise operations,
each rounded to the stage's dtype. Elementwise + − × ÷ are IEEE correctly rounded on every
machine, 16-bit stages are computed in fp32 and rounded (fp32 has 24 ≥ 2·11 + 2 bits, so the
double rounding is exact), and exp is computed here in float64 from + − × alone (`exp64`:
Cody–Waite reduction, degree-13 Taylor polynomial, ldexp) and then rounded — numpy's own exp
is a SIMD routine whose last bit differs between CPUs. The outputs are therefore the same bits
under any BLAS, core type, thread count or SIMD level (tests/test_honest_ensemble.py runs
them under several OPENBLAS_CORETYPE and thread settings in subprocesses).

What the rule built on it assumes, and how often it can be wrong: a correct kernel of the
precision model errs like one more member (independent rounding errors; an exp within a few
ulp), so its error exceeds K × E + floor only if it is K times worse than the worst of the
members on the same inputs. No closed form gives that probability; measured
(tests/measure_ensemble_ratios.py, README "The error model and verdicts"), the smallest K that
8,631 judged examples of the built-in backends and tests/fixtures/honest_variants.py needed
was 0.99, under four OpenBLAS core types and the ci and thorough profiles: 0 false positives,
i.e. below 3.5e-4 per example at 95% confidence (rule of three) for kernels and inputs like those.

Large problems: the members cost O(B·H·Nq·Nk·D) elementwise operations each, tens of ns per
multiply-add here, so above `FULL_WORK` they run on the `MAX_ROWS` query rows with the largest
error-model bound relative to their row scale (where an honest kernel's rounding errors are
largest: large logits, peaky rows) plus rows spread evenly over the rest; the ensemble's max
is then over those rows, which `EnsembleErrors.rows` reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fa_verify.dtypes import numpy_dtype
from fa_verify.error_model import EX2_APPROX_ERROR, TANH_APPROX_ERROR
from fa_verify.metrics import OutputErrors
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

#: Above this B·H·Nq·Nk·D the members run on a subset of rows (the `thorough` profile's largest
#: problems, 2e6, still run in full).
FULL_WORK = 4_000_000
#: Rows evaluated above FULL_WORK: half where the bound is largest, half spread evenly.
MAX_ROWS = 128
#: Elements of one [rows, Nk, D] block of products held at once (memory, not accuracy).
BLOCK = 1 << 21


@dataclass(frozen=True)
class Member:
    """One honest implementation of a precision model."""

    name: str
    #: order of every sum: "forward", "reversed" or "pairwise" (a balanced tree)
    order: str
    #: multiply-add with one rounding (FMA) instead of a rounded product and a rounded sum
    fused: bool = False
    #: None: two-pass softmax with the row's max; n: online softmax over key tiles of n (FA2)
    tile: int | None = None
    #: "exp": p = exp(t − m); "exp2": FA2's p = exp2(fl(s·c) − m·c) with c = scale·log2(e)
    exp: str = "exp"
    #: the row sum adds P after its rounding to p_rounding (as FA2) or before
    sum_rounded_p: bool = True


#: The ensemble. Every axis of variation appears in at least two members, crossed with
#: different orders, so that no single choice of the kernel's is the only one represented.
MEMBERS = (
    Member("sequential", "forward"),
    Member("reversed-unrounded-sum", "reversed", sum_rounded_p=False),
    Member("pairwise", "pairwise"),
    Member("fma-exp2", "forward", fused=True, exp="exp2"),
    Member("online-16-exp2", "forward", tile=16, exp="exp2", sum_rounded_p=False),
    Member("online-64-reversed-fma", "reversed", fused=True, tile=64),
)


@dataclass(frozen=True)
class EnsembleErrors:
    """Each member's max normalised error over the rows evaluated."""

    #: member name -> max over the evaluated rows of |out − ref| / row scale
    errors: dict
    #: query rows evaluated (over B, H, Nq) and rows in the problem
    rows: int
    total_rows: int

    @property
    def worst_member(self) -> str | None:
        """The member with the largest finite error (None when every member overflowed)."""
        finite = {name: e for name, e in self.errors.items() if np.isfinite(e)}
        return max(finite, key=finite.get) if finite else None

    @property
    def max_error(self) -> float:
        """E: the largest finite member error. A member that overflows (same-precision fp16
        with V near the fp16 maximum) says nothing about the size of rounding errors; a kernel
        that overflows too fails the verdict's "finite" rule. inf when every member overflowed."""
        worst = self.worst_member
        return float("inf") if worst is None else self.errors[worst]


# --- exp from + − × only: the same bits on every IEEE machine ------------------------------------

_LN2 = math.log(2.0)
#: ln 2 = _LN2_HI + _LN2_LO to ~2^-85, _LN2_HI with 32 significant bits so that k·_LN2_HI is
#: exact for |k| < 2^21 (Cody–Waite); _LN2_LO is ln 2 − _LN2_HI rounded (computed with mpmath).
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_INV_FACTORIALS = tuple(1.0 / math.factorial(n) for n in range(14))


def _exp_reduced(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """2^k · e^r for |r| ≤ ln2/2: Taylor to degree 13 (truncation < 1e-17 relative)."""
    poly = np.full_like(r, _INV_FACTORIALS[-1])
    for c in _INV_FACTORIALS[-2::-1]:
        poly = poly * r + c
    return np.ldexp(poly, k.astype(np.int32))


def exp64(x) -> np.ndarray:
    """e^x in float64 to a few ulp, deterministic: no libm, no SIMD exp. -inf gives 0."""
    x = np.asarray(x, dtype=np.float64)
    clipped = np.clip(np.nan_to_num(x, nan=0.0, neginf=-1100.0), -1100.0, 710.0)
    k = np.rint(clipped / _LN2)
    r = (clipped - k * _LN2_HI) - k * _LN2_LO
    with np.errstate(over="ignore"):
        out = _exp_reduced(r, k)
    return np.where(np.isnan(x), np.nan, out)


def exp2_64(y) -> np.ndarray:
    """2^y in float64, deterministic (y − rint(y) is exact, its product with ln2 one rounding)."""
    y = np.asarray(y, dtype=np.float64)
    clipped = np.clip(np.nan_to_num(y, nan=0.0, neginf=-1600.0), -1600.0, 1025.0)
    k = np.rint(clipped)
    with np.errstate(over="ignore"):
        out = _exp_reduced((clipped - k) * _LN2, k)
    return np.where(np.isnan(y), np.nan, out)


def tanh64(x) -> np.ndarray:
    """tanh(x) in float64 to a few ulp, deterministic: e / (e + 2) with e = e^{2|x|} - 1 from
    the same polynomial (directly for small arguments, where e^y - 1 would cancel)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.minimum(2 * np.abs(x), 40.0)  # tanh(20) is 1 in float64
    small = y <= _LN2 / 2
    poly = np.full_like(y, _INV_FACTORIALS[-1])
    for c in _INV_FACTORIALS[-2:0:-1]:  # (e^y - 1) / y = sum_n y^n / (n + 1)!
        poly = poly * y + c
    e = np.where(small, y * poly, exp64(y) - 1.0)
    return np.copysign(e / (e + 2.0), x)


# --- rounding and sums ---------------------------------------------------------------------------


class Stage:
    """Arithmetic rounded to one dtype. Values are held in `work` (fp32, or fp64 when a stage is
    fp64); a 16-bit stage computes in fp32 and rounds, which is correctly rounded."""

    def __init__(self, dtype: str, work: np.dtype):
        self.dtype, self.work = numpy_dtype(dtype), work

    def __call__(self, x):
        x = np.asarray(x)
        if x.dtype == self.dtype == self.work:
            return x
        return x.astype(self.dtype).astype(self.work)

    def round64(self, x):
        """x (float64) rounded to the stage and returned as float64 (for fused sums)."""
        return x.astype(self.dtype).astype(np.float64)


def rounded_sum(terms: np.ndarray, order: str, rnd: Stage, init=None) -> np.ndarray:
    """init + Σ_j terms[:, j] along axis 1, every addition rounded."""
    if order == "pairwise":
        while terms.shape[1] > 1:
            half = terms.shape[1] // 2
            paired = rnd(terms[:, :half] + terms[:, half:2 * half])
            terms = np.concatenate([paired, terms[:, 2 * half:]], axis=1)
        total = terms[:, 0]
        return total if init is None else rnd(init + total)
    steps = range(terms.shape[1]) if order == "forward" else range(terms.shape[1] - 1, -1, -1)
    total = init
    for j in steps:
        total = terms[:, j] if total is None else rnd(total + terms[:, j])
    return total


def rounded_dot(a: np.ndarray, b: np.ndarray, member: Member, rnd: Stage, init=None) -> np.ndarray:
    """init + Σ_j a[:, j] · b[:, j] along axis 1 (a and b broadcast), in the member's order."""
    if not member.fused or member.order == "pairwise":
        return rounded_sum(rnd(a * b), member.order, rnd, init)
    # FMA: the products are exact in float64 (at most 48 significant bits), each addition is
    # rounded to float64 and then to the stage: for an fp32 stage a double rounding, at most
    # 2^-29 u more than an FMA's; it is what a kernel with a wider accumulator would do.
    products = a.astype(np.float64) * b.astype(np.float64)
    steps = range(products.shape[1]) if member.order == "forward" else range(products.shape[1] - 1, -1, -1)
    total = np.zeros(products[:, 0].shape) if init is None else init.astype(np.float64)
    for j in steps:
        total = rnd.round64(total + products[:, j])
    return total.astype(rnd.work)


def rounded_significand(x: np.ndarray, bits: int) -> np.ndarray:
    """x (float64) rounded to nearest (even) with `bits` significant bits: a relative error of up
    to 2^-bits, as an approximation unit that keeps that many bits would have (exact operations
    only: frexp, a power-of-two scaling, rint)."""
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.rint(np.ldexp(mantissa, bits)), exponent - bits)


def _bits(error: float) -> int:
    """Significant bits whose rounding errs by at most `error` (relative), and by nearly that."""
    return math.ceil(-math.log2(error))


def exp_kind(exp: str, accuracy: str = "accurate") -> tuple:
    """(unit, power) of an "exp" or "exp2" kernel: exp2 kernels work in log2 units, as FA2 does.
    accuracy "approx" (`PrecisionModel.exp`): the power errs by up to EX2_APPROX_ERROR, as
    ex2.approx.f32 may."""
    unit, power = (math.log2(math.e), exp2_64) if exp == "exp2" else (1.0, exp64)
    if accuracy == "approx":
        return unit, lambda y: rounded_significand(power(y), _bits(EX2_APPROX_ERROR))
    return unit, power


def tanh_kind(accuracy: str, score: Stage):
    """tanh in the `score` stage as a kernel of the declared accuracy (`PrecisionModel.tanh`)
    computes it: "accurate" rounded once; "absolute" as 1 - 2 / (e^{2x} + 1), every operation
    rounded; "approx" with a relative error of up to TANH_APPROX_ERROR, as tanh.approx.f32 may."""
    if accuracy == "absolute":
        one, two = score(np.asarray(1.0)), score(np.asarray(2.0))
        return lambda x: score(one - score(two / score(score(exp64(two * x)) + one)))
    if accuracy == "approx":
        return lambda x: score(rounded_significand(tanh64(x), _bits(TANH_APPROX_ERROR)))
    return lambda x: score(tanh64(x))


def gemm(a: np.ndarray, b: np.ndarray, member, rnd: Stage) -> np.ndarray:
    """a [M, K] @ b [K, N] with every sum explicit (`rounded_dot`, the member's order), computed
    in blocks of rows of at most BLOCK products (each output element is its own sum, so the
    blocks change no bit)."""
    step = max(1, BLOCK // max(1, a.shape[1] * b.shape[1]))
    parts = [rounded_dot(a[i:i + step, :, None], b[None], member, rnd) for i in range(0, a.shape[0], step)]
    return np.concatenate(parts) if parts else np.zeros((0, b.shape[1]), rnd.work)


def logits(s: np.ndarray, exp: str, score: Stage, scale: float, softcap: float = 0.0, bias=None,
           accuracy: tuple = ("accurate", "accurate")) -> tuple:
    """(t, th, unit, power): the logits of scores `s` as a kernel of the `exp` kind computes them
    in the `score` stage (softcap, then ALiBi `bias`), tanh(s·scale / softcap) as rounded (None
    without a softcap: the backward's derivative 1 − th²), the unit of t (1, or log2(e) for exp2
    kernels, which work in log2 units as FA2 does: logits and sinks times log2(e)) and the
    matching deterministic power function (exp64 or exp2_64). accuracy: the declared accuracy
    of (tanh, exp), `PrecisionModel.tanh` and `.exp`."""
    unit, power = exp_kind(exp, accuracy[1])
    tanh = tanh_kind(accuracy[0], score)
    log2e = math.log2(math.e)
    th = None
    if softcap > 0 and exp == "exp2":
        # FA2: tanh(s * (scale / c)), then c * log2(e) folded into the exp2 argument
        arg = score(s * score(np.asarray(scale / softcap)))
        th = tanh(arg)
        t = score(th * score(np.asarray(softcap * log2e)))
    elif softcap > 0:
        t = score(s * score(np.asarray(scale)))
        th = tanh(score(t / score(np.asarray(softcap))))
        t = score(softcap * th)
    elif exp == "exp2":
        t = score(s * score(np.asarray(scale * log2e)))  # FA2 folds scale and log2(e) into one product
    else:
        t = score(s * score(np.asarray(scale)))
    if bias is not None:
        t = score(t + score(bias * unit))
    return t, th, unit, power


# --- one member on a block of rows ---------------------------------------------------------------


@dataclass
class _Rows:
    """A block of query rows, each with its own key/value head: q [R, D], k [R, Nk, D], v [R, Nk, D_v],
    mask [R, Nk]; the variants: softcap, ALiBi bias [R, Nk] (float64, exact) and sinks [R]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray
    softcap: float = 0.0
    bias: np.ndarray | None = None
    sinks: np.ndarray | None = None


def _member_out(member: Member, rows: _Rows, precision: PrecisionModel, scale: float,
                work: np.dtype) -> np.ndarray:
    """The member's output [R, D_v] in float64 (rounded to precision.output); 16-bit stages may
    overflow to inf (and inf − inf to NaN), as such a kernel's would."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _member_out_unchecked(member, rows, precision, scale, work)


def _member_out_unchecked(member: Member, rows: _Rows, precision: PrecisionModel, scale: float,
                          work: np.dtype) -> np.ndarray:
    score = Stage(precision.score_accumulation, work)
    p_round = Stage(precision.p_rounding, work)
    pv = Stage(precision.pv_accumulation, work)
    # S = q·kᵀ, summed over D: products laid out [R, D, Nk] so the sum runs along axis 1
    s = rounded_dot(rows.q[:, :, None], np.swapaxes(rows.k, 1, 2), member, score)
    t, _, unit, power = logits(s, member.exp, score, scale, rows.softcap, rows.bias, (precision.tanh, precision.exp))
    t = np.where(rows.mask, t, -np.inf)
    nk, n_rows = t.shape[1], t.shape[0]
    tile = member.tile or nk
    starts = list(range(0, nk, tile))
    if member.order == "reversed":
        starts.reverse()
    m = np.full(n_rows, -np.inf, work)
    l = np.zeros(n_rows, work)
    acc = np.zeros((n_rows, rows.v.shape[-1]), work)
    for start in starts:
        block = t[:, start:start + tile]
        m_new = np.maximum(m, block.max(axis=1))
        shift = np.where(np.isfinite(m_new), m_new, 0).astype(work)  # no −inf − −inf
        alpha = score(power(score(m - shift)))  # 0 before the first live key (m = −inf)
        p = score(power(score(block - shift[:, None])))
        p_rounded = p_round(p)
        l = rounded_sum(pv(p_rounded if member.sum_rounded_p else p), member.order, pv, pv(l * alpha))
        acc = rounded_dot(p_rounded[:, :, None], rows.v[:, start:start + tile], member, pv, pv(acc * alpha[:, None]))
        m = m_new
    if rows.sinks is not None:  # after the keys: one more rescale, the sink's term in the row sum only
        sink = score(rows.sinks * unit)
        m_new = np.maximum(m, sink)
        alpha = score(power(score(m - m_new)))
        l = pv(pv(l * alpha) + score(power(score(sink - m_new))))
        acc = pv(acc * alpha[:, None])
    out = pv(acc / np.where(l > 0, l, 1)[:, None])
    return out.astype(numpy_dtype(precision.output)).astype(np.float64)


# --- the ensemble --------------------------------------------------------------------------------


def _chosen_rows(problem: AttentionProblem, reference, bound) -> np.ndarray:
    """Flat indices into [B, H, Nq] of the rows to evaluate (all of them for small problems)."""
    B, H, Nq, D = problem.out_shape
    total = B * H * Nq
    if B * H * Nq * problem.nk * D <= FULL_WORK or total <= MAX_ROWS:
        return np.arange(total)
    if bound is None:
        return largest_and_spread(None, total, MAX_ROWS)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.nan_to_num(bound.out / reference.row_scale, nan=0.0, posinf=0.0).max(axis=-1)
    return largest_and_spread(relative.reshape(total), total, MAX_ROWS)


def largest_and_spread(relative, total: int, count: int) -> np.ndarray:
    """Sorted unique indices into range(total): count // 2 spread evenly, and the count // 2
    largest of `relative` (a [total] array: where an honest kernel's rounding errors are largest
    relative to the scale they are judged by; None: the spread ones only). Ties go to the later
    index (a stable sort, reversed): the same rows on every machine, whatever numpy's sort."""
    spread = np.linspace(0, total - 1, count // 2).round().astype(int)
    if relative is None:
        return np.unique(spread)
    largest = np.argsort(relative, kind="stable")[::-1][:count // 2]
    return np.unique(np.concatenate([largest, spread]))


def ensemble_outputs(problem: AttentionProblem, precision: PrecisionModel, rows=None, members=MEMBERS) -> dict:
    """{member name: output [len(rows), D_v] float64} on the flat [B, H, Nq] row indices `rows`
    (all rows when None)."""
    B, H, Nq, D = problem.out_shape
    stages = (precision.score_accumulation, precision.p_rounding, precision.pv_accumulation)
    work = np.dtype(np.float64 if "fp64" in stages else np.float32)
    rows = np.arange(B * H * Nq) if rows is None else np.asarray(rows)
    b, h, i = np.unravel_index(rows, (B, H, Nq))
    kv = h // problem.group_size
    mask = problem.mask
    bias = problem.alibi_bias(b, h, i)
    outs = {m.name: np.empty((len(rows), D)) for m in members}
    step = max(1, BLOCK // max(1, problem.nk * max(D, problem.head_dim)))
    for lo in range(0, len(rows), step):
        sl = slice(lo, lo + step)
        block = _Rows(q=_given(problem.q[b[sl], h[sl], i[sl]], precision, work),
                      k=_given(problem.k[b[sl], kv[sl]], precision, work),
                      v=_given(problem.v[b[sl], kv[sl]], precision, work), mask=mask[i[sl]], softcap=problem.softcap,
                      bias=None if bias is None else bias[sl],
                      sinks=None if problem.sinks is None else problem.sinks[h[sl]].astype(work))
        for member in members:
            outs[member.name][sl] = _member_out(member, block, precision, problem.scale_value, work)
    return outs


def _given(x: np.ndarray, precision: PrecisionModel, work: np.dtype) -> np.ndarray:
    """Inputs as a member computes with them: rounded first where the kernel rounds its inputs."""
    if precision.input_rounding:
        x = x.astype(numpy_dtype(precision.input_rounding))
    return x.astype(work)


def ensemble_errors(problem: AttentionProblem, precision: PrecisionModel, reference, bound=None,
                    members=MEMBERS) -> EnsembleErrors:
    """Every member's max normalised error against `reference` (fa_verify.oracle.reference).

    bound: the problem's `error_model.Bound` under `precision`, to pick the rows of a large
    problem (rows spread evenly only, when None). Fully masked rows count as error 0 (their
    output is 0 in every member).
    """
    rows = _chosen_rows(problem, reference, bound)
    B, H, Nq, D = problem.out_shape
    flat_ref = reference.out.reshape(B * H * Nq, D)[rows]
    flat_scale = np.broadcast_to(reference.row_scale, problem.out_shape).reshape(B * H * Nq, D)[rows]
    errors = {}
    for name, out in ensemble_outputs(problem, precision, rows, members).items():
        err = OutputErrors.compute(out, flat_ref, flat_scale, precision.output).normalised
        errors[name] = float(np.max(err, initial=0.0))
    return EnsembleErrors(errors, rows=len(rows), total_rows=B * H * Nq)
