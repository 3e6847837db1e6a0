"""The verdict: does a kernel's output agree with the reference as its precision model says?

Rules, checked in this order; the verdict names the first that fails:

1. "shape"        out is [B, H, Nq, D] (and LSE [B, H, Nq]); nothing else can be judged otherwise.
2. "finite"       no NaN or Inf where the reference is finite.
3. "masked_rows"  fully masked rows give exactly 0 and LSE -inf (fa_verify's convention).
4. "error_bound"  |out - ref| <= bound.out at every element (`error_model.error_bound`).
5. "lse_bound"    |lse - ref| <= bound.lse at every row, when the kernel returned an LSE.
6. "ensemble"     max normalised error <= K x the largest of an ensemble of honest
                  implementations of the same precision model on the same inputs + floor
                  (`fa_verify.honest_ensemble`).

Why the bound decides and the ensemble rule is a second opinion: the bound is derived per
element from the precision model and holds for every correct kernel of that model (measured on
the tests' inputs: torch's CPU kernels and the numpy FA2 model use at most 0.54 of the default
flash-model bound; only where output rounding is the whole bound, at rounding midpoints and
subnormal outputs, can a correct kernel come close to 1), so exceeding it is a finding in
itself. For fp32 the worst-case bound is 10-100x looser than real errors (gamma_D, gamma_N, a
20-ulp exp allowance), and the ensemble rule is the sharper test; for fp16/bf16 both are close.

The ensemble rule: E = max over the members of `honest_ensemble.MEMBERS` (forward, reversed and
pairwise sums, FMA or not, two-pass or online softmax over key tiles of 16 and 64, exp or FA2's
exp2 fold, the row sum of P before or after its rounding) of their max normalised error
against the reference. The members round every operation explicitly in numpy, so E is the same
number on every machine: no BLAS kernel, thread count or SIMD exp decides it. (The rule it
replaces, 4 x naive attention computed with BLAS matmuls, rejected correct fp32 kernels on CPUs
where OpenBLAS picked a GEMM that happened to round 4x better.) A correct kernel is one more
implementation of the same kind: under the model of independent rounding errors it errs like
the members, so its max error exceeds max(members) only in the tail, and K
(DEFAULT_ENSEMBLE_FACTOR) covers that tail and what no member models (an exp with a few ulp of
error such as CUDA's __expf, a score rounded to a wider dtype). K was chosen from measurements
(tests/measure_ensemble_ratios.py, README "The error model and verdicts"): over the built-in
backends and tests/fixtures/honest_variants.py, under four OpenBLAS core types with 1 or 2 threads
and the ci and thorough profiles, the smallest K each judged example needed (its error beyond
the floor over E) never exceeded 1 — correct kernels are no worse than the worst member —
so K = 4 leaves a factor of 4 for what was not measured. The floor, FLOOR_ROUNDINGS (u_out + sqrt(Nk) u_pv) in normalised
units, keeps the rule from demanding the impossible where every member happens to be exact
(V constant along the keys): two output roundings plus twice the typical sqrt(Nk) u_pv noise of
an accumulation in another order. Where outputs are subnormal, relative resolution is gone, so
the allowance gains an absolute part: (Nk + 2) subnormal spacings of the P·V accumulation dtype
(each accumulated rounding may cost one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa_verify.causes import got_expected, tiny_scale_note
from fa_verify.dtypes import finfo, numpy_dtype, unit_roundoff
from fa_verify.error_model import DEFAULT_LAMBDA, Bound, error_bound, flushed_output_error
from fa_verify.honest_ensemble import EnsembleErrors, ensemble_errors
from fa_verify.errors import AttentionMismatch, InvalidArgumentError
from fa_verify.metrics import ErrorSummary, OutputErrors, lse_errors, measure
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

RULES = ("shape", "finite", "masked_rows", "error_bound", "lse_bound", "ensemble")
#: K of the ensemble rule: error <= K * max honest-ensemble error + floor (see module doc).
DEFAULT_ENSEMBLE_FACTOR = 4.0
#: The ensemble rule's floor (normalised error): FLOOR_ROUNDINGS * (u_out + sqrt(Nk) u_pv).
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
    #: max normalised error of the output
    normalised_error: float = float("nan")
    # --- ensemble: honest implementations of the same precision model on the same inputs ---
    ensemble_factor: float | None = None
    #: max over the members of their max normalised error, and the member that reached it
    ensemble_error: float | None = None
    ensemble_member: str | None = None
    #: every member's max normalised error
    ensemble_errors: dict | None = None
    #: query rows the members ran on, of all rows (large problems: a subset)
    ensemble_rows: int | None = None
    total_rows: int | None = None
    #: the floor's terms (normalised): u_out, sqrt(Nk) and u_pv; the absolute floor
    floor_u_out: float | None = None
    floor_sqrt_nk: float | None = None
    floor_u_pv: float | None = None
    ensemble_floor: float | None = None
    absolute_floor: float | None = None
    #: max over elements of |out - ref| / ((K * E + floor) * row scale + absolute floor); fails above 1
    ensemble_ratio: float | None = None
    #: where that max is, and the error, row scale and allowance there
    ensemble_worst_index: tuple | None = None
    ensemble_worst_error: float | None = None
    ensemble_worst_row_scale: float | None = None
    ensemble_worst_allowed: float | None = None
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
        # After a shape, finiteness or masked-row failure, a measurement with nothing over its bound
        # is noise ("0 / 1 exceed ... error 0 = 0 x bound 0"): shown only when something exceeds.
        quiet = not self.passed and self.rule in ("shape", "finite", "masked_rows")
        if self.worst_index is not None and not (quiet and not self.over_count):
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
        if self.lse_bound_ratio is not None and self.lse_worst_index is not None and not (quiet and not self.lse_over_count):
            lines.append(
                f"LSE: {self.lse_over_count} / {self.lse_total} rows ({_pct(self.lse_over_count, self.lse_total)}) "
                f"exceed the bound; worst at {list(self.lse_worst_index)}: "
                f"{got_expected(self.lse_worst_value, self.lse_worst_reference, 'reference')}, "
                f"error {_g(self.lse_worst_error, 2)} = "
                f"{_r(self.lse_bound_ratio)} × bound {_g(self.lse_worst_bound, 2)} "
                f"(dominant term: {self.lse_dominant_term})")
        if self.ensemble_ratio is not None:
            lines.append(self._ensemble_line())
        if self.summary is not None:
            s = self.summary
            lines.append(
                f"Errors: normalised max {_g(s.normalised.max, 2)}, p99 {_g(s.normalised.p99, 2)}, "
                f"median {_g(s.normalised.median, 2)}; abs max {_g(s.abs.max, 2)}, RMSE {_g(s.abs.rmse, 2)}, "
                f"mean {_g(s.abs.mean, 2)}; ULP ({s.dtype}) max {_g(s.ulp.max, 3)}")
        return "\n".join(lines)

    def _ensemble_line(self) -> str:
        """The ensemble rule with every term of its allowance, so that "used X" can be redone by hand."""
        rows = ("" if self.ensemble_rows == self.total_rows else
                f", on the {self.ensemble_rows} of {self.total_rows} rows with the largest bounds and spread evenly")
        per_row = self.ensemble_factor * self.ensemble_error + self.ensemble_floor
        if self.ensemble_member is None:
            return (f"Ensemble rule: not applied: every one of the {len(self.ensemble_errors)} honest "
                    f"implementations of this precision model overflows on these inputs")
        return (f"Ensemble rule: max normalised error {_g(self.normalised_error)}; allowed per element "
                f"(K × E + floor) × row scale + absolute floor, with K = {_g(self.ensemble_factor)}, "
                f"E = {_g(self.ensemble_error)} (the largest max normalised error of "
                f"{len(self.ensemble_errors)} honest implementations of this precision model, reached by "
                f"{self.ensemble_member!r}{rows}), floor = {_g(FLOOR_ROUNDINGS)} × (u_out {_g(self.floor_u_out)} "
                f"+ √Nk {_g(self.floor_sqrt_nk)} × u_pv {_g(self.floor_u_pv)}) = {_g(self.ensemble_floor)}, "
                f"so K × E + floor = {_g(per_row)}; absolute floor {_g(self.absolute_floor)}; "
                f"used {_r(self.ensemble_ratio)} of it at {list(self.ensemble_worst_index)}: error "
                f"{_g(self.ensemble_worst_error)} against {_g(per_row)} × row scale "
                f"{_g(self.ensemble_worst_row_scale)} + {_g(self.absolute_floor)} = "
                f"{_g(self.ensemble_worst_allowed)}")

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


def _first(bad: np.ndarray, values: np.ndarray) -> str:
    """"(first X at [i, ...])": the first element of `values` where `bad` holds, for messages."""
    where = _index(int(np.argmax(bad)), bad.shape)
    return f"(first {values[where]} at {list(where)})"


def _ratio(err: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """err / bound with 0/0 = 0 and x/0 = inf (err is NaN-free: NaN was mapped to inf)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = err / bound
    return np.where((bound == 0) & (err == 0), 0.0, r)


