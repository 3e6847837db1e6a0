"""The verdict: does a kernel's output agree with the reference as its precision model says?

Rules, checked in this order; the verdict names the first that fails:

1. "shape"        out is [B, H, Nq, D] (and LSE [B, H, Nq]); nothing else can be judged otherwise.
2. "finite"       no NaN or Inf where the reference is finite.
3. "masked_rows"  fully masked rows give exactly 0 and LSE -inf (fa_verify's convention).
4. "error_bound"  |out - ref| <= bound.out at every element (`error_model.error_bound`).
5. "lse_bound"    |lse - ref| <= bound.lse at every row, when the kernel returned an LSE.
6. "baseline"     max normalised error <= K x that of naive same-precision attention on the
                  same inputs + floor (flash-attention's style of rule).

Why the bound decides and the baseline is a second opinion with a wide factor: the bound is
derived per element from the precision model and holds for every correct kernel of that model
(measured on the tests' inputs: torch's CPU kernels and the numpy FA2 model use at most 0.54 of
the default flash-model bound; only where output rounding is the whole bound, at rounding
midpoints and subnormal outputs, can a correct kernel come close to 1), so exceeding it is a
finding in itself. The baseline is empirical: naive attention with
every stage in the input dtype is far less accurate than a FlashAttention kernel for fp16/bf16
(its scores are rounded to 16 bits), so there K x baseline is far above the bound and the rule
never decides; for fp32 both have errors of a few u, while the worst-case bound is 10-100x
looser (gamma_D, gamma_N, a 20-ulp exp allowance), and the baseline is the sharper test.
flash-attention uses K = 2 against a baseline in the kernel's own precision; measured against
ours, correct kernels reach 1.45 x (baseline + floor) in fp32 (0.41 in fp16/bf16), so K = 2
leaves too little room for a kernel with a different exp (CUDA's ex2.approx) or summation
order. K = 4 (DEFAULT_BASELINE_FACTOR) keeps 2.7x headroom and still fails fp32 kernels whose
error the loose bound would admit. The floor, FLOOR_ROUNDINGS u_out in normalised units, is
two output roundings: rounding the exact output alone gives normalised errors up to u_out, so a
baseline that happens to be exact cannot demand the impossible (flash-attention's atol is
likewise twice the rounding noise of its reference), plus twice the typical sqrt(Nk) u_pv
noise of an accumulation in a different order (torch's fp32 math path is 2 ulp off where naive
fp32 attention is exact by coincidence, V constant along the keys). Where outputs are subnormal, relative
resolution is gone, so the floor gains an absolute part: (Nk + 2) subnormal spacings of the
P·V accumulation dtype (each accumulated rounding may cost one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_verify.causes import got_expected, tiny_scale_note
from fa_verify.dtypes import finfo, unit_roundoff
from fa_verify.error_model import DEFAULT_LAMBDA, Bound, error_bound
from fa_verify.errors import AttentionMismatch, InvalidArgumentError
from fa_verify.metrics import ErrorSummary, OutputErrors, lse_errors, measure
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

RULES = ("shape", "finite", "masked_rows", "error_bound", "lse_bound", "baseline")
#: K of the baseline rule: error <= K * naive same-precision error + floor (see module doc).
DEFAULT_BASELINE_FACTOR = 4.0
#: The baseline floor (normalised error): FLOOR_ROUNDINGS * (u_out + sqrt(Nk) u_pv).
FLOOR_ROUNDINGS = 2.0


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one output against the reference and the error model."""

    passed: bool
    #: first rule that failed (one of RULES), None when passed
    rule: str | None
    problem: str
    precision: str
    #: what went wrong for the shape / finite / masked_rows rules ("" otherwise)
    detail: str = ""
    # --- output against the error-model bound ---
    total: int = 0
    over_count: int = 0
    #: max over elements of |out - ref| / bound
    bound_ratio: float = float("nan")
    worst_index: tuple | None = None
    worst_value: float = float("nan")
    worst_reference: float = float("nan")
    worst_reference_bound: float = float("nan")
    worst_error: float = float("nan")
    worst_bound: float = float("nan")
    dominant_term: str | None = None
    #: elements where the error model has no finite bound (the bound rule cannot judge them)
    unbounded_count: int = 0
    # --- LSE against its bound (None when no LSE was given) ---
    lse_total: int = 0
    lse_over_count: int = 0
    lse_bound_ratio: float | None = None
    lse_worst_index: tuple | None = None
    lse_worst_value: float = float("nan")
    lse_worst_reference: float = float("nan")
    lse_worst_error: float = float("nan")
    lse_worst_bound: float = float("nan")
    lse_dominant_term: str | None = None
    # --- baseline: naive same-precision attention on the same inputs ---
    baseline_factor: float | None = None
    baseline_floor: float | None = None
    #: max normalised error of the kernel and of the baseline
    normalised_error: float = float("nan")
    baseline_error: float | None = None
    #: normalised_error / (baseline_factor * baseline_error + baseline_floor); fails above 1
    baseline_ratio: float | None = None
    summary: ErrorSummary | None = field(default=None, repr=False)
    #: the likely cause where the numbers alone mislead (`fa_verify.causes`), "" otherwise
    cause: str = ""

    @property
    def share_over(self) -> float:
        return self.over_count / self.total if self.total else 0.0

    def message(self) -> str:
        """A torch.testing-style report: the rule, how many elements, the worst one and why."""
        if not self.passed:
            head = f"attention output failed rule {self.rule!r}"
        elif self.unbounded_count:
            head = "attention output passes the rules that could judge it"
        else:
            head = "attention output agrees with the reference within the error model"
        lines = [f"{head} ({self.problem}; precision {self.precision})"]
        if self.detail:
            lines.append(self.detail)
        if self.cause:
            lines.append(self.cause)
        if self.worst_index is not None:
            got = got_expected(self.worst_value, self.worst_reference, "reference",
                               f" ± {_g(self.worst_reference_bound, 2)}")
            lines.append(
                f"Mismatched elements: {self.over_count} / {self.total} ({_pct(self.over_count, self.total)}) "
                f"exceed the error-model bound; worst at {list(self.worst_index)}: {got}, "
                f"error {_g(self.worst_error, 2)} = {_r(self.bound_ratio)} × bound {_g(self.worst_bound, 2)} "
                f"(dominant term: {self.dominant_term})")
        if self.unbounded_count:
            lines.append(
                f"No finite bound for {self.unbounded_count} / {self.total} elements: the precision "
                f"model's relative errors reach 1/4 there, where a first-order bound says nothing; "
                f"the error-model rule cannot judge them")
        if self.lse_bound_ratio is not None and self.lse_worst_index is not None:
            lines.append(
                f"LSE: {self.lse_over_count} / {self.lse_total} rows ({_pct(self.lse_over_count, self.lse_total)}) "
                f"exceed the bound; worst at {list(self.lse_worst_index)}: "
                f"{got_expected(self.lse_worst_value, self.lse_worst_reference, 'reference')}, "
                f"error {_g(self.lse_worst_error, 2)} = "
                f"{_r(self.lse_bound_ratio)} × bound {_g(self.lse_worst_bound, 2)} "
                f"(dominant term: {self.lse_dominant_term})")
        if self.baseline_ratio is not None:
            lines.append(
                f"Baseline: max normalised error {_g(self.normalised_error, 2)} vs naive same-precision "
                f"{_g(self.baseline_error, 2)}; allowed {_g(self.baseline_factor, 3)} × baseline + "
                f"floor {_g(self.baseline_floor, 2)} = "
                f"{_g(self.baseline_factor * self.baseline_error + self.baseline_floor, 2)}, "
                f"used {_r(self.baseline_ratio)} of it")
        if self.summary is not None:
            s = self.summary
            lines.append(
                f"Errors: normalised max {_g(s.normalised.max, 2)}, p99 {_g(s.normalised.p99, 2)}, "
                f"median {_g(s.normalised.median, 2)}; abs max {_g(s.abs.max, 2)}, RMSE {_g(s.abs.rmse, 2)}, "
                f"mean {_g(s.abs.mean, 2)}; ULP ({s.dtype}) max {_g(s.ulp.max, 3)}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Plain JSON-ready fields (tuples as lists, the summary as a dict)."""
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, ErrorSummary):
                value = value.as_dict()
            out[name] = value
        out["share_over"] = self.share_over
        return out


