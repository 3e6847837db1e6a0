"""Error histograms on fixed logarithmic bins, so that histograms of many runs add up.

A record cannot keep every element's error, but the report wants the distribution per cell;
so each run stores counts on bins shared by all runs (quarter decades from 1e-12 to 1e8), plus
exact zeros (common in ULPs: correctly rounded elements) and the under/overflow beyond the
bins (inf — a NaN output — counts as overflow). Changing the bins changes the record format.
"""

from __future__ import annotations

import numpy as np

#: Bin edges: 10^(k/4) for k = -48 ... 32, i.e. 1e-12 ... 1e8 in quarter decades.
EDGES = 10.0 ** (np.arange(-48, 33) / 4)


def histogram(magnitudes) -> dict:
    """{"zero", "under", "bins" (len(EDGES) - 1 counts), "over"} of non-negative errors."""
    e = np.asarray(magnitudes, dtype=np.float64).ravel()
    e = np.where(np.isnan(e), np.inf, e)
    positive = e[e > 0]
    counts, _ = np.histogram(positive, bins=EDGES)
    return {"zero": int((e == 0).sum()), "under": int((positive < EDGES[0]).sum()),
            "bins": [int(c) for c in counts], "over": int((positive > EDGES[-1]).sum())}


def merge(histograms) -> dict | None:
    """The sum of several histograms (None ones skipped); None if there are none."""
    present = [h for h in histograms if h]
    if not present:
        return None
    return {"zero": sum(h["zero"] for h in present), "under": sum(h["under"] for h in present),
            "bins": [int(c) for c in np.sum([h["bins"] for h in present], axis=0)],
            "over": sum(h["over"] for h in present)}
