"""What judges a problem, by its kind: the certified reference, the error bound of a precision
model and the null model's trivial outputs, for the kinds whose problems the dense relations
(`properties.metamorphic`) judge — dense and FP8 (docs/properties.md, "On FP8 problems").

A table keyed by `problem.kind` rather than methods of the problem types: the oracles and error
models import the problem module, so the problem cannot import them back (tests/test_architecture.py).
A new kind that the relations should judge adds its line here (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fa_verify.error_model import error_bound
from fa_verify.errors import InvalidArgumentError
from fa_verify.fp8_error_model import fp8_error_bound
from fa_verify.null_model import fp8_null_outputs, null_outputs
from fa_verify.oracle import reference
from fa_verify.oracle.fp8 import reference_fp8


@dataclass(frozen=True)
class Judging:
    #: problem -> its certified `Reference`
    reference: Callable
    #: (problem, precision model, reference) -> the error model's `Bound`
    error_bound: Callable
    #: (problem, reference, precision model) -> the null model's trivial outputs, as a kernel of
    #: that precision returns them
    null_outputs: Callable


JUDGING = {
    "dense": Judging(reference, error_bound, lambda p, ref, precision: null_outputs(p, ref, precision.output)),
    # the output in the problem's own output dtype (bf16 unless declared), whatever the model says
    "fp8": Judging(reference_fp8, fp8_error_bound, lambda p, ref, precision: fp8_null_outputs(p, ref, p.output_dtype)),
}


def judging(problem) -> Judging:
    """The reference, bound and null outputs of `problem`'s kind."""
    found = JUDGING.get(problem.kind)
    if found is None:
        raise InvalidArgumentError(f"no reference and error bound for {problem.kind} problems here (kinds: "
                                   f"{', '.join(JUDGING)}); their own properties judge them")
    return found
