"""Fully masked rows: output exactly 0 and LSE exactly -inf (fa_verify's convention), never NaN.

Rows are fully masked only under bottom-right causal masking with Nq > Nk, so the property
derives such a problem: the problem's queries against its first Nk' < Nq keys, bottom-right.
(Top-left rows always see key 0; a target that only implements top-left is not applicable.)
"""

from __future__ import annotations

import numpy as np

from fa_verify.properties._compare import differing
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported


def check_fully_masked_rows(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Bottom-right causal with Nk' < Nq keys: the first Nq - Nk' rows give O = 0, LSE = -inf."""
    backend = as_backend(backend)
    if problem.nq < 2:
        return not_applicable("fully_masked_rows", problem, "Nq=1: no row can be fully masked")
    # Fewer keys than queries, as many as the declared limits allow (a multiple of the sequence
    # multiple, at least the shortest allowed length; any count when nothing is declared).
    limits = backend.limits
    counts = np.arange(limits.seq_lo, min(problem.nq - 1, problem.nk) + 1, limits.seq_multiple)
    if not len(counts):
        return not_applicable("fully_masked_rows", problem, f"Nq={problem.nq}: no key count below it is within "
                                                            f"the declared limits ({limits.describe()})")
    nk = int(counts[np.random.default_rng(seed).integers(len(counts))])
    derived = problem.replace(k=np.ascontiguousarray(problem.k[:, :, :nk]),
                              v=np.ascontiguousarray(problem.v[:, :, :nk]),
                              causal=True, causal_alignment="bottom-right")
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable("fully_masked_rows", problem, reason)
    out, lse = backend.run(derived)
    masked = derived.masked_rows
    found = []
    mismatch = differing(out, np.zeros(out.shape), masked[None, None, :, None])
    if mismatch is not None:
        found.append(mismatch.describe("O of fully masked rows (must be 0)"))
    if lse is not None:
        mismatch = differing(lse, np.full(lse.shape, -np.inf), masked[None, None, :])
        if mismatch is not None:
            found.append(mismatch.describe("LSE of fully masked rows (must be -inf)"))
    what = (f"queries against their first {nk} keys, bottom-right causal: "
            f"rows 0..{int(masked.sum()) - 1} see no key")
    if found:
        return failed("fully_masked_rows", problem, f"{what}: " + "; ".join(found))
    note = "no LSE returned: only the output was checked" if lse is None else ""
    return passed("fully_masked_rows", problem, note=note)