def _g(x, digits: int = 4) -> str:
    return "nan" if x is None else f"{float(x):.{digits}g}"


def _r(x) -> str:
    """A ratio: 3 significant digits, 'inf' for NaN/Inf outputs."""
    return f"{float(x):.3g}"


def _pct(n: int, total: int) -> str:
    share = 100.0 * n / total if total else 0.0
    return f"{share:.1f}%" if share == 0 or share >= 0.1 else f"{share:.2g}%"


def _as_numpy(x, name: str):
    """numpy arrays pass through; torch tensors are converted bit-exactly (bf16 included)."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # a torch tensor; imported lazily so torch stays optional
        from fa_verify.backends.torch_arrays import to_numpy
        return to_numpy(x)
    try:
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - report what we got, whatever went wrong
        raise InvalidArgumentError(f"{name} of type {type(x).__name__} is not an array") from exc


def _resolve_precision(precision, problem: AttentionProblem) -> PrecisionModel:
    if precision is None:
        return PrecisionModel.flash(problem.dtype)
    if isinstance(precision, str):
        return PrecisionModel.parse(precision, problem.dtype)
    if not isinstance(precision, PrecisionModel):
        raise InvalidArgumentError(
            f"precision={precision!r} must be a PrecisionModel, a preset name or a spec string")
    return precision


def _index(flat_argmax: int, shape) -> tuple:
    return tuple(int(i) for i in np.unravel_index(flat_argmax, shape))


def _ratio(err: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """err / bound with 0/0 = 0 and x/0 = inf (err is NaN-free: NaN was mapped to inf)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = err / bound
    return np.where((bound == 0) & (err == 0), 0.0, r)


