"""Nothing passes that was not checked: empty selections, empty results files, failing examples
without a verdict, reproducers of the property that failed, nondeterministic targets, and
random seeds that CI can replay."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fa_verify.backends import CallableBackend, get_backend
from fa_verify.check import check_backend, results_recorder
from fa_verify.cli.main import main
from fa_verify.properties import Selection, as_backend, search_property
from fa_verify.report.cases import worst_cases
from fa_verify.results import RUN_ERROR, ResultsStore, ResultsWarning

pytest_plugins = ["pytester"]

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import attention_variants as variants  # noqa: E402

TILED = get_backend("numpy-tiled")
FAST = Selection(max_examples=5)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _differs_on_the_second_call():
    """numpy-tiled, but the second call's output is off at its last element: a nondeterministic
    target whose failure does not repeat when Hypothesis replays the example."""
    calls = []

    def run(problem):
        out, lse = TILED.run(problem)
        calls.append(None)
        if len(calls) == 2:
            out = out.copy()
            out.flat[-1] += 0.5
        return out, lse

    return run


def test_a_nondeterministic_target_fails_determinism_with_both_values_and_the_run_goes_on():
    target = as_backend(_differs_on_the_second_call(), name="flaky")
    outcome = check_backend(target, FAST, properties=["determinism", "oracle_agreement"])
    determinism, agreement = outcome.properties
    assert determinism.status == "failed" and "nondeterministic" in determinism.message()
    # the index and both runs' values
    assert "differ; first at [0, 0, 0, 0]: got " in determinism.message() and ", expected " in determinism.message()
    assert agreement.status == "passed" and agreement.examples > 0


def test_check_with_none_of_the_targets_dtypes_exits_2_in_text_and_json(capsys):
    wmma = get_backend("wmma-cpu")
    if not wmma.availability().available or "fp32" in wmma.dtypes:
        pytest.skip("needs wmma-cpu, an fp16/bf16-only backend")
    code, out, err = _run(capsys, "check", "wmma-cpu", "--dtype", "fp32")
    assert code == 2 and "nothing to check: wmma-cpu runs fp16, bf16, not --dtype fp32" in err
    code, out, err = _run(capsys, "check", "wmma-cpu", "--dtype", "fp32", "--json")
    document = json.loads(out)
    assert code == 2 and not document["passed"] and "nothing to check" in document["error"]


def test_check_where_every_property_is_not_applicable_exits_2(capsys):
    code, out, err = _run(capsys, "check", "numpy-tiled", "--causal", "yes", "--property", "key_permutation",
                          "--max-examples", "3")
    assert code == 2 and "NOTHING CHECKED numpy-tiled" in out
    assert "every property was not applicable (needs non-causal problems" in err


@pytest.mark.parametrize("content", [b"", b"garbage\n\x00\xff not json\n", b'{"a": 1}\n[1, 2]\n"text"\n'],
                         ids=["empty", "garbage", "json-but-not-records"])
def test_report_from_a_file_without_a_valid_record_is_an_error(capsys, tmp_path, content):
    source = tmp_path / "results.jsonl"
    source.write_bytes(content)
    with pytest.warns(ResultsWarning) if content else contextlib.nullcontext():
        code, _, err = _run(capsys, "report", "--from", source, "--out", tmp_path / "out")
    assert code == 2 and "no valid record found" in err
    assert not (tmp_path / "out" / "index.html").exists()


def _crashes(q, k, v, *, causal, scale):
    raise ZeroDivisionError("kernel bug")


def test_check_results_records_each_failure_and_the_report_shows_them(capsys, tmp_path):
    path = tmp_path / "results.jsonl"
    crashes = CallableBackend(_crashes, name="crashes")
    check_backend(crashes, FAST, properties=["oracle_agreement", "determinism"],
                  on_result=results_recorder(path, crashes, "check"))
    wrong_lse = CallableBackend(variants.wrong_lse, name="attention_variants:wrong_lse")
    check_backend(wrong_lse, Selection(max_examples=5, shrink=False), properties=["merge_law"],
                  on_result=results_recorder(path, wrong_lse, "check"))
    records = ResultsStore(path).read()
    raised = [r for r in records if r.backend == "crashes"]
    assert {r.extra["property"] for r in raised} == {"oracle_agreement", "determinism"}
    assert all(not r.passed and r.rule == RUN_ERROR and "ZeroDivisionError: kernel bug" in r.extra["error"]
               for r in raised)
    merge = [r for r in records if r.backend == "attention_variants:wrong_lse"]
    assert merge and all(r.rule == "merge_law" and not r.passed and "property_seed" in r.extra for r in merge)
    code, _, err = _run(capsys, "report", "--from", path, "--out", tmp_path / "out")
    assert code == 1 and f"{len(records)} failing" in err


def test_a_reproducer_in_the_report_replays_the_property_that_failed(tmp_path):
    path = tmp_path / "results.jsonl"
    backend = CallableBackend(variants.wrong_lse, name="attention_variants:wrong_lse")
    search_property(backend, "lse_agreement", Selection(max_examples=3, shrink=False),
                    on_result=results_recorder(path, backend, "check"))
    failures, _ = worst_cases(ResultsStore(path).read(), repro_dir=tmp_path / "repro")
    [script] = (tmp_path / "repro").glob("repro_*.py")
    assert failures and failures[0].reproducer.endswith(str(script)) and script.name.startswith("repro_lse_agreement_")
    rerun = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path)
    assert rerun.returncode == 1 and "property 'lse_agreement' failed" in rerun.stdout, rerun.stderr
    assert "oracle_agreement" not in rerun.stdout


def test_a_sweep_record_replays_agreement_of_the_output_and_of_the_lse():
    from fa_verify.report.cases import replayed_properties
    from fa_verify.results import record_from_verdict
    from fa_verify.strategies import make_problem
    from fa_verify.verdict import check_attention

    problem = make_problem("normal", (1, 1, 1, 4, 4, 8), "fp16", 0)
    out, lse = TILED.run(problem)
    record = record_from_verdict(problem, "numpy-tiled", TILED.precision("fp16"),
                                 check_attention(out, problem, lse=lse + 1), 0.0, "report")
    assert replayed_properties(record) == ("oracle_agreement", "lse_agreement")


def _problem_keys(path):
    return [r.problem.key() for r in ResultsStore(path).read()]


def test_seed_random_is_printed_first_recorded_and_replays(capsys, tmp_path):
    args = ("check", "numpy-tiled", "--property", "oracle_agreement", "--max-examples", "3", "--dtype", "fp16")
    code, out, _ = _run(capsys, *args, "--seed", "random", "--results", tmp_path / "a.jsonl")
    first = out.splitlines()[0]
    assert code == 0 and first.startswith("seed ") and "replay with --seed" in first
    seed = int(first.split()[1])
    assert {r.extra["search_seed"] for r in ResultsStore(tmp_path / "a.jsonl").read()} == {seed}
    code, out, err = _run(capsys, *args, "--seed", "random", "--json")
    document = json.loads(out)
    assert document["seed_drawn"] and err.startswith(f"seed {document['seed']} ")
    assert document["seed"] != seed  # a new draw (1 in 2**32 to repeat)
    _run(capsys, *args, "--seed", seed, "--results", tmp_path / "b.jsonl")
    assert _problem_keys(tmp_path / "a.jsonl") == _problem_keys(tmp_path / "b.jsonl")


def test_the_plugin_records_a_target_that_raises_and_its_random_seed(pytester):
    pytester.makepyfile(test_kernel="""
        from fa_verify.backends import get_backend

        def test_agreement(fa_search):
            assert fa_search(get_backend("numpy-tiled"), "oracle_agreement").examples > 0

        def test_a_kernel_that_throws(fa_search):
            def throws(problem):
                raise RuntimeError("launch failed")
            fa_search(throws, "oracle_agreement")
    """)
    result = pytester.runpytest_subprocess("--fa-seed", "random", "--fa-results", "r.jsonl")
    result.assert_outcomes(passed=1, failed=1)
    lines = [line for line in result.outlines if line.startswith("fa_verify: Hypothesis seed ")]
    assert len(lines) == 2 and lines[0] == lines[1]  # in the header, and at the end (-q hides the header)
    assert "drawn by --fa-seed random" in lines[0]
    seed = int(lines[0].split()[3])
    records = ResultsStore(pytester.path / "r.jsonl").read()
    assert records and {r.extra["search_seed"] for r in records} == {seed}
    raised = [r for r in records if r.rule == RUN_ERROR]
    assert raised and all("RuntimeError: launch failed" in r.extra["error"] for r in raised)
    rendered = subprocess.run([sys.executable, "-m", "fa_verify", "report", "--from", "r.jsonl", "--out", "out"],
                              cwd=pytester.path, capture_output=True, text=True)
    assert rendered.returncode == 1 and f"{len(raised)} failing" in rendered.stderr
