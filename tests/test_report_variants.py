"""`fa_verify report --sweep variants` and `--sweep decode`: the sweeps' points, records that
keep a problem's variant parameters, and the report's per-feature tables, figures and
not-applicable backends, on tiny sweeps of the numpy backends (seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fa_verify.backends import NaiveBackend, get_backend
from fa_verify.problem import FEATURES
from fa_verify.report import write_report
from fa_verify.report.data import build
from fa_verify.report.plots import backend_colours, curve_svg
from fa_verify.report.runner import run_sweep
from fa_verify.results import ProblemDescriptor, Record, ResultsStore
from fa_verify.sweeps import (
    CAUSAL,
    DTYPES,
    QUICK_LENGTHS,
    SWEEPS,
    TILE,
    VARIANT_POINTS,
    Sweep,
    Variant,
    grid,
)

COMBINED = "window + softcap + alibi + sinks"


def _dense_only() -> NaiveBackend:
    """A backend that implements no variant (the built-in ones may gain them)."""
    backend = NaiveBackend("fp32")
    backend.name, backend.features = "dense-only", ()
    return backend


def _row_maxima(problem) -> np.ndarray:
    """Each row's largest scaled score q.k / sqrt(D) over the keys it attends, [B, H, rows that
    attend a key]."""
    k, _ = problem.kv64()
    scores = np.einsum("bhid,bhjd->bhij", problem.q64(), k) * problem.scale_value
    live = ~problem.masked_rows
    return np.where(problem.mask, scores, -np.inf).max(-1)[..., live]


# --- the sweeps ------------------------------------------------------------------------------

def test_the_variants_sweep_runs_each_feature_alone_and_combined_in_every_column():
    points = SWEEPS["variants"].points
    assert set(points) == {p for group in VARIANT_POINTS.values() for p in group}
    expected = {(f,) for f in FEATURES} | {tuple(FEATURES)}
    assert {p.variant.features for p in points} == expected
    for features in expected:
        mine = [p for p in points if p.variant.features == features]
        assert {(p.dtype, p.causal) for p in mine} == {(d, c) for d in DTYPES for c in CAUSAL}, features
        # each feature has an error-vs-N family: one variant at several N, Nq = Nk, MHA
        lengths = {}
        for p in mine:
            if p.shape.nq == p.shape.nk and p.shape.heads == p.shape.kv_heads:
                lengths.setdefault(p.variant, set()).add(p.shape.nq)
        assert max(map(len, lengths.values())) >= 4, features


def test_the_variants_sweep_has_the_parameters_where_kernels_break():
    points = SWEEPS["variants"].points
    windows = {(p.variant.window_size, p.shape.nk) for p in points if p.variant.features == ("window",)}
    left = {w[0] for w, _ in windows}
    assert {TILE - 1, TILE + 1} <= {side for w, _ in windows for side in w}  # edges across a tile
    assert 0 in left and min(left - {0}) <= 8  # the diagonal alone, a small window
    assert any(min(w) > nk for w, nk in windows)  # wider than N
    assert any(p.shape.nq < p.shape.nk for p in points if p.variant.features == ("window",))
    alibi = [p for p in points if p.variant.features == ("alibi",)]
    assert {p.variant.alibi for p in alibi} == {"heads", "batch"}
    assert any(p.shape.heads > p.shape.kv_heads for p in alibi)  # the query head picks the slope
    problem = next(p for p in alibi if p.variant.alibi == "batch").problem()
    assert problem.alibi_slopes.shape == (problem.batch, problem.heads)
    assert len({tuple(row) for row in problem.alibi_slopes}) == problem.batch


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
def test_softcaps_bind_or_not_and_sinks_lie_above_among_or_below_the_row_maxima(feature):
    """The claims of VARIANT_POINTS' comment, checked on the sweep's own problems (fp32, so
    both causal modes and every length, without rebuilding each dtype)."""
    seen = set()
    for point in VARIANT_POINTS[feature]:
        if point.dtype != "fp32":
            continue
        problem = point.problem()
        maxima = _row_maxima(problem)
        if feature == "softcap":
            largest = np.abs(maxima).max()
            seen.add("binds" if problem.softcap < largest else
                     "does not bind" if problem.softcap > 5 * largest else "in between")
        else:
            sinks = problem.sinks[None, :, None]
            seen.add("above" if (sinks > maxima).all() else "below" if (sinks < maxima).all() else "among")
    assert seen == ({"binds", "does not bind"} if feature == "softcap" else {"above", "among", "below"})


def test_the_decode_sweep_is_the_quick_family_with_one_query():
    quick = {(p.shape.heads, p.shape.kv_heads, p.shape.head_dim) for p in SWEEPS["quick"].points
             if p.shape.nq == p.shape.nk and p.shape.heads == p.shape.kv_heads}
    decode = SWEEPS["decode"].points
    family = [p for p in decode if (p.shape.heads, p.shape.kv_heads, p.shape.head_dim) in quick]
    assert all(p.shape.nq == 1 for p in decode)
    assert sorted({p.shape.nk for p in family}) == list(QUICK_LENGTHS)
    assert {(p.dtype, p.causal) for p in family} == {(d, c) for d in DTYPES for c in CAUSAL}


# --- records ---------------------------------------------------------------------------------

def test_a_record_keeps_the_variant_parameters_and_rebuilds_the_problem():
    point = grid([(2, 4, 2, 16, 24, 16)], dtypes=("bf16",), causal=(True,), variants=(
        Variant(window_size=(3, 5), softcap=2.0, alibi="batch", sinks=-1.5),))[0]
    problem = point.problem()
    descriptor = ProblemDescriptor.of(problem)
    stored = Record.from_json(Record(
        source="report", backend="b", precision={}, problem=descriptor, out_errors=None,
        lse_errors=None, bound_ratio=None, lse_bound_ratio=None, ensemble_ratio=None, passed=True,
        rule=None, seconds={}, timestamp="").to_json()).problem
    assert stored == descriptor and hash(stored.key())
    assert stored.features == tuple(FEATURES)
    assert stored.variant.startswith("window_size=(3, 5) softcap=2 alibi_slopes=[[0.25, ")
    again = stored.rebuild()
    assert again.window_size == (3, 5) and again.softcap == 2.0
    np.testing.assert_array_equal(again.alibi_slopes, problem.alibi_slopes)
    np.testing.assert_array_equal(again.sinks, problem.sinks)
    assert again.q.tobytes() == problem.q.tobytes()
    # a dense problem's descriptor reads as before variants existed
    assert ProblemDescriptor.of(grid([(1, 2, 2, 8, 8, 16)])[0].problem()).variant == ""


# --- the report ------------------------------------------------------------------------------

#: Two features alone and all four together at two lengths, fp16, both causal modes (each
#: feature's figures take seconds to draw: the sweep's coverage of all is checked above).
TINY_VARIANTS = Sweep("tiny-variants", "per feature", grid(
    [(1, 2, 2, 16, 16, 16), (1, 2, 2, 32, 32, 16)], dtypes=("fp16",),
    variants=(Variant(window_size=(4, 4)), Variant(sinks=2.0),
              Variant(window_size=(4, 4), softcap=1.0, alibi="heads", sinks=2.0))),
    budget_s=60.0)


@pytest.fixture(scope="module")
def variants_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("variants")
    store = ResultsStore(out / "results.jsonl")
    info = run_sweep(TINY_VARIANTS, [get_backend("numpy-tiled"), _dense_only()], store, out_dir=out)
    write_report(store.read(), out, run=info, generated="2026-01-01T00:00:00+00:00")
    return out, store.read()


def test_a_variants_report_has_tables_and_plots_per_feature(variants_report):
    out, records = variants_report
    assert {r.backend for r in records} == {"numpy-tiled"} and all(r.passed for r in records)
    summary = json.loads((out / "summary.json").read_text())
    groups = {g["name"]: g for g in summary["features"]}
    assert list(groups) == ["window", "sinks", COMBINED]
    for name, g in groups.items():
        assert g["runs"] == 4 and [s["name"] for s in g["sections"]] == ["numpy-tiled"], name
        [curve] = g["curves"]
        assert curve["dtype"] == "fp16" and curve["shape_family"] == "Nq = Nk, D = 16, MHA, normal inputs"
        assert curve["variant"] in g["parameters"], name
        assert [d["dtype"] for d in g["distributions"]] == ["fp16"], name
        cells = [c for c in g["sections"][0]["overview"] if c]
        assert len(cells) == 2 and all(c["runs"] == 2 for c in cells), name
    assert groups["window"]["parameters"] == ["window_size=(4, 4)"]
    assert groups["sinks"]["parameters"] == ["sinks=[2, 2.5]"]
    assert summary["curves"] == []  # no dense problem: the top-level curves are dense ones
    page = (out / "index.html").read_text()
    assert 'id="features"' in page and page.count('id="feature-') == 3
    for name in groups:
        assert f'data-feature="{name}|numpy-tiled|fp16 · causal"' in page, name
    # a curve and a histogram per feature, besides the top-level histograms and sparklines
    assert page.count("error against sequence length (Nq = Nk") == 3
    assert page.count("normalised error per backend; grey") == 4
    md = (out / "summary.md").read_text()
    assert "## Per feature" in md and "### window: 4 runs, all pass" in md
    # the per-backend rows give each feature its own, with the parameters in the shapes
    assert f"{COMBINED} · N 17–64 · D 1–32 · MHA" in page
    assert "1×2×32×32×16 window_size=(4, 4) softcap=1 alibi_slopes=[0.0625, 0.00391] sinks=[2, 2.5]" in page


def test_a_backend_without_a_feature_is_listed_not_applicable_with_why(variants_report):
    out, _ = variants_report
    summary = json.loads((out / "summary.json").read_text())
    for g in summary["features"]:
        [na] = g["not_applicable"]
        assert na["backend"] == "dense-only" and na["count"] == 4 and na["kind"] == "unsupported"
        missing = "window, softcap, alibi, sinks" if g["name"] == COMBINED else g["name"]
        assert na["reason"].startswith(f"dense-only does not implement {missing} "), na["reason"]
    page = (out / "index.html").read_text()
    assert 'data-na="sinks|dense-only"' in page
    assert "not applicable to **dense-only** (4 points): dense-only does not implement window (" in (
        out / "summary.md").read_text()


def test_decode_curves_draw_error_against_the_key_length(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    decode = Sweep("tiny-decode", "", grid([(1, 2, 2, 1, n, 16) for n in (16, 32, 64)],
                                           dtypes=("fp16",)), budget_s=60.0)
    run_sweep(decode, [get_backend("numpy-tiled")], store)
    [curve] = build(store.read(), environment={}).curves
    assert curve.axis == "key length Nk" and curve.lengths == 3
    assert curve.shape_family == "Nq = 1 (decode), D = 16, MHA, normal inputs"
    svg = curve_svg(curve, backend_colours(["numpy-tiled"]))
    assert "key length Nk" in svg and "fp16: error against key length (Nq = 1 (decode)" in svg
