"""Deep and long-key shapes and problems (fa_verify.strategies._depth), and their shares in the
agreement properties' strategy (fa_verify.properties.draw)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from fa_verify import InvalidArgumentError
from fa_verify import strategies as fst
from fa_verify.backends.numpy_tiled import NumpyTiledBackend
from fa_verify.limits import Limits
from fa_verify.properties import Selection, get_property
from fa_verify.properties.draw import DEPTH_PROPERTIES, Capabilities, capabilities, problem_strategy
from fa_verify.strategies._depth import MODERATE_DISTRIBUTIONS, SMALL_RISE_MAX

KERNEL_DIMS = (16, 32, 64, 96, 128, 256)


def _draws(strategy, n=200, seed=None) -> list:
    out = []

    @settings(max_examples=n, derandomize=seed is None, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x):
        out.append(x)

    (collect if seed is None else hypothesis_seed(seed)(collect))()
    return out


def _two_tiles(n: int, tile: int) -> bool:
    return n > tile


# --- deep shapes ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_deep_shapes_stay_within_their_bounds_and_limits(data):
    max_seq = data.draw(st.integers(63, 600), label="max_seq")
    max_work = data.draw(st.integers(100_000, 2_000_000), label="max_work")
    multiple = data.draw(st.sampled_from([1, 1, 8, 16, 64]), label="seq_multiple")
    seq_min = data.draw(st.sampled_from([1, 20, 100]), label="seq_min")
    equal = data.draw(st.booleans(), label="equal_seq")
    head_dims = data.draw(st.sampled_from([None, (16, 32, 64), (1, 7)]), label="head_dims")
    layouts = data.draw(st.sampled_from([None, ("mha",), ("gqa",), ("mqa", "gqa")]), label="layouts")
    groups = data.draw(st.sampled_from([None, (1, 2), (4,)]), label="group_sizes")
    try:
        strategy = fst.deep_shapes(max_seq=max_seq, max_work=max_work, seq_multiple=multiple, seq_min=seq_min,
                                   equal_seq=equal, head_dims=head_dims, head_layouts=layouts, group_sizes=groups)
    except InvalidArgumentError:
        return  # no tile fits these bounds: draw.py then draws no deep share
    shape = data.draw(strategy, label="shape")
    lowest = multiple * -(-seq_min // multiple)
    assert shape.work <= max_work and shape.batch * shape.heads * shape.nq * shape.nk <= max_seq ** 2
    for n in (shape.nq, shape.nk):
        assert n % multiple == 0 and lowest <= n <= max_seq
        assert n >= 2 * min(fst.DEEP_TILE_SIZES) - 1  # two tiles of 16 at least
    assert not equal or shape.nq == shape.nk
    assert head_dims is None or shape.head_dim in head_dims
    layout = "mha" if shape.heads == shape.kv_heads else "mqa" if shape.kv_heads == 1 else "gqa"
    assert layouts is None or layout in layouts
    assert groups is None or shape.group_size in groups


@pytest.mark.parametrize("head_dims, tiles", [
    (None, ((64, 64), (128, 128), (32, 32), (16, 16), (64, 32), (128, 16))),
    # a kernel with D >= 16 in the ci budget: up to 64-row query tiles by 32-key tiles
    (KERNEL_DIMS, ((64, 32), (32, 32), (16, 16), (32, 64))),
])
def test_deep_shapes_pass_the_first_tile_of_each_tile_size(head_dims, tiles):
    shapes = _draws(fst.deep_shapes(max_seq=257, max_work=200_000, head_dims=head_dims), n=300)
    for tq, tk in tiles:
        assert any(_two_tiles(s.nq, tq) and _two_tiles(s.nk, tk) for s in shapes), (tq, tk)
    assert {s.nq for s in shapes} & {127, 128, 129} and {s.nk for s in shapes} & {63, 64, 65}


def test_deep_shapes_shrink_to_two_tiles_of_64():
    from hypothesis import find

    assert find(fst.deep_shapes(), lambda s: True) == fst.Shape(1, 1, 1, 127, 127, 1)


def test_deep_shapes_refuse_bounds_without_two_tiles():
    with pytest.raises(InvalidArgumentError, match="no tile size"):
        fst.deep_shapes(max_seq=30)
    with pytest.raises(InvalidArgumentError, match="no tile size"):
        fst.deep_shapes(max_work=31 * 31 * 16 - 1, head_dims=(16,))


# --- long-key shapes -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_long_key_shapes_stay_within_their_bounds_and_limits(data):
    max_nk = data.draw(st.integers(1000, 8192), label="max_nk")
    max_work = data.draw(st.integers(100_000, 2_000_000), label="max_work")
    multiple = data.draw(st.sampled_from([1, 1, 8, 64]), label="seq_multiple")
    head_dims = data.draw(st.sampled_from([None, KERNEL_DIMS]), label="head_dims")
    groups = data.draw(st.sampled_from([None, (4,)]), label="group_sizes")
    try:
        strategy = fst.long_key_shapes(max_nk=max_nk, max_work=max_work, max_scores=257 ** 2, seq_multiple=multiple,
                                       head_dims=head_dims, group_sizes=groups)
    except InvalidArgumentError:
        return
    shape = data.draw(strategy, label="shape")
    assert fst.LONG_KEYS_RANGE[0] <= shape.nk <= max_nk and shape.nq <= max(fst.LONG_KEYS_RANGE[0], 8)
    assert shape.nq <= max(8, multiple) and shape.nq % multiple == 0 == shape.nk % multiple
    assert shape.work <= max_work and shape.batch * shape.heads * shape.nq * shape.nk <= 257 ** 2
    assert head_dims is None or shape.head_dim in head_dims
    assert groups is None or shape.group_size in groups


def test_long_key_shapes_reach_4096_keys_and_tile_multiples():
    for head_dims in (None, KERNEL_DIMS):
        shapes = _draws(fst.long_key_shapes(max_scores=257 ** 2, head_dims=head_dims), n=300)
        nks = {s.nk for s in shapes}
        assert 4096 in nks and nks & {1023, 1025, 2047, 2049, 3071, 3073}, sorted(nks)
        assert {s.nq for s in shapes} >= {1, 2} and max(s.nq for s in shapes) >= 5


def test_long_key_shapes_refuse_equal_seq_and_short_caps():
    with pytest.raises(InvalidArgumentError, match="equal_seq"):
        fst.long_key_shapes(equal_seq=True)
    with pytest.raises(InvalidArgumentError, match="no Nk"):
        fst.long_key_shapes(max_nk=257)
    with pytest.raises(InvalidArgumentError, match="no Nk"):
        fst.long_key_shapes(max_work=999 * 16, head_dims=(16,))


# --- problems ------------------------------------------------------------------------------------


def test_small_rises_are_small_and_rise_at_tile_edges():
    profiles = _draws(fst.small_rises(), n=200)
    assert all(p.kind == "rise" and 0.25 <= p.step <= SMALL_RISE_MAX for p in profiles)
    assert all(min(abs(p.start - t) for t in (16, 32, 64, 128, 256)) <= 1 for p in profiles)
    steps = sorted(p.step for p in profiles)
    assert steps[len(steps) // 2] < 3  # log-uniform: half the steps below 1.6 logits


def test_deep_and_long_key_problems_have_moderate_scores():
    deep = _draws(fst.deep_problems(), n=60)
    long_keys = _draws(fst.long_key_problems(fst.long_key_shapes(max_scores=257 ** 2)), n=40)
    for problems, names in ((deep, MODERATE_DISTRIBUTIONS), (long_keys, ("normal", "constant_rows"))):
        for problem in problems:
            name, _, profile = dict(problem.tags)["distribution"].partition("+")
            assert name in names
            assert not profile or fst.ScoreProfile.parse(profile).step <= SMALL_RISE_MAX
        assert any("+" not in dict(p.tags)["distribution"] for p in problems)  # plain, without a profile
        assert any("+rise" in dict(p.tags)["distribution"] for p in problems)
    assert {p.causal_alignment for p in long_keys if p.causal} == {"bottom-right"}  # top-left sees a few keys


# --- shares --------------------------------------------------------------------------------------


def _tag(name):
    return st.tuples(st.just(name), st.integers(0, 10 ** 6))


def test_depth_shares_are_fixed():
    """1 in 4 deep, 1 in 8 long, of 1000 fresh draws (5 seeds x 200); each seed's share in a band."""
    counts = collections.Counter()
    for seed in range(5):
        drawn = collections.Counter(x[0] for x in _draws(fst.depth_shares(_tag("o"), _tag("d"), _tag("l")), seed=seed))
        assert 0.15 <= drawn["d"] / 200 <= 0.35 and 0.05 <= drawn["l"] / 200 <= 0.2, drawn
        counts += drawn
    assert fst.DEEP_SHARE == 1 / 4 and fst.LONG_KEYS_SHARE == 1 / 8
    assert abs(counts["d"] / 1000 - 1 / 4) < 0.05 and abs(counts["l"] / 1000 - 1 / 8) < 0.04, counts