def check_attention(out, problem: AttentionProblem, lse=None, precision=None, reference=None,
                    ensemble_factor: float | None = DEFAULT_ENSEMBLE_FACTOR, *,
                    ensemble: EnsembleErrors | None = None, accumulation: str = "worst-case",
                    lam: float = DEFAULT_LAMBDA, bound: Bound | None = None) -> Verdict:
    """Judge `out` (and `lse`) of `problem` against the reference under a precision model.

    precision: a PrecisionModel, a preset/spec string for PrecisionModel.parse, or None for
        PrecisionModel.flash(problem.dtype): FlashAttention's model (fp32 scores and accumulation,
        P rounded to the input dtype).
    reference: a precomputed `fa_verify.oracle.reference(problem)` (computed when None).
    ensemble_factor: K of the ensemble rule; None skips the rule (and running the ensemble).
    ensemble: precomputed `honest_ensemble.ensemble_errors(problem, precision, reference, ...)`,
        to share it between checks of one problem and precision model.
    accumulation, lam: forwarded to `error_model.error_bound`; `bound` skips computing it.
    """
    if not isinstance(problem, AttentionProblem):
        raise InvalidArgumentError(f"problem must be an AttentionProblem, got {type(problem).__name__}")
    precision = _resolve_precision(precision, problem)
    if ensemble_factor is not None and not (isinstance(ensemble_factor, (int, float))
                                            and np.isfinite(ensemble_factor) and ensemble_factor > 0):
        raise InvalidArgumentError(f"ensemble_factor={ensemble_factor!r} must be a positive number or None")
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
    if out.dtype != numpy_dtype(precision.output):  # a wider out would be judged on values the kernel never stored
        return Verdict(False, "shape", detail=(
            f"out.dtype={out.dtype} but the precision model ({precision.describe()}) stores the output in "
            f"{precision.output}: pass the output as the kernel stores it, or declare the dtype it stores in the "
            "model (precision='...,out=fp32' for an fp32 output)"), **info)

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
            parts.append(f"out holds {int(bad.sum())} NaN/Inf values where the reference is finite "
                         f"{_first(bad, got)}")
        if lse_bad.any():
            parts.append(f"lse holds {int(lse_bad.sum())} NaN/Inf values where the reference is finite "
                         f"{_first(lse_bad, lse64)}")
        failures.append(("finite", "; ".join(parts)))

    # masked rows: exactly 0 and -inf
    masked = ~np.isfinite(reference.lse)
    if masked.any():
        nonzero = masked[..., None] & (got != 0)
        lse_wrong = (np.zeros_like(masked) if lse is None else masked & ~(lse64 == -np.inf))
        parts = []
        if nonzero.any():
            parts.append(f"{int(nonzero.sum())} outputs of fully masked rows are not 0 {_first(nonzero, got)}")
        if lse_wrong.any():
            parts.append(f"{int(lse_wrong.sum())} LSEs of fully masked rows are not -inf {_first(lse_wrong, lse64)}")
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
    if ensemble_factor is not None:
        fields.update(_ensemble_rule(errors, problem, precision, reference, bound, ensemble_factor, ensemble))
        if fields["ensemble_ratio"] > 1:
            failures.append(("ensemble", ""))

    order = {name: n for n, name in enumerate(RULES)}
    failures.sort(key=lambda item: order[item[0]])
    rule = failures[0][0] if failures else None
    detail = "; ".join(d for _, d in failures if d)
    cause = tiny_scale_note(errors, got, reference.out, precision.output) if failures else ""
    return Verdict(passed=not failures, rule=rule, detail=detail, summary=summary, cause=cause, **info, **fields)


