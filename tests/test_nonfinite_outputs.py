"""Non-finite outputs never pass (fa_verify.backends.watch): a target whose outputs are all
infinite fails every property that judges values, and no property passes it, informative or not;
relations between two runs (bitwise equal infinities, inf - inf) included."""

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.backends.numpy_ragged import NumpyRaggedBackend
from fa_verify.check import check_backend
from fa_verify.properties import FAILED, NOT_APPLICABLE, PASSED, Selection, as_backend, check_convex_hull
from fa_verify.properties._subject import RunFunctionBackend
from fa_verify.strategies import make_problem

TILED = get_backend("numpy-tiled")
FEW = Selection(max_examples=4, shrink=False, distinct_failures=False)
#: Properties that judge no output values: the CUDA-on-CPU runner's race detector and sanitizer.
NOT_ABOUT_VALUES = {"races", "address_sanitizer"}


def _all_inf(problem):
    out, lse = TILED.run(problem)
    return np.full_like(out, np.inf), np.full_like(lse, np.inf)


def _all_nan_out(problem):
    out, lse = TILED.run(problem)
    return np.full_like(out, np.nan), lse


@pytest.mark.parametrize("target", [_all_inf, _all_nan_out])
def test_every_value_property_fails_a_dense_target_with_non_finite_outputs(target):
    outcome = check_backend(as_backend(target), FEW)
    statuses = {p.property: p.status for p in outcome.properties}
    assert PASSED not in statuses.values(), statuses
    judged = {name for name, status in statuses.items() if status != NOT_APPLICABLE}
    assert judged >= {"oracle_agreement", "convex_hull", "constant_v", "v_affinity", "key_permutation",
                      "query_permutation", "score_shift", "batch_head_independence", "determinism",
                      "masked_key_independence", "unbiased_rounding", "merge_law"}
    assert all(statuses[name] == FAILED for name in judged)
    assert not judged & NOT_ABOUT_VALUES
    for p in outcome.properties:
        assert not p.informative, f"{p.property} counted {p.informative} informative examples"


def test_a_relation_between_two_runs_names_the_non_finite_output():
    problem = make_problem("normal", (1, 2, 2, 8, 8, 16), "fp16", 0)
    result = check_convex_hull(_all_inf, problem)  # called directly: the watch is the registry's
    assert result.failed  # inf is outside every hull
    from fa_verify.properties import get_property

    judged = get_property("determinism")(RunFunctionBackend(_all_inf), problem)
    assert judged.failed and "non-finite output: out holds 256 non-finite values of 256" in judged.detail
    assert "(first inf at [0, 0, 0, 0] of [B,H,Nq,D_v])" in judged.detail


class _InfiniteRagged(NumpyRaggedBackend):
    def _run(self, problem):
        out, lse = super()._run(problem)
        return np.full_like(out, np.inf), lse


@pytest.mark.parametrize("layout", ["varlen", "paged"])
def test_every_ragged_property_fails_a_batch_target_with_infinite_outputs(layout):
    backend = _InfiniteRagged(layout)
    backend.contiguous = None if layout == "varlen" else NumpyRaggedBackend("varlen")
    outcome = check_backend(backend, FEW)
    statuses = {p.property: p.status for p in outcome.properties}
    assert PASSED not in statuses.values(), statuses
    assert statuses["ragged_agreement"] == statuses["sequence_independence"] == FAILED
    assert sum(status == FAILED for status in statuses.values()) >= (3 if layout == "varlen" else 6)