def test_depth_shares_give_a_missing_branch_to_the_ordinary_one():
    drawn = {x[0] for x in _draws(fst.depth_shares(_tag("o"), None, _tag("l")), n=100)}
    assert drawn == {"o", "l"}
    ordinary = _tag("o")
    assert fst.depth_shares(ordinary) is ordinary


def _kinds(prop, selection=Selection(), caps=None, n=200, seeds=range(3)) -> collections.Counter:
    """How many of the problems the search of `prop` draws are long-key and deep ones."""
    strategy = problem_strategy(get_property(prop), caps or capabilities(NumpyTiledBackend()), selection)
    kinds = collections.Counter()
    for seed in seeds:
        for p in _draws(strategy, n=n, seed=seed):
            kinds["long"] += p.nk >= fst.LONG_KEYS_RANGE[0]
            kinds["past 64 x 64"] += p.nq > 64 and p.nk > 64
            kinds["max nk"] = max(kinds["max nk"], p.nk)
            kinds["all"] += 1
    return kinds


def test_the_agreement_properties_draw_deep_and_long_problems():
    assert DEPTH_PROPERTIES == ("oracle_agreement", "lse_agreement")
    for prop in DEPTH_PROPERTIES:
        kinds = _kinds(prop)
        # Hypothesis follows a fresh example with mutations of it: shares vary from run to run
        assert 0.06 <= kinds["long"] / kinds["all"] <= 0.25, kinds
        assert kinds["max nk"] == 4096 and kinds["past 64 x 64"] / kinds["all"] >= 0.15, kinds


