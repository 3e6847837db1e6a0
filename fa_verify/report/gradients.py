"""A backward sweep point's records: one per gradient (dq, dk, dv; dsinks with sinks).

The runner (`runner.run_sweep`) asks a point's comparators for each backend's records; for a
backward problem (`fa_verify.backward.BackwardProblem`) they are these. Per point, once: the
certified gradients (`oracle.backward.gradient_reference`), per precision model the gradients'
error bound (`backward_error_model`), the exact gradients rounded to the dtype (the floor, as
for the forward's "× rounded") and the eager same-precision gradients (every op rounded to the
dtype: `judge.gradient_rules.eager_gradients`, the baseline of flash-attention's and PyTorch's
rules; the naive-attention comparison of the forward). Per backend run: `check_gradients` judges
the run, and each gradient becomes a Record of that tensor (`Record.tensor`): its errors in the
forward's three views, its own bound ratio, worst element and dominant term, the first rule it
fails, and whether each of the rules others use (`judge.gradient_rules.GRADIENT_RULES`) accepts it
(`extra[RULES_KEY]`).

The normalised view divides a gradient's error by the magnitude of the terms it is a sum of,
the analogue of the forward's row scale sum_j p_ij |v_jc| (`magnitudes`): robust where a gradient
cancels to ~0 (a row that sees one key has dS = 0 exactly, and its dq is rounding noise); ULPs
count where |exact| >= NOT_TINY x that magnitude, as for the output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fa_verify.backward_error_model import gradient_error_bound
from fa_verify.backward_verdict import check_gradients
from fa_verify.dtypes import round_to
from fa_verify.metrics import OutputErrors
from fa_verify.oracle.backward import gradient_reference
from fa_verify.report.failure import KEY as FAILURE_KEY, element
from fa_verify.report.histogram import histogram
from fa_verify.report.ulp import KEY as ULP_KEY, ulp_not_tiny
from fa_verify.report.yardsticks import (
    EXACTLY_ROUNDED_KEY,
    LARGEST_BOUND_KEY,
    ROUNDED_HISTOGRAM_KEY,
    error_stats,
    exactly_rounded,
    largest_bound,
)
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION, record_from_error, record_from_failure, record_of

#: The key of Record.extra with {rule name: None where the rule accepts the gradient, else why
#: not} for the rules others use (`judge.gradient_rules`); absent where they do not apply.
RULES_KEY = "gradient_rules"
#: The property that judges gradients against the oracle (the reproducers' replay).
PROPERTY = "gradient_agreement"


def magnitudes(problem, reference) -> dict:
    """Per gradient, per element, the sum of the magnitudes of the terms it adds (float64), with
    |dS|_ij = P_ij (|dP_ij| + |D_i| + |dlse_i|) (P, D exact; a softcap's factor <= 1 left out):
        dv_jc: sum_i P_ij |dO_ic|,   dq_ic: scale sum_j |dS|_ij |k_jc|,   dk_jc: scale sum_i |dS|_ij |q_ic|
    (kv heads sum their query heads), and dsinks_h: sum_i P_sink,i (|D_i| + |dlse_i|)."""
    f = problem.forward
    q = f.q64()
    k, v = f.kv64()
    do = problem.dout.astype(np.float64)
    lse = reference.lse
    logits = f.capped(np.einsum("bhid,bhjd->bhij", q, k) * f.scale_value)
    if f.alibi_slopes is not None:
        B, H, Nq = f.lse_shape
        logits += f.alibi_bias(*np.ix_(range(B), range(H), range(Nq)))
    live = f.mask & np.isfinite(lse)[..., None]
    with np.errstate(under="ignore", invalid="ignore", over="ignore"):
        p = np.where(live, np.exp(np.where(live, logits, 0.0) - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    extra = np.abs(reference.delta) + (0.0 if problem.dlse is None else np.abs(problem.dlse.astype(np.float64)))
    ds = p * (np.abs(do @ np.swapaxes(v, -1, -2)) + extra[..., None])
    group = lambda x: x.reshape(x.shape[0], f.kv_heads, f.group_size, *x.shape[2:]).sum(2)  # noqa: E731
    scales = {"dq": f.scale_value * ds @ np.abs(k),
              "dk": group(f.scale_value * np.swapaxes(ds, -1, -2) @ np.abs(q)),
              "dv": group(np.swapaxes(p, -1, -2) @ np.abs(do))}
    if f.sinks is not None:
        sink_p = np.where(np.isfinite(lse), np.exp(f.sinks.astype(np.float64)[None, :, None] - np.where(
            np.isfinite(lse), lse, 0.0)), 1.0)
        scales["dsinks"] = (sink_p * extra).sum(axis=(0, 2))
    return scales


def gradient_errors(got, exact, scale, dtype) -> OutputErrors:
    """The three views of a gradient's errors (`metrics.OutputErrors`), normalised by `scale`
    (its `magnitudes`)."""
    return OutputErrors.compute(got, exact, scale, dtype)


def error_summary(errors: OutputErrors, dtype: str) -> dict:
    """Record.out_errors of a gradient: its dtype, the views' stats, the worst normalised index."""
    worst = np.unravel_index(int(np.argmax(errors.normalised)), errors.normalised.shape)
    return {"dtype": dtype, **error_stats(errors), "worst_index": [int(i) for i in worst]}


def applicable_rules(problem) -> tuple:
    """The rules others use that can judge this problem: theirs are plain attention's gradients
    for dout alone (no variants, no dlse); () elsewhere."""
    if problem.features or problem.dlse is not None:
        return ()
    from fa_verify.judge.gradient_rules import GRADIENT_RULES

    return GRADIENT_RULES


def rule_verdicts(problem, tensor: str, got, exact) -> dict | None:
    """{rule: None if it accepts gradient `tensor`, else why not} for the applicable rules,
    judged as theirs are (against the exact gradient rounded to the dtype); None if none applies."""
    from fa_verify.judge.gradient_rules import TENSORS

    rules = applicable_rules(problem)
    if not rules or tensor not in TENSORS:
        return None
    rounded = round_to(exact, problem.dtype).astype(np.float64)
    return {rule.name: rule.tensor(tensor, np.asarray(got).astype(np.float64), rounded, problem) for rule in rules}


@dataclass(eq=False)
class GradientComparators:
    """What every backend's run of one backward problem is compared with."""

    problem: object
    reference: object
    #: per tensor, its `magnitudes` (the normalised view's unit)
    scales: dict
    #: per tensor: error stats of the exact gradient rounded to the dtype and of the eager
    #: same-precision gradients (Record.comparisons), and the rounded one's normalised histogram
    comparisons: dict
    rounded_histograms: dict
    seconds: float
    _bounds: dict = field(default_factory=dict)

    @classmethod
    def of(cls, problem) -> "GradientComparators":
        from fa_verify.judge.gradient_rules import eager_gradients

        start = time.perf_counter()
        ref = gradient_reference(problem.forward, problem.dout, problem.dlse)
        eager = eager_gradients(problem) if applicable_rules(problem) else {}
        scales = magnitudes(problem, ref)
        comparisons, histograms = {}, {}
        for name, (exact, _) in ref.tensors().items():
            dtype = problem.dtype if name != "dsinks" else "fp32"
            rounded = gradient_errors(round_to(exact, dtype), exact, scales[name], dtype)
            comparisons[name] = {EXACTLY_ROUNDED: error_stats(rounded)}
            if name in eager:
                comparisons[name][NAIVE_SAME_PRECISION] = error_stats(
                    gradient_errors(eager[name], exact, scales[name], dtype))
            histograms[name] = histogram(rounded.normalised)
        return cls(problem, ref, scales, comparisons, histograms, time.perf_counter() - start)

    def bound(self, precision):
        """The gradients' error bound under `precision`, once per model."""
        if precision not in self._bounds:
            p = self.problem
            self._bounds[precision] = gradient_error_bound(p.forward, p.dout, precision, self.reference,
                                                           out_given=p.out, lse_given=p.lse, dlse=p.dlse)
        return self._bounds[precision]

    def records(self, backend, sweep: str) -> list:
        """One Record per gradient of `backend`'s run, judged under its precision model."""
        problem = self.problem
        precision = backend.precision(problem.dtype)
        names = [o.name for o in problem.outputs(precision)]
        start = time.perf_counter()
        try:
            result = backend.run(problem)
        except Exception as exc:  # noqa: BLE001 - a crashing kernel is a finding, not the sweep's end
            seconds = time.perf_counter() - start
            return [record_from_error(problem, backend.name, precision, exc, seconds, "report", sweep=sweep,
                                      tensor=name) for name in names]
        run_s = time.perf_counter() - start
        start = time.perf_counter()
        grads = dict(zip(names, result))
        verdict = check_gradients(grads, problem.forward, problem.dout, out_given=problem.out,
                                  lse_given=problem.lse, dlse=problem.dlse, precision=precision,
                                  reference=self.reference, bound=self.bound(precision))
        seconds = {"run": run_s, "check": time.perf_counter() - start, "reference": self.seconds}
        if not verdict.tensors:  # the shape rule failed: no tensor was measured
            return [record_from_failure(problem, backend.name, precision, verdict.rule, verdict.detail, seconds,
                                        "report", sweep=sweep, tensor=name) for name in names]
        return [self._record(backend.name, precision, verdict, name, grads[name], seconds, sweep) for name in names]

    def _record(self, backend_name, precision, verdict, name, got, seconds, sweep):
        problem, check = self.problem, verdict.tensors[name]
        exact, _ = self.reference.tensors()[name]
        dtype = precision.output if name != "dsinks" else "fp32"
        errors = gradient_errors(got, exact, self.scales[name], dtype)
        extra = {ULP_KEY: ulp_not_tiny(errors, exact), EXACTLY_ROUNDED_KEY: exactly_rounded(got, exact, dtype),
                 ROUNDED_HISTOGRAM_KEY: self.rounded_histograms[name],
                 LARGEST_BOUND_KEY: largest_bound(self.bound(precision).bound(name), errors.row_scale),
                 "dominant_term": check.dominant_term}
        if check.rule is not None:
            extra[FAILURE_KEY] = element(name, check.worst_index, check.value, check.reference,
                                         f"error {check.error:.3g} = {check.ratio:.3g} × its bound "
                                         f"(dominant term: {check.dominant_term})")
            extra["error"] = verdict.message()
        rules = rule_verdicts(problem, name, got, exact)
        if rules is not None:
            extra[RULES_KEY] = rules
        return record_of(problem, backend_name, precision, seconds, "report",
                         {k: v for k, v in extra.items() if v is not None},
                         out_errors=error_summary(errors, dtype), lse_errors=None,
                         bound_ratio=_finite_or_none(check.ratio), lse_bound_ratio=None, ensemble_ratio=None,
                         passed=check.rule is None, rule=check.rule, unbounded=check.unbounded_count,
                         sweep=sweep, comparisons=self.comparisons[name],
                         histograms={"normalised": histogram(errors.normalised), "ulp": histogram(errors.ulp)},
                         tensor=name)


def _finite_or_none(x) -> float | None:
    return None if x is None or np.isnan(x) else float(x)
