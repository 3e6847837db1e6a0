"""Bad options and arguments: a message naming the option or argument and the fix, exit 2 in
the CLI, never a traceback; and the small things around a check's output (warnings from other
code, --json progress, the working directory left clean, targets that call sys.exit)."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.cli.main import main
from fa_verify.cli.other_warnings import held_back
from fa_verify.errors import InvalidArgumentError, InvalidProblemError
from fa_verify.problem import AttentionProblem
from fa_verify.properties import check_nan_padding
from fa_verify.results import ResultsWarning
from fa_verify.strategies import make_problem

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
#: The cheapest honest check: one property, one dtype, few examples.
QUICK = ("--property", "oracle_agreement", "--dtype", "fp32", "--max-examples", "2")


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `fa_verify ARGV`, whether argparse or a handler stopped it."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def usage_error(capsys, *argv) -> str:
    """The one-line error of a command that must end in exit 2 without a traceback."""
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def write_module(folder: Path, name: str, source: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


# --- options of fa_verify check -----------------------------------------------------------------

@pytest.mark.parametrize("option, value, expected", [
    ("--max-examples", "0", "argument --max-examples: 0 must be a whole number >= 1"),
    ("--max-examples", "-1", "argument --max-examples: -1 must be a whole number >= 1"),
    ("--max-examples", "many", "argument --max-examples: 'many' is not an integer; give a whole number >= 1"),
    ("--max-seq", "0", "argument --max-seq: 0 must be a whole number >= 1"),
    ("--max-seq", "-64", "argument --max-seq: -64 must be a whole number >= 1"),
    ("--max-seq", "1.5", "argument --max-seq: '1.5' is not an integer"),
])
def test_check_counts_must_be_positive_integers(capsys, option, value, expected):
    assert expected in usage_error(capsys, "check", "naive-fp32", option, value)


def test_results_naming_a_folder(capsys, tmp_path):
    line = usage_error(capsys, "check", "naive-fp32", "--results", tmp_path)
    assert f"argument --results: {str(tmp_path)!r} is a folder; name a file inside it" in line


def test_results_under_a_file(capsys, tmp_path):
    (tmp_path / "notes").write_text("")
    line = usage_error(capsys, "check", "naive-fp32", "--results", tmp_path / "notes" / "r.jsonl")
    assert f"{str(tmp_path / 'notes')!r} is a file, not a folder" in line


def test_results_in_a_missing_folder_creates_it(capsys, tmp_path):
    path = tmp_path / "new" / "deeper" / "results.jsonl"
    code, _, err = run_cli(capsys, "check", "naive-fp32", *QUICK, "--results", path)
    assert code == 0, err
    assert path.stat().st_size > 0


# --- options of fa_verify report -----------------------------------------------------------------

def test_report_out_naming_a_file(capsys, tmp_path):
    (tmp_path / "summary.md").write_text("")
    line = usage_error(capsys, "report", "--out", tmp_path / "summary.md", "--from", tmp_path / "summary.md")
    assert "argument --out:" in line and "is a file; name a folder (it is created if missing)" in line
    line = usage_error(capsys, "report", "--out", tmp_path / "summary.md" / "sub")
    assert f"lies under the file {str(tmp_path / 'summary.md')!r}" in line


def test_report_from_a_folder_points_at_its_results(capsys, tmp_path):
    line = usage_error(capsys, "report", "--from", tmp_path, "--out", tmp_path / "out")
    assert f"argument --from: {str(tmp_path)!r} is a folder, not a file; name the file itself" in line
    (tmp_path / "results.jsonl").write_text("")
    line = usage_error(capsys, "report", "--from", tmp_path, "--out", tmp_path / "out")
    assert f"did you mean {str(tmp_path / 'results.jsonl')!r}?" in line


def test_report_from_a_missing_file(capsys, tmp_path):
    line = usage_error(capsys, "report", "--from", tmp_path / "none.jsonl")
    assert f"--from {str(tmp_path / 'none.jsonl')!r}: no such file" in line


# --- options of bench and mutants ----------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (("bench", "oracle", "--sizes", "1024", "0"), "argument --sizes: 0 must be a whole number >= 1"),
    (("bench", "runner", "--repeats", "0"), "argument --repeats: 0 must be a whole number >= 1"),
    (("mutants", "--seeds", "-1"), "argument --seeds: -1 must be a whole number >= 0"),
    (("mutants", "--max-examples", "0"), "argument --max-examples: 0 must be a whole number >= 1"),
])
def test_bench_and_mutants_counts(capsys, argv, expected):
    assert expected in usage_error(capsys, *argv)


def test_mutants_files_checked_before_the_run(capsys, tmp_path):
    assert "argument --save:" in usage_error(capsys, "mutants", "--save", tmp_path)
    assert "argument --mutants-file:" in usage_error(capsys, "mutants", "--mutants-file", tmp_path)
    line = usage_error(capsys, "mutants", "--mutants-file", tmp_path / "none.toml")
    assert f"--mutants-file {str(tmp_path / 'none.toml')!r}: no such file" in line


# --- options for MODULE:FUNC targets given with a built-in backend ----------------------------------

@pytest.mark.parametrize("options, named", [
    (("--precision", "flash"), "--precision applies"),
    (("--layout", "bshd", "--precision", "same-precision"), "--layout, --precision apply"),
    (("--array", "torch"), "--array applies"),
    (("--causal-alignment", "top-left"), "--causal-alignment applies"),
])
def test_callable_options_with_a_builtin_backend(capsys, options, named):
    line = usage_error(capsys, "check", "naive-fp32", *QUICK, *options)
    assert f"{named} to MODULE:FUNC targets only; 'naive-fp32' names built-in backends" in line
    assert "drop " in line


def test_callable_options_still_apply_to_callables(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.syspath_prepend(tmp_path)
    write_module(tmp_path, "bshd_kernel", """
        from user_kernels import float64_then_round

        def attention(q, k, v, *, causal, scale):  # [B, N, H, D]
            q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
            return float64_then_round(q, k, v, causal=causal, scale=scale).transpose(0, 2, 1, 3)
    """)
    code, out, err = run_cli(capsys, "check", "bshd_kernel:attention", *QUICK,
                             "--layout", "bshd", "--precision", "fp32-accumulate")
    assert code == 0, out + err


# --- the Python API ----------------------------------------------------------------------------

def _arrays(dtype=np.float32):
    x = np.arange(8, dtype=np.float64).reshape(1, 1, 2, 4) / 8
    return x.astype(dtype), x.astype(dtype), x.astype(dtype)


def test_scale_of_the_wrong_type():
    with pytest.raises(InvalidArgumentError, match=r"scale='0.25' must be None \(1/sqrt\(D\)\) or a finite "
                                                   r"positive number, got str; pass a float") as exc:
        AttentionProblem(*_arrays(), scale="0.25")
    assert isinstance(exc.value, TypeError) and isinstance(exc.value, ValueError)
    with pytest.raises(TypeError, match="scale=True"):
        AttentionProblem(*_arrays(), scale=True)
    with pytest.raises(InvalidProblemError, match="scale=-1.0"):  # a number, but not a scale
        AttentionProblem(*_arrays(), scale=-1.0)


@pytest.mark.parametrize("causal", ["no", "False", 0, None])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(InvalidArgumentError, match=rf"causal={causal!r} must be True or False.*"
                                                   r"pass causal=False or causal=True") as exc:
        AttentionProblem(*_arrays(), causal=causal)
    assert isinstance(exc.value, TypeError)


def test_causal_numpy_bool_is_a_bool():
    problem = AttentionProblem(*_arrays(), causal=np.bool_(True))
    assert problem.causal is True


def test_from_float_takes_torch_tensors_bf16_included():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
               for i in range(3))
    problem = AttentionProblem.from_float(q, k, v, "bf16")
    assert problem.dtype == "bf16"
    assert np.array_equal(problem.k.astype(np.float32), k.float().numpy())  # exact: no second rounding


def test_from_float_names_an_unreadable_input():
    with pytest.raises(InvalidArgumentError, match=r"v: a str cannot be read as float data .*pass a numpy array"):
        AttentionProblem.from_float(*_arrays()[:2], "not numbers", "fp32")


def test_the_constructor_points_torch_users_at_from_float():
    torch = pytest.importorskip("torch")
    t = torch.zeros(1, 1, 2, 4)
    with pytest.raises(InvalidProblemError, match="q must be a numpy array, got Tensor; "
                                                  r"AttentionProblem.from_float\(q, k, v, dtype\) takes torch"):
        AttentionProblem(t, t, t)


# --- a target that calls sys.exit ---------------------------------------------------------------

def test_a_target_calling_sys_exit_is_a_failing_example(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(tmp_path)
    write_module(tmp_path, "exiting_kernel", """
        import sys

        def attention(q, k, v, *, causal, scale):
            sys.exit(3)
    """)
    code, out, err = run_cli(capsys, "check", "exiting_kernel:attention", *QUICK, "--json")
    assert code == 1, err
    failure = json.loads(out)["targets"][0]["properties"][0]
    assert failure["status"] == "failed"
    assert "the target raised SystemExit(3): it called sys.exit(3) (at " in failure["failure"]


# --- warnings from other code, --json progress ----------------------------------------------------

def test_other_warnings_come_once_after_the_output(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.syspath_prepend(tmp_path)
    write_module(tmp_path, "noisy_kernel", """
        import warnings
        from user_kernels import float64_then_round

        def attention(q, k, v, *, causal, scale):
            warnings.warn("this library is deprecated, and says so at length", UserWarning)
            return float64_then_round(q, k, v, causal=causal, scale=scale)
    """)
    code, out, err = run_cli(capsys, "check", "noisy_kernel:attention", *QUICK)
    assert code == 0, out + err
    assert err.count("this library is deprecated") == 1
    tail = err.strip().splitlines()[-2:]
    assert tail[0] == "fa_verify check: 1 warning(s) from other code (the target or a library), each shown once:"
    assert "noisy_kernel.py:" in tail[1]
    assert tail[1].endswith(": UserWarning: this library is deprecated, and says so at length")
    assert "PASS oracle_agreement" in out


def test_fa_verify_warnings_are_shown_at_once(capsys):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with held_back("report"):
            warnings.warn("skipped a line", ResultsWarning)
            warnings.warn_explicit("elsewhere", UserWarning, "/site-packages/lib/mod.py", 7)
            assert [str(w.message) for w in shown] == ["skipped a line"]  # not held back
    assert [str(w.message) for w in shown] == ["skipped a line"]
    err = capsys.readouterr().err
    assert "fa_verify report: 1 warning(s) from other code" in err
    assert "/site-packages/lib/mod.py:7: UserWarning: elsewhere" in err


def test_json_progress_goes_to_stderr(capsys):
    code, out, err = run_cli(capsys, "check", "naive-fp32", "--property", "determinism", "--property",
                             "oracle_agreement", "--dtype", "fp32", "--max-examples", "2", "--json")
    assert code == 0
    document = json.loads(out)  # stdout is nothing but the document
    assert document["passed"]
    assert "PASS determinism" in err and "PASS oracle_agreement" in err


# --- the working directory stays clean --------------------------------------------------------------

def test_check_leaves_no_hypothesis_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run([sys.executable, "-m", "fa_verify", "check", "naive-fp32", "--property", "determinism",
                             "--dtype", "fp32", "--max-examples", "3"], cwd=work, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(work.iterdir()) == []  # no ./.hypothesis
    # Whether Hypothesis stores anything in a given run depends on its version and on where the
    # package was imported from; where it goes is what fa_verify decides.
    probe = subprocess.run([sys.executable, "-c", "import os; from fa_verify.cli.main import hypothesis_storage; "
                            "hypothesis_storage(); print(os.environ['HYPOTHESIS_STORAGE_DIRECTORY'])"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == str(tmp_path / "cache" / "fa_verify" / "hypothesis")


# --- nan_padding where padding cannot reach ----------------------------------------------------------

def test_nan_padding_is_not_applicable_without_a_way_to_the_buffers():
    problem = make_problem("normal", (1, 1, 1, 4, 13, 16), "fp32", 0)
    result = check_nan_padding(get_backend("naive-fp32"), problem)
    assert result.status == "not applicable"
    assert "no run_padded hook and is no callable" in result.detail and "would test nothing" in result.detail


def test_nan_padding_reaches_torch_tensors(capsys, tmp_path, monkeypatch):
    """--array torch: the tensors sit inside the NaN buffers, so a read past v's end is seen."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(tmp_path)
    write_module(tmp_path, "torch_overread", """
        import torch

        def attention(q, k, v, *, causal, scale):
            out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
            try:  # one element past v's end, as a pointer-reading kernel would (0 * x is NaN for NaN)
                out = out + 0 * torch.as_strided(v, (1,), (1,), v.storage_offset() + v.numel()).float()
            except RuntimeError:  # past the end of v's own storage: torch refuses
                pass
            return out.to(q.dtype)
    """)
    code, out, err = run_cli(capsys, "check", "torch_overread:attention", "--property", "nan_padding",
                             "--dtype", "fp32", "--causal", "no", "--array", "torch", "--json")
    assert code == 1, err
    failure = json.loads(out)["targets"][0]["properties"][0]["failure"]
    assert "the target reads outside its inputs" in failure


# --- help -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [(), ("backends",), ("bench",), ("bench", "oracle"), ("bench", "runner"),
                                     ("check",), ("report",), ("mutants",), ("build",)])
def test_every_help_states_the_exit_codes(capsys, command):
    code, out, _ = run_cli(capsys, *command, "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "Exit" in text and "2" in text[text.index("Exit"):], text
