"""Declared conventions: each changes the verdict. A target with the convention fails without
the option and passes with it; a target with the convention and a real bug fails with it."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import CallableBackend
from fa_verify.cli.main import main
from fa_verify.conventions import Conventions, conventions_from_options, parse_conventions
from fa_verify.errors import BackendOutputError, InvalidArgumentError
from fa_verify.problem import AttentionProblem
from fa_verify.properties.agreement import check_lse_agreement, check_oracle_agreement
from fa_verify.properties._result import failed
from fa_verify.properties.masking import check_fully_masked_rows
from fa_verify.properties.rounding import check_unbiased_rounding

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import convention_kernels as kernels  # noqa: E402

pytest_plugins = ["pytester"]


def _problem(dtype="fp16", nq=24, nk=24, d=16, causal=False, seed=0, v_scale=1.0, spread=1.0, scale=None):
    rng = np.random.default_rng(seed)
    q = spread * rng.standard_normal((1, 2, nq, d))
    k = spread * rng.standard_normal((1, 2, nk, d))
    v = v_scale * rng.standard_normal((1, 2, nk, d))
    return AttentionProblem.from_float(q, k, v, dtype, causal=causal, scale=scale)


def _judge(fn, check, problem, **conventions):
    """The property `check` of `fn` declared with `conventions`, on `problem` as judged under them
    (as `search_property` judges: an output the protocol refuses is a failure)."""
    backend = CallableBackend(fn, conventions=conventions)
    problem = backend.judged_under.problem(problem)
    try:
        return check(backend, problem)
    except BackendOutputError as exc:
        return failed(check.__name__, problem, str(exc))


CASES = [  # (the convention, its target, the same with a bug, the property that sees it, a problem)
    ({"lse_base": "2"}, kernels.lse_base_2, kernels.lse_base_2_off, check_lse_agreement, _problem()),
    ({"lse_dtype": "input"}, kernels.lse_in_input_dtype, kernels.lse_in_input_dtype_unscaled,
     check_lse_agreement, _problem(spread=2.0)),
    ({"masked_rows": "uniform"}, kernels.uniform_masked_rows, kernels.uniform_masked_rows_first_key,
     check_fully_masked_rows, _problem(nq=24, nk=16, causal=True)),
    # head 1's V is subnormal in fp16 (flushed: off by up to 6e-5); head 0 keeps the example informative
    ({"ftz": True}, kernels.flush_to_zero, kernels.flush_to_zero_wrong_scale, check_oracle_agreement,
     AttentionProblem.from_float(*(_problem("fp32").q, _problem("fp32").k,
                                   _problem("fp32").v * np.array([1.0, 2e-5])[None, :, None, None]), "fp16")),
    # a scale rounded to bf16 (D = 12: 1.3e-3 high) is within the output's bound but biases the errors
    ({"scale_precision": "input"}, kernels.rounded_scale, kernels.rounded_scale_truncated, check_unbiased_rounding,
     _problem("bf16", nq=64, nk=64, d=12)),
]
IDS = [next(iter(c[0])) for c in CASES]


@pytest.mark.parametrize("conventions, fn, buggy, check, problem", CASES, ids=IDS)
def test_each_convention_changes_the_verdict(conventions, fn, buggy, check, problem):
    without = _judge(fn, check, problem)
    assert without.failed, without.message()
    declared = _judge(fn, check, problem, **conventions)
    assert declared.passed, declared.message()
    still = _judge(buggy, check, problem, **conventions)
    assert still.failed, still.message()


def test_an_lse_in_the_input_dtype_is_refused_with_the_option_that_declares_it():
    result = _judge(kernels.lse_in_input_dtype, check_lse_agreement, _problem())
    assert "dtype=fp16" in result.detail and "--lse-dtype input" in result.detail


def test_uniform_rows_are_judged_against_the_mean_of_v_not_waved_through():
    """With the convention, the first-key bug's masked rows keep their distance from the mean."""
    problem = _problem(nq=24, nk=16, causal=True)
    backend = CallableBackend(kernels.uniform_masked_rows_first_key, conventions={"masked_rows": "uniform"})
    out, lse = backend.run(problem)
    masked = problem.masked_rows
    assert np.all(lse[:, :, masked] == -np.inf)
    assert np.abs(out[:, :, masked].astype(np.float64)).max() > 0.1
    right = CallableBackend(kernels.uniform_masked_rows, conventions={"masked_rows": "uniform"}).run(problem)[0]
    assert np.all(right[:, :, masked] == 0)


