"""Non-finite outputs never pass: what a property's runs returned, watched for NaN and infinity.

Attention of finite inputs is finite: each output row is a convex combination of V rows (0 for
a row that sees no key), and the LSE is finite or -inf (a row without keys). Every problem's
inputs are finite (`fa_verify.problem`'s input policy), so a target returning NaN or an
infinity in out, or NaN or +inf in the LSE, is wrong whatever a property compares: two runs
that both give inf agree bitwise, and inf - inf is no error a relation sees. While a property
runs (`Property.__call__` opens `watching()`), `Backend.run` reports each output here, and the
first non-finite one makes the property fail instead of pass.
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


def seen(problem, out: np.ndarray, lse) -> None:
    """Called by `Backend.run` with every output it returns (before any convention is applied)."""
    found = _FOUND.get()
    if found is None or found:
        return
    finding = nonfinite(problem, out, lse)
    if finding:
        found.append(finding)


def nonfinite(problem, out: np.ndarray, lse) -> str | None:
    """Where `out` holds NaN or an infinity, or `lse` NaN or +inf, in words; None if nowhere."""
    for what, x, bad in (("out", out, lambda a: ~np.isfinite(a)),
                         ("LSE", lse, lambda a: np.isnan(a) | (a == np.inf))):
        if x is None:
            continue
        wrong = bad(np.asarray(x, dtype=np.float64))
        if wrong.any():
            index = tuple(int(i) for i in np.argwhere(wrong)[0])
            return (f"{what} holds {int(wrong.sum())} non-finite values of {wrong.size} (first {float(x[index])!r} at "
                    f"{list(index)} of {problem.out_label if what == 'out' else problem.lse_label}) for finite "
                    f"inputs ({problem.describe()}): attention of finite inputs is finite")
    return None
