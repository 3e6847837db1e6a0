"""The command line: help, backends, bench and check, with the exit codes CI relies on."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fa_verify.cli.main import main

FIXTURES = Path(__file__).parent / "fixtures"


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_commands_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("backends", "check", "bench", "Exit codes"):
        assert word in out


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "fa_verify", "--version"],
                            capture_output=True, text=True, check=True)
    assert result.stdout.startswith("fa_verify ")


def test_backends_json_lists_availability_and_reasons(capsys):
    code, out, _ = _run(capsys, "backends", "--json")
    assert code == 0
    table = {row["name"]: row for row in json.loads(out)}
    assert table["numpy-tiled"]["available"] is True
    for row in table.values():
        assert row["available"] or row["reason"]
    assert table["numpy-tiled"]["layout"] == "dense"
    paged = table["numpy-ragged-paged"]
    assert (paged["layout"], paged["splits"], paged["available"]) == ("paged", False, True)
    assert set(paged["features"]) == {"window", "softcap", "alibi", "sinks"}
    assert table["numpy-ragged-varlen"]["layout"] == "varlen"
    assert table["split-kv-cpu"]["splits"] and table["split-kv-varlen-cpu"]["layout"] == "varlen"


def test_backends_table_lists_ragged_backends_with_layout(capsys):
    code, out, _ = _run(capsys, "backends")
    line = next(line for line in out.splitlines() if line.startswith("numpy-ragged-varlen"))
    assert code == 0 and "varlen" in line.split()[1] and "split-KV" not in line and "available" in line
    line = next(line for line in out.splitlines() if line.startswith("split-kv-cpu"))
    assert "paged" in line.split()[1] and "split-KV" in line


def test_bench_oracle_json_reports_ratio_and_bound(capsys):
    code, out, _ = _run(capsys, "bench", "oracle", "--json", "--sizes", "256",
                        "--repeats", "1", "--mpmath-n", "4", "--head-dim", "16")
    result = json.loads(out)
    row = result["sizes"][0]
    assert row["n"] == 256 and row["ratio"] > 0
    assert 0 < row["max_relative_bound"] <= 1e-12
    assert result["backward"][0]["n"] == 256 and result["backward"][0]["ratio"] > 0
    assert 0 < result["backward"][0]["max_relative_bound"] <= 1e-10
    assert result["mpmath"]["seconds"] > 0
    assert code == (0 if result["meets_target"] else 1)


def test_bench_runner_ci_times_each_style_on_the_checks_problems(capsys):
    """--ci: the problems the ci profile's agreement check judges (a dense and a paged style), the
    runner and the oracle timed on each, and the check's own rate."""
    code, out, _ = _run(capsys, "bench", "runner", "--ci", "--json", "--kernel", "naive", "--kernel", "split_kv",
                        "--max-examples", "2", "--repeats", "1")
    rows = {row["style"]: row for row in json.loads(out)["rows"]}
    assert code == 0 and set(rows) == {"naive", "split_kv"}
    for row in rows.values():
        assert row["check_status"] == "passed" and row["examples"] == row["check_examples"] >= 2
        assert row["runner_s"] > 0 and row["oracle_s"] > 0 and row["check_s"] > 0
    code, out, err = _run(capsys, "bench", "runner", "--kernel", "split_kv")
    assert code == 2 and "need --ci" in err


def test_check_passes_a_correct_callable(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, out, _ = _run(capsys, "check", "user_kernels:float64_then_round",
                        "--max-examples", "5", "--json")
    result = json.loads(out)
    assert code == 0 and result["passed"]
    target = result["targets"][0]
    assert target["examples"] >= 25 and target["counts"] == {"passed": 14, "failed": 0, "not applicable": 9}
    status = {p["property"]: p["status"] for p in target["properties"]}
    assert status["lse_agreement"] == status["merge_law"] == "not applicable"  # it returns no LSE
    assert status["races"] == "not applicable"  # no CUDA kernel on the CPU runner
    assert status["variant_agreement"] == "not applicable"  # it takes no window_size, softcap, ...
    assert status["address_sanitizer"] == "not applicable"  # a callable, not a CUDA kernel


def test_check_fails_a_buggy_callable_with_reproducer(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    # oracle_agreement alone: the only property asserted on (each search is seeded on its own)
    code, out, _ = _run(capsys, "check", "user_kernels:drops_last_key", "--property", "oracle_agreement",
                        "--max-examples", "50", "--dtype", "fp16")
    assert code == 1
    assert "FAIL oracle_agreement: FAILED after" in out and "minimal counterexample" in out and "reproduce:" in out
    assert re.search(r"failed rule '(error_bound|ensemble)'", out)


def test_check_fails_a_callable_that_breaks_the_protocol(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, out, _ = _run(capsys, "check", "user_kernels:wrong_shape", "--max-examples", "5")
    assert code == 1 and "returned out with shape" in out


def test_check_runs_chosen_properties_and_records_comparisons(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(FIXTURES)
    results = tmp_path / "results.jsonl"
    code, out, _ = _run(capsys, "check", "attention_variants:wrong_lse", "--property", "oracle_agreement",
                        "--property", "lse_agreement", "--dtype", "bf16", "--causal", "no",
                        "--max-examples", "5", "--results", str(results), "--json")
    result = json.loads(out)
    assert code == 1 and [p["status"] for p in result["targets"][0]["properties"]] == ["passed", "failed"]
    assert result["targets"][0]["properties"][1]["examples_to_failure"] == 1
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert {r["source"] for r in records} == {"check"} and {r["problem"]["dtype"] for r in records} == {"bf16"}
    assert {r["extra"]["property"] for r in records} == {"oracle_agreement", "lse_agreement"}


def test_check_a_torch_callable_in_bshd_layout_with_top_left_masking(capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(FIXTURES)
    code, out, _ = _run(capsys, "check", "torch_sdpa:sdpa_bshd", "--array", "torch", "--layout", "bshd",
                        "--causal-alignment", "top-left", "--property", "oracle_agreement",
                        "--property", "masked_key_independence", "--property", "fully_masked_rows",
                        "--max-examples", "5")
    assert code == 0, out
    assert "PASS masked_key_independence" in out and "N/A  fully_masked_rows" in out


def test_check_setup_errors_exit_2(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, _, err = _run(capsys, "check", "no_such_backend")
    assert code == 2 and "numpy-tiled" in err  # the message lists the known names
    code, _, err = _run(capsys, "check", "user_kernels:missing")
    assert code == 2 and "missing" in err
    code, _, err = _run(capsys, "check", "numpy-tiled", "--property", "speed")
    assert code == 2 and "merge_law" in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "numpy-tiled", "--causal", "sometimes"])
    assert exc.value.code == 2
