"""`fa_verify check --grading` and `--forbid` (docs/grading.md): the versioned JSON verdict, the seed
printed after the verdict, forbidden framework calls, numpy targets untouched, the time budget."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa_verify.cli.main import main
from fa_verify.grading import FORMAT

FIXTURES = Path(__file__).parent / "fixtures"
NUMPY_TARGET = f"{FIXTURES / 'user_kernels.py'}:float64_then_round"
SDPA_TARGET = f"{FIXTURES / 'grading_targets.py'}:sdpa"
TORCH_OPTIONS = ("--array", "torch", "--causal-alignment", "top-left", "--dtype", "fp32")
QUICK = ("--property", "oracle_agreement", "--max-examples", "2")


def _run(capsys, tmp_path, *argv):
    code = main(["check", *argv, *QUICK, "--repro-dir", str(tmp_path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_grading_prints_a_versioned_json_verdict_then_the_seed_after_the_verdict(tmp_path):
    """A subprocess, as a reward function calls it: stdout is the JSON document alone; on stderr the
    seed comes after the verdict line, so nothing the target can see printed it first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1]), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    result = subprocess.run([sys.executable, "-m", "fa_verify", "check", NUMPY_TARGET, "--grading", *QUICK,
                             "--dtype", "fp32", "--repro-dir", str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["format"] == FORMAT and document["passed"] is True
    assert document["seed_drawn"] is True and isinstance(document["seed"], int)
    lines = result.stderr.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("GRADE PASS"))
    seed = next(i for i, line in enumerate(lines) if line.startswith(f"seed {document['seed']} "))
    assert verdict < seed and not any(str(document["seed"]) in line for line in lines[:verdict])
    prop = document["properties"]["oracle_agreement"]
    assert prop["status"] == "passed" and prop["examples"] >= 2 and prop["judged_enough"]
    # the null-model guard's power: which trivial outputs the tolerance rejected, on how many examples
    assert prop["null_model"]["rejected"]["zeros"] == prop["null_model"]["informative"] > 0
    assert "rejected" in prop["null_model"]["power"]
    assert document["throughput"] > 0 and document["timings"]["seconds"] > 0
    # a numpy target is a reference model: the torch defaults are forbidden, numpy's matmul is not
    assert "numpy targets are reference models" in document["guards"]["numpy"]


def test_a_target_calling_torch_sdpa_fails_under_grading_naming_the_call_and_line(capsys, tmp_path):
    pytest.importorskip("torch", reason="torch is not installed: the forbidden call under test is torch's SDPA")
    code, out, err = _run(capsys, tmp_path, SDPA_TARGET, "--grading", *TORCH_OPTIONS)
    assert code == 1
    document = json.loads(out)
    assert document["passed"] is False and document["format"] == FORMAT
    failure = document["properties"]["oracle_agreement"]["minimal_failing_case"]
    line = next(i for i, text in enumerate((FIXTURES / "grading_targets.py").read_text().splitlines(), 1)
                if "return scaled_dot_product_attention(" in text)
    assert "ForbiddenCallError" in failure
    assert f"forbidden torch.nn.functional.scaled_dot_product_attention (called at " \
           f"{FIXTURES / 'grading_targets.py'}:{line})" in failure
    assert "torch.nn.functional.scaled_dot_product_attention" in document["guards"]["forbid"]


def test_the_same_target_passes_without_forbid(capsys, tmp_path):
    pytest.importorskip("torch", reason="torch is not installed")
    code, out, _ = _run(capsys, tmp_path, SDPA_TARGET, "--grading", "--forbid", "none", *TORCH_OPTIONS)
    document = json.loads(out)
    assert code == 0 and document["passed"] is True and document["guards"]["forbid"] == []


def test_forbid_in_process_catches_a_swallowed_call_and_restores_the_originals(capsys, tmp_path):
    """--no-isolate: the module was imported before the guard (its names bound to the originals) and
    the target catches the guard's exception; the profile hook still sees both calls; the
    originals are back afterwards."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    original = torch.nn.functional.scaled_dot_product_attention, torch.matmul, torch.Tensor.softmax
    code, out, err = _run(capsys, tmp_path, f"{FIXTURES / 'grading_targets.py'}:sdpa_swallowing",
                          "--forbid", "default", "--no-isolate", *TORCH_OPTIONS)
    assert code == 1
    assert "forbidden torch.matmul (called at" in out
    assert "torch.nn.functional.scaled_dot_product_attention (called at" in out
    assert (torch.nn.functional.scaled_dot_product_attention, torch.matmul, torch.Tensor.softmax) == original
    assert "softmax" not in vars(torch.Tensor)  # inherited from TensorBase, as before


def test_budget_stops_drawing_and_fails_closed(capsys, tmp_path):
    code, out, err = main(["check", NUMPY_TARGET, "--grading", "--dtype", "fp32", "--property",
                           "oracle_agreement", "--property", "convex_hull", "--max-examples", "20",
                           "--budget", "0.001", "--repro-dir", str(tmp_path)]), *capsys.readouterr()
    document = json.loads(out)
    assert code == 1 and document["passed"] is False
    assert document["budget"] == {**document["budget"], "seconds": 0.001, "spent": True}
    assert set(document["budget"]["stopped"]) == {"oracle_agreement", "convex_hull"}
    assert document["not_judged_enough"] and "budget spent" in err


def test_forbid_is_a_usage_error_for_built_in_backends_and_bad_names(capsys):
    assert main(["check", "numpy-tiled", "--forbid", "torch.matmul"]) == 2
    assert "--forbid" in capsys.readouterr().err
    assert main(["check", NUMPY_TARGET, "--forbid", "matmul"]) == 2
    assert "not a dotted name" in capsys.readouterr().err