def check_attention(out, problem: AttentionProblem, lse=None, precision=None, reference=None,
                    baseline_factor: float | None = DEFAULT_BASELINE_FACTOR, *,
                    baseline_out=None, accumulation: str = "worst-case",
                    lam: float = DEFAULT_LAMBDA, bound: Bound | None = None) -> Verdict:
    """Judge `out` (and `lse`) of `problem` against the reference under a precision model.

    precision: a PrecisionModel, a preset/spec string for PrecisionModel.parse, or None for
        PrecisionModel.flash(problem.dtype), the most lenient legitimate model.
    reference: a precomputed `fa_verify.oracle.reference(problem)` (computed when None).
    baseline_factor: K of the baseline rule; None skips the baseline (and its naive run).
    baseline_out: a precomputed naive same-precision output, to share it between checks.
    accumulation, lam: forwarded to `error_model.error_bound`; `bound` skips computing it.
    """
    if not isinstance(problem, AttentionProblem):
        raise InvalidArgumentError(f"problem must be an AttentionProblem, got {type(problem).__name__}")
    precision = _resolve_precision(precision, problem)
    if baseline_factor is not None and not (isinstance(baseline_factor, (int, float))
                                            and np.isfinite(baseline_factor) and baseline_factor > 0):
        raise InvalidArgumentError(f"baseline_factor={baseline_factor!r} must be a positive number or None")
    if out is None:
        raise InvalidArgumentError("out is None; pass the kernel's output [B, H, Nq, D]")
    out = _as_numpy(out, "out")
    lse = _as_numpy(lse, "lse")
    info = dict(problem=problem.describe(), precision=precision.describe())

    B, H, Nq, D = problem.out_shape
    if out.shape != problem.out_shape:
        return Verdict(False, "shape", detail=(
            f"out.shape={tuple(out.shape)} but the problem needs [B, H, Nq, D] = {problem.out_shape}"), **info)
    if lse is not None and lse.shape != (B, H, Nq):
        return Verdict(False, "shape", detail=(
            f"lse.shape={tuple(lse.shape)} but the problem needs [B, H, Nq] = {(B, H, Nq)}"), **info)

    if reference is None:
        from fa_verify.oracle import reference as compute_reference
        reference = compute_reference(problem)
    if bound is None:
        bound = error_bound(problem, precision, reference, accumulation=accumulation, lam=lam)
    summary = measure(out, reference, precision.output, lse=lse)
    errors = OutputErrors.compute(out, reference.out, reference.row_scale, precision.output)
    failures = []

    # finite: NaN/Inf where the reference is finite (it always is for out)
    got = out.astype(np.float64)
    bad = ~np.isfinite(got)
    lse64 = None if lse is None else lse.astype(np.float64)
    lse_bad = (np.zeros((B, H, Nq), bool) if lse is None else
               np.isnan(lse64) | (np.isinf(lse64) & np.isfinite(reference.lse)))
    if bad.any() or lse_bad.any():
        parts = []
        if bad.any():
            where = _index(int(np.argmax(bad)), bad.shape)
            parts.append(f"out holds {int(bad.sum())} NaN/Inf values where the reference is finite "
                         f"(first {got[where]} at {list(where)})")
        if lse_bad.any():
            where = _index(int(np.argmax(lse_bad)), lse_bad.shape)
            parts.append(f"lse holds {int(lse_bad.sum())} NaN/Inf values where the reference is finite "
                         f"(first {lse64[where]} at {list(where)})")
        failures.append(("finite", "; ".join(parts)))

    # masked rows: exactly 0 and -inf
    masked = ~np.isfinite(reference.lse)
    if masked.any():
        nonzero = masked[..., None] & (got != 0)
        lse_wrong = (np.zeros_like(masked) if lse is None else masked & ~(lse64 == -np.inf))
        parts = []
        if nonzero.any():
            where = _index(int(np.argmax(nonzero)), nonzero.shape)
            parts.append(f"{int(nonzero.sum())} outputs of fully masked rows are not 0 "
                         f"(first {got[where]} at {list(where)})")
        if lse_wrong.any():
            where = _index(int(np.argmax(lse_wrong)), lse_wrong.shape)
            parts.append(f"{int(lse_wrong.sum())} LSEs of fully masked rows are not -inf "
                         f"(first {lse64[where]} at {list(where)})")
        if parts:
            failures.append(("masked_rows", "; ".join(parts) + " (convention: output 0, LSE -inf)"))

    # the error-model bound, over the rows that attend something
    live = ~masked[..., None] & np.ones(problem.out_shape, bool)
    ratios = np.where(live, _ratio(errors.abs, bound.out), 0.0)
    worst = _index(int(np.argmax(ratios)), ratios.shape)
    over = int(((errors.abs > bound.out) & live).sum())
    fields = dict(
        total=int(live.sum()), over_count=over, bound_ratio=float(ratios[worst]), worst_index=worst,
        worst_value=float(got[worst]), worst_reference=float(reference.out[worst]),
        worst_reference_bound=float(reference.out_bound[worst]), worst_error=float(errors.abs[worst]),
        worst_bound=float(bound.out[worst]), dominant_term=bound.dominant_out_term(worst),
        unbounded_count=int((live & np.isinf(bound.out)).sum()))
    if over:
        failures.append(("error_bound", ""))

    if lse is not None:
        lse_err = np.abs(lse_errors(lse, reference.lse))
        lse_err[np.isnan(lse_err)] = np.inf
        lse_bound_ratios = np.where(~masked, _ratio(lse_err, bound.lse), 0.0)
        lw = _index(int(np.argmax(lse_bound_ratios)), lse_bound_ratios.shape)
        lse_over = int(((lse_err > bound.lse) & ~masked).sum())
        fields.update(
            lse_total=int((~masked).sum()), lse_over_count=lse_over, lse_bound_ratio=float(lse_bound_ratios[lw]),
            lse_worst_index=lw, lse_worst_value=float(lse64[lw]), lse_worst_reference=float(reference.lse[lw]),
            lse_worst_error=float(lse_err[lw]), lse_worst_bound=float(bound.lse[lw]),
            lse_dominant_term=bound.dominant_lse_term(lw))
        if lse_over:
            failures.append(("lse_bound", ""))

    fields["normalised_error"] = float(errors.normalised.max(initial=0.0))
    if baseline_factor is not None:
        if baseline_out is None:
            from fa_verify.backends.naive import naive_attention
            baseline_out, _ = naive_attention(problem, PrecisionModel.same_precision(problem.dtype))
        baseline_out = _as_numpy(baseline_out, "baseline_out")
        base = OutputErrors.compute(baseline_out, reference.out, reference.row_scale, precision.output)
        base_err = float(base.normalised.max(initial=0.0))
        # Two output roundings, plus the typical sqrt(N) rounding noise of an accumulation in
        # another order: a baseline that is exact by coincidence (constant V) must not demand it.
        floor = FLOOR_ROUNDINGS * (unit_roundoff(precision.output)
                                   + np.sqrt(problem.nk) * unit_roundoff(precision.pv_accumulation))
        # Below the normal range, relative resolution is lost: every accumulated rounding may
        # cost a subnormal spacing, whatever the row scale, so the floor also has an absolute part.
        absolute_floor = (problem.nk + 2) * float(finfo(precision.pv_accumulation).smallest_subnormal)
        allowed = (baseline_factor * base_err + floor) * reference.row_scale + absolute_floor
        fields.update(baseline_factor=float(baseline_factor), baseline_floor=floor,
                      baseline_error=base_err,
                      baseline_ratio=float(np.max(_ratio(errors.abs, allowed), initial=0.0)))
        if fields["baseline_ratio"] > 1:
            failures.append(("baseline", ""))

    order = {name: n for n, name in enumerate(RULES)}
    failures.sort(key=lambda item: order[item[0]])
    rule = failures[0][0] if failures else None
    detail = "; ".join(d for _, d in failures if d)
    cause = tiny_scale_note(errors, got, reference.out, precision.output) if failures else ""
    return Verdict(passed=not failures, rule=rule, detail=detail, summary=summary, cause=cause, **info, **fields)


def assert_attention_close(out, problem: AttentionProblem, lse=None, precision=None, **kwargs) -> Verdict:
    """Raise AttentionMismatch (carrying the Verdict) unless `out` passes `check_attention`."""
    verdict = check_attention(out, problem, lse=lse, precision=precision, **kwargs)
    if not verdict.passed:
        raise AttentionMismatch(verdict.message(), verdict)
    return verdict
