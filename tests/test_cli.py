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


def test_bench_oracle_json_reports_ratio_and_bound(capsys):
    code, out, _ = _run(capsys, "bench", "oracle", "--json", "--sizes", "256",
                        "--repeats", "1", "--mpmath-n", "4", "--head-dim", "16")
    result = json.loads(out)
    row = result["sizes"][0]
    assert row["n"] == 256 and row["ratio"] > 0
    assert 0 < row["max_relative_bound"] <= 1e-12
    assert result["mpmath"]["seconds"] > 0
    assert code == (0 if result["meets_target"] else 1)


def test_check_passes_a_correct_callable(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, out, _ = _run(capsys, "check", "user_kernels:float64_then_round",
                        "--max-examples", "25", "--json")
    result = json.loads(out)
    assert code == 0 and result["passed"]
    assert result["targets"][0]["examples"] >= 25


def test_check_fails_a_buggy_callable_with_reproducer(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, out, _ = _run(capsys, "check", "user_kernels:drops_last_key", "--max-examples", "50")
    assert code == 1
    assert "FAIL" in out and "minimal failing problem" in out and "reproduce:" in out
    assert re.search(r"failed rule '(error_bound|baseline)'", out)


def test_check_fails_a_callable_that_breaks_the_protocol(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, out, _ = _run(capsys, "check", "user_kernels:wrong_shape", "--max-examples", "5")
    assert code == 1 and "returned out with shape" in out


def test_check_setup_errors_exit_2(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    code, _, err = _run(capsys, "check", "no_such_backend")
    assert code == 2 and "numpy-tiled" in err  # the message lists the known names
    code, _, err = _run(capsys, "check", "user_kernels:missing")
    assert code == 2 and "missing" in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "numpy-tiled", "--causal", "sometimes"])
    assert exc.value.code == 2
