"""ULP errors where they say something about the kernel: outputs not tiny against their row.

Far below its row scale Σⱼpᵢⱼ|vⱼc|, an output is the small difference of large terms: its ULP
is tiny and every correct kernel's error is many ULPs of it (issue 14 measured 2.4e7 ULP for
an FA2-style fp32 kernel that passes every rule), so a maximum over all elements ranks kernels
by where their outputs happen to cancel. The report's ULP figures count only elements with
|O| ≥ NOT_TINY × row scale; the normalised error covers the others.
"""

from __future__ import annotations

import numpy as np

from fa_verify.metrics import ErrorStats

#: The key of Record.extra with the ULP statistics of the outputs that are not tiny.
KEY = "ulp_not_tiny"
#: ULPs count where |O| >= NOT_TINY x the row scale, NOT_TINY = 2**NOT_TINY_EXPONENT.
NOT_TINY_EXPONENT = -4
NOT_TINY = 2.0 ** NOT_TINY_EXPONENT


def ulp_not_tiny(errors, ref_out) -> dict:
    """ErrorStats (as a dict) of the ULP errors (metrics.OutputErrors) where
    |ref_out| >= NOT_TINY x the row scale."""
    keep = np.abs(ref_out) >= NOT_TINY * errors.row_scale
    return ErrorStats.from_values((errors.signed / errors.ulp_size)[keep]).as_dict()


def ulp_stat(record, stat: str) -> float | None:
    """One ULP statistic of a record's not-tiny outputs (None: not measured, or none there)."""
    stats = record.extra.get(KEY)
    return stats[stat] if stats and stats["count"] else None
