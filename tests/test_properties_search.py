"""The search engine behind `fa_verify check`, the plugin and properties/: outcomes, counts,
reproducers, applicability, target errors, records."""

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis.database import InMemoryExampleDatabase

from fa_verify.backends import CallableBackend, get_backend
from fa_verify.check import Oracle, check_backend, results_recorder
from fa_verify.errors import AttentionMismatch, InvalidArgumentError
from fa_verify.profiles import PROFILES, get_profile
from fa_verify.properties import PROPERTY_NAMES, Selection, get_property, search_property
from fa_verify.properties.draw import edge_problems
from fa_verify.results import ResultsStore
from fa_verify.strategies import make_problem

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import attention_variants as variants  # noqa: E402

TILED = get_backend("numpy-tiled")
FAST = Selection(max_examples=5)


def test_the_suite_covers_every_property_once():
    tests = set()
    for path in (Path(__file__).parents[1] / "properties").glob("test_*.py"):
        lines = path.read_text().splitlines()
        tests |= {line.split("(")[0].removeprefix("def test_") for line in lines if line.startswith("def test_")}
    assert tests == set(PROPERTY_NAMES)


def test_a_failure_has_a_minimal_counterexample_and_a_reproducer_that_reproduces_it(tmp_path):
    backend = CallableBackend(variants.wrong_lse, name="attention_variants:wrong_lse")
    outcome = search_property(backend, "lse_agreement", FAST, repro_dir=tmp_path / "repro")
    assert outcome.status == "failed" and outcome.examples_to_failure == 1
    assert outcome.problem.nq * outcome.problem.nk <= 4  # shrunk from an edge case
    assert "minimal counterexample" in outcome.message() and "reproduce: python3 " in outcome.message()
    rerun = subprocess.run([sys.executable, outcome.reproducer_files["script"]], capture_output=True, text=True,
                           cwd=tmp_path)
    assert rerun.returncode == 1 and "property 'lse_agreement' failed" in rerun.stdout, rerun.stderr
    assert search_property(backend, "lse_agreement", FAST).reproducer == ""  # no folder, nothing written


def test_examples_to_failure_counts_the_examples_judged_before_the_first_failure():
    backend = CallableBackend(variants.truncation, name="truncation")
    outcome = search_property(backend, "unbiased_rounding", Selection(max_examples=20, shrink=False))
    assert outcome.status == "failed" and 1 <= outcome.examples_to_failure <= outcome.examples


def test_not_applicable_is_reported_with_its_reason_never_as_passed():
    math_sdpa = get_backend("torch-sdpa-math")
    if not math_sdpa.availability().available:
        pytest.skip("torch is not installed")
    outcome = search_property(math_sdpa, "merge_law", FAST)
    assert outcome.status == "not applicable" and "returns no LSE" in outcome.reason and outcome.examples == 0
    outcome = search_property(TILED, "key_permutation", Selection(max_examples=5, causal=(True,)))
    assert outcome.status == "not applicable" and "non-causal" in outcome.reason
    top_left_only = CallableBackend(variants.tiles_in_order, causal_alignment="top-left")
    outcome = search_property(top_left_only, "fully_masked_rows", FAST)
    assert outcome.status == "not applicable" and "bottom-right" in outcome.reason


def test_the_search_draws_only_what_the_target_runs():
    class Dims16And32(type(TILED)):
        def supports(self, problem):
            return None if problem.head_dim in (16, 32) and problem.dtype != "fp32" else "no"

    seen = []
    search_property(Dims16And32(), "oracle_agreement", Selection(max_examples=15),
                    on_result=lambda p, r, s: seen.append((p.head_dim, p.dtype)))
    assert seen and {d for d, _ in seen} <= {16, 32} and "fp32" not in {t for _, t in seen}


def test_edge_cases_run_first_for_agreement():
    prop = get_property("oracle_agreement")
    edges, notes = edge_problems(prop, TILED, FAST)
    # nine shapes and two with D_v != D (numpy-tiled runs any D_v), three dtypes, three causal modes
    assert len(edges) == 11 * 3 * 3 and not notes
    assert edge_problems(get_property("merge_law"), TILED, FAST) == ([], ())
    outcome = search_property(TILED, prop, FAST)
    assert outcome.passed and outcome.examples >= len(edges)


def test_target_errors_are_failures_and_setup_errors_are_raised():
    def crashes(q, k, v, *, causal, scale):
        raise ZeroDivisionError("kernel bug")

    outcome = search_property(CallableBackend(crashes, name="crashes"), "determinism", FAST)
    assert outcome.status == "failed" and "the target raised ZeroDivisionError: kernel bug" in outcome.message()

    def misuse(problem):
        raise InvalidArgumentError("bad setup")

    with pytest.raises(InvalidArgumentError, match="bad setup"):
        search_property(misuse, "determinism", FAST)


def test_searches_share_a_database_without_mixing_their_examples():
    db = InMemoryExampleDatabase()
    backend = CallableBackend(variants.wrong_lse, name="wrong_lse")
    search_property(backend, "merge_law", Selection(max_examples=5, seed=None, database=db))
    assert db.data and all(key.startswith(b"merge_law:wrong_lse\0") for key in db.data)


def test_profiles_and_selection():
    assert {"ci", "thorough", "gpu"} <= set(PROFILES)
    ci = Selection.from_profile("ci", max_seq=None)
    assert (ci.max_examples, ci.max_seq, ci.typical_seq, ci.seed) == (get_profile("ci").max_examples, 257, 64, 0)
    assert Selection.from_profile("thorough").seed is None
    with pytest.raises(InvalidArgumentError, match="profile='nightly'"):
        get_profile("nightly")


def test_check_backend_runs_the_chosen_properties_and_records_verdicts(tmp_path):
    path = tmp_path / "results.jsonl"
    outcome = check_backend(TILED, FAST, properties=["oracle_agreement", "determinism"],
                            on_result=results_recorder(path, TILED, "check"))
    data = outcome.as_dict()
    assert data["passed"] and [p["property"] for p in data["properties"]] == ["oracle_agreement", "determinism"]
    records = ResultsStore(path).read()
    assert len(records) == outcome.properties[0].examples  # one verdict per agreement example
    assert {r.source for r in records} == {"check"} and records[0].extra == {"property": "oracle_agreement"}


def test_oracle_records_and_raises(tmp_path):
    problem = make_problem("normal", (1, 1, 1, 4, 4, 8), "fp16", 0)
    oracle = Oracle(results=tmp_path / "r.jsonl")
    out, lse = TILED.run(problem)
    assert oracle.assert_close(out, problem, lse=lse, name="tiled").passed
    with pytest.raises(AttentionMismatch, match="error_bound|ensemble"):
        oracle.assert_close(out * 2, problem, name="doubled")
    assert [r.backend for r in ResultsStore(tmp_path / "r.jsonl").read()] == ["tiled", "doubled"]
    assert oracle.reference(problem).out.shape == problem.out_shape
