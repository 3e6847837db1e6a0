"""The report's reproductions of published results (fa_verify.report.published): FlashAttention-3's
Table 3 and Golden et al. 2024, their measurement cache, their page section, and the fa2 key-tile
instantiations they use. Tiny setups throughout: the default ones take seconds per problem.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from fa_verify.backends.cuda_kernels import CpuKernelBackend, cpu_runner_availability
from fa_verify.cli.main import main
from fa_verify.dtypes import unit_roundoff
from fa_verify.kernels import KERNELS_DIR_ENV, kernels_dir
from fa_verify.kernels.catalogue import FA2, FA2_KEY_TILES, FAMILIES
from fa_verify.kernels.nvcc import NvccNotFoundError, compile_file, find_nvcc
from fa_verify.report import fa3, golden, published, write_report
from fa_verify.report import measurements
from fa_verify.report.measurements import MeasurementCache, code_fingerprint
from fa_verify.results import ResultsStore
from fa_verify.strategies import make_problem
from fa_verify.sweeps import SWEEPS, Sweep, grid
from fa_verify.verdict import check_attention

CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)
try:
    NVCC, NVCC_MISSING = find_nvcc(), ""
except NvccNotFoundError as exc:
    NVCC, NVCC_MISSING = None, str(exc)

TINY_GOLDEN = golden.GoldenSetup(seq_lengths=(40, 96), key_tiles=(16, 32, 128), seeds=(0, 1))
TINY_TABLE3 = fa3.Table3Setup(seq_len=48, head_dim=32, seeds=(0,))
NEW_TILES = {n: f for n, f in FA2_KEY_TILES.items() if f is not FA2}


def tiny_experiments(monkeypatch):
    monkeypatch.setitem(published.EXPERIMENTS, "fa3", (
        lambda cache, progress: fa3.measure_table3(TINY_TABLE3, cache, progress), fa3.table3))
    monkeypatch.setitem(published.EXPERIMENTS, "golden", (
        lambda cache, progress: golden.measure(TINY_GOLDEN, cache, progress), golden.summarise))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Both tiny experiments measured once into a fresh cache: (JSON, cache folder)."""
    folder = tmp_path_factory.mktemp("measurements")
    cache = MeasurementCache(folder)
    data = {"experiments": {"fa3": fa3.measure_table3(TINY_TABLE3, cache),
                            "golden": golden.measure(TINY_GOLDEN, cache)},
            "seconds": 1.0, "computed": cache.computed, "reused": cache.reused}
    return data, folder


# --- the key-tile instantiations -------------------------------------------------------------------


def test_key_tile_catalogue_matches_the_source():
    """fa2_key_tiles.cu's FA2_KEY_TILE_ENTRY lines are the catalogue's configurations; tile 32 is fa2's own."""
    source = (kernels_dir() / "fa2_key_tiles.cu").read_text()
    found = {}
    for dtype, d, block_m, block_n, threads in re.findall(
            r"^FA2_KEY_TILE_ENTRY\((\w+), \w+, (\d+), (\d+), (\d+), (\d+)\)", source, re.M):
        found[int(block_n)] = (dtype, int(d), int(block_m), int(threads))
    assert sorted(found) == sorted(NEW_TILES)
    for n, family in NEW_TILES.items():
        [(d, cfg)] = family.configs.items()
        assert found[n] == (family.dtypes[0], d, cfg.block_m, cfg.threads) and cfg.block_n == n
        assert family.entries() == [f"fa2_k{n}_bf16_d64"] and family.name not in FAMILIES
    assert FA2_KEY_TILES[32] is FA2 and FA2.config(64).block_n == 32
    assert "#ifndef FA2_TEMPLATE_ONLY" in FA2.source_path.read_text()  # the include takes the template only


@needs_cpu_runner
@pytest.mark.parametrize("tile", sorted(NEW_TILES))
def test_key_tile_kernels_match_the_oracle_on_the_cpu_runner(tile):
    backend = CpuKernelBackend(NEW_TILES[tile])
    for shape, causal in (((1, 2, 1, 70, 150, 64), False), ((1, 2, 2, 130, 129, 64), True)):
        problem = make_problem("normal", shape, "bf16", 3, causal=causal)
        out, lse = backend.run(problem)
        verdict = check_attention(out, problem, lse=lse, precision=backend.precision("bf16"))
        assert verdict.passed, verdict.message()


@pytest.mark.skipif(NVCC is None, reason=f"nvcc not found: {NVCC_MISSING}")
def test_key_tile_kernels_compile_for_sm80():
    result = compile_file(list(NEW_TILES.values()), "sm_80", NVCC)
    assert result.ok, f"{result.log}\n{result.command}"
    assert [e.entry for e in result.entries] == [f.entries()[0] for f in NEW_TILES.values()]
    for e in result.entries:
        assert e.static_smem == 0 and 0 < e.registers <= 255
        assert e.dynamic_smem <= 163 * 1024  # sm_80's opt-in limit per block


