"""Deep and long-key problems in the agreement properties' search (fa_verify.strategies._depth).

A wrong rescale of later rows (tests/fixtures/depth_kernels.py: alpha² instead of alpha past the
first query tile and the first key tile) is caught by oracle_agreement's random examples within
30 at each of five seeds, and by a fixed case, while the fixed case whose max rises by 89 logits
is blind to it; the honest model passes the same searches. An fp16/bf16 P·V accumulator's error
grows with the keys: thousands of keys judge it at tens of times its tolerance. Run with -s to
see the examples to failure and the ratios (also in the JUnit report: record_property).
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from fa_verify import strategies as fst
from fa_verify.backends.numpy_tiled import NumpyTiledBackend, tiled_attention
from fa_verify.precision import PrecisionModel
from fa_verify.properties import Selection, get_property, search_property
from fa_verify.properties.draw import EDGE_CASES, edge_problems

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from depth_kernels import HonestTiled, LaterRowsRescale, PvInputDtypeAccumulate  # noqa: E402

ORACLE = get_property("oracle_agreement")
#: oracle_agreement without its fixed cases: the random search alone.
RANDOM_ONLY = dataclasses.replace(ORACLE, edge_cases=False)
SEEDS = range(5)
#: The fixed case whose max rises by 89 logits at keys 64 and 128.
JUMP_89 = next(case for case in EDGE_CASES if "step=89.0" in case[1])
MODES = ((False, "bottom-right"), (True, "bottom-right"), (True, "top-left"))


def _problems(shape, distribution="normal", dtypes=("fp16", "bf16", "fp32"), seeds=(0, 1)):
    return [fst.make_problem(distribution, shape, dtype, seed, causal=c, causal_alignment=a)
            for dtype in dtypes for seed in seeds for c, a in MODES]


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b))


# --- the buggy model is wrong only past the first query tile and the first key tile ----------------


@pytest.mark.parametrize("shape", [(1, 2, 1, 129, 129, 16), (2, 4, 2, 65, 200, 8), (1, 1, 1, 3, 300, 4)])
def test_the_fixture_model_is_numpy_tiled_bitwise(shape):
    for problem in _problems(shape):
        assert _same(HonestTiled().run(problem), tiled_attention(problem, PrecisionModel.flash(problem.dtype)))


@pytest.mark.parametrize("shape", [
    (1, 2, 1, 64, 300, 16),   # one query tile, five key tiles
    (2, 2, 2, 200, 64, 8),    # four query tiles, one key tile
    (1, 1, 1, 1, 1000, 4),
    (1, 1, 1, 300, 1, 4),
])
def test_the_rescale_bug_is_invisible_within_one_query_or_key_tile(shape):
    for problem in _problems(shape, "normal+rise(step=2.0,every=32,start=32,count=4)"):
        assert _same(LaterRowsRescale().run(problem), HonestTiled().run(problem)), problem.describe()


def test_the_rescale_bug_shows_past_both_first_tiles():
    problem = fst.make_problem("normal+rise(step=4.0,every=64,start=64,count=1)", (1, 1, 1, 80, 80, 16), "fp32", 0)
    bug, honest = LaterRowsRescale().run(problem)[0], HonestTiled().run(problem)[0]
    assert np.array_equal(bug[..., :64, :], honest[..., :64, :])  # the first query tile: right
    assert not np.array_equal(bug[..., 64:, :], honest[..., 64:, :])


# --- caught by the search ----------------------------------------------------------------------


def test_the_89_logit_fixed_case_is_blind_to_the_rescale_bug():
    """After a jump of 89 logits the right rescale factor exp(-89) and the wrong one exp(-178)
    are both ~0: the fixed case that has only such rises passes the bug."""
    shape, distribution = JUMP_89
    for problem in _problems(shape, distribution, seeds=(0,)):
        assert ORACLE(LaterRowsRescale(), problem).passed, problem.describe()


def test_a_fixed_deep_case_catches_the_rescale_bug(record_property):
    problems, _ = edge_problems(ORACLE, LaterRowsRescale(), Selection(dtypes=("fp16",)))
    failing = {(fst.Shape.of(p), dict(p.tags)["distribution"]) for p in problems
               if ORACLE(LaterRowsRescale(), p).failed}
    record_property("failing_fixed_cases", sorted(map(str, failing)))
    assert (fst.Shape(1, 1, 1, 129, 129, 16), "normal+rise(step=2.0,every=32,start=32,count=4)") in failing
    assert all(shape.nq > 64 and shape.nk > 64 for shape, _ in failing)  # only those past both first tiles


@pytest.mark.parametrize("seed", SEEDS)
def test_oracle_agreement_catches_the_rescale_bug_within_30_random_examples(seed, record_property):
    outcome = search_property(LaterRowsRescale(), RANDOM_ONLY, Selection(seed=seed, max_examples=30, shrink=False))
    record_property("examples_to_failure", outcome.examples_to_failure)
    print(f"seed {seed}: caught after {outcome.examples_to_failure} random examples "
          f"({outcome.problem.describe() if outcome.problem else '-'})")
    assert outcome.status == "failed" and outcome.examples_to_failure <= 30


def test_the_full_search_catches_the_rescale_bug_at_the_first_deep_fixed_case():
    """The fixed cases do not depend on the seed: the first of the deep ones catches it."""
    outcome = search_property(LaterRowsRescale(), ORACLE, Selection(max_examples=30, shrink=False))
    first_deep = 9 * EDGE_CASES.index(((1, 1, 1, 129, 129, 16), "normal+rise(step=2.0,every=32,start=32,count=4)"))
    assert outcome.status == "failed" and outcome.examples_to_failure == first_deep + 1


@pytest.mark.parametrize("seed", SEEDS)
def test_the_honest_model_passes_the_same_random_examples(seed):
    for backend in (NumpyTiledBackend(), HonestTiled()):
        outcome = search_property(backend, RANDOM_ONLY, Selection(seed=seed, max_examples=30))
        assert outcome.passed, outcome.message()


def test_the_honest_model_passes_the_deep_and_long_fixed_cases():
    problems, _ = edge_problems(ORACLE, NumpyTiledBackend(), Selection())
    new = [p for p in problems if (p.nq > 64 and p.nk > 64) or p.nk > 1000]
    assert len(new) == 4 * 9  # 129x129, 96x159 and 3x2049 (new), 127x129 (the 89-logit jump)
    for problem in new:
        assert ORACLE(NumpyTiledBackend(), problem).passed, problem.describe()


# --- long keys: an fp16/bf16 P·V accumulator ----------------------------------------------------


def test_the_pv_accumulator_error_grows_with_the_keys(record_property):
    """With V constant along the keys (constant_rows, seed 0) the input-dtype accumulator's error,
    in units of its FA2 tolerance, grows with Nk: four times or more from 257 keys to 4096."""
    ratios = {}
    for dtype in ("fp16", "bf16"):
        for nk in (257, 1025, 4096):
            problem = fst.make_problem("constant_rows", (1, 1, 1, 4, nk, 16), dtype, 0)
            ratios[dtype, nk] = ORACLE(PvInputDtypeAccumulate(), problem).worst_ratio
            assert ORACLE(NumpyTiledBackend(), problem).passed
    record_property("ratios", {f"{d} Nk={n}": round(r, 1) for (d, n), r in ratios.items()})
    print(ratios)
    for dtype in ("fp16", "bf16"):
        assert ratios[dtype, 257] < ratios[dtype, 1025] < ratios[dtype, 4096]
        assert ratios[dtype, 4096] > 4 * ratios[dtype, 257] > 4


def test_the_long_fixed_case_catches_the_pv_accumulator_by_a_wide_margin(record_property):
    problems, _ = edge_problems(ORACLE, PvInputDtypeAccumulate(), Selection(dtypes=("fp16", "bf16")))
    long_keys = [p for p in problems if p.nk > 1000]
    ratios = [ORACLE(PvInputDtypeAccumulate(), p).worst_ratio for p in long_keys]
    record_property("ratios", ratios)
    assert long_keys and max(ratios) > 50


def test_oracle_agreement_catches_the_pv_accumulator_by_a_wide_margin(record_property):
    """The search (fixed cases first, then 30 examples, each failure kind shrunk) reports its
    worst ratio: the long fixed case's, tens of times the tolerance."""
    outcome = search_property(PvInputDtypeAccumulate(), ORACLE, Selection(max_examples=30, dtypes=("fp16",)))
    record_property("worst_ratio", outcome.worst_ratio)
    print(outcome.message())
    assert outcome.status == "failed" and outcome.worst_ratio > 50


def test_long_key_problems_judge_the_pv_accumulator_far_past_its_tolerance(record_property):
    """The long-key problems the agreement properties draw (as problem_strategy builds them for a
    target without limits, ci profile, fp16): where V is constant along the keys (constant_rows'
    modes with V constant, not those with q = 0 alone) the accumulator fails by tens of times
    its tolerance."""
    strategy = fst.long_key_problems(fst.long_key_shapes(max_scores=257 ** 2), fst.dtypes(["fp16"]))
    found = {}

    @settings(max_examples=40, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(problem):
        found.setdefault((fst.Shape.of(problem), problem.tags, problem.causal, problem.causal_alignment), problem)

    collect()
    ratios = sorted(((ORACLE(PvInputDtypeAccumulate(), p).worst_ratio, p.nk, dict(p.tags)["distribution"])
                     for p in found.values()), reverse=True)
    record_property("long_key_ratios", ratios)
    print(ratios)
    constant = [r for r, _, dist in ratios if dist.startswith("constant_rows")]
    assert max(nk for _, nk, _ in ratios) >= 4000 and len(constant) >= 5
    assert max(constant) > 50 and sum(r > 20 for r in constant) >= 5
