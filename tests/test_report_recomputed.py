"""The forward report's figures recomputed here independently, from the backends' outputs and the
mpmath oracle by plain loops, and compared with what the records store and the report shows:
each run's errors (absolute, normalised, ULPs where not tiny), its exactly rounded count,
histogram counts and bound ratio; each cell's × rounded (RMSEs pooled over its runs), the rank's
geometric mean, the curves' points and the histograms' exactly rounded shares.

The gold files (tests/test_report.py) detect a change of these figures; this file detects a
wrong one. The units are restated here, not imported: the dtypes' spacings, the histogram's
quarter decades from 1e-12 to 1e8, "not tiny" = |O| >= row scale / 16.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.error_model import error_bound
from fa_verify.oracle import reference
from fa_verify.report import write_report
from fa_verify.report.buckets import column_of
from fa_verify.report.runner import run_sweep
from fa_verify.report.yardsticks import EXACTLY_ROUNDED_KEY, LARGEST_BOUND_KEY, ROUNDED_HISTOGRAM_KEY
from fa_verify.results import ResultsStore
from fa_verify.sweeps import Sweep, grid

#: Two shapes of one bucket (N <= 16, D <= 32, MHA): each cell pools two runs.
SWEEP = Sweep("recomputed", "two shapes of one bucket", grid([(1, 2, 2, 8, 8, 16), (1, 2, 2, 12, 12, 16)],
                                                             dtypes=("fp16", "fp32")), budget_s=60.0)
BACKENDS = ("numpy-tiled", "naive-fp32")
#: mantissa bits and smallest normal exponent of each output dtype
FORMATS = {"fp16": (10, -14), "fp32": (23, -126)}
CAST = {"fp16": np.float16, "fp32": np.float32}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("recomputed")
    store = ResultsStore(out / "results.jsonl")
    info = run_sweep(SWEEP, [get_backend(name) for name in BACKENDS], store, out_dir=out)
    records = store.read()
    data = write_report(records, out, run=info)
    return out, records, data, {(r.backend, r.problem.key()): _recompute(r) for r in records}


def _spacing(x, dtype):
    """The spacing of `dtype` at |x| (its subnormal spacing below the smallest normal)."""
    bits, emin = FORMATS[dtype]
    exponent = max(math.frexp(abs(x))[1] - 1, emin) if x else emin
    return 2.0 ** (exponent - bits)


def _nearest_rank(values, share):
    ordered = sorted(values)
    return ordered[max(math.ceil(share * len(ordered)) - 1, 0)]


def _histogram(values):
    """zero / under / quarter-decade bins from 1e-12 to 1e8 / over, by each value's log10."""
    counts = {"zero": 0, "under": 0, "bins": [0] * 80, "over": 0}
    for e in values:
        if e == 0:
            counts["zero"] += 1
        elif e < 1e-12:
            counts["under"] += 1
        elif e > 1e8:
            counts["over"] += 1
        else:
            counts["bins"][min(math.floor(4 * math.log10(e)) + 48, 79)] += 1
    return counts


def _recompute(record):
    """The record's run again: its figures from the backend's output and mpmath's reference."""
    problem = record.problem.rebuild()
    dtype = record.precision["output"]
    out, _ = get_backend(record.backend).run(problem)
    exact = reference(problem, method="mpmath")
    q, k, v = (x.astype(np.float64) for x in (problem.q, problem.k, problem.v))
    bound = error_bound(problem, get_backend(record.backend).precision(problem.dtype), reference(problem)).out
    figures = defaultdict(list)
    for b, h, i in np.ndindex(*problem.out_shape[:3]):
        lse = float(exact.lse[b, h, i])
        keys = [j for j in range(problem.nk) if problem.mask[i, j]]
        p = {j: math.exp(problem.scale_value * math.fsum(q[b, h, i] * k[b, h, j]) - lse) for j in keys}
        for c in range(problem.head_dim):
            o, got = float(exact.out[b, h, i, c]), float(out[b, h, i, c])
            row_scale = math.fsum(p[j] * abs(v[b, h, j, c]) for j in keys)
            rounded = float(CAST[dtype](o))
            figures["err"].append(abs(got - o))
            figures["rounded_err"].append(abs(rounded - o))
            figures["normalised"].append(abs(got - o) / row_scale if row_scale else 0.0)
            figures["rounded_normalised"].append(abs(rounded - o) / row_scale if row_scale else 0.0)
            figures["exact"].append(got == rounded)
            figures["bound_ratio"].append(abs(got - o) / bound[b, h, i, c] if keys else 0.0)
            if row_scale and math.isfinite(bound[b, h, i, c]):
                figures["bound"].append(bound[b, h, i, c] / row_scale)
            if abs(o) >= row_scale / 16:
                figures["ulp_not_tiny"].append(abs(got - o) / _spacing(o, dtype))
    return figures


def _rms(values):
    return math.sqrt(math.fsum(x * x for x in values) / len(values))


