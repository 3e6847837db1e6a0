"""Records written by `fa_verify check --results` and the pytest plugin (`check.results_recorder`,
`check.Oracle`): the examples a user would count, each with the rounded reference's error, so a
report made from them has its headline figure ("× rounded") and counts failures as the search
reported them (issue 25 saw "× rounded —" in every cell and "938 failing" for one buggy kernel)."""

from __future__ import annotations

import numpy as np

from fa_verify.backends import NumpyTiledBackend
from fa_verify.check import Oracle, check_backend, results_recorder
from fa_verify.properties import Selection
from fa_verify.limits import Limits
from fa_verify.report.data import build
from fa_verify.report.render import render_markdown
from fa_verify.results import EXACTLY_ROUNDED, ResultsStore
from fa_verify.strategies import make_problem

FAST = Selection(max_examples=5, dtypes=("fp16",), max_seq=24, typical_seq=16)


class _OffAtLength(NumpyTiledBackend):
    """numpy-tiled whose output is 5% off from 9 queries on, so that shrinking has work to do."""

    name = "off-at-9"
    limits = Limits()  # D_v = D: the draws this test was written against (others reach fp16_extremes' overflow)

    def _run(self, problem):
        out, lse = super()._run(problem)
        return (out * (1.05 if problem.nq >= 9 else 1.0)).astype(out.dtype), lse


def test_check_records_carry_the_rounded_references_error_and_the_report_its_ratio(tmp_path):
    path = tmp_path / "results.jsonl"
    backend = NumpyTiledBackend()
    check_backend(backend, FAST, properties=["oracle_agreement"], on_result=results_recorder(path, backend, "check"))
    records = ResultsStore(path).read()
    assert records and all(set(r.comparisons) == {EXACTLY_ROUNDED} for r in records)
    # the rounded reference's error is a rounding: at most half an ULP, and never above the kernel's
    for r in records:
        rounded = r.comparisons[EXACTLY_ROUNDED]
        assert rounded["ulp"]["max"] <= 0.5 and rounded["abs"]["rmse"] <= r.out_errors["abs"]["rmse"]
    data = build(records, environment={})
    assert all(cell.vs_rounded >= 1 for cell in data.sections[0].overview if cell)
    assert "× rounded —" not in render_markdown(data)


def test_the_oracle_fixtures_records_carry_the_rounded_references_error(tmp_path):
    problem = make_problem("normal", (1, 2, 2, 24, 24, 16), "fp16", 0)
    oracle = Oracle(results=tmp_path / "r.jsonl")
    out, lse = NumpyTiledBackend().run(problem)
    oracle.check(out, problem, lse=lse, name="tiled")
    [record] = ResultsStore(tmp_path / "r.jsonl").read()
    assert build([record], environment={}).sections[0].overview[0].vs_rounded >= 1


def test_only_the_minimal_failing_example_of_each_distinct_failure_is_recorded(tmp_path):
    path = tmp_path / "results.jsonl"
    backend = _OffAtLength()
    seen = []
    record = results_recorder(path, backend, "check")

    def counting(problem, result, seconds):
        seen.append(result.failed)
        record(problem, result, seconds)

    if hasattr(record, "finish"):  # told the search's outcome when it ends
        counting.finish = record.finish
    [outcome] = check_backend(backend, Selection(max_examples=20, dtypes=("fp16",), max_seq=24, typical_seq=16),
                              properties=["oracle_agreement"], on_result=counting).properties
    assert outcome.status == "failed" and sum(seen) > 1 + len(outcome.other_failures)  # it shrank
    records = ResultsStore(path).read()
    failing = [r for r in records if not r.passed]
    minimal = [outcome.problem] + [p for p, _, _ in outcome.other_failures]
    assert sorted((r.problem.nq, r.problem.nk, r.problem.causal) for r in failing) == sorted(
        (p.nq, p.nk, p.causal) for p in minimal)
    assert all(r.problem.nq >= 9 for r in failing)
    assert len(records) - len(failing) == seen.count(False)  # every pass is recorded
    data = build(records, environment={})
    assert data.totals.failed == len(minimal) and np.isfinite(data.sections[0].vs_rounded)
