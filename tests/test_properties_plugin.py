"""The pytest plugin: options, fixtures, the properties/ suite, and the examples/ file."""

import json
import re
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
    # not applicable: races and address_sanitizer (no CUDA kernel) and the variant properties, the
    # tests of varlen / paged batches (properties/test_varlen_paged.py) and of the backward
    # (properties/test_backward.py) and of FP8 problems (properties/test_fp8.py): the callable runs
    # dense problems
    other_kinds = sum(len(re.findall(r"^def test_", (ROOT / "properties" / name).read_text(), re.MULTILINE))
                      for name in ("test_varlen_paged.py", "test_backward.py", "test_fp8.py"))
    assert other_kinds >= 8 + 12
    result.assert_outcomes(passed=16, skipped=7 + other_kinds)


def test_fa_layout_checks_varlen_and_paged_functions(pytester):
    for name in ("ragged_kernels.py", "feature_kernels.py"):
        shutil.copy(FIXTURES / name, pytester.path)
    pytester.makepyfile(test_kernel="""
        def test_agreement(fa_backend, fa_search):
            fa_search(fa_backend, "ragged_agreement")

        def test_dense(fa_backend, fa_search):
            fa_search(fa_backend, "oracle_agreement")
    """)
    quick = ("--fa-page-sizes", "16", "--fa-dtype", "fp16", "--fa-no-isolate", "-p", "no:cacheprovider", "-rs")
    result = pytester.runpytest_subprocess("--fa-layout", "paged", "--fa-backend", "ragged_kernels:paged_attention",
                                           "--fa-backend", "ragged_kernels:paged_page_boundary", *quick)
    result.assert_outcomes(passed=1, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*ragged_agreement: FAILED after * examples*", "*page_size=16*",
                                 "*reproduce: python3 *repro_ragged_agreement_*.py*",
                                 "*a property of dense problems; ragged_kernels:paged_attention runs paged problems*"])
    for argv, message in ((("--fa-layout", "varlen", "--fa-backend", "numpy-tiled"),
                           "*--fa-layout applies to MODULE:FUNC targets only*"),
                          (("--fa-layout", "varlen", "--fa-backend", "ragged_kernels:varlen_attention",
                            "--fa-page-sizes", "16"), "*give --fa-layout paged (not varlen)*"),
                          (("--fa-layout", "paged", "--fa-backend", "ragged_kernels:paged_attention",
                            "--fa-causal-alignment", "top-left"), "*--fa-causal-alignment top-left cannot be used*")):
        result = pytester.runpytest_subprocess(*argv)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([message])


def test_the_example_ci_file_passes(pytester):
    shutil.copy(ROOT / "examples" / "test_my_attention.py", pytester.path)
    result = pytester.runpytest_subprocess("--fa-profile", "ci")
    result.assert_outcomes(passed=17, skipped=7)  # races, address_sanitizer and the variant properties: not applicable to a callable


def test_a_known_deviation_is_expected_only_in_the_way_it_is_declared(pytester):
    pytester.makepyfile(test_kernel="""
        import numpy as np
        import pytest
        from fa_verify.backends import get_backend
        from fa_verify.backends.torch_sdpa import MASKED_ROW_LSE_ZERO
        from fa_verify.properties.known_deviation import KnownDeviation

        TILED = get_backend("numpy-tiled")
        OVERFLOWS = pytest.mark.fa_known_deviation(KnownDeviation("overflows", rules=("finite",)))
        LSE_ZERO = pytest.mark.fa_known_deviation(KnownDeviation("LSE 0", deviations=(MASKED_ROW_LSE_ZERO,)))

        def overflowing(problem):
            out, lse = TILED.run(problem)
            out = out.copy()
            out[..., -1, 0] = np.inf
            return out, lse

        def lse_zero(problem):
            out, lse = TILED.run(problem)
            return out, np.where(problem.masked_rows, np.float32(0), lse)

        def overflowing_and_wrong(problem):  # wrong in fp32: a failure of another kind, found too
            return overflowing(problem) if problem.dtype != "fp32" else (TILED.run(problem)[0] * 2, None)

        @OVERFLOWS
        def test_declared_rule(fa_search):
            fa_search(overflowing, "oracle_agreement")

        @OVERFLOWS
        def test_declared_rule_and_another(fa_search):
            fa_search(overflowing_and_wrong, "oracle_agreement")

        @LSE_ZERO
        def test_declared_convention(fa_search):
            fa_search(lse_zero, "fully_masked_rows")

        @LSE_ZERO
        def test_more_than_the_convention(fa_search):
            fa_search(lambda problem: (lse_zero(problem)[0] + 1, lse_zero(problem)[1]), "fully_masked_rows")

        @LSE_ZERO
        def test_the_convention_not_drawn(fa_search):
            fa_search(TILED, "fully_masked_rows")

        @pytest.mark.fa_known_deviation(KnownDeviation("LSE 0", deviations=(MASKED_ROW_LSE_ZERO,), always=True))
        def test_always_but_it_passed(fa_search):
            fa_search(TILED, "fully_masked_rows")
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fa-shapes", "2", "-rx")
    result.assert_outcomes(passed=1, xfailed=2, failed=3)
    result.stdout.fnmatch_lines_random([
        "XFAIL*test_declared_rule - known deviation: overflows",
        "XFAIL*test_declared_convention - known deviation: LSE 0",
        "*_ test_declared_rule_and_another _*", "it fails by error_bound, not by finite only:",
        "*_ test_more_than_the_convention _*", "with fa_verify's convention put back*it does not pass:",
        "*_ test_always_but_it_passed _*", "known deviation (LSE 0) did not show*out of date"])