# --- the measurements and their cache ---------------------------------------------------------------


def test_measurements_are_cached_by_their_inputs(measured):
    data, folder = measured
    problems = len(TINY_GOLDEN.seq_lengths) * len(TINY_GOLDEN.seeds) + len(TINY_TABLE3.dtypes)
    assert data["computed"] == problems and data["reused"] == 0
    again = MeasurementCache(folder)
    rerun = {"fa3": fa3.measure_table3(TINY_TABLE3, again), "golden": golden.measure(TINY_GOLDEN, again)}
    assert (again.computed, again.reused) == (0, problems)  # a re-run measures nothing
    assert rerun == data["experiments"]
    more_seeds = MeasurementCache(folder)
    golden.measure(golden.GoldenSetup(seq_lengths=(40,), key_tiles=(16, 32, 128), seeds=(0, 1, 2)), more_seeds)
    assert more_seeds.computed == 3  # the setup is part of every problem's key


def test_a_damaged_entry_is_measured_again(tmp_path):
    cache = MeasurementCache(tmp_path)
    calls = []
    value = cache.get({"x": 1}, "code", lambda: calls.append(1) or {"v": 2.5})
    [entry] = tmp_path.glob("*.json")
    entry.write_text("{truncated")
    assert MeasurementCache(tmp_path).get({"x": 1}, "code", lambda: calls.append(1) or {"v": 2.5}) == value
    assert len(calls) == 2
    assert MeasurementCache(tmp_path).get({"x": 1}, "other code", lambda: calls.append(1) or {"v": 3}) == {"v": 3}


def test_the_code_fingerprint_follows_the_kernel_sources(tmp_path, monkeypatch):
    before = code_fingerprint(("fa_verify.report.golden",), ("fa2.cu",))
    copy = tmp_path / "kernels"
    shutil.copytree(kernels_dir(), copy)
    monkeypatch.setenv(KERNELS_DIR_ENV, str(copy))
    assert code_fingerprint(("fa_verify.report.golden",), ("fa2.cu",)) == before
    (copy / "fa2.cu").write_text((copy / "fa2.cu").read_text() + "\n// edited\n")
    assert code_fingerprint(("fa_verify.report.golden",), ("fa2.cu",)) != before


@needs_cpu_runner
def test_golden_figures(measured):
    view = golden.summarise(measured[0]["experiments"]["golden"])
    assert [row.n for row in view.rows] == list(TINY_GOLDEN.seq_lengths) and view.unavailable is None
    assert view.names == ([golden.ROUNDED, golden.STANDARD] + [golden.fa2_name(t) for t in (16, 32, 128)]
                          + [golden.bf16_state_name(t) for t in (16, 32, 128)])
    half_ulp = unit_roundoff("bf16")
    for row in view.rows:
        # rounding to nearest is off by at most half an ulp: relative 2^-8 of the largest output
        assert 0 < row.rel_dev[golden.ROUNDED] <= half_ulp
        for name in view.names:
            assert row.max_dev[name] >= row.max_dev[golden.ROUNDED]  # no implementation beats rounding
    assert view.ratio_range(golden.fa2_name(32)) is not None and view.growth(golden.STANDARD) > 0
    svg = view.figure()
    assert svg.startswith("<svg") and "sequence length N" in svg and "key tile 128" in svg


@needs_cpu_runner
def test_table3_figures(measured):
    view = fa3.table3(measured[0]["experiments"]["fa3"])
    by_name = {row.name: row for row in view.rows}
    fa2_row = by_name[CpuKernelBackend(FA2).name]
    assert fa2_row.paper_row == "FlashAttention-2 (fp16)" and fa2_row.paper_rmse == 1.9e-4
    assert by_name["exactly rounded reference"].vs_rounded == {"fp16": 1.0, "bf16": 1.0}
    for row in view.rows:
        assert all(ratio >= 1.0 for ratio in row.vs_rounded.values())  # rounding is the floor
    assert view.standard_over_fa2() > 1  # every stage in fp16 is less accurate than FA2's fp32 state
    assert set(view.not_reproduced) == set(fa3.NOT_REPRODUCED)


# --- the page --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gold_records():
    """Two records of the report's gold file: the page around the section, rendered quickly."""
    from pathlib import Path

    return ResultsStore(Path(__file__).parent / "gold" / "report" / "results.jsonl").read()[:2]


@needs_cpu_runner
def test_the_page_shows_both_reproductions_beside_the_papers(measured, gold_records, tmp_path):
    write_report(gold_records, tmp_path, generated="2026-01-01T00:00:00+00:00", published=measured[0])
    page = (tmp_path / "index.html").read_text()
    assert json.loads((tmp_path / "published.json").read_text()) == json.loads(json.dumps(measured[0]))
    section = page[page.index('<h2 id="published"'):]
    for anchor in ('id="published-fa3-table"', 'id="published-golden-table"', 'id="published-golden-paper"'):
        assert anchor in section
    assert "<svg" in section[section.index('id="published-golden"'):]
    assert "arXiv:2405.02803" in section and "roughly an order of magnitude" in section
    assert section.count("no figure available to us") == 2  # said plainly, not invented
    assert "B=1 H=1 D=64" in section and "seeds 0, 1" in section and "seed 0" in section
    assert 'data-v="0.00019"' in section  # the paper's FA2 figure beside ours


