"""The report's figures, overview rank and Markdown summary, on small synthetic record sets.

Gold file: tests/gold/report/synthetic_summary.md is what `_records()` below renders to.
After an intended change to summary.md, regenerate it with
    FA_VERIFY_UPDATE_GOLD=1 python3 -m pytest -q tests/test_report_figures.py -k gold
and review the diff. The records are built here, number by number, so the gold file does not
move with BLAS versions or the oracle (unlike tests/gold/report, which holds measured records).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from fa_verify.backends import builtin_backends
from fa_verify.dtypes import round_to
from fa_verify.precision import PrecisionModel
from fa_verify.report.curves import curves
from fa_verify.report.data import build
from fa_verify.report.deviations import KEY as DEVIATION_KEY
from fa_verify.report.distributions import distributions
from fa_verify.report.failure import KEY as FAILURE_KEY
from fa_verify.report.families import KERNELS, NUMPY, OTHER, TORCH, family_of
from fa_verify.report.histogram import histogram
from fa_verify.report.plots import HEADROOM, backend_colours, curve_svg, histograms_svg
from fa_verify.report.render import render_html, render_markdown
from fa_verify.report.yardsticks import (
    EXACTLY_ROUNDED_KEY,
    LARGEST_BOUND_KEY,
    ROUNDED_HISTOGRAM_KEY,
    exactly_rounded,
)
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION, ProblemDescriptor, Record
from fa_verify.sweeps import SWEEPS

GOLD_MD = Path(__file__).parent / "gold" / "report" / "synthetic_summary.md"
STAMP = "2026-01-01T00:00:00+00:00"


def _stats(rmse: float, count: int = 2048) -> dict:
    return {"max": 4 * rmse, "p99": 3 * rmse, "median": rmse, "rmse": rmse, "mean": 0.0, "count": count}


def _views(rmse: float) -> dict:
    return {"abs": _stats(rmse), "normalised": _stats(rmse), "ulp": _stats(rmse * 2048)}


def _record(backend: str, dtype: str, causal: bool, n: int, rmse: float, *, passed: bool = True,
            rule: str | None = None, bound_ratio: float | None = 0.5, unbounded: int = 0,
            exact: int = 1024, largest_bound: float | None = 1e-2, extra: dict | None = None) -> Record:
    """A sweep record of `backend` on an N x N, D = 16 problem whose output RMSE is `rmse`
    (the exactly rounded reference's is 1e-4) and `exact` of its 2048 elements exactly rounded."""
    errors = np.full(2048, 1e-4)
    return Record(
        source="report", backend=backend, precision=PrecisionModel.flash(dtype).as_dict(),
        problem=ProblemDescriptor(batch=1, heads=2, kv_heads=2, nq=n, nk=n, head_dim=16, dtype=dtype,
                                  causal=causal, causal_alignment="bottom-right", scale=None,
                                  distribution="normal", seed=0),
        out_errors={"dtype": dtype, **_views(rmse), "worst_index": [0, 0, 0, 0]},
        lse_errors=_stats(1e-7, 128), bound_ratio=bound_ratio, lse_bound_ratio=0.01,
        ensemble_ratio=0.25, passed=passed, rule=rule, seconds={"run": 0.01}, timestamp=STAMP,
        sweep="synthetic",
        comparisons={EXACTLY_ROUNDED: _views(1e-4), NAIVE_SAME_PRECISION: _views(3e-4)},
        histograms={"normalised": histogram(errors * rmse / 1e-4), "ulp": histogram(errors * 1e4)},
        unbounded=unbounded,
        extra={EXACTLY_ROUNDED_KEY: {"count": exact, "of": 2048}, LARGEST_BOUND_KEY: largest_bound,
               ROUNDED_HISTOGRAM_KEY: histogram(errors), **(extra or {})})


_MASKED_ROW = {"name": "masked-row-lse-zero", "differs": "fully masked rows: LSE 0 instead of -inf",
               "rule": "masked_rows", "property": "fully_masked_rows"}


def _records() -> list[Record]:
    """Three backends of three families over two lengths, fp16 both causal modes (nearly
    correctly rounded; FA2-style with some elements without a finite bound; FA2-style with a
    declared deviation), and one more whose name breaks a Markdown table, failing the bound
    rule in one run and without a finite bound in the other."""
    records = []
    for n in (16, 64):
        for causal in (False, True):
            records.append(_record("naive-fp32", "fp16", causal, n, 1.0e-4, exact=2040, bound_ratio=0.9))
            records.append(_record("fa2-cpu", "fp16", causal, n, 1.25e-4, exact=1300, bound_ratio=0.3,
                                   unbounded=12 * causal))
            deviates = causal and n == 64
            records.append(_record(
                "torch-sdpa-flash-cpu", "fp16", causal, n, 1.3e-4, exact=1250, passed=not deviates,
                rule="masked_rows" if deviates else None,
                extra={DEVIATION_KEY: [_MASKED_ROW]} if deviates else None))
    records.append(_record("my|kernel", "fp16", False, 64, 5e-4, passed=False, rule="error_bound",
                           bound_ratio=3.5, exact=100, extra={FAILURE_KEY: {
                               "tensor": "out", "index": [0, 1, 2, 3], "got": 0.5, "expected": 0.25,
                               "what": "error 0.25 > bound 0.0714"}}))
    records.append(_record("my|kernel", "fp16", True, 64, 2e-4, bound_ratio=0.0, unbounded=2048,
                           exact=900, largest_bound=None))
    return records


def test_the_markdown_summary_matches_its_gold_file():
    text = render_markdown(build(_records(), generated=STAMP, environment={}))
    if os.environ.get("FA_VERIFY_UPDATE_GOLD"):
        GOLD_MD.write_text(text)
    assert text == GOLD_MD.read_text()


def test_the_quick_sweep_draws_error_against_n_at_eight_lengths_or_more():
    data = build([_record("fa2-cpu", p.dtype, p.causal, p.shape.nq, 1e-4)
                  for p in SWEEPS["quick"].points
                  if p.shape.nq == p.shape.nk and p.shape.heads == p.shape.kv_heads], environment={})
    assert [c.dtype for c in data.curves] == ["fp16", "bf16", "fp32"]
    assert all(c.lengths >= 8 for c in data.curves)


def test_exactly_rounded_counts_the_elements_equal_to_the_rounded_reference():
    ref = np.random.default_rng(0).standard_normal((1, 2, 8, 16))
    rounded = round_to(ref, "fp16")
    assert exactly_rounded(rounded, ref, "fp16") == {"count": 256, "of": 256}
    off = rounded.copy()
    off[0, 1, 2, 3] = np.nextafter(off[0, 1, 2, 3], np.float16(np.inf))  # one ULP away
    off[0, 0, 0, 0] = np.float16(ref[0, 0, 0, 0])  # rounded the same way: still exact
    assert exactly_rounded(off, ref, "fp16") == {"count": 255, "of": 256}


def test_every_built_in_backend_has_its_family():
    families = {b.name: family_of(b.name) for b in builtin_backends()}
    assert {name for name, f in families.items() if f == TORCH} == {"torch-sdpa-math", "torch-sdpa-flash-cpu"}
    assert {name for name, f in families.items() if f == NUMPY} == {"numpy-tiled", "naive-same-precision",
                                                                    "naive-fp32", "numpy-ragged-varlen",
                                                                    "numpy-ragged-paged", "numpy-fa2-backward",
                                                                    "numpy-fa3-fp8", "numpy-paged-fp8"}
    assert {name for name, f in families.items() if f == KERNELS} == set(families) - {
        name for name, f in families.items() if f in (TORCH, NUMPY)}
    assert family_of("my_module:attention") == OTHER


def test_curves_are_small_multiples_per_family_with_the_floor_and_each_bound():
    [curve] = curves(_records())
    assert curve.groups == {KERNELS: ["fa2-cpu"], NUMPY: ["naive-fp32"], TORCH: ["torch-sdpa-flash-cpu"],
                            OTHER: ["my|kernel"]}
    kinds = [s.kind for s in curve.series if not s.causal]
    # naive same-precision attention is drawn: it is not among the backends
    assert kinds.count("floor") == 1 and kinds.count("comparison") == 1
    fa2 = next(s for s in curve.series if s.label == "fa2-cpu" and not s.causal)
    assert fa2.points == [(16, 5e-4), (64, 5e-4)] and fa2.bound == [(16, 1e-2), (64, 1e-2)]
    svg = curve_svg(curve, backend_colours(b for names in curve.groups.values() for b in names))
    for text in ("sequence length N", "max normalised error", "our CUDA kernels · full",
                 "torch · causal", "exactly rounded reference (floor)", "naive same-precision attention"):
        assert svg.count(text) >= 1, text
    assert svg.count(">fa2-cpu<") == 1  # one legend entry per backend, not one per panel
    assert "bound up to" not in svg  # 1e-2 is within HEADROOM x the largest error drawn (2e-3)
    # the largest error drawn is naive same-precision's, 1.2e-3: a bound above 30 x that is cut
    [cut] = curves([_record("fa2-cpu", "fp16", False, n, 1e-4, largest_bound=1.2e-3 * HEADROOM * 1.5)
                    for n in (16, 64)])
    assert "bound up to 0.054 ↑" in curve_svg(cut, backend_colours(["fa2-cpu"]))


def test_histograms_state_each_backends_own_share_of_exactly_rounded_elements():
    [fp16] = distributions(_records())
    shares = {d.backend: d.exactly_rounded for d in fp16.panels}
    assert shares == {"fa2-cpu": 1300 / 2048, "naive-fp32": 2040 / 2048, "torch-sdpa-flash-cpu": 1250 / 2048,
                      "my|kernel": 1000 / 4096}
    assert [d.backend for d in fp16.panels] == ["fa2-cpu", "naive-fp32", "torch-sdpa-flash-cpu", "my|kernel"]
    svg = histograms_svg("fp16", fp16.panels, backend_colours(shares))
    for backend, share in shares.items():
        assert f"{100 * share:.1f}% exactly rounded" in svg, backend
    assert "error / row scale" in svg and "share of elements" in svg


def test_the_rank_compares_backends_on_the_columns_they_all_ran():
    # a 16-bit-only FA2-style kernel against a correctly rounding one that also runs fp32, where
    # every kernel is ~10x the rounded reference: on its own columns the first would rank first
    records = [_record("wmma-cpu", dtype, False, 16, 1.25e-4) for dtype in ("fp16", "bf16")]
    records += [_record("naive-fp32", dtype, False, 16, rmse)
                for dtype, rmse in (("fp16", 1e-4), ("bf16", 1e-4), ("fp32", 1.2e-3))]
    data = build(records, environment={})
    assert [c.label for c in data.ranked_on] == ["fp16 · full", "bf16 · full"]
    ranks = [(s.name, round(s.vs_rounded, 6)) for s in data.sections]
    assert ranks == [("naive-fp32", 1.0), ("wmma-cpu", 1.25)]
    # with no column common to all, each backend is ranked on its own
    alone = build(records[2:] + [_record("wmma-cpu", "fp32", True, 16, 2e-4)], environment={})
    assert len(alone.ranked_on) == len(alone.columns) == 4


def test_the_overview_and_the_deviations_table_name_the_same_property_for_a_declared_deviation():
    # a sweep record of a declared deviation: its worst element is an LSE, which alone would
    # point at lse_agreement; the backend declares fully_masked_rows
    lse = {"tensor": "lse", "index": [0, 0, 0], "got": 0.0, "expected": -np.inf,
           "what": "a fully masked row's LSE is not -inf"}
    records = [_record("torch-sdpa-flash-cpu", "fp16", True, 64, 1.3e-4, passed=False, rule="masked_rows",
                       extra={DEVIATION_KEY: [_MASKED_ROW], FAILURE_KEY: lse})]
    data = build(records, environment={})
    [deviation] = data.deviations
    assert data.sections[0].overview[0].failure.property == deviation.property == "fully_masked_rows"
    page = render_html(data)
    overview = page[page.index('id="overview"'):page.index('id="worst"')]
    table = page[page.index('id="deviations"'):page.index('id="fa3"')]
    assert re.findall(r"property <code>(\w+)</code>", overview) == ["fully_masked_rows"]
    assert re.findall(r"<code>(\w+)</code>: <pre>", table) == ["fully_masked_rows"]
    assert "lse_agreement" not in page
    assert re.findall(r"property `(\w+)`", render_markdown(data)) == ["fully_masked_rows"]


def test_the_rank_is_over_the_problems_every_ranked_backend_ran_and_says_which_it_left_out():
    # identical kernels (× rounded 1.25 at N = 16, 1.5 at N = 64) but the time budget skipped
    # slow-cpu's N = 64 run: over its own runs it would be 1.25, ahead of the other two
    records = [_record(name, "fp16", False, n, 1e-4 * x) for name in ("fa2-cpu", "wmma-cpu", "slow-cpu")
               for n, x in ((16, 1.25), (64, 1.5)) if not (name == "slow-cpu" and n == 64)]
    data = build(records, environment={})
    assert {s.name: round(s.vs_rounded, 6) for s in data.sections} == {
        "fa2-cpu": 1.25, "wmma-cpu": 1.25, "slow-cpu": 1.25}
    assert [s.name for s in data.sections] == ["fa2-cpu", "slow-cpu", "wmma-cpu"]  # a tie: by name
    [left] = data.rank_left_out
    assert (left.column, left.problem, left.missing) == ("fp16 · full", "1×2×64×64×16", ["slow-cpu"])
    page = render_html(data)
    assert 'data-left-out="fp16 · full|1×2×64×64×16"' in page and "not run by slow-cpu" in page
    assert "Left out of the rank (not run by every ranked backend): fp16 · full 1×2×64×64×16 " \
           "(not run by slow-cpu)." in render_markdown(data)
    # the overview's cells still pool each backend's own runs
    assert round(next(s for s in data.sections if s.name == "fa2-cpu").overview[0].vs_rounded, 3) == 1.381


def test_bounds_are_lines_coinciding_curves_are_named_together_and_a_stopping_bound_says_why():
    # three kernels of one family with the same errors and one precision model (one bound), and
    # a 16-bit one whose bound has no finite element past N = 16
    records = [_record(name, "bf16", causal, n, 1.25e-4) for name in ("fa2-cpu", "mma-ptx-cpu", "wmma-cpu")
               for n in (16, 64) for causal in (False, True)]
    records += [_record("naive16-cuda-cpu", "bf16", causal, n, 4e-4, largest_bound=3e-3 if n == 16 else None)
                for n in (16, 64) for causal in (False, True)]
    data = build(records, environment={})
    [curve] = data.curves
    assert curve.coinciding == [["fa2-cpu", "mma-ptx-cpu", "wmma-cpu"]]
    stops = {s.label: s.bound_ends for s in curve.series if s.kind == "backend"}
    assert stops == {"fa2-cpu": None, "mma-ptx-cpu": None, "wmma-cpu": None, "naive16-cuda-cpu": 16}
    svg = curve_svg(curve, backend_colours(["fa2-cpu", "mma-ptx-cpu", "wmma-cpu", "naive16-cuda-cpu"]))
    assert "PolyCollection" not in svg  # no shaded band: translucent bands over one another are unreadable
    assert svg.count("fa2-cpu, mma-ptx-cpu, wmma-cpu (coincide)") == 1 and ">mma-ptx-cpu<" not in svg
    assert svg.count("bound of fa2-cpu = mma-ptx-cpu = wmma-cpu") == 1
    assert svg.count("no finite bound past N = 16: its model's error reaches 1/4") == 2  # full and causal
    assert "PolyCollection" not in curve_svg(curves(_records())[0], backend_colours(
        ["fa2-cpu", "naive-fp32", "torch-sdpa-flash-cpu", "my|kernel"]))
