"""The gradients' verdict: do a backward pass's dq, dk, dv (and dsinks) agree with the exact
gradients as its precision model says?

Rules, checked in this order; the verdict names the first that fails:

1. "shape"        every gradient has its tensor's shape (dq like q, dk and dv like k, dsinks [H]
                  when the problem has sinks) and dq, dk, dv the precision model's output dtype.
2. "finite"       no NaN or Inf where the reference is finite.
3. "structural_zeros" rows that see no key have dq exactly 0, keys that no row sees have dk and
                  dv exactly 0 (flash-attn's convention; exact in any arithmetic).
4. "error_bound"  |gradient - exact| <= the bound of `backward_error_model.gradient_error_bound`
                  at every element of every tensor.
5. "ensemble"     per tensor, |gradient - exact| <= (K x E + floor) x magnitude + absolute floor
                  at every element, E the largest max normalised error of the honest members of
                  `backward_ensemble.MEMBERS` on the same inputs (`backward_ensemble`: errors
                  normalised by the magnitude of what each gradient sums).

As for the forward (`fa_verify.verdict`), the bound decides and the ensemble rule is a second
opinion: the bound holds for every correct kernel of the model whatever its order of summation,
so for fp32 it is loose (gamma_n of the GEMMs' magnitudes); the ensemble asks whether the kernel
errs like one more honest implementation. K = DEFAULT_GRADIENT_ENSEMBLE_FACTOR, chosen from
tests/measure_backward_ensemble_ratios.py (docs/numerics.md, "The backward's ensemble rule").
The floor, GRADIENT_FLOOR_ROUNDINGS x (u_out + sqrt(n) u_pv) in normalised units with n the
summed length (Nk for dq, G Nq for dk and dv, B Nq for dsinks; dsinks stored in float32), keeps
the rule from demanding the impossible where every member happens to be exact; the absolute
floor, one subnormal spacing of the stored dtype plus (n + 2) of the accumulation dtype, is
where relative resolution is gone. With a declared flush-to-zero (`precision.ftz`) the allowance
also gains the bound's flush_to_zero term: no member flushes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from fa_verify.backward_ensemble import GradientEnsemble, absolute_floor, gradient_ensemble_errors, summed_length
from fa_verify.backward_error_model import GradientBound, gradient_error_bound
from fa_verify.causes import got_expected
from fa_verify.dtypes import numpy_dtype, unit_roundoff
from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle.backward import GradientReference, gradient_reference
from fa_verify.problem import AttentionProblem
from fa_verify.verdict import _as_numpy, _first, _g, _index, _pct, _r, _ratio, _resolve_precision

RULES = ("shape", "finite", "structural_zeros", "error_bound", "ensemble")
#: K of the ensemble rule: error <= (K E + floor) x magnitude + absolute floor (module doc).
DEFAULT_GRADIENT_ENSEMBLE_FACTOR = 4.0
#: The ensemble rule's floor (normalised): GRADIENT_FLOOR_ROUNDINGS (u_out + sqrt(n) u_pv).
GRADIENT_FLOOR_ROUNDINGS = 2.0


@dataclass(frozen=True)
class TensorCheck:
    """One gradient against its bound: the worst element and how many exceed."""

    tensor: str
    total: int
    over_count: int
    #: max over elements of |gradient - reference| / bound
    ratio: float
    worst_index: tuple
    value: float
    reference: float
    error: float
    bound: float
    dominant_term: str
    #: elements without a finite bound (first-order analysis fails there)
    unbounded_count: int = 0
    #: the first rule this tensor fails (one of RULES after "shape"), None when it passes them
    rule: str | None = None

    def line(self) -> str:
        return (f"{self.tensor}: {self.over_count} / {self.total} ({_pct(self.over_count, self.total)}) exceed the "
                f"bound; worst at {list(self.worst_index)}: {got_expected(self.value, self.reference, 'reference')}, "
                f"error {_g(self.error, 3)} = {_r(self.ratio)} × bound {_g(self.bound, 3)} "
                f"(dominant term: {self.dominant_term})")


@dataclass(frozen=True)
class EnsembleCheck:
    """One gradient against the honest ensemble: every term of its allowance, and the worst element."""

    tensor: str
    factor: float
    #: E: the largest max normalised error of the members, and the member that reached it
    ensemble_error: float
    member: str | None
    members: int
    #: elements of the tensor's rows (dq) or keys (dk, dv) the members ran on, of all
    evaluated: int
    total: int
    #: the floor's terms: u_out, n (the summed length), u_pv; the floor (normalised) and absolute floor
    u_out: float
    n: int
    u_pv: float
    floor: float
    absolute_floor: float
    #: the gradient's max normalised error (|gradient - exact| / magnitude)
    normalised_error: float
    #: max over elements of |gradient - exact| / ((K E + floor) magnitude + absolute floor)
    ratio: float
    worst_index: tuple
    error: float
    magnitude: float
    allowed: float
    #: with a declared flush-to-zero, the bound's flush_to_zero term at the worst element, added
    #: to the allowance: no member flushes
    flushed: float = 0.0

    def line(self) -> str:
        if self.member is None:
            return (f"Ensemble rule, {self.tensor}: not applied: every one of the {self.members} honest "
                    "implementations of this precision model overflows on these inputs")
        part = "" if self.evaluated == self.total else (
            f", on the {self.evaluated} of {self.total} {'rows' if self.tensor == 'dq' else 'keys'} with the largest "
            "bounds and spread evenly")
        per = self.factor * self.ensemble_error + self.floor
        return (f"Ensemble rule, {self.tensor}: max normalised error {_g(self.normalised_error)}; allowed per element "
                f"(K × E + floor) × magnitude + absolute floor, with K = {_g(self.factor)}, E = "
                f"{_g(self.ensemble_error)} (the largest of {self.members} honest implementations, reached by "
                f"{self.member!r}{part}), floor = {_g(GRADIENT_FLOOR_ROUNDINGS)} × (u_out {_g(self.u_out)} + "
                f"√n {_g(np.sqrt(self.n))} × u_pv {_g(self.u_pv)}) = {_g(self.floor)}, so K × E + floor = {_g(per)}; "
                f"absolute floor {_g(self.absolute_floor)}; used {_r(self.ratio)} of it at {list(self.worst_index)}: "
                f"error {_g(self.error)} against {_g(per)} × magnitude {_g(self.magnitude)} + "
                f"{_g(self.absolute_floor)}" + (f" + flush-to-zero's term {_g(self.flushed)}" if self.flushed else "")
                + f" = {_g(self.allowed)}")


@dataclass(frozen=True)
class GradientVerdict:
    """Outcome of checking a backward pass's gradients."""

    passed: bool
    #: first rule that failed (one of RULES), None when passed
    rule: str | None
    problem: str
    precision: str
    #: what went wrong for the shape / finite / structural_zeros rules ("" otherwise)
    detail: str = ""
    #: tensor name -> TensorCheck (empty when the shape rule failed)
    tensors: dict = field(default_factory=dict)
    #: tensor name -> EnsembleCheck (empty when the rule was skipped or the shape rule failed)
    ensemble: dict = field(default_factory=dict)

    @property
    def ensemble_ratio(self) -> float:
        """The largest share of the ensemble rule's allowance used over every tensor (nan when not applied)."""
        return max((c.ratio for c in self.ensemble.values()), default=float("nan"))

    @property
    def worst_ratio(self) -> float:
        """The largest error / bound over every tensor (nan when nothing was compared)."""
        return max((c.ratio for c in self.tensors.values()), default=float("nan"))

    def message(self) -> str:
        """The rule, then per tensor how many elements exceed, the worst one and its dominant term."""
        unbounded = [c for c in self.tensors.values() if c.unbounded_count]
        judged = ("gradients pass the rules that could judge them" if unbounded
                  else "gradients agree with the exact gradients within the error model")
        head = judged if self.passed else f"gradients failed rule {self.rule!r}"
        lines = [f"{head} ({self.problem}; precision {self.precision})"] + ([self.detail] if self.detail else [])
        checks = sorted(self.tensors.values(), key=lambda c: -c.ratio)
        lines.extend(c.line() for c in checks)
        lines.extend(f"No finite bound for {c.unbounded_count} / {c.total} elements of {c.tensor}: relative errors "
                     "of the precision model reach 1/4 there, where a first-order bound says nothing"
                     for c in unbounded)
        lines.extend(c.line() for c in sorted(self.ensemble.values(), key=lambda c: -c.ratio))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        out = asdict(self)
        for check in list(out["tensors"].values()) + list(out["ensemble"].values()):
            check["worst_index"] = list(check["worst_index"])
        out["ensemble_ratio"] = self.ensemble_ratio
        out["worst_ratio"] = self.worst_ratio
        return out


