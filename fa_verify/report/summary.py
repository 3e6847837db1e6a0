"""summary.json: the report's data for machines — strict JSON with a format version.

Strict means no NaN/Infinity tokens (JavaScript and many parsers reject them): non-finite
numbers are written as the strings "inf", "-inf" and "nan". Histograms stay in the records;
the summary keeps the numbers the page shows.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields, is_dataclass

from fa_verify.report.buckets import Bucket, Column

#: Version of summary.json's format; bump it when a field changes meaning or disappears.
#: 2: "failed" counts leave out declared deviations, counted in "deviations".
#: 3: cells and backends gain "vs_rounded" (the headline, × rounded) and cells "failure" (the
#: worst failing run: rule, element, property, reproducer); cells' "ulp_max"/"ulp_p99" count
#: only outputs not tiny against their row scale (null where not measured); "bound_ratio" is
#: null with "no_finite_bound" true where no element has a finite bound (was 0); cases gain
#: "element" and "property"; backends are listed most accurate first (by vs_rounded).
#: 4: cells' "baseline_ratio" became "ensemble_ratio" (the verdict's ensemble rule replaced
#: the naive-baseline rule).
#: 5: "curves" name their shape family "shape_family" (was "family"), group their backends by
#: backend family ("groups"), and each backend series carries "bound" (N, the largest element
#: of its normalised error-model bound); comparison series are "floor" (exactly rounded) or
#: "comparison"; new "distributions": per dtype and backend, "exactly_rounded", the share of
#: output elements equal to the reference rounded to the output dtype; backends' "vs_rounded"
#: (the rank) averages over "ranked_on", the columns every ranked backend has runs in (was:
#: each backend's own columns).
#: 6: "curves" gain "axis" (the x axis: "sequence length N", or "key length Nk" for decode, Nq =
#: 1) and "variant" (the family's variant parameters, "" when dense); new "features": per combination of variants (window, softcap, ALiBi, sinks) its runs'
#: overview ("sections", "columns", "ranked_on"), "curves", "distributions", "parameters" and the
#: backends "not_applicable" to it (empty when every problem is dense); cells' "shapes" end
#: with a problem's variant parameters.
#: 7: backends' "vs_rounded" (the rank) pools, per ranking column, only the problems every
#: ranked backend ran; new "rank_left_out" (also per feature): the problems left out of the rank
#: ("column", "problem", "missing": the ranked backends without a run of it; null when no problem
#: is shared by every ranked backend and each is ranked over its own runs); "curves" gain
#: "coinciding" (groups of backends of one panel whose curves lie on top of one another).
#: 8: a backward sweep's records are one per gradient: cells, curves and distributions gain the
#: tensor their errors are of (bucket labels end with " · dq" etc.; curves and distributions
#: "tensor", "out" for the output); cells' "shapes" end with a backward problem's "dout=..."; new
#: "gradient_rules" (null without gradient records): per gradient record fa_verify's verdict and
#: each rule others use ("rules": [name, title]; "rows": "verdicts", null where the rule accepts,
#: else why not; "totals" per backend and tensor).
SUMMARY_VERSION = 8


def _plain(value):
    """JSON-ready: buckets and columns as their labels, non-finite floats as strings."""
    if isinstance(value, (Bucket, Column)):
        return value.label
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)
                if f.name != "histograms"}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def summary(data) -> dict:
    body = _plain(data)
    # The run's environment is the report's (already in the body) and its skips are grouped.
    body["run"] = None if data.run is None else _plain(
        {k: v for k, v in asdict(data.run).items() if k not in ("environment", "skips")})
    body["passed"] = data.totals.failed == 0
    return {"format_version": SUMMARY_VERSION, **body}


def summary_json(data) -> str:
    return json.dumps(summary(data), indent=1, allow_nan=False, ensure_ascii=False) + "\n"