def test_each_runs_figures_recomputed_independently(swept):
    _, records, _, recomputed = swept
    assert len(records) == len(BACKENDS) * len(SWEEP.points)
    for r in records:
        f = recomputed[r.backend, r.problem.key()]
        e = r.out_errors
        assert e["abs"]["max"] == pytest.approx(max(f["err"]), rel=1e-9), r.backend
        assert e["abs"]["rmse"] == pytest.approx(_rms(f["err"]), rel=1e-9)
        assert e["normalised"]["max"] == pytest.approx(max(f["normalised"]), rel=1e-9)
        assert e["normalised"]["p99"] == pytest.approx(_nearest_rank(f["normalised"], 0.99), rel=1e-9)
        assert r.extra["ulp_not_tiny"]["count"] == len(f["ulp_not_tiny"])
        assert r.extra["ulp_not_tiny"]["max"] == pytest.approx(max(f["ulp_not_tiny"]), rel=1e-9)
        assert r.extra[EXACTLY_ROUNDED_KEY] == {"count": sum(f["exact"]), "of": len(f["exact"])}
        assert r.comparisons["exactly-rounded"]["abs"]["rmse"] == pytest.approx(_rms(f["rounded_err"]), rel=1e-9)
        assert r.histograms["normalised"] == _histogram(f["normalised"])
        assert r.extra[ROUNDED_HISTOGRAM_KEY] == _histogram(f["rounded_normalised"])
        assert r.bound_ratio == pytest.approx(max(f["bound_ratio"]), rel=1e-9)
        assert r.extra[LARGEST_BOUND_KEY] == pytest.approx(max(f["bound"]), rel=1e-9)
    # in fp16 the figures tell the backends apart, so a record holding another's would show above
    # (in fp32 both compute the same outputs)
    fp16 = [r for r in records if r.problem.dtype == "fp16"]
    assert len({r.out_errors["abs"]["rmse"] for r in fp16}) == len(fp16)


def _cells(records, recomputed):
    """{(backend, column label): the recomputed figures of its runs, pooled}."""
    cells = defaultdict(lambda: defaultdict(list))
    for r in records:
        cell = cells[r.backend, column_of(r.problem).label]
        for name, values in recomputed[r.backend, r.problem.key()].items():
            cell[name] += values
    return cells


def test_cells_and_rank_recomputed_from_the_runs(swept):
    out, records, _, recomputed = swept
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    table = (out / "summary.md").read_text(encoding="utf-8").splitlines()
    cells = _cells(records, recomputed)
    ranks = {}
    for section in summary["sections"]:
        name, [row] = section["name"], section["rows"]  # one bucket
        # the Markdown table's row: runs, rank, then per column "✅ {× rounded}× · bound {ratio}"
        shown = next(line for line in table if line.startswith(f"| {name} |")).strip("|").split("|")
        vs_rounded = []
        for label, cell, text in zip(section["columns"], row["cells"], shown[3:], strict=True):
            f = cells[name, label]
            assert cell["runs"] == 2
            # × rounded: the RMSE of every element of the cell's runs over the rounded reference's
            vs_rounded.append(_rms(f["err"]) / _rms(f["rounded_err"]))
            assert cell["vs_rounded"] == pytest.approx(vs_rounded[-1], rel=1e-9), (name, label)
            assert cell["normalised_max"] == pytest.approx(max(f["normalised"]), rel=1e-9)
            assert cell["ulp_max"] == pytest.approx(max(f["ulp_not_tiny"]), rel=1e-9)
            assert cell["bound_ratio"] == pytest.approx(max(f["bound_ratio"]), rel=1e-9)
            x, bound = re.fullmatch(r" ✅ ([\d.]+)× · bound ([\d.e-]+) ", text).groups()
            # shown to 3 significant digits
            assert (float(x), float(bound)) == pytest.approx((vs_rounded[-1], max(f["bound_ratio"])), rel=5e-3)
        ranks[name] = math.prod(vs_rounded) ** (1 / len(vs_rounded))
        assert section["vs_rounded"] == pytest.approx(ranks[name], rel=1e-9)
        assert int(shown[1]) == 2 * len(vs_rounded) and float(shown[2]) == pytest.approx(ranks[name], rel=5e-3)
    assert [s["name"] for s in summary["sections"]] == sorted(ranks, key=ranks.get)


def test_curves_and_histograms_recomputed_from_the_runs(swept):
    out, records, data, recomputed = swept
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    # error against N: the largest normalised error of each backend's runs of that length, and
    # the largest bound (normalised alike) its line is drawn at
    for curve in summary["curves"]:
        for series in (s for s in curve["series"] if s["kind"] == "backend"):
            assert [n for n, _ in series["points"]] == [n for n, _ in series["bound"]] == [8, 12]
            for (n, value), (_, bound) in zip(series["points"], series["bound"]):
                runs = [recomputed[r.backend, r.problem.key()] for r in records if r.backend == series["label"]
                        and r.problem.dtype == curve["dtype"] and r.problem.causal == series["causal"]
                        and r.problem.nq == n]
                assert value == pytest.approx(max(max(f["normalised"]) for f in runs), rel=1e-9)
                assert bound == pytest.approx(max(max(f["bound"]) for f in runs), rel=1e-9)
    # histograms: each backend's counts over its runs of a dtype, and its exactly rounded share
    page = (out / "index.html").read_text(encoding="utf-8")
    for distribution in data.distributions:
        for panel in distribution.panels:
            runs = [recomputed[r.backend, r.problem.key()] for r in records
                    if r.backend == panel.backend and r.problem.dtype == distribution.dtype]
            exact = [x for f in runs for x in f["exact"]]
            assert panel.exactly_rounded == sum(exact) / len(exact)
            assert f"{100 * sum(exact) / len(exact):.1f}% exactly rounded" in page
            assert panel.histograms["backend"] == _histogram([x for f in runs for x in f["normalised"]])
            assert panel.histograms["rounded"] == _histogram([x for f in runs for x in f["rounded_normalised"]])