def _shapes(problem) -> dict:
    shapes = {"dq": problem.q.shape, "dk": problem.k.shape, "dv": problem.v.shape}
    if problem.sinks is not None:
        shapes["dsinks"] = (problem.heads,)
    return shapes


def check_gradients(grads: dict, problem: AttentionProblem, dout, *, out_given, lse_given, dlse=None,
                    precision=None, reference: GradientReference | None = None,
                    bound: GradientBound | None = None, accumulation: str = "worst-case",
                    ensemble_factor: float | None = DEFAULT_GRADIENT_ENSEMBLE_FACTOR,
                    ensemble: GradientEnsemble | None = None) -> GradientVerdict:
    """Judge `grads` ({"dq", "dk", "dv"[, "dsinks"]}) of `problem` for upstream `dout` (and `dlse`),
    computed by a backward handed `out_given` and `lse_given` by its forward.

    precision: a PrecisionModel, a preset/spec string, or None for FA2's (P and dS rounded to the
        input dtype, fp32 accumulation); reference, bound: precomputed, to share between checks.
    ensemble_factor: K of the ensemble rule; None skips the rule (and running the members).
    ensemble: precomputed `backward_ensemble.gradient_ensemble_errors(...)` for these inputs."""
    if not isinstance(problem, AttentionProblem):
        raise InvalidArgumentError(f"problem must be an AttentionProblem, got {type(problem).__name__}")
    if not isinstance(grads, dict):
        raise InvalidArgumentError(f"grads must be a dict of 'dq', 'dk', 'dv' (and 'dsinks'), got {type(grads).__name__}")
    precision = _resolve_precision(precision, problem)
    if ensemble_factor is not None and not (isinstance(ensemble_factor, (int, float))
                                            and np.isfinite(ensemble_factor) and ensemble_factor > 0):
        raise InvalidArgumentError(f"ensemble_factor={ensemble_factor!r} must be a positive number or None")
    info = dict(problem=problem.describe(), precision=precision.describe())
    shapes = _shapes(problem)
    got = {}
    for name, shape in shapes.items():
        if grads.get(name) is None:
            return GradientVerdict(False, "shape", detail=f"{name} is missing: the problem needs {name} {list(shape)}",
                                   **info)
        x = _as_numpy(grads[name], name)
        if x.shape != shape:
            return GradientVerdict(False, "shape", detail=f"{name}.shape={tuple(x.shape)} but the problem needs "
                                   f"{shape}", **info)
        if name != "dsinks" and x.dtype != numpy_dtype(precision.output):
            return GradientVerdict(False, "shape", detail=(
                f"{name}.dtype={x.dtype} but the precision model ({precision.describe()}) stores gradients in "
                f"{precision.output}: pass them as the kernel stores them, or declare the dtype in the model"), **info)
        got[name] = x.astype(np.float64)

    if reference is None:
        reference = gradient_reference(problem, dout, dlse)
    if bound is None:
        bound = gradient_error_bound(problem, dout, precision, reference, out_given=out_given, lse_given=lse_given,
                                     dlse=dlse, accumulation=accumulation)
    failures = []
    refs = reference.tensors()

    bad = {name: ~np.isfinite(x) & np.isfinite(refs[name][0]) for name, x in got.items()}
    parts = [f"{name} holds {int(b.sum())} NaN/Inf values where the exact gradient is finite {_first(b, got[name])}"
             for name, b in bad.items() if b.any()]
    if parts:
        failures.append(("finite", "; ".join(parts)))

    zeros = _structural_zeros(problem)
    parts = []
    tensor_rule = {name: "finite" for name, b in bad.items() if b.any()}
    for name, where in zeros.items():
        nonzero = where & (got[name] != 0)
        if nonzero.any():
            tensor_rule.setdefault(name, "structural_zeros")
            parts.append(f"{name} is not 0 at {int(nonzero.sum())} elements of rows or keys that attend nothing "
                         f"{_first(nonzero, got[name])}")
    if parts:
        failures.append(("structural_zeros", "; ".join(parts) + " (convention: exactly 0)"))

    checks = {}
    for name, x in got.items():
        ref, allowed = refs[name][0], bound.bound(name)
        err = np.abs(x - ref)
        err[np.isnan(err)] = np.inf
        ratios = _ratio(err, allowed)
        w = _index(int(np.argmax(ratios)), ratios.shape)
        over = int((err > allowed).sum())
        checks[name] = TensorCheck(
            tensor=name, total=int(err.size), over_count=over, ratio=float(ratios[w]), worst_index=w,
            value=float(x[w]), reference=float(ref[w]), error=float(err[w]), bound=float(allowed[w]),
            dominant_term=bound.dominant_term(name, w), unbounded_count=int(np.isinf(allowed).sum()),
            rule=tensor_rule.get(name, "error_bound" if over else None))
        if over:
            failures.append(("error_bound", ""))
    ensemble_checks = {}
    if ensemble_factor is not None:
        if ensemble is None:
            ensemble = gradient_ensemble_errors(problem, dout, precision, reference, out_given=out_given,
                                                lse_given=lse_given, dlse=dlse, bound=bound)
        ensemble_checks = {name: _ensemble_check(name, x, refs[name][0], problem, precision, ensemble, ensemble_factor,
                                                 bound.terms[name]["flush_to_zero"] if precision.ftz else 0.0)
                           for name, x in got.items()}
        if any(c.ratio > 1 for c in ensemble_checks.values()):
            failures.append(("ensemble", ""))
    order = {name: n for n, name in enumerate(RULES)}
    failures.sort(key=lambda item: order[item[0]])
    return GradientVerdict(passed=not failures, rule=failures[0][0] if failures else None,
                           detail="; ".join(d for _, d in failures if d), tensors=checks,
                           ensemble=ensemble_checks, **info)


