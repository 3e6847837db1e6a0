"""The ragged properties (fa_verify.properties.ragged) against correct varlen / paged functions
and one-bug fixtures (tests/fixtures/ragged_kernels.py) through the ragged callable protocol;
the ragged strategies within a target's limits."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from fa_verify.backends.numpy_ragged import NumpyRaggedBackend
from fa_verify.backends.ragged_callable import RaggedCallableBackend
from fa_verify.limits import Limits
from fa_verify.properties import FAILED, NOT_APPLICABLE, PASSED, Selection
from fa_verify.properties import PROPERTIES, search_property
from fa_verify.strategies import ragged_problems

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import ragged_kernels  # noqa: E402

RAGGED_PROPERTY_NAMES = [p.name for p in PROPERTIES if set(p.kinds) & {"varlen", "paged"}]
FEW = Selection(max_examples=10, shrink=False, max_seq=2 * 64 + 1)
LAYOUTS = {"varlen_attention": "varlen", "paged_attention": "paged", "paged_attention_into": "paged",
           "varlen_global_seqlen_k": "varlen", "paged_page_boundary": "paged",
           "paged_first_sequence_only": "paged", "paged_split_lse_layout": "paged"}
#: The properties each one-bug fixture must fail within FEW examples.
CATCHES = {
    "varlen_global_seqlen_k": {"ragged_agreement", "sequence_alone"},
    "paged_page_boundary": {"ragged_agreement", "unused_cache", "paged_contiguous"},
    "paged_first_sequence_only": {"ragged_agreement", "unwritten_rows"},
    "paged_split_lse_layout": {"ragged_agreement", "split_invariance"},
}


def _backend(name, twin=None):
    backend = RaggedCallableBackend(getattr(ragged_kernels, name), LAYOUTS[name])
    backend.contiguous = None if twin is None else _backend(twin)
    return backend


@pytest.mark.parametrize("name", ["varlen_attention", "paged_attention", "paged_attention_into"])
def test_correct_functions_pass_every_applicable_ragged_property(name):
    backend = _backend(name, "varlen_attention" if LAYOUTS[name] == "paged" else None)
    statuses = {prop: search_property(backend, prop, FEW) for prop in RAGGED_PROPERTY_NAMES}
    failures = [o.message() for o in statuses.values() if o.status == FAILED]
    assert not failures, "\n".join(failures)
    applicable = {prop for prop, o in statuses.items() if o.status == PASSED}
    expected = {"ragged_agreement", "sequence_alone", "sequence_independence"}
    expected |= {"page_placement", "paged_contiguous", "unused_cache"} if LAYOUTS[name] == "paged" else set()
    expected |= {"split_invariance"} if backend.splits else {"unwritten_rows"}
    assert applicable == expected


@pytest.mark.parametrize("name", sorted(CATCHES))
def test_each_one_bug_fixture_is_caught_naming_the_sequence(name):
    backend = _backend(name, "varlen_attention" if LAYOUTS[name] == "paged" else None)
    for prop in CATCHES[name]:
        outcome = search_property(backend, prop, FEW)
        assert outcome.status == FAILED, f"{name} passed {prop}: {outcome.message()}"
        assert "sequence " in outcome.failure.detail


def test_unwritten_rows_name_the_sequences_left_unwritten():
    outcome = search_property(_backend("paged_first_sequence_only"), "unwritten_rows", Selection(max_examples=10, max_seq=2 * 64 + 1))
    # shrunk to two sequences of one query: sequence 1's only row was never written
    assert outcome.status == FAILED and "sequence 1 of 2" in outcome.failure.detail
    assert "sequence 0 of" not in outcome.failure.detail


def test_ragged_properties_are_not_applicable_where_the_target_lacks_the_feature():
    varlen = _backend("varlen_global_seqlen_k")  # varlen, no num_splits, returns its output
    for prop, why in (("page_placement", "a property of paged and paged-fp8 problems; "
                                         "ragged_kernels:varlen_global_seqlen_k runs varlen problems"),
                      ("split_invariance", "takes no num_splits"), ("unwritten_rows", "returns its output"),
                      ("oracle_agreement", "a property of dense problems")):
        outcome = search_property(varlen, prop, FEW)
        assert outcome.status == NOT_APPLICABLE and why in outcome.reason


@settings(max_examples=25, deadline=None, database=None)
@given(ragged_problems("paged", dtypes=("bf16",), limits=Limits(seq_multiple=4, head_dims=(16,), causal=(True,),
                                                                heads=("gqa",)),
                       features=("window", "sinks"), page_sizes=(8, 16), splits=True, tile=16, max_seq=48))
def test_ragged_strategies_stay_within_the_declared_limits(problem):
    assert problem.dtype == "bf16" and problem.head_dim == 16 and problem.causal
    assert 1 < problem.heads // problem.kv_heads < problem.heads
    assert all(n % 4 == 0 for n in problem.seqlens_q + problem.seqlens_k)
    assert problem.pages.page_size in (8, 16) and set(problem.features) <= {"window", "sinks"}
    assert len(set(problem.seqlens_q)) == 1 and 0 <= problem.num_splits <= 8
    # the drawn table is a valid placement: the cache holds every sequence's keys
    inputs = problem.paged_inputs()
    for b, seq in enumerate(problem.sequences):
        page, slot = problem.pages.key_slots(b, seq.nk)
        assert np.array_equal(inputs["k_cache"][page, slot].transpose(1, 0, 2), seq.k[0])


class _HeadDim24(NumpyRaggedBackend):
    """A target whose own supports() takes D = 24 only (no declared limits)."""

    def supports(self, problem):
        return super().supports(problem) or (None if problem.head_dim == 24 else "D must be 24")


def test_head_dims_are_probed_through_supports_when_none_are_declared():
    backend, seen = _HeadDim24("varlen"), set()
    run = backend.run
    backend.run = lambda problem: seen.add(problem.head_dim) or run(problem)
    outcome = search_property(backend, "ragged_agreement", FEW)
    assert outcome.status == PASSED and outcome.examples == 10 and seen == {24}


def test_sequence_independence_keeps_the_keys_of_pages_two_other_sequences_share():
    """Sequences 0 and 1 share a page and sequence 2 is kept (seed 0; seed 1 keeps sequence 1):
    the new values of the others must leave the shared slots alone (new values drawn per
    sequence would disagree there: an invalid problem)."""
    from fa_verify.problem import AttentionProblem
    from fa_verify.properties.ragged import check_sequence_independence
    from fa_verify.ragged import PageLayout, RaggedProblem

    rng = np.random.default_rng(0)
    k_shared, v_shared = rng.standard_normal((1, 1, 4, 8)), rng.standard_normal((1, 1, 4, 8))
    sequences = tuple(AttentionProblem.from_float(rng.standard_normal((1, 1, 1, 8)), k, v, "fp32")
                      for k, v in ((k_shared, v_shared), (k_shared, v_shared),
                                   (rng.standard_normal((1, 1, 4, 8)), rng.standard_normal((1, 1, 4, 8)))))
    problem = RaggedProblem(sequences, "paged", pages=PageLayout(4, np.array([[1], [1], [0]], np.int32), 2))
    for seed in (0, 1):
        assert check_sequence_independence(NumpyRaggedBackend("paged"), problem, seed=seed).passed
