"""Argument checks, in one place (the strategies' and the problem model's).

Every message reads ``name=value!r`` and says how to fix the call. Checks run when a strategy
is *built* (``fst.shapes(max_seq=0)`` raises at once), not lazily when Hypothesis draws from it.
"""

from __future__ import annotations

import math
import numbers

from hypothesis.strategies import SearchStrategy

from fa_verify.dtypes import DTYPE_NAMES, dtype_name
from fa_verify.errors import InvalidArgumentError


def check_int(name: str, value, *, min_value: int = 1) -> int:
    """An integer (not a bool) >= min_value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(
            f"{name}={value!r} must be an integer >= {min_value}, got {type(value).__name__}"
        )
    if value < min_value:
        raise InvalidArgumentError(f"{name}={value!r} must be >= {min_value}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name}={value!r} must be True or False")
    return value


def check_strategy(name: str, value, example: str) -> SearchStrategy:
    """A Hypothesis strategy; the message shows how to wrap a fixed value."""
    if not isinstance(value, SearchStrategy):
        raise InvalidArgumentError(
            f"{name}={value!r} must be a Hypothesis strategy or None (for the default); "
            f"for a fixed value pass e.g. {name}={example}"
        )
    return value


def check_dtype(name: str, value) -> str:
    """A problem dtype name: 'fp16', 'bf16' or 'fp32' (aliases and numpy dtypes accepted)."""
    canonical = dtype_name(value)
    if canonical not in DTYPE_NAMES:
        raise InvalidArgumentError(
            f"{name}={value!r} is not a problem dtype; use one of {', '.join(DTYPE_NAMES)}"
        )
    return canonical


def check_names(name: str, values, known, what: str, allow_empty: bool = False) -> tuple:
    """A sequence of names drawn from `known` (non-empty unless allowed), duplicates removed,
    order kept."""
    if isinstance(values, str):
        values = (values,)
    try:
        values = tuple(values)
    except TypeError:
        raise InvalidArgumentError(
            f"{name}={values!r} must be a sequence of {what} names from {tuple(known)}"
        ) from None
    if not values and not allow_empty:
        raise InvalidArgumentError(f"{name}={values!r} must name at least one {what}")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise InvalidArgumentError(
            f"{name}={values!r} holds unknown {what} name(s) {unknown!r}; known: {tuple(known)}"
        )
    return tuple(dict.fromkeys(values))


def check_scale(name: str, value) -> float | None:
    """None (exactly 1/sqrt(D)) or a finite positive float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name}={value!r} must be None or a finite positive number")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{name}={value!r} must be None or a finite positive number")
    return value