def test_one_spelling_in_options_toml_and_the_api():
    from_options = parse_conventions({"lse-base": "2", "lse-dtype": "input", "masked-rows": "uniform",
                                      "ftz": "yes", "scale-precision": "input"})
    from_toml = conventions_from_options({}, {"lse-base": 2, "lse-dtype": "input", "masked-rows": "uniform",
                                              "ftz": True, "scale-precision": "input", "head-dims": [16]})
    from_api = CallableBackend(kernels.lse_base_2, conventions={"lse_base": "2", "lse_dtype": "input",
                                                                 "masked_rows": "uniform", "ftz": True,
                                                                 "scale_precision": "input"}).judged_under
    assert from_options == from_toml == from_api == Conventions("2", "input", "uniform", True, "input")
    assert from_api.describe() == ("LSE base 2, LSE in the input dtype, fully masked rows uniform (output the "
                                   "mean of V), flush-to-zero, scale rounded to the input dtype")
    assert parse_conventions(from_api.as_dict()) == from_api


@pytest.mark.parametrize("values, named", [
    ({"lse-base": "10"}, "--lse-base='10'"), ({"ftz": "maybe"}, "--ftz='maybe'"),
    ({"masked-rows": "nan"}, "a bug"), ({"lse-bass": "2"}, "--lse-bass is not a convention"),
])
def test_bad_conventions_name_the_option(values, named):
    with pytest.raises(InvalidArgumentError, match=named.replace("(", r"\(")):
        parse_conventions(values)


def test_the_cli_judges_under_the_declared_conventions_and_says_so(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    args = ["check", "convention_kernels:lse_base_2", "--property", "lse_agreement", "--dtype", "fp32",
            "--max-examples", "3", "--no-isolate"]
    assert main(args) == 1
    printed = capsys.readouterr().out
    assert "judged under: fa_verify's conventions" in printed and "FAIL lse_agreement" in printed
    assert "the LSE is log2 of the row sum" in printed and "declare --lse-base 2" in printed
    assert main([*args, "--lse-base", "2", "--ftz"]) == 0
    printed = capsys.readouterr().out
    assert "judged under: LSE base 2, flush-to-zero" in printed and "PASS lse_agreement" in printed
    assert main([*args, "--lse-base", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["targets"][0]["judged_under"] == "LSE base 2"
    assert document["targets"][0]["conventions"]["lse-base"] == "2"


def test_a_convention_with_a_builtin_backend_is_a_usage_error(capsys):
    assert main(["check", "numpy-tiled", "--lse-base", "2"]) == 2
    assert "--lse-base" in capsys.readouterr().err


def test_the_pytest_plugin_takes_the_same_conventions(pytester, tmp_path):
    import shutil

    shutil.copy(FIXTURES / "convention_kernels.py", pytester.path)
    (tmp_path / "limits.toml").write_text("lse-dtype = 'input'\nhead-dims = [16]\n")
    pytester.makepyfile(test_kernel="""
        from fa_verify.conventions import Conventions

        def test_declared(fa_backend):
            assert fa_backend.judged_under == Conventions(lse_base="2", lse_dtype="input", ftz=True)
            assert fa_backend.limits.head_dims == (16,)
    """)
    result = pytester.runpytest_subprocess("--fa-backend", "convention_kernels:lse_base_2", "--fa-lse-base", "2",
                                           "--fa-ftz", "--fa-limits", str(tmp_path / "limits.toml"))
    result.assert_outcomes(passed=1)
    bad = pytester.runpytest_subprocess("--fa-backend", "convention_kernels:lse_base_2", "--fa-lse-base", "10")
    assert bad.ret == 4 and "--fa-lse-base='10' is not valid" in bad.stderr.str()
