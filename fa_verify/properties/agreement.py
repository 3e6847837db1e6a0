"""Agreement with the certified oracle under the error model: the output, and the LSE.

Two properties, so that a target without an LSE shows "lse_agreement: not applicable"
instead of a pass that never looked at an LSE. Both ask the null-model guard whether a
trivial output would pass the same rules (`fa_verify.null_model`): if one does, the example
is uninformative.
"""

from __future__ import annotations

from fa_verify.conventions import lse_hint
from fa_verify.error_model import error_bound
from fa_verify.honest_ensemble import ensemble_errors
from fa_verify.null_model import guard, null_outputs
from fa_verify.oracle import reference
from fa_verify.properties._compare import exceeding
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend
from fa_verify.verdict import check_attention


def check_oracle_agreement(backend, problem) -> PropertyResult:
    """The output agrees with the reference: every rule of `check_attention` but the LSE ones."""
    backend = as_backend(backend)
    out, _ = backend.run(problem)
    precision = backend.precision(problem.dtype)
    ref = reference(problem)
    bound = error_bound(problem, precision, ref)
    # One ensemble for the target's verdict and the trivial outputs' (it depends on the inputs only).
    ensemble = ensemble_errors(problem, precision, ref, bound)
    verdict = check_attention(out, problem, precision=precision, reference=ref, bound=bound, ensemble=ensemble)
    if not verdict.passed:
        return failed("oracle_agreement", problem, verdict.message(), verdict.bound_ratio, [verdict])
    null_guard = guard(null_outputs(problem, ref, precision.output),
                       lambda null: check_attention(null.out, problem, precision=precision, reference=ref,
                                                    bound=bound, ensemble=ensemble).passed)
    return passed("oracle_agreement", problem, worst_ratio=verdict.bound_ratio, verdicts=[verdict],
                  guard=null_guard)


def check_lse_agreement(backend, problem) -> PropertyResult:
    """The LSE is within its error-model bound of the reference; -inf exactly at fully masked rows."""
    backend = as_backend(backend)
    out, lse = backend.run(problem)
    if lse is None:
        return not_applicable("lse_agreement", problem, f"{backend.name} returns no LSE")
    precision = backend.precision(problem.dtype)
    ref = reference(problem)
    bound = error_bound(problem, precision, ref)
    verdict = check_attention(out, problem, lse=lse, precision=precision, reference=ref, bound=bound)
    mismatch, worst = exceeding(lse, ref.lse, bound.lse)
    if mismatch is None:
        null_guard = guard(null_outputs(problem, ref, precision.output),
                           lambda null: exceeding(null.lse, ref.lse, bound.lse)[0] is None, judged=("lse",))
        return passed("lse_agreement", problem, worst_ratio=worst, verdicts=[verdict], guard=null_guard)
    masked = "" if mismatch.want > float("-inf") else " (a fully masked row: LSE must be -inf)"
    hint = lse_hint(lse, ref.lse)
    detail = (f"{mismatch.describe('LSE')}{masked}; dominant term of the bound there: "
              f"{bound.dominant_lse_term(mismatch.index)}" + (f"\n{hint}" if hint else ""))
    return failed("lse_agreement", problem, detail, worst, [verdict])