def test_without_measurements_the_page_says_how_to_get_them(gold_records, tmp_path):
    write_report(gold_records, tmp_path, generated="2026-01-01T00:00:00+00:00")
    page = (tmp_path / "index.html").read_text()
    assert "Not measured for these results" in page and not (tmp_path / "published.json").exists()


@needs_cpu_runner
def test_report_command_measures_them_once_and_from_renders_them(monkeypatch, tmp_path, capsys):
    tiny_experiments(monkeypatch)
    monkeypatch.setattr(measurements, "default_folder", lambda: tmp_path / "measurements")
    sweep = Sweep("quick", "one tiny point", grid([(1, 1, 1, 8, 8, 16)], dtypes=("fp32",), causal=(False,)),
                  budget_s=60.0, published=("fa3", "golden"))
    monkeypatch.setitem(SWEEPS, "quick", sweep)
    out = tmp_path / "out"
    assert main(["report", "--backend", "naive-fp32", "--out", str(out)]) == 0
    first = json.loads((out / "published.json").read_text())
    assert first["computed"] == 6 and first["reused"] == 0
    assert main(["report", "--backend", "naive-fp32", "--out", str(out)]) == 0
    second = json.loads((out / "published.json").read_text())
    assert (second["computed"], second["reused"]) == (0, 6)  # the re-run measured nothing
    assert second["experiments"] == first["experiments"]
    capsys.readouterr()
    assert main(["report", "--from", str(out / "results.jsonl"), "--out", str(tmp_path / "r")]) == 0
    assert 'id="published-golden-table"' in (tmp_path / "r" / "index.html").read_text()
    err = capsys.readouterr().err
    assert "published results reproduced" not in err  # --from measures nothing


def test_default_sweeps_name_the_reproductions():
    assert SWEEPS["quick"].published == ("fa3", "golden")
    assert all(set(s.published) <= set(published.EXPERIMENTS) for s in SWEEPS.values())


def test_a_bf16_running_state_costs_accuracy():
    """The tiled model rounds its running sum and accumulator after every key tile only for a
    16-bit P·V accumulation; 16 tiles of 16 keys then lose more than FA2's fp32 state does."""
    from fa_verify.backends.numpy_tiled import tiled_attention
    from fa_verify.oracle import reference
    from fa_verify.precision import PrecisionModel

    problem = make_problem("normal", (1, 2, 2, 32, 256, 32), "bf16", 0)
    exact = reference(problem).out
    fp32_state = tiled_attention(problem, PrecisionModel.flash("bf16"), block_k=16)[0]
    bf16_state = tiled_attention(problem, PrecisionModel(input="bf16", p_rounding="bf16",
                                                         pv_accumulation="bf16"), block_k=16)[0]
    error = {name: np.abs(out.astype(np.float64) - exact).max()
             for name, out in (("fp32", fp32_state), ("bf16", bf16_state))}
    assert error["bf16"] > error["fp32"]


@needs_cpu_runner
def test_without_the_cpu_runner_the_page_says_why(monkeypatch, gold_records, tmp_path):
    from fa_verify.backends.base import Availability

    missing = Availability(False, "no C++ compiler (g++) on PATH")
    monkeypatch.setattr(golden, "cpu_runner_availability", lambda: missing)
    monkeypatch.setattr(fa3, "cpu_runner_availability", lambda: missing)
    cache = MeasurementCache(tmp_path / "cache")
    data = {"experiments": {"fa3": fa3.measure_table3(TINY_TABLE3, cache),
                            "golden": golden.measure(TINY_GOLDEN, cache)},
            "seconds": 0.1, "computed": cache.computed, "reused": cache.reused}
    view = published.view(data)
    assert view.golden.unavailable == missing.reason and golden.STANDARD not in view.golden.names
    assert view.fa3.standard_over_fa2() is None
    write_report(gold_records, tmp_path / "out", generated="2026-01-01T00:00:00+00:00", published=data)
    section = (tmp_path / "out" / "index.html").read_text().split('<h2 id="published"')[1]
    assert section.count("The kernels did not run: no C++ compiler (g++) on PATH") == 2
    assert golden.bf16_state_name(16) in section  # the numpy model still ran
    monkeypatch.undo()  # the runner is back: nothing measured without it is reused
    again = MeasurementCache(tmp_path / "cache")
    golden.measure(TINY_GOLDEN, again)
    assert again.reused == 0 and again.computed == len(TINY_GOLDEN.seq_lengths) * len(TINY_GOLDEN.seeds)
