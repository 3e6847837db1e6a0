"""Values built directly in Python are held to what the options accept (issue: "The first hour",
items 16-18): a wrong value is refused with the option's own words, never judged as something else."""

import numpy as np
import pytest

from fa_verify.conventions import Conventions
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import Limits
from fa_verify.oracle import reference
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem
from fa_verify.strategies import make_problem
from fa_verify.verdict import check_attention


@pytest.mark.parametrize("values, words", [
    (dict(lse_base="3"), "Conventions(lse_base='3') is not valid: base of the returned LSE"),
    (dict(ftz="maybe"), "Conventions(ftz='maybe') is not valid: subnormal inputs"),
    (dict(lse_dtype="fp16"), "Conventions(lse_dtype='fp16') is not valid"),
    (dict(masked_rows="nan"), "NaN there is a bug"),
    (dict(scale_precision="half"), "Conventions(scale_precision='half') is not valid"),
])
def test_conventions_refuse_what_the_options_refuse(values, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Conventions(**values)


def test_conventions_accept_what_the_options_accept():
    assert Conventions(lse_base="2", ftz=True, masked_rows="uniform").describe() == (
        "LSE base 2, fully masked rows uniform (output the mean of V), flush-to-zero")


@pytest.mark.parametrize("values, option", [
    (dict(head_dims=(-1,)), "--head-dims"), (dict(dtypes=("fp8",)), "--dtype"), (dict(seq_multiple=0), "--seq-multiple"),
    (dict(causal=()), "--causal"), (dict(causal=("yes",)), "--causal"), (dict(heads=("xyz",)), "--heads"),
    (dict(group_sizes=(0,)), "--group-sizes"), (dict(equal_seq="maybe"), "--equal-seq"),
])
def test_limits_refuse_what_the_options_refuse(values, option):
    with pytest.raises(InvalidArgumentError, match=f"Limits\\({next(iter(values))}=.* is not valid: .*{option}"):
        Limits(**values)


def test_limits_built_directly_equal_the_parsed_ones():
    assert Limits(head_dims=(128, 64, 64), causal=(True, False)) == Limits(head_dims=(64, 128))


def test_the_oracle_names_what_it_expected_instead_of_an_array():
    q = np.zeros((1, 1, 2, 8), np.float16)
    with pytest.raises(InvalidArgumentError, match="problem must be an AttentionProblem, got ndarray; build one"):
        reference(q)


def test_from_float_names_a_tensor_without_values():
    torch = pytest.importorskip("torch")
    meta = torch.zeros((1, 1, 2, 8), device="meta")
    with pytest.raises(InvalidArgumentError, match="q: a torch tensor on the meta device has no values"):
        AttentionProblem.from_float(meta, meta, meta, "fp16")


def test_check_attention_refuses_an_output_wider_than_the_kernel_stores():
    problem = make_problem("normal", (1, 2, 2, 8, 8, 16), "fp16", 0)
    exact = reference(problem).out
    verdict = check_attention(exact, problem, precision="flash")  # float64: values no fp16 kernel stores
    assert not verdict.passed and verdict.rule == "shape"
    assert "out.dtype=float64 but the precision model" in verdict.detail and "stores the output in fp16" in verdict.detail
    assert check_attention(exact.astype(np.float16), problem, precision="flash").passed
    fp32_out = PrecisionModel.parse("score=fp32,p=fp16,pv=fp32,out=fp32", "fp16")
    assert check_attention(exact.astype(np.float32), problem, precision=fp32_out).passed


def test_a_callable_that_fits_no_protocol_is_a_usage_error_naming_the_parameter(tmp_path, monkeypatch, capsys):
    """Item 19: a function that fits no protocol is refused before anything runs (exit 2), not
    reported as fifteen property failures. (A backward function, which was the example then, is
    now checked as the backward it is: tests/test_backward_pipeline.py.)"""
    from fa_verify.cli.main import main

    (tmp_path / "grads.py").write_text("def fwd(q, k, v, bias, *, causal, scale):\n    return q\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check", "grads:fwd", "--max-examples", "1"]) == 2
    err = capsys.readouterr().err
    assert "grads:fwd(q, k, v, bias, *, causal, scale) does not fit the callable protocol" in err
    assert "missing a required argument: 'bias'" in err and "--layout varlen" in err and "names dout" in err


def test_a_small_budget_limits_the_fixed_edge_cases_too_and_the_count_says_both(capsys):
    """Item 15: --max-examples 2 ran 46 examples (the fixed edge cases were not counted against it)."""
    import json
    import re

    from fa_verify.cli.main import main

    assert main(["check", "numpy-tiled", "--max-examples", "2", "--property", "oracle_agreement", "--json"]) == 0
    (prop,) = json.loads(capsys.readouterr().out)["targets"][0]["properties"]
    assert prop["fixed_examples"] == 2 and prop["examples"] == 4
    assert any(re.fullmatch(r"2 of the \d+ fixed edge cases, spread over them \(--max-examples 2\)", note)
               for note in prop["notes"])
    assert main(["check", "numpy-tiled", "--max-examples", "2", "--property", "oracle_agreement"]) == 0
    assert "passed, 4 examples (2 fixed edge cases, 2 drawn)" in capsys.readouterr().out
