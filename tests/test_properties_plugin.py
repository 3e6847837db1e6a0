"""The pytest plugin: options, fixtures, the properties/ suite, and the examples/ file."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


def test_fa_search_and_fa_oracle_in_another_projects_tests(pytester):
    pytester.makepyfile(test_kernel="""
        from hypothesis import given, settings
        from fa_verify import strategies as fst
        from fa_verify.backends import get_backend

        TILED = get_backend("numpy-tiled")

        def test_agreement(fa_search):
            outcome = fa_search(TILED, "oracle_agreement")
            assert outcome.examples > 0

        def test_no_lse_is_skipped(fa_search):
            fa_search(lambda problem: TILED.run(problem)[0], "lse_agreement")

        @settings(max_examples=5, deadline=None)
        @given(problem=fst.problems())
        def test_oracle(fa_oracle, problem):
            out, lse = TILED.run(problem)
            fa_oracle.assert_close(out, problem, lse=lse, name="tiled")
    """)
    result = pytester.runpytest_subprocess("--fa-results", "r.jsonl", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*lse_agreement: not applicable*returns no LSE*"])
    records = [json.loads(line) for line in (pytester.path / "r.jsonl").read_text().splitlines()]
    assert {r["source"] for r in records} == {"pytest"}
    assert {r["backend"] for r in records} == {"numpy-tiled", "tiled"}


def test_a_failing_property_prints_the_counterexample_and_reproducer(pytester, monkeypatch):
    monkeypatch.delenv("FA_VERIFY_REPRO_DIR")  # the default folder: under the rootdir
    shutil.copy(FIXTURES / "attention_variants.py", pytester.path)
    pytester.makepyfile(test_kernel="""
        def test_merge(fa_backend, fa_search):
            fa_search(fa_backend, "merge_law")
    """)
    result = pytester.runpytest_subprocess("--fa-backend", "attention_variants:wrong_lse",
                                           "--fa-backend", "numpy-tiled")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*merge_law: FAILED after * examples*", "*minimal counterexample: B=*",
                                 "*reproduce: python3 .fa_verify/repro/repro_merge_law_*.py"])
    [script] = (pytester.path / ".fa_verify" / "repro").glob("repro_merge_law_*.py")  # under the rootdir
    elsewhere = pytester.mkdir("elsewhere")
    rerun = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=elsewhere)
    assert rerun.returncode == 1 and "property 'merge_law' failed" in rerun.stdout, rerun.stderr


def test_unknown_backend_is_a_usage_error(pytester):
    pytester.makepyfile(test_kernel="def test_x(fa_backend): pass")
    result = pytester.runpytest_subprocess("--fa-backend", "no-such-backend")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--fa-backend*no-such-backend*"])


def test_the_property_suite_runs_against_a_callable(pytester):
    shutil.copytree(ROOT / "properties", pytester.path / "properties")
    shutil.copy(FIXTURES / "attention_variants.py", pytester.path)
    result = pytester.runpytest_subprocess("properties", "--fa-backend", "attention_variants:split_kv",
                                           "-p", "no:cacheprovider")
    # not applicable: races and address_sanitizer (no CUDA kernel) and the variant properties; skipped: the
    # 16 ragged tests of the built-in ragged backends (properties/test_varlen_paged.py), --fa-backend given
    result.assert_outcomes(passed=15, skipped=7 + 16)


def test_the_example_ci_file_passes(pytester):
    shutil.copy(ROOT / "examples" / "test_my_attention.py", pytester.path)
    result = pytester.runpytest_subprocess("--fa-profile", "ci")
    result.assert_outcomes(passed=16, skipped=7)  # races, address_sanitizer and the variant properties: not applicable to a callable
