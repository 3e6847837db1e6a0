"""What a failing run shows: the rule, its worst element, and the property that sees it.

A sweep stores, with each failing record, the element that made its first failing rule fail
(`extra[KEY]`): which tensor, the index, what the kernel gave and what was expected, so that
the page can say "lse[0, 1, 3] = 0 where -inf was expected" instead of unrelated error
statistics. Records from elsewhere (pytest, `fa_verify check`) carry the verdict's message
instead (`extra["error"]`) or a property name (`extra["property"]`).
"""

from __future__ import annotations

import math

import numpy as np

from fa_verify.report.deviations import deviation_of

#: The key of Record.extra that holds the worst element of a failing run.
KEY = "failure"
#: The property of `fa_verify.properties` that checks each tensor against the oracle.
PROPERTY_OF_TENSOR = {"out": "oracle_agreement", "lse": "lse_agreement",
                      **dict.fromkeys(("dq", "dk", "dv", "dsinks"), "gradient_agreement")}


def _first(mask: np.ndarray):
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


def element(tensor: str, index, got: float, expected: float, what: str) -> dict:
    return {"tensor": tensor, "index": None if index is None else [int(i) for i in index],
            "got": float(got), "expected": float(expected), "what": what}


def worst_element(verdict, reference, out, lse) -> dict | None:
    """The element that made `verdict`'s failing rule fail, JSON-ready; None if it passed or
    the rule has no element (a wrong shape)."""
    if verdict.passed or verdict.rule == "shape":
        return None
    got = np.asarray(out, dtype=np.float64)
    lse64 = None if lse is None else np.asarray(lse, dtype=np.float64)
    masked = ~np.isfinite(reference.lse)
    if verdict.rule == "finite":
        bad = ~np.isfinite(got)
        if bad.any():
            i = _first(bad)
            return element("out", i, got[i], reference.out[i], "NaN/Inf where the reference is finite")
        i = _first(np.isnan(lse64) | (np.isinf(lse64) & ~masked))
        return element("lse", i, lse64[i], reference.lse[i], "NaN/Inf where the reference is finite")
    if verdict.rule == "masked_rows":
        nonzero = masked[..., None] & (got != 0)
        if nonzero.any():
            i = _first(nonzero)
            return element("out", i, got[i], 0.0, "a fully masked row's output is not 0")
        i = _first(masked & ~(lse64 == -np.inf))
        return element("lse", i, lse64[i], -math.inf, "a fully masked row's LSE is not -inf")
    if verdict.rule == "lse_bound":
        return element("lse", verdict.lse_worst_index, verdict.lse_worst_value,
                        verdict.lse_worst_reference,
                        f"error {verdict.lse_worst_error:.3g} = {verdict.lse_bound_ratio:.3g} × its bound")
    if verdict.rule == "error_bound":
        return element("out", verdict.worst_index, verdict.worst_value, verdict.worst_reference,
                        f"error {verdict.worst_error:.3g} = {verdict.bound_ratio:.3g} × its bound")
    # the last rule compares the whole output with other implementations' errors: show the
    # element with the largest normalised error
    i = tuple(verdict.summary.worst_index)
    return element("out", i, got[i], reference.out[i], "the largest normalised error")


def property_of(record) -> str | None:
    """The property that sees the record's failure: for a declared deviation the one its
    backend declares (as the deviations table says), else the one that judged it (check,
    pytest), else the oracle property of the tensor that failed."""
    declared = deviation_of(record)
    if declared:
        return declared[0]["property"]
    if "property" in record.extra:
        return record.extra["property"]
    element = record.extra.get(KEY)
    return PROPERTY_OF_TENSOR[element["tensor"]] if element else None
