"""fa_verify: is an attention kernel right, and is its error what its precision should give?

    from fa_verify import AttentionProblem, assert_attention_close, reference
    problem = AttentionProblem.from_float(q, k, v, "bf16", causal=True)
    assert_attention_close(my_kernel(problem), problem, precision="flash")

Backends live in `fa_verify.backends`, Hypothesis strategies in `fa_verify.strategies`.
"""

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
    "InvalidArgumentError",
    "InvalidProblemError",
    "Limits",
    "PrecisionModel",
    "Reference",
    "Verdict",
    "assert_attention_close",
    "check_attention",
    "error_bound",
    "measure",
    "reference",
]