def test_the_other_properties_draw_as_before():
    kinds = _kinds("convex_hull", n=100, seeds=[0])
    assert kinds["long"] == 0 and kinds["max nk"] <= 257


def test_a_max_seq_of_the_users_caps_the_long_keys():
    """`check --max-seq N` sets both max_seq and max_long_keys (a profile's max_seq alone does not
    cap the long keys)."""
    assert _kinds("oracle_agreement", Selection(max_seq=200, max_long_keys=200), n=100, seeds=[0])["max nk"] <= 200
    assert _kinds("oracle_agreement", Selection(max_seq=2000, max_long_keys=2000, max_work=10 ** 6), n=100,
                  seeds=[0])["max nk"] <= 2000
    # a profile's max_seq is no user's cap: the gpu profile's 1024 reaches 4096 keys
    assert _kinds("oracle_agreement", Selection.from_profile("gpu"), n=100, seeds=[0])["max nk"] > 1024


def test_the_shares_follow_a_targets_limits():
    limits = Limits(seq_multiple=8, seq_max=2048, head_dims=(16, 32), heads=("mha", "gqa"), group_sizes=(1, 2))
    caps = Capabilities(name="limited", dtypes=("fp16",), head_dims=(16, 32), alignments=("bottom-right",),
                        returns_lse=True, limits=limits)
    strategy = problem_strategy(get_property("oracle_agreement"), caps, Selection(dtypes=("fp16",)))
    problems = _draws(strategy, n=150, seed=0)
    assert any(p.nk >= 1000 for p in problems) and any(p.nq > 64 and p.nk > 64 for p in problems)
    for p in problems:
        assert limits.check(p) is None, p.describe()
    equal = Limits(equal_seq=True)
    caps = Capabilities(name="square", dtypes=("fp32",), head_dims=None, alignments=("bottom-right", "top-left"),
                        returns_lse=True, limits=equal)
    problems = _draws(problem_strategy(get_property("oracle_agreement"), caps, Selection(dtypes=("fp32",))), n=100)
    assert all(p.nq == p.nk <= 257 for p in problems)  # no long keys under Nq = Nk, deep ones still
    assert any(p.nq > 64 for p in problems)


def test_a_shape_budget_still_bounds_the_signatures():
    from fa_verify.properties import search_property
    from fa_verify.properties.draw import edge_problems

    def signature(p):
        return fst.Shape.of(p), p.dtype, p.causal, p.causal_alignment, p.scale

    selection = Selection(max_examples=8, shapes=3, seed=1, dtypes=("fp32",))
    edges = {signature(p) for p in edge_problems(get_property("oracle_agreement"), NumpyTiledBackend(), selection)[0]}
    seen = set()
    outcome = search_property(NumpyTiledBackend(), "oracle_agreement", selection,
                              on_result=lambda p, r, s: seen.add(signature(p)))
    assert outcome.passed and "--shapes 3: drawn from 3 shapes" in outcome.message(), outcome.message()
    assert 1 <= len(seen - edges) <= 3
