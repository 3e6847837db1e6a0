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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from fa_verify.backward_error_model import GradientBound, gradient_error_bound
from fa_verify.causes import got_expected
from fa_verify.dtypes import numpy_dtype
from fa_verify.errors import InvalidArgumentError
from fa_verify.oracle.backward import GradientReference, gradient_reference
from fa_verify.problem import AttentionProblem
from fa_verify.verdict import _as_numpy, _first, _g, _index, _pct, _r, _ratio, _resolve_precision

RULES = ("shape", "finite", "structural_zeros", "error_bound")


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
        return "\n".join(lines)

    def as_dict(self) -> dict:
        out = asdict(self)
        for check in out["tensors"].values():
            check["worst_index"] = list(check["worst_index"])
        out["worst_ratio"] = self.worst_ratio
        return out


def _shapes(problem) -> dict:
    shapes = {"dq": problem.q.shape, "dk": problem.k.shape, "dv": problem.v.shape}
    if problem.sinks is not None:
        shapes["dsinks"] = (problem.heads,)
    return shapes


def check_gradients(grads: dict, problem: AttentionProblem, dout, *, out_given, lse_given, dlse=None,
                    precision=None, reference: GradientReference | None = None,
                    bound: GradientBound | None = None, accumulation: str = "worst-case") -> GradientVerdict:
    """Judge `grads` ({"dq", "dk", "dv"[, "dsinks"]}) of `problem` for upstream `dout` (and `dlse`),
    computed by a backward handed `out_given` and `lse_given` by its forward.

    precision: a PrecisionModel, a preset/spec string, or None for FA2's (P and dS rounded to the
        input dtype, fp32 accumulation); reference, bound: precomputed, to share between checks."""
    if not isinstance(problem, AttentionProblem):
        raise InvalidArgumentError(f"problem must be an AttentionProblem, got {type(problem).__name__}")
    if not isinstance(grads, dict):
        raise InvalidArgumentError(f"grads must be a dict of 'dq', 'dk', 'dv' (and 'dsinks'), got {type(grads).__name__}")
    precision = _resolve_precision(precision, problem)
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
    order = {name: n for n, name in enumerate(RULES)}
    failures.sort(key=lambda item: order[item[0]])
    return GradientVerdict(passed=not failures, rule=failures[0][0] if failures else None,
                           detail="; ".join(d for _, d in failures if d), tensors=checks, **info)


def _structural_zeros(problem) -> dict:
    """tensor -> boolean mask of the elements that are exactly 0 whatever the inputs."""
    B, H, Nq, D = problem.out_shape
    seen = problem.mask.any(axis=0)  # keys some row attends
    empty_rows = problem.masked_rows
    keys = np.broadcast_to(~seen[None, None, :, None], problem.k.shape)
    return {"dq": np.broadcast_to(empty_rows[None, None, :, None], problem.out_shape), "dk": keys, "dv": keys}
