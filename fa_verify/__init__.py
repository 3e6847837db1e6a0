"""fa_verify: is an attention kernel right, and is its error what its precision should give?"""

from fa_verify.errors import (
    AttentionMismatch,
    BackendOutputError,
    BackendUnavailableError,
    FaVerifyError,
    InvalidArgumentError,
    InvalidProblemError,
)
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

__version__ = "0.1.0"

__all__ = [
    "AttentionMismatch",
    "AttentionProblem",
    "BackendOutputError",
    "BackendUnavailableError",
    "FaVerifyError",
    "InvalidArgumentError",
    "InvalidProblemError",
    "PrecisionModel",
]
