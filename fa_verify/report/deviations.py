"""Declared deviations: runs that fail only because of a backend's declared deviations.

A backend may declare deviations (`fa_verify.backends.base.Deviation`) in which it knowingly
differs from fa_verify's, such as torch's CPU flash kernel returning LSE 0 for fully masked
rows. A failing run is a declared deviation when its output, with fa_verify's convention put
back where a declared one applies, passes the same verdict: nothing else is wrong with it. The
record keeps its failing verdict and names the deviations in `extra[KEY]`, so the report (also
one rendered later with --from) can show it apart from the failures.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

#: The key of Record.extra that lists the declared deviations a failing run deviates by.
KEY = "declared_deviation"


def restored_lse(problem, lse, deviations):
    """lse with -inf put back in the fully masked rows where a deviation's value stands, and
    the deviations that changed something."""
    masked = problem.masked_rows[None, None, :]
    used = []
    for deviation in deviations:
        hit = masked & (lse == deviation.masked_row_lse)
        if hit.any():
            lse = np.where(hit, np.float32(-np.inf), lse)
            used.append(deviation)
    return lse, used


def declared_deviation(deviations, problem, out, lse, recheck) -> list | None:
    """The deviations (as dicts, for Record.extra[KEY]) that a failing run deviates by, when
    they are all that is wrong with it; None otherwise.

    recheck(out, lse) -> Verdict: the run's verdict on other outputs, same rules and bounds.
    """
    if lse is None or not deviations:
        return None
    restored, used = restored_lse(problem, lse, deviations)
    if not used or not recheck(out, restored).passed:
        return None
    return [asdict(c) for c in used]


def deviation_of(record) -> list | None:
    """The declared deviations a failing record deviates by only (None: passed or failed)."""
    return None if record.passed else record.extra.get(KEY)
