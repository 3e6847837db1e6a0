"""The shape budget (--shapes N): each property draws from at most N problem signatures, values
still vary, within the declared limits; bad budgets are usage errors."""

import sys
from pathlib import Path

import pytest

from fa_verify.backends import CallableBackend, get_backend
from fa_verify.cli.main import main
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import Limits
from fa_verify.properties import Selection, search_property
from fa_verify.strategies import Shape

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from user_kernels import float64_then_round  # noqa: E402

pytest_plugins = ["pytester"]


def _drawn(backend, prop, selection):
    """(the signatures, the value seeds) of the problems the search of `prop` judged."""
    signatures, seeds = set(), set()

    def record(problem, result, seconds):
        signatures.add((Shape.of(problem), problem.dtype, problem.causal, problem.causal_alignment, problem.scale))
        seeds.add(dict(problem.tags)["seed"])

    outcome = search_property(backend, prop, selection, on_result=record)
    return outcome, signatures, seeds


def test_a_property_draws_from_at_most_the_budgeted_shapes_with_varying_values():
    backend = get_backend("naive-fp32")
    outcome, signatures, seeds = _drawn(backend, "convex_hull", Selection(max_examples=12, shapes=2))
    assert outcome.passed and outcome.examples == 12
    assert len(signatures) == 2  # two signatures, both drawn from (a dozen examples)
    assert len(seeds) > 2  # and fresh values for each example
    assert "--shapes 2: drawn from 2 shapes" in outcome.message()
    _, unbudgeted, _ = _drawn(backend, "convex_hull", Selection(max_examples=12))
    assert len(unbudgeted) > 2  # without a budget the same search draws more shapes


def test_the_budget_is_drawn_from_the_seed_and_stays_within_declared_limits():
    limits = Limits(head_dims=(16, 32), seq_multiple=16, equal_seq=True, heads=("mha",))
    backend = CallableBackend(float64_then_round, name="limited", limits=limits, dtypes=("fp32",))
    selection = Selection(max_examples=8, shapes=3, seed=5)
    _, first, _ = _drawn(backend, "constant_v", selection)
    _, again, _ = _drawn(backend, "constant_v", selection)
    assert first == again and len(first) <= 3
    for shape, *_ in first:
        assert shape.head_dim in (16, 32) and shape.nq == shape.nk and shape.nq % 16 == 0
        assert shape.heads == shape.kv_heads


def test_properties_that_derive_other_shapes_say_so():
    outcome = search_property(get_backend("naive-fp32"), "merge_law", Selection(max_examples=3, shapes=1))
    assert "--shapes 1: drawn from 1 shapes; its key chunks: one choice per shape (property seed 0)" in outcome.message()


@pytest.mark.parametrize("value", [0, -1, 2.5, "3", True])
def test_a_bad_budget_in_the_api_names_it(value):
    with pytest.raises(InvalidArgumentError, match="Selection.shapes="):
        Selection(shapes=value)


@pytest.mark.parametrize("value, message", [("0", "0 must be a whole number >= 1"),
                                            ("-1", "-1 must be a whole number >= 1"),
                                            ("four", "'four' is not an integer")])
def test_a_bad_budget_on_the_command_line_exits_2(capsys, value, message):
    with pytest.raises(SystemExit) as exc:
        main(["check", "naive-fp32", "--shapes", value])
    assert exc.value.code == 2
    assert f"argument --shapes: {message}" in capsys.readouterr().err


def test_the_pytest_plugin_takes_the_budget_as_fa_shapes(pytester):
    pytester.makepyfile(test_kernel="""
        from fa_verify.backends import get_backend

        def test_budget(fa_search):
            outcome = fa_search(get_backend("naive-fp32"), "convex_hull")
            assert "--shapes 2: drawn from 2 shapes" in outcome.message()
    """)
    pytester.runpytest_subprocess("--fa-shapes", "2").assert_outcomes(passed=1)


def test_a_bad_fa_shapes_is_a_usage_error(pytester):
    result = pytester.runpytest_inprocess("--fa-shapes", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --fa-shapes: 0 must be a whole number >= 1*"])