def _ensemble_rule(errors: OutputErrors, problem, precision, reference, bound, factor, ensemble) -> dict:
    """The ensemble rule's fields: every term of the allowance, the ratio and where it peaks."""
    if ensemble is None:
        ensemble = ensemble_errors(problem, precision, reference, bound)
    u_out, u_pv = unit_roundoff(precision.output), unit_roundoff(precision.pv_accumulation)
    sqrt_nk = float(np.sqrt(problem.nk))
    # Two output roundings, plus the typical sqrt(N) rounding noise of an accumulation in
    # another order: members that are exact by coincidence (constant V) must not demand it.
    floor = FLOOR_ROUNDINGS * (u_out + sqrt_nk * u_pv)
    # Below the normal range, relative resolution is lost: every accumulated rounding may
    # cost a subnormal spacing, whatever the row scale, so the floor also has an absolute part.
    absolute_floor = (problem.nk + 2) * float(finfo(precision.pv_accumulation).smallest_subnormal)
    if precision.ftz:  # declared flush-to-zero: what flushing V and the output may cost (no member flushes)
        absolute_floor += flushed_output_error(precision)
    row_scale = np.broadcast_to(reference.row_scale, problem.out_shape)
    allowed = (factor * ensemble.max_error + floor) * row_scale + absolute_floor
    ratios = _ratio(errors.abs, allowed)
    worst = _index(int(np.argmax(ratios)), ratios.shape)
    return dict(ensemble_factor=float(factor), ensemble_error=ensemble.max_error,
                ensemble_member=ensemble.worst_member, ensemble_errors=dict(ensemble.errors),
                ensemble_rows=ensemble.rows, total_rows=ensemble.total_rows,
                floor_u_out=u_out, floor_sqrt_nk=sqrt_nk, floor_u_pv=u_pv, ensemble_floor=floor,
                absolute_floor=absolute_floor, ensemble_ratio=float(ratios[worst]), ensemble_worst_index=worst,
                ensemble_worst_error=float(errors.abs[worst]), ensemble_worst_row_scale=float(row_scale[worst]),
                ensemble_worst_allowed=float(allowed[worst]))


def assert_attention_close(out, problem: AttentionProblem, lse=None, precision=None, **kwargs) -> Verdict:
    """Raise AttentionMismatch (carrying the Verdict) unless `out` passes `check_attention`."""
    verdict = check_attention(out, problem, lse=lse, precision=precision, **kwargs)
    if not verdict.passed:
        raise AttentionMismatch(verdict.message(), verdict)
    return verdict