def _ensemble_check(tensor, got, ref, problem, precision, ensemble: GradientEnsemble, factor,
                    flushed=0.0) -> EnsembleCheck:
    """The ensemble rule on one gradient (module doc): every term of its allowance, the worst element;
    `flushed`: what a declared flush-to-zero may cost there (the bound's term), added."""
    stored = "fp32" if tensor == "dsinks" else precision.output
    u_out, u_pv = unit_roundoff(stored), unit_roundoff(precision.pv_accumulation)
    n = summed_length(problem, tensor)
    floor = GRADIENT_FLOOR_ROUNDINGS * (u_out + np.sqrt(n) * u_pv)
    absolute = absolute_floor(problem, precision, tensor)
    magnitude = ensemble.magnitudes.of(tensor)
    E = ensemble.max_error(tensor)
    flushed = np.broadcast_to(flushed, magnitude.shape)
    allowed = (factor * E + floor) * magnitude + absolute + flushed
    err = np.abs(got - ref)
    err[np.isnan(err)] = np.inf
    ratios = _ratio(err, allowed)
    w = _index(int(np.argmax(ratios)), ratios.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        normalised = np.where(magnitude > 0, err / magnitude, np.where(err > 0, np.inf, 0.0))
    evaluated, total = ((ensemble.rows, ensemble.total_rows) if tensor == "dq" else
                        (ensemble.keys, ensemble.total_keys) if tensor in ("dk", "dv") else (1, 1))
    return EnsembleCheck(tensor=tensor, factor=float(factor), ensemble_error=E, member=ensemble.worst_member(tensor),
                         members=len(ensemble.errors[tensor]), evaluated=evaluated, total=total, u_out=u_out, n=n,
                         u_pv=u_pv, floor=floor, absolute_floor=absolute,
                         normalised_error=float(np.max(normalised, initial=0.0)),
                         ratio=float(ratios[w]) if np.isfinite(E) else 0.0, worst_index=w, error=float(err[w]),
                         magnitude=float(magnitude[w]), allowed=float(allowed[w]), flushed=float(flushed[w]))


def _structural_zeros(problem) -> dict:
    """tensor -> boolean mask of the elements that are exactly 0 whatever the inputs."""
    B, H, Nq, D = problem.out_shape
    seen = problem.mask.any(axis=0)  # keys some row attends
    empty_rows = problem.masked_rows
    keys = np.broadcast_to(~seen[None, None, :, None], problem.k.shape)
    return {"dq": np.broadcast_to(empty_rows[None, None, :, None], problem.out_shape), "dk": keys, "dv": keys}
