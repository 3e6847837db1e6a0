"""Every command of `fa_verify --help`, run as CI runs it (a process), exits 0 on success and 1 or 2
on failure: 1 a check failed, 2 usage or setup error (cli/main.py). A handler that returned
anything but an int (build once returned "ok", which sys.exit turns into status 1) fails here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fa_verify.backends.cuda_kernels import cpu_runner_availability
from fa_verify.kernels.nvcc import NvccNotFoundError, find_nvcc

FIXTURES = Path(__file__).parent / "fixtures"


def exit_code(*argv, cwd=FIXTURES) -> tuple[int, str]:
    """(exit status, stdout) of `python -m fa_verify ARGV`; stderr follows stdout after a blank line."""
    proc = subprocess.run([sys.executable, "-m", "fa_verify", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
    return proc.returncode, proc.stdout + "\n" + proc.stderr


def _nvcc_missing() -> str | None:
    try:
        find_nvcc()
    except NvccNotFoundError as exc:
        return str(exc)
    return None


needs_nvcc = pytest.mark.skipif(_nvcc_missing() is not None, reason=f"needs nvcc: {_nvcc_missing()}")
needs_cpu_runner = pytest.mark.skipif(not cpu_runner_availability().available,
                                      reason=cpu_runner_availability().reason)


def test_every_command_of_help_is_covered_here():
    _, out = exit_code("--help")
    listed = set(re.findall(r"^    (\w+)  ", out, re.M))
    assert listed == {"backends", "bench", "check", "build", "report", "mutants"}


def test_backends_exit_codes():
    assert exit_code("backends")[0] == 0
    assert exit_code("backends", "--no-such-option")[0] == 2


def test_bench_exit_codes():
    code, out = exit_code("bench", "oracle", "--json", "--sizes", "64", "--repeats", "1", "--mpmath-n", "4",
                          "--head-dim", "16")
    assert code == (0 if json.loads(out.split("\n\n")[0])["meets_target"] else 1)
    assert exit_code("bench", "oracle", "--sizes", "many")[0] == 2


def test_check_exit_codes():
    assert exit_code("check", "user_kernels:float64_then_round", "--max-examples", "3")[0] == 0
    assert exit_code("check", "user_kernels:wrong_shape", "--max-examples", "3")[0] == 1
    assert exit_code("check", "no_such_backend")[0] == 2


@needs_nvcc
def test_build_exit_codes():
    """Exit 0 when every kernel compiles (it was 1 whatever happened), 1 when one does not, 2 on bad arguments."""
    code, out = exit_code("build", "--nvcc", "--kernel", "naive", "--arch", "sm_80")
    assert code == 0, out
    code, out = exit_code("build", "--nvcc", "--kernel", "wmma", "--arch", "sm_75")  # bf16 wmma needs sm_80
    assert code == 1 and "failed: wmma.cu [sm_75]" in out
    assert exit_code("build", "--arch", "80")[0] == 2


def test_report_exit_codes(tmp_path):
    passing, failing = tmp_path / "passing.jsonl", tmp_path / "failing.jsonl"
    exit_code("check", "user_kernels:float64_then_round", "--max-examples", "2", "--property", "oracle_agreement",
              "--dtype", "fp16", "--results", str(passing))
    exit_code("check", "user_kernels:drops_last_key", "--max-examples", "5", "--property", "oracle_agreement",
              "--dtype", "fp16", "--results", str(failing))
    assert exit_code("report", "--from", str(passing), "--out", str(tmp_path / "a"))[0] == 0
    assert exit_code("report", "--from", str(failing), "--out", str(tmp_path / "b"))[0] == 1
    assert exit_code("report", "--from", str(tmp_path / "missing.jsonl"))[0] == 2


#: A "mutant" that changes nothing but a comment: no correct check can kill it, so the campaign must exit 1.
EQUIVALENT_MUTANT = """
[[mutant]]
name = "fa2-comment-only"
family = "fa2"
bug_class = "none (equivalent mutant)"
description = "a comment added; the kernel is unchanged"
find = "// One extern \\"C\\" entry per (dtype, D)"
replace = "// (an equivalent copy) One extern \\"C\\" entry per (dtype, D)"
caught_by = "oracle"
"""


@needs_cpu_runner
def test_mutants_exit_codes():
    code, out = exit_code("mutants", "--mutant", "fa2-causal-off-by-one", "--seeds", "0", "--no-rules",
                          "--first-kill", "--no-sanitizer", "--max-examples", "5")
    assert code == 0, out
    assert exit_code("mutants", "--mutant", "no-such-mutant")[0] == 2


@pytest.mark.slow  # a campaign in a subprocess (~8 s); test_mutants_exit_codes keeps exit 0 and 2 in the default run
@needs_cpu_runner
def test_mutants_exit_1_when_a_mutant_survives(tmp_path):
    mutants = tmp_path / "mutants.toml"
    mutants.write_text(EQUIVALENT_MUTANT)
    code, out = exit_code("mutants", "--mutants-file", str(mutants), "--seeds", "0", "--no-rules", "--no-sanitizer",
                          "--max-examples", "2", "--first-kill")
    assert code == 1, out
    assert "SURVIVED our suite: fa2-comment-only" in out  # and the table says so
