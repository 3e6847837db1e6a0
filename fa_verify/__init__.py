"""fa_verify: is an attention kernel right, and is its error what its precision should give?

    from fa_verify import AttentionProblem, assert_attention_close, reference
    problem = AttentionProblem.from_float(q, k, v, "bf16", causal=True)
    assert_attention_close(my_kernel(problem), problem, precision="flash")

Gradients: `check_gradients(grads, problem, dout, out_given=..., lse_given=...)` against
`gradient_reference` (the backward pass; docs/numerics.md). Backends live in
`fa_verify.backends`, Hypothesis strategies in `fa_verify.strategies`.
"""

from fa_verify.backward_verdict import GradientVerdict, check_gradients
from fa_verify.conventions import Conventions
from fa_verify.error_model import Bound, error_bound
from fa_verify.errors import (
    AttentionMismatch,
    BackendOutputError,
    BackendUnavailableError,
    FaVerifyError,
    InvalidArgumentError,
    InvalidProblemError,
)
from fa_verify.limits import Limits
from fa_verify.metrics import ErrorStats, ErrorSummary, measure
from fa_verify.oracle import Reference, reference
from fa_verify.oracle.backward import GradientReference, gradient_reference
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem
from fa_verify.verdict import Verdict, assert_attention_close, check_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionMismatch",
    "AttentionProblem",
    "BackendOutputError",
    "BackendUnavailableError",
    "Bound",
    "Conventions",
    "ErrorStats",
    "ErrorSummary",
    "FaVerifyError",
    "GradientReference",
    "GradientVerdict",
    "InvalidArgumentError",
    "InvalidProblemError",
    "Limits",
    "PrecisionModel",
    "Reference",
    "Verdict",
    "assert_attention_close",
    "check_attention",
    "check_gradients",
    "error_bound",
    "gradient_reference",
    "measure",
    "reference",
]
