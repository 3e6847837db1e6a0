"""`fa_verify report`: the sweep runner, the data layer, the rendered page and summaries.

Gold files: tests/gold/report/results.jsonl holds real records (a tiny sweep of numpy-tiled,
torch-sdpa-flash-cpu and naive-same-precision, FA3-setup runs of numpy-tiled and
naive16-cuda-cpu, a pytest record and a crashed run; timestamps and timings fixed); summary.md and summary.json are what they render to, with the environment
scrubbed. After an intended change, regenerate with FA_VERIFY_UPDATE_GOLD=1 and review the diff.
The gold records predate the runner's not-tiny ULP statistics and worst elements
(`report.ulp`, `report.failure`), so their cells show no ULP figure ("—"): re-running their
problems today gives slightly different outputs (the reference and BLAS orders moved), so the
new figures cannot honestly be added to the old records; the tests below that run sweeps cover them.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import NaiveBackend, NumpyTiledBackend, get_backend
from fa_verify.backends.torch_sdpa import MASKED_ROW_LSE_ZERO
from fa_verify.cli.main import main
from fa_verify.oracle import reference as _reference
from fa_verify.report import write_report
from fa_verify.report.budget import Budget
from fa_verify.report.buckets import bucket_of, column_of
from fa_verify.report.data import build, has_finite_bound
from fa_verify.report.deviations import KEY as DEVIATION_KEY
from fa_verify.report.histogram import EDGES, histogram, merge
from fa_verify.report.plots import backend_colours
from fa_verify.report.render import render_html
from fa_verify.report.run_info import RunInfo
from fa_verify.report.runner import run_sweep
from fa_verify.report.yardsticks import EXACTLY_ROUNDED_KEY, LARGEST_BOUND_KEY, ROUNDED_HISTOGRAM_KEY
from fa_verify.results import ResultsStore, ResultsWarning
from fa_verify.sweeps import SWEEPS, Sweep, Variant, grid

GOLD = Path(__file__).parent / "gold" / "report"
GENERATED = "2026-01-01T00:00:00+00:00"


@pytest.fixture(scope="module")
def gold_records():
    return ResultsStore(GOLD / "results.jsonl").read()


@pytest.fixture(scope="module")
def rendered(gold_records, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    write_report(gold_records, out, generated=GENERATED)
    return out


# --- the rendered outputs ------------------------------------------------------------------


class _Cells(HTMLParser):
    """data-v values of the numbers inside each summary cell, by the cell's data-key."""

    def __init__(self):
        super().__init__()
        self.cells, self._key, self._depth = {}, None, 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "td" and "data-key" in attrs:
            self._key, self._depth = attrs["data-key"], 0
            self.cells[self._key] = []
        elif self._key and tag == "td":
            self._depth += 1
        if self._key and tag == "span" and "data-v" in attrs:
            self.cells[self._key].append(attrs["data-v"])

    def handle_endtag(self, tag):
        if self._key and tag == "td":
            if self._depth == 0:
                self._key = None
            else:
                self._depth -= 1


def test_rendered_numbers_equal_the_stored_metrics(gold_records, rendered):
    parser = _Cells()
    parser.feed((rendered / "index.html").read_text())
    single, not_applicable = {}, 0
    for r in gold_records:
        key = f"{r.backend}|{bucket_of(r.problem).label}|{column_of(r.problem).label}"
        single.setdefault(key, []).append(r)
    checked = 0
    for key, records in single.items():
        if len(records) != 1 or records[0].out_errors is None or not records[0].comparisons:
            continue
        r = records[0]
        e, ulp = r.out_errors, r.extra.get("ulp_not_tiny") or {}
        rounded = r.comparisons["exactly-rounded"]["abs"]["rmse"]
        vs_rounded, *numbers = parser.cells[key]
        # × rounded pools RMSEs, sqrt(n·rmse²/n): equal to rounding
        assert float(vs_rounded) == pytest.approx(e["abs"]["rmse"] / rounded, rel=1e-12), key
        expected = [ulp.get("max"), ulp.get("p99"), e["normalised"]["max"], e["normalised"]["p99"]]
        # n/a (no number) where no element that attends a key has a finite bound
        expected += [r.bound_ratio] if has_finite_bound(r) else []
        expected += [r.ensemble_ratio]
        assert numbers == ["" if x is None else repr(float(x)) for x in expected], key
        checked += 1
        not_applicable += not has_finite_bound(r)
    assert checked >= 20
    assert not_applicable >= 2  # naive16-cuda-cpu's runs: no element has a finite bound


