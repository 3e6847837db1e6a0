"""Wording that points a mismatch at its likely cause, shared by verdicts and property checks.

Two causes that plain numbers hide:
  * a NaN output: "got nan, expected nan" says nothing (the expected value of a metamorphic
    property derives from the target's own NaN output); attention of finite inputs is never
    NaN, so the message says where the exact result is finite;
  * a row whose scale is below the output dtype's normal range: errors normalised by the row
    scale reach 1 there when a target flushes subnormal outputs to zero (XLA on CPU does), an
    absolute error of ~1e-42 in fp32 — the absolute error and the likely cause are shown next
    to the normalised one.
"""

from __future__ import annotations

import math

import numpy as np

from fa_verify.dtypes import finfo


def _number(x: float) -> str:
    return "NaN" if math.isnan(x) else f"{x:.6g}"


def got_expected(got: float, expected: float, what: str = "expected", spread: str = "") -> str:
    """"got X, expected Y" (`spread`, e.g. " ± 1e-15", follows Y), naming a NaN for what it is:
    a NaN where `what` is finite, or NaN on both sides (the expected value derives from the
    target's own output, which is NaN)."""
    noun = "the expected value" if what == "expected" else f"the {what}"
    if math.isnan(got) and math.isnan(expected):
        return (f"got NaN, and {noun} (derived from the target's own output) is NaN too, where the exact "
                f"result is finite (attention of finite inputs is finite)")
    if math.isnan(got) and math.isfinite(expected):
        return f"got NaN where {noun} is finite ({_number(expected)}{spread})"
    return f"got {_number(got)}, {what} {_number(expected)}{spread}"


def tiny_scale_note(errors, got: np.ndarray, reference: np.ndarray, dtype) -> str:
    """A note when the largest normalised error sits in a row whose scale is below `dtype`'s
    normal range: its absolute error, and "flush-to-zero?" when the output there is 0 for a
    nonzero reference. "" otherwise. `errors`: metrics.OutputErrors of `got` against `reference`."""
    normalised = np.nan_to_num(errors.normalised, nan=np.inf)
    if normalised.size == 0:
        return ""
    index = np.unravel_index(int(np.argmax(normalised)), normalised.shape)
    smallest = float(finfo(dtype).smallest_normal)
    row_scale = float(errors.row_scale[index])
    if not (0 < row_scale < smallest and np.isfinite(errors.abs[index])):  # NaN/Inf: the "finite" rule says it
        return ""
    note = (f"absolute error {float(errors.abs[index]):.2g} (normalised {float(normalised[index]):.3g}) at "
            f"{[int(i) for i in index]}, where the row scale {row_scale:.2g} is below the {dtype} normal range "
            f"(smallest normal {smallest:.2g})")
    if got[index] == 0 and reference[index] != 0:
        note += f": got 0 for a reference of {float(reference[index]):.2g} — a flush-to-zero target?"
    return note
