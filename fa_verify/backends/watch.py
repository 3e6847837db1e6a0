"""Non-finite outputs never pass: what a property's runs returned, watched for NaN and infinity.

Attention of finite inputs is finite: each output row is a convex combination of V rows (0 for
a row that sees no key), and the LSE is finite or -inf (a row without keys). Every problem's
inputs are finite (`fa_verify.problem`'s input policy), so a target returning NaN or an
infinity in out, or NaN or +inf in the LSE, is wrong whatever a property compares: two runs
that both give inf agree bitwise, and inf - inf is no error a relation sees. While a property
runs (`Property.__call__` opens `watching()`), `Backend.run` reports each output here, and the
first non-finite one makes the property fail instead of pass. The same holds of every kind's
outputs (`problem.outputs`): the gradients of attention at finite inputs are finite too.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import numpy as np

_FOUND: contextvars.ContextVar = contextvars.ContextVar("fa_verify_nonfinite", default=None)


@contextmanager
def watching():
    """A list that receives, in words, the first non-finite output of the runs made inside."""
    found: list = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def seen(problem, result: tuple, precision) -> None:
    """Called by `Backend.run` with every result it returns (before any convention is applied)."""
    found = _FOUND.get()
    if found is None or found:
        return
    finding = nonfinite(problem, result, precision)
    if finding:
        found.append(finding)


def nonfinite(problem, result: tuple, precision) -> str | None:
    """Where an output of `result` (`problem.outputs(precision)`, in order) holds NaN or an
    infinity (an LSE: NaN or +inf), in words; None if nowhere."""
    for output, x in zip(problem.outputs(precision), result):
        if x is None:
            continue
        values = np.asarray(x, dtype=np.float64)
        wrong = (np.isnan(values) | (values == np.inf)) if output.minus_inf else ~np.isfinite(values)
        if wrong.any():
            index = tuple(int(i) for i in np.argwhere(wrong)[0])
            what = "LSE" if output.name == "lse" else output.name
            return (f"{what} holds {int(wrong.sum())} non-finite values of {wrong.size} (first {float(x[index])!r} at "
                    f"{list(index)} of {output.label}) for finite inputs ({problem.describe()}): "
                    f"{problem.finite_because}")
    return None
