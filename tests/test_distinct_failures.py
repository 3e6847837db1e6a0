"""A property searches on after a first failure and reports failures of other kinds (rule,
dtype, causal mode) apart, each with its own minimal counterexample."""

import sys
from pathlib import Path

from fa_verify.backends import CallableBackend
from fa_verify.properties import Selection, search_property
from fa_verify.properties.search import failure_kind

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from convention_kernels import wrong_fp16_causal_and_bf16_lse  # noqa: E402

SELECTION = Selection(dtypes=("fp16", "bf16"), max_examples=15, max_seq=32, typical_seq=16)


def _kinds(outcome):
    failures = [(outcome.problem, outcome.failure), *((p, r) for p, _, r in outcome.other_failures)]
    return {failure_kind(p, r)[1:] for p, r in failures}


def test_a_wrong_fp16_causal_output_and_a_wrong_bf16_lse_are_both_reported():
    outcome = search_property(CallableBackend(wrong_fp16_causal_and_bf16_lse), "merge_law", SELECTION)
    kinds = _kinds(outcome)
    assert ("fp16", True) in kinds and {("bf16", False), ("bf16", True)} & kinds, outcome.message()
    assert ("fp16", False) not in kinds  # nothing wrong there
    message = outcome.message()
    assert f"{len(kinds)} distinct failures" in message and "also failed (merge_law, " in message
    assert len(outcome.as_dict()["other_failures"]) == len(kinds) - 1


def test_without_distinct_failures_the_first_one_ends_the_search():
    from dataclasses import replace

    outcome = search_property(CallableBackend(wrong_fp16_causal_and_bf16_lse), "merge_law",
                              replace(SELECTION, distinct_failures=False))
    assert outcome.status == "failed" and outcome.other_failures == []


def test_other_failures_are_one_line_each_and_in_full_with_verbose():
    """Issue 25 item 9: the first failure in full, the others one line each (all of it with -v)."""
    outcome = search_property(CallableBackend(wrong_fp16_causal_and_bf16_lse), "merge_law", SELECTION)
    assert outcome.other_failures
    short, full = outcome.message(), outcome.message(verbose=True)
    assert short.count("minimal counterexample") == 1 and "(each in full with -v)" in short
    assert full.count("minimal counterexample") == 1 + len(outcome.other_failures)
    assert short.count("also failed (") == full.count("also failed (") == len(outcome.other_failures)
    assert len(short.splitlines()) < len(full.splitlines())