def test_summary_json_is_strict_and_matches_the_records(gold_records, rendered):
    text = (rendered / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert summary["format_version"] == 8
    assert summary["totals"]["records"] == len(gold_records)
    declared = [r for r in gold_records if r.extra.get("declared_deviation")]
    assert len(declared) == 3 and {r.backend for r in declared} == {"torch-sdpa-flash-cpu"}
    assert summary["totals"]["deviations"] == 3
    assert summary["totals"]["failed"] == sum(not r.passed for r in gold_records) - 3
    assert summary["passed"] is False  # the crashed run
    [deviation] = summary["deviations"]
    assert (deviation["convention"], deviation["rule"], deviation["property"], deviation["runs"]) \
        == ("masked-row-lse-zero", "masked_rows", "fully_masked_rows", 3)
    fa3 = {row["name"]: row for row in summary["fa3"]["rows"]}
    assert fa3["numpy-tiled"]["runs"] == 4  # fp16 and bf16, seeds 0 and 1
    assert summary["fa3"]["paper"]["FlashAttention-2 (fp16)"] == 1.9e-4


def _scrub_reproducers(value):
    """Every reproducer command (its path is the temporary report folder's) as "<reproducer>"."""
    if isinstance(value, dict):
        return {k: (v and "<reproducer>") if k == "reproducer" else _scrub_reproducers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_reproducers(v) for v in value]
    return value


def _scrub_json(summary: dict) -> dict:
    """The machine's environment and the reproducers' paths vary."""
    return {**_scrub_reproducers(summary), "environment": "<scrubbed>"}


def _scrub_md(text: str) -> str:
    return re.sub(r"^  python3 \S*repro_\S*\.py$", "  <reproducer>", text, flags=re.MULTILINE)


def test_summaries_match_the_gold_files(rendered):
    md = _scrub_md((rendered / "summary.md").read_text())
    summary = _scrub_json(json.loads((rendered / "summary.json").read_text()))
    if os.environ.get("FA_VERIFY_UPDATE_GOLD"):
        (GOLD / "summary.md").write_text(md)
        (GOLD / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    assert md == (GOLD / "summary.md").read_text()
    assert summary == json.loads((GOLD / "summary.json").read_text())


def test_page_is_self_contained_and_shows_every_section(rendered):
    page = (rendered / "index.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page), "the page must not load anything"
    assert "<link" not in page and "<script" not in page
    for anchor in ("overview", "worst", "fa3", "curves", "histograms", "backends", "skipped", "environment"):
        assert f'id="{anchor}"' in page
    assert page.count("<svg") >= 4  # curves, histograms and sparklines are inline
    assert re.search(r"<code>python3 [^<]*/repro/repro_oracle_agreement", page)  # a reproducer
    assert "masked_rows" in page and "run_error" in page


def test_every_string_from_the_records_is_escaped(gold_records, tmp_path):
    hostile = gold_records[0].__class__(**{**gold_records[0].__dict__,
                                           "backend": "<script>alert(1)</script>",
                                           "passed": False, "rule": "<b>rule</b>",
                                           "extra": {"error": "<img src=x onerror=alert(1)>"}})
    page = render_html(build([hostile], generated=GENERATED, environment={}))
    assert "<script>" not in page and "<img" not in page and "<b>rule" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_a_partial_store_renders(gold_records, tmp_path):
    path = tmp_path / "results.jsonl"
    text = (GOLD / "results.jsonl").read_text()
    path.write_text(text[: len(text) - 300])  # the last line was being written when killed
    with pytest.warns(ResultsWarning, match="truncated last line"):
        records = ResultsStore(path).read()
    assert len(records) == len(gold_records) - 1
    data = write_report(records, tmp_path / "out", generated=GENERATED)
    assert data.totals.records == len(records)
    assert (tmp_path / "out" / "index.html").stat().st_size > 10_000


# --- a real browser ------------------------------------------------------------------------

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browse(page: Path, tmp_path, height: int) -> tuple:
    """(the screenshot of `page` in headless Chromium, 1400 px wide, as a PIL image; the DOM
    after loading it). Fails on console errors; skips without a browser."""
    browser = next((shutil.which(b) for b in _BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no chromium binary on PATH: install it with "
                    "'apt-get update && apt-get install -y chromium' to run this test")
    shot = tmp_path / "report.png"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}"]
    result = subprocess.run([*flags, f"--window-size=1400,{height}", f"--screenshot={shot}", "--dump-dom",
                             page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    from PIL import Image  # matplotlib's dependency

    with Image.open(shot) as image:
        image.load()
    if os.environ.get("FA_VERIFY_SCREENSHOT_DIR"):  # for CI artifacts and for looking at it
        shutil.copy(shot, Path(os.environ["FA_VERIFY_SCREENSHOT_DIR"]) / f"{page.parent.name}.png")
    dom = result.stdout
    return image, dom


def _not_blank(image) -> None:
    grey = np.asarray(image.convert("L"), dtype=float)
    assert grey.std() > 10, f"the screenshot is blank (grey level std {grey.std():.1f})"
    colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 50, "the screenshot has almost no colours"


def test_page_loads_in_headless_chromium_without_errors(rendered, tmp_path):
    image, dom = _browse(rendered / "index.html", tmp_path, 2400)
    assert image.size == (1400, 2400)
    _not_blank(image)
    assert "FlashAttention-3 Table 3" in dom and dom.count('class="cell ') >= 20


#: Writes the rendered widths of the overview's header cells into the page, for --dump-dom.
_WIDTHS = """<script>document.body.dataset.widths = JSON.stringify([...document.querySelector(
  'table.overview').rows[0].cells].map(cell => cell.getBoundingClientRect().width));</script>"""


def test_the_overviews_dtype_and_causal_columns_are_as_wide_as_one_another(rendered, tmp_path):
    # the gold records' causal cells hold a declared deviation's text, the full ones a few words
    probe = tmp_path / "probe" / "index.html"
    probe.parent.mkdir()
    probe.write_text((rendered / "index.html").read_text().replace("</body>", _WIDTHS + "</body>"))
    _, dom = _browse(probe, tmp_path, 1200)
    widths = json.loads(html.unescape(re.search(r'data-widths="([^"]*)"', dom).group(1)))
    columns = widths[3:]  # after backend, runs and × rounded
    assert len(columns) == 6 and max(columns) - min(columns) <= 1, widths


class _Page(HTMLParser):
    """From a dumped DOM: the overview's cells (text, × rounded data-v) by data-overview key,
    and the <text> of the SVG figures under the curves and histograms headings."""

    def __init__(self):
        super().__init__()
        self.overview, self.figure_text = {}, {"curves": [], "histograms": []}
        self._cell = self._section = None
        self._in_text = self._headline = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "h2":
            self._section = attrs.get("id")
        elif tag == "td" and "data-overview" in attrs:
            self._cell = {"text": "", "vs_rounded": None}
            self.overview[attrs["data-overview"]] = self._cell
        elif tag == "b" and self._cell is not None and "headline" in (attrs.get("class") or ""):
            self._headline = True
        elif tag == "span" and self._headline and "data-v" in attrs:
            self._cell["vs_rounded"] = attrs["data-v"]
        self._in_text = tag == "text" and self._section in self.figure_text

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None
        elif tag == "b":
            self._headline = False
        self._in_text = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data
        if self._in_text:
            self.figure_text[self._section].append(data.strip())


#: Two lengths of one MHA family in two dtypes: the smallest sweep with curves.
FIGURES = Sweep("figures", "two lengths", grid([(1, 2, 2, 16, 16, 16), (1, 2, 2, 32, 32, 16)],
                                               dtypes=("fp16", "fp32")), budget_s=60.0)


def test_a_screenshot_shows_the_headline_cells_and_labelled_figures(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    run_sweep(FIGURES, [get_backend("numpy-tiled"), NaiveBackend("fp32")], store)
    out = tmp_path / "figures"
    write_report(store.read(), out, generated=GENERATED)
    summary = json.loads((out / "summary.json").read_text())
    image, dom = _browse(out / "index.html", tmp_path, 7000)
    _not_blank(image)
    # the figures were drawn: each backend's colour is on screen (tables and text have none)
    pixels = np.asarray(image.convert("RGB"), dtype=int)
    for backend, colour in backend_colours(["numpy-tiled", "naive-fp32"]).items():
        near = np.abs(pixels - np.round(np.array(colour) * 255)).sum(axis=-1) < 40
        assert near.sum() > 100, f"{backend}'s colour is missing from the screenshot"
    page = _Page()
    page.feed(dom)
    # the headline cells: × rounded and pass/fail as summary.json has them
    expected = {f"{s['name']}|{column}": cell for s in summary["sections"]
                for column, cell in zip(summary["columns"], s["overview"]) if cell}
    assert set(page.overview) == set(expected) and len(expected) == 8
    for key, cell in expected.items():
        assert page.overview[key]["vs_rounded"] == repr(float(cell["vs_rounded"])), key
        text = " ".join(page.overview[key]["text"].split())
        assert text.startswith(f"{cell['runs']} pass · × rounded "), key
    # the figures and their labels
    curves, histograms = page.figure_text["curves"], page.figure_text["histograms"]
    for dtype in ("fp16", "fp32"):
        assert f"{dtype}: error against sequence length (Nq = Nk, D = 16, MHA, normal inputs)" in curves
        assert f"{dtype}: normalised error per backend; grey: the exactly rounded reference" in histograms
    for label in ("sequence length N", "max normalised error", "numpy models · full",
                  "numpy models · causal", "exactly rounded reference (floor)"):
        assert label in curves, label
    assert "error / row scale" in histograms and "share of elements" in histograms
    shares = [f"{100 * d['exactly_rounded']:.1f}% exactly rounded"
              for dist in summary["distributions"] for d in dist["panels"]]
    assert len(shares) == 4 and all(share in histograms for share in shares)
    assert "100.0% exactly rounded" not in shares[:1]  # numpy-tiled rounds P to fp16: not all exact


# --- the ranking ---------------------------------------------------------------------------

#: One N = 256, D = 64 shape in every dtype and causal mode: enough elements for a stable RMSE.
RANKING = Sweep("ranking", "the built-in backends' accuracy",
                grid([(1, 2, 2, 256, 256, 64)]), budget_s=60.0)
NEARLY_CORRECTLY_ROUNDED = ("naive-fp32", "torch-sdpa-math")  # P and P·V in fp32, one rounding
FA2_STYLE = ("numpy-tiled", "fa2-cpu")  # P rounded to fp16/bf16 before P·V


def test_the_overview_ranks_backends_by_their_error_over_the_exactly_rounded_one(tmp_path):
    pytest.importorskip("torch")
    store = ResultsStore(tmp_path / "results.jsonl")
    run_sweep(RANKING, [get_backend(n) for n in FA2_STYLE + NEARLY_CORRECTLY_ROUNDED], store)
    data = build(store.read(), generated=GENERATED, environment={})
    sections = {s.name: s for s in data.sections}
    figures = {name: {c.label: cell.vs_rounded for c, cell in zip(data.columns, s.overview)}
               for name, s in sections.items()}
    print({name: {k: round(v, 3) for k, v in f.items()} | {"rank": round(sections[name].vs_rounded, 3)}
           for name, f in figures.items()})
    for f in figures.values():  # rounding to nearest has the least error: 1 is the limit
        assert all(v >= 1 for v in f.values()), f
    for column in data.columns:
        if column.dtype == "fp32":  # every backend accumulates in fp32 there: no class apart
            continue
        accurate = [figures[n][column.label] for n in NEARLY_CORRECTLY_ROUNDED]
        fa2 = [figures[n][column.label] for n in FA2_STYLE]
        assert max(accurate) < 1.05 < min(fa2), (column.label, accurate, fa2)
        # ULPs where the output is not tiny: one rounding (≤ 1 ULP) for the accurate ones, more
        # for FA2-style ones; over all elements both reach hundreds at cancelling outputs
        ulp = {s.name: s.overview[data.columns.index(column)].ulp_max for s in data.sections}
        assert max(ulp[n] for n in NEARLY_CORRECTLY_ROUNDED) <= 1 < min(ulp[n] for n in FA2_STYLE), ulp
    for r in store.read():  # a subset's maximum; for FA2-style kernels far below the whole's
        assert r.extra["ulp_not_tiny"]["max"] <= r.out_errors["ulp"]["max"], r.backend
        if r.backend in FA2_STYLE and r.problem.dtype != "fp32":
            assert 10 * r.extra["ulp_not_tiny"]["max"] < r.out_errors["ulp"]["max"], r.backend
    ranked = [s.name for s in data.sections]
    assert set(ranked[:2]) == set(NEARLY_CORRECTLY_ROUNDED) and set(ranked[2:]) == set(FA2_STYLE)
    page = render_html(data)
    overview = page[page.index('id="overview"'):page.index('id="worst"')]
    assert [overview.index(f">{name}</a>") for name in ranked] == sorted(
        overview.index(f">{name}</a>") for name in ranked)  # the page shows them in rank order


# --- the sweep runner ----------------------------------------------------------------------

TINY = Sweep("tiny", "two shapes", grid([(1, 2, 2, 8, 8, 16), (1, 2, 1, 24, 24, 16)],
                                         dtypes=("fp16", "fp32")), budget_s=60.0)


def test_runner_records_every_point_with_comparisons_and_histograms(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    backends = [get_backend("numpy-tiled"), NaiveBackend("fp32")]
    info = run_sweep(TINY, backends, store, out_dir=tmp_path)
    records = store.read()
    assert len(records) == len(TINY.points) * 2 and not info.skips
    for r in records:
        assert r.source == "report" and r.sweep == "tiny" and r.passed
        assert set(r.comparisons) == {"exactly-rounded", "naive-same-precision"}
        elements = r.out_errors["ulp"]["count"]
        for h in (r.histograms["ulp"], r.extra[ROUNDED_HISTOGRAM_KEY]):
            assert h["zero"] + h["under"] + sum(h["bins"]) + h["over"] == elements
        exact = r.extra[EXACTLY_ROUNDED_KEY]
        assert exact["of"] == elements and 0 < exact["count"] <= elements
        assert r.extra[LARGEST_BOUND_KEY] > r.out_errors["normalised"]["max"]
        assert set(r.seconds) == {"run", "check", "reference"}
    assert RunInfo.load(tmp_path).backends == ["numpy-tiled", "naive-fp32"]
    # --resume: nothing is left to do
    again = run_sweep(TINY, backends, store, done=store.keys())
    assert len(store.read()) == len(records) and not again.skips


def test_budget_skips_the_larger_points_and_says_so(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    stingy = Sweep("stingy", "", TINY.points, budget_s=0.0)
    info = run_sweep(stingy, [get_backend("numpy-tiled")], store)
    assert len(store.read()) == 1  # the first run cannot be predicted, so it runs
    assert {s.kind for s in info.skips} == {"budget"} and len(info.skips) == len(TINY.points) - 1
    assert "budget" in info.skips[0].reason


def test_budget_predicts_from_the_largest_run():
    budget = Budget(10.0)
    assert budget.refusal(10**9) is None  # nothing to predict from yet
    budget.charge(100, 1.0)
    budget.charge(1000, 2.0)
    assert budget.predict(2000) == pytest.approx(4.0)
    assert budget.refusal(3000) is None and "exceeds the 7.0 s left" in budget.refusal(4000)


class _Interrupting(NaiveBackend):
    def __init__(self, after):
        super().__init__("fp32")
        self.calls, self.after = 0, after

    def _run(self, problem):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt
        return super()._run(problem)


def test_an_interrupted_sweep_keeps_its_records_and_says_so(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    with pytest.raises(KeyboardInterrupt):
        run_sweep(TINY, [_Interrupting(after=3)], store, out_dir=tmp_path)  # warm-up + 2 runs
    assert len(store.read()) == 2
    assert RunInfo.load(tmp_path).interrupted


def test_histograms_bin_and_merge():
    h = histogram([0.0, 0.0, 1e-13, 1.0, float("nan"), 1e9])
    assert (h["zero"], h["under"], h["over"], sum(h["bins"])) == (2, 1, 2, 1)
    assert len(h["bins"]) == len(EDGES) - 1
    both = merge([h, None, h])
    assert both["zero"] == 4 and sum(both["bins"]) == 2 and merge([None]) is None


#: One causal point with Nq > Nk: its first rows attend no key.
MASKED = Sweep("masked", "fully masked rows", grid([(1, 2, 1, 20, 12, 16)], dtypes=("fp32",),
                                                   causal=(True,)), budget_s=60.0)


class _MaskedLse(NumpyTiledBackend):
    """numpy-tiled declaring torch flash's masked-row LSE 0; it writes `masked_lse` there and
    scales its output by `skew`."""

    deviations = (MASKED_ROW_LSE_ZERO,)

    def __init__(self, name, masked_lse=0.0, skew=1.0):
        super().__init__()
        self.name, self.masked_lse, self.skew = name, masked_lse, skew

    def _run(self, problem):
        out, lse = super()._run(problem)
        lse = np.where(problem.masked_rows, np.float32(self.masked_lse), lse)
        return (out * self.skew).astype(out.dtype), lse


def test_only_a_declared_convention_makes_a_declared_deviation(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    backends = [_MaskedLse("declared"), _MaskedLse("other-value", masked_lse=5.0),
                _MaskedLse("also-wrong", skew=1.01)]
    run_sweep(MASKED, backends, store)
    records = {r.backend: r for r in store.read()}
    assert all(not r.passed and r.rule == "masked_rows" for r in records.values())
    assert records["declared"].extra[DEVIATION_KEY][0]["name"] == "masked-row-lse-zero"
    assert DEVIATION_KEY not in records["other-value"].extra
    assert DEVIATION_KEY not in records["also-wrong"].extra  # error_bound fails too
    data = build(list(records.values()), generated=GENERATED, environment={})
    assert (data.totals.failed, data.totals.deviations) == (2, 1)
    assert [(d.backend, d.property) for d in data.deviations] == [("declared", "fully_masked_rows")]
    assert {c.backend for c in data.failures} == {"other-value", "also-wrong"}


class _OneWrong(NumpyTiledBackend):
    """numpy-tiled (under its own name, so a reproducer can be written) with one output element
    off by 1: out[0, 1, 15, 2] breaks the error-model bound."""

    def _run(self, problem):
        out, lse = super()._run(problem)
        out = out.copy()
        out[0, 1, 15, 2] += 1
        return out, lse


def test_a_failing_cell_shows_its_rule_worst_element_property_and_reproducer(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    run_sweep(MASKED, [_OneWrong(), _MaskedLse("other-value", masked_lse=5.0)], store)
    records = {r.backend: r for r in store.read()}
    data = build(list(records.values()), generated=GENERATED, environment={}, repro_dir=tmp_path / "repro")
    cells = {s.name: s.overview[0] for s in data.sections}
    wrong = cells["numpy-tiled"].failure
    assert (wrong.rule, wrong.element["tensor"], wrong.element["index"]) == ("error_bound", "out", [0, 1, 15, 2])
    problem = records["numpy-tiled"].problem.rebuild()
    expected = _reference(problem).out[0, 1, 15, 2]
    assert wrong.element["expected"] == expected
    assert wrong.element["got"] == pytest.approx(expected + 1, abs=1e-5)
    assert wrong.property == "oracle_agreement"
    # it replays the property that sees it, only
    assert re.search(r"/repro/repro_oracle_agreement_[0-9a-f]+\.py$", wrong.reproducer)
    masked = cells["other-value"].failure  # not a built-in: no reproducer
    assert (masked.rule, masked.element["tensor"], masked.element["got"], masked.element["expected"],
            masked.property, masked.reproducer) == ("masked_rows", "lse", 5.0, -np.inf, "lse_agreement", None)
    page = render_html(data)
    assert "out[0, 1, 15, 2] = " in page and "seen by property <code>oracle_agreement</code>" in page
    assert "lse[0, 0, 0] = 5, expected -inf" in page


def test_the_worst_element_is_the_one_its_rule_saw():
    from fa_verify.report.failure import worst_element
    from fa_verify.strategies import make_problem
    from fa_verify.verdict import check_attention

    problem = make_problem("normal", (1, 2, 1, 20, 12, 16), "fp32", 0, causal=True)
    ref = _reference(problem)
    out, lse = NumpyTiledBackend().run(problem)
    assert worst_element(check_attention(out, problem, lse=lse, reference=ref), ref, out, lse) is None
    nan = out.copy()
    nan[0, 1, 17, 3] = np.nan
    element = worst_element(check_attention(nan, problem, lse=lse, reference=ref), ref, nan, lse)
    assert element["index"] == [0, 1, 17, 3] and np.isnan(element["got"])
    assert element["expected"] == ref.out[0, 1, 17, 3]
    off = lse.copy()
    off[0, 0, 12] += 0.5
    verdict = check_attention(out, problem, lse=off, reference=ref)
    element = worst_element(verdict, ref, out, off)
    assert (verdict.rule, element["tensor"], element["index"]) == ("lse_bound", "lse", [0, 0, 12])
    assert element["got"] == pytest.approx(ref.lse[0, 0, 12] + 0.5, abs=1e-5)


def test_the_reproducer_of_a_cell_replays_its_failure_on_the_real_backend(tmp_path):
    pytest.importorskip("torch")
    store = ResultsStore(tmp_path / "results.jsonl")
    run_sweep(MASKED, [get_backend("torch-sdpa-flash-cpu")], store)  # LSE 0 at masked rows
    [section] = build(store.read(), generated=GENERATED, environment={}, repro_dir=tmp_path / "repro").sections
    case = section.overview[0].failure
    # the property its backend declares for the deviation, as the deviations table says
    assert (case.element["got"], case.element["expected"], case.property) == (0.0, -np.inf, "fully_masked_rows")
    # The reproducer says `python3 SCRIPT`; run SCRIPT with this interpreter, not the PATH's python3
    # (a virtual environment that is not activated has fa_verify, the PATH's python3 may not).
    command = shlex.split(case.reproducer)
    assert command[0] == "python3" and len(command) == 2, case.reproducer
    rerun = subprocess.run([sys.executable, command[1]], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert rerun.returncode == 1 and "property 'fully_masked_rows' failed" in rerun.stdout, rerun.stderr[-2000:]
    assert "got 0, expected -inf" in rerun.stdout


def test_report_exits_0_on_a_declared_deviation_and_1_with_fail_on_deviation(tmp_path, monkeypatch,
                                                                              capsys):
    pytest.importorskip("torch")
    monkeypatch.setitem(SWEEPS, "quick", MASKED)
    out = tmp_path / "reports"
    assert main(["report", "--backend", "torch-sdpa-flash-cpu", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "**all pass**, 1 by declared conventions only" in summary
    assert "--property fully_masked_rows" in summary
    assert 'id="deviations"' in (out / "index.html").read_text()
    results = str(out / "results.jsonl")
    assert main(["report", "--from", results, "--out", str(tmp_path / "r"),
                 "--fail-on", "deviation"]) == 1
    assert main(["report", "--from", results, "--out", str(tmp_path / "r")]) == 0
    assert main(["report", "--backend", "torch-sdpa-flash-cpu", "--out", str(out),
                 "--fail-on", "deviation"]) == 1


class _Fp16Only(NaiveBackend):
    dtypes = ("fp16",)

    def __init__(self):
        super().__init__("fp32")
        self.name = "fp16-only"


def _bar_lines(stream):
    """(percent, runs done, runs planned) of every progress line, and the closing line."""
    lines = stream.getvalue().splitlines()
    bars = [tuple(map(int, m.groups())) for line in lines
            if (m := re.search(r"\] +(\d+)% (\d+)/(\d+) runs", line))]
    return bars, lines[-1]


def test_progress_counts_the_runs_it_will_make_and_says_what_it_skipped(tmp_path):
    stream = io.StringIO()
    store = ResultsStore(tmp_path / "results.jsonl")
    run_sweep(TINY, [get_backend("numpy-tiled"), _Fp16Only()], store, stream=stream)
    bars, last = _bar_lines(stream)
    planned = len(TINY.points) + len(TINY.points) // 2  # fp16-only skips the fp32 half
    assert bars and all(total == planned for _, _, total in bars)
    assert all(pct == int(100 * done / total + 0.5) for pct, done, total in bars)
    assert last.startswith(f"{planned} runs in ") and last.endswith(
        f"skipped {len(TINY.points) // 2} ({len(TINY.points) // 2} unsupported)")
    # --resume: nothing planned; the closing line says why
    stream = io.StringIO()
    run_sweep(TINY, [get_backend("numpy-tiled")], store, done=store.keys(), stream=stream)
    assert _bar_lines(stream)[1].endswith(f"skipped {len(TINY.points)} "
                                          f"({len(TINY.points)} already recorded)")


def test_progress_takes_budget_skips_out_of_its_total(tmp_path):
    stream = io.StringIO()
    stingy = Sweep("stingy", "", TINY.points, budget_s=0.0)
    run_sweep(stingy, [get_backend("numpy-tiled")], ResultsStore(tmp_path / "r.jsonl"),
              stream=stream)
    bars, last = _bar_lines(stream)
    skipped = len(TINY.points) - 1
    assert bars[0] == (0, 0, len(TINY.points))
    assert last.startswith("1 runs in ") and last.endswith(f"skipped {skipped} ({skipped} budget)")


# --- the command -----------------------------------------------------------------------------


def test_report_command_runs_resumes_and_renders(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SWEEPS, "quick", TINY)
    out = tmp_path / "reports"
    assert main(["report", "--backend", "numpy-tiled", "--out", str(out)]) == 0
    for name in ("index.html", "summary.json", "summary.md", "results.jsonl", "run.json"):
        assert (out / name).exists(), name
    assert "| numpy-tiled |" in capsys.readouterr().out  # the Markdown summary, for CI logs
    count = len(ResultsStore(out / "results.jsonl").read())
    assert main(["report", "--backend", "numpy-tiled", "--out", str(out), "--resume"]) == 0
    assert len(ResultsStore(out / "results.jsonl").read()) == count
    rendered = tmp_path / "again"
    assert main(["report", "--from", str(out / "results.jsonl"), "--out", str(rendered)]) == 0
    assert (rendered / "index.html").exists()
    # a fresh run keeps the previous store aside instead of mixing the two
    assert main(["report", "--backend", "naive-fp32", "--out", str(out)]) == 0
    assert {r.backend for r in ResultsStore(out / "results.jsonl").read()} == {"naive-fp32"}
    assert (out / "results.prev.jsonl").exists()


def test_report_command_exits_1_on_failures_and_2_on_bad_input(tmp_path, capsys):
    assert main(["report", "--from", str(GOLD / "results.jsonl"), "--out", str(tmp_path)]) == 1
    assert main(["report", "--from", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["report", "--backend", "no-such-backend", "--out", str(tmp_path)]) == 2


def test_a_repeated_backend_runs_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SWEEPS, "quick", TINY)
    out = tmp_path / "reports"
    assert main(["report", "--backend", "numpy-tiled", "--backend", "numpy-tiled", "--out", str(out)]) == 0
    records = ResultsStore(out / "results.jsonl").read()
    assert len(records) == len(TINY.points) and len({r.key() for r in records}) == len(records)


def _dense_only_cli_backend():
    """A built-in backend that implements no variant, or skip."""
    backend = get_backend("torch-sdpa-math")
    if backend.features or not backend.availability().available:
        pytest.skip("torch-sdpa-math is unavailable here, or implements variants now")
    return backend.name


def test_a_sweep_no_selected_backend_runs_is_a_usage_error_that_touches_nothing(tmp_path, capsys):
    name = _dense_only_cli_backend()
    out = tmp_path / "reports"
    out.mkdir()
    (out / "results.jsonl").write_text("")  # a previous run's store stays where it is
    assert main(["report", "--sweep", "variants", "--backend", name, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"no point of the variants sweep runs on {name}" in err
    assert "does not implement" in err and "fa_verify backends" in err
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl"]


def test_a_selected_backend_without_the_sweeps_problems_is_skipped_and_said_so(tmp_path, monkeypatch,
                                                                               capsys):
    name = _dense_only_cli_backend()
    window = Sweep("variants", "one window", grid([(1, 2, 2, 8, 8, 16)], dtypes=("fp32",), causal=(False,),
                                                variants=(Variant(window_size=(2, 2)),)), budget_s=60.0)
    monkeypatch.setitem(SWEEPS, "variants", window)
    out = tmp_path / "reports"
    assert main(["report", "--sweep", "variants", "--backend", name, "--backend", "numpy-tiled",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{name} runs no point of the variants sweep (" in err and "listed as not applicable" in err
    assert {r.backend for r in ResultsStore(out / "results.jsonl").read()} == {"numpy-tiled"}
