"""Tests of fa_verify.strategies: validity, bounds, coverage, statistics, determinism."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from fa_verify import AttentionProblem, InvalidArgumentError
from fa_verify import strategies as fst
from fa_verify.dtypes import DTYPE_NAMES, finfo

FAST = settings(max_examples=15, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
# derandomized: a find() shrinks to the minimum from most seeds, not all (the long-shape one failed once in ~10 runs)
FIND = settings(max_examples=2000, deadline=None, database=None, derandomize=True)


def scaled_scores(problem: AttentionProblem) -> np.ndarray:
    """Scaled scores in float64, [B, H, Nq, Nk], masked entries -inf."""
    k, _ = problem.kv64()
    s = problem.scale_value * np.einsum("bhid,bhjd->bhij", problem.q64(), k)
    return np.where(problem.mask, s, -np.inf)


def softmax(problem: AttentionProblem) -> np.ndarray:
    s = scaled_scores(problem)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


# --- the public surface -------------------------------------------------------------------------
def test_all_is_exact():
    public = {name for name, value in vars(fst).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert sorted(fst.__all__) == sorted(public)
    assert len(set(fst.__all__)) == len(fst.__all__)
    for name in fst.__all__:
        assert hasattr(fst, name), name


def test_registry_names_and_read_only():
    assert set(fst.DISTRIBUTION_NAMES) == {
        "normal", "uniform", "fa3_outliers", "large_logits", "ties", "dominant_key",
        "constant_rows", "fp16_extremes", "tiny"}
    assert tuple(fst.DISTRIBUTIONS) == fst.DISTRIBUTION_NAMES
    with pytest.raises(TypeError):
        fst.DISTRIBUTIONS["mine"] = lambda *a: None


# --- every distribution, every dtype: valid problems ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", fst.DISTRIBUTION_NAMES)
def test_every_distribution_gives_valid_problems(name, dtype):
    @FAST
    @given(fst.problems(distributions=st.just(name), dtypes=st.just(dtype)))
    def check(problem):
        assert isinstance(problem, AttentionProblem)  # construction validated finiteness, shapes
        assert problem.dtype == dtype
        tags = dict(problem.tags)
        assert tags["distribution"].partition("+")[0] == name and isinstance(tags["seed"], int)
        for x in (problem.q, problem.k, problem.v):
            assert np.isfinite(x.astype(np.float64)).all()
            assert np.abs(x.astype(np.float64)).max() <= float(finfo(dtype).max)
        bound = (np.abs(problem.q64()).max() * np.abs(problem.k.astype(np.float64)).max()
                 * problem.head_dim * problem.scale_value)
        assert bound < 3e38
        attended = scaled_scores(problem)[..., problem.mask]
        assert np.isfinite(attended.astype(np.float32)).all()

    check()


def test_generators_clip_and_work_outside_hypothesis():
    shape = fst.Shape(1, 2, 1, 5, 7, 3)
    for name, generate in fst.DISTRIBUTIONS.items():
        for dtype in DTYPE_NAMES:
            q, k, v = generate(np.random.default_rng(0), shape, dtype)
            assert q.dtype == k.dtype == v.dtype == np.float64
            assert q.shape == (1, 2, 5, 3) and k.shape == v.shape == (1, 1, 7, 3)
            big = float(finfo(dtype).max)
            assert all(np.abs(x).max() <= big for x in (q, k, v)), name
    # A 6-tuple works as a shape, and the scale argument is optional.
    q, k, v = fst.DISTRIBUTIONS["normal"](np.random.default_rng(0), (1, 2, 1, 5, 7, 3), "half", 0.5)
    assert q.shape == (1, 2, 5, 3)


# --- shapes: bounds by construction, coverage of the interesting cases ------------------------
@settings(max_examples=150, deadline=None, database=None)
@given(st.data())
def test_shape_bounds_hold(data):
    b = data.draw(st.integers(1, 3), label="max_batch")
    h = data.draw(st.integers(1, 8), label="max_heads")
    n = data.draw(st.integers(1, 300), label="max_seq")
    d = data.draw(st.integers(1, 300), label="max_head_dim")
    w = data.draw(st.integers(1, 10 ** 6), label="max_work")
    gqa = data.draw(st.booleans(), label="gqa")
    typical = data.draw(st.none() | st.integers(1, 300), label="typical_seq")
    shape = data.draw(fst.shapes(max_batch=b, max_heads=h, max_seq=n, max_head_dim=d,
                                 gqa=gqa, max_work=w, typical_seq=typical))
    assert 1 <= shape.batch <= b and 1 <= shape.heads <= h
    assert 1 <= shape.nq <= n and 1 <= shape.nk <= n
    assert 1 <= shape.head_dim <= d
    assert shape.heads % shape.kv_heads == 0
    assert shape.work <= w
    if typical is not None and max(shape.nq, shape.nk) > typical:  # a long shape
        assert shape.batch * shape.heads * shape.nq * shape.nk <= n * n
    if not gqa:
        assert shape.kv_heads == shape.heads


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_head_dims_restrict_d(data):
    dims = data.draw(st.lists(st.integers(1, 256), min_size=1, max_size=4), label="head_dims")
    w = data.draw(st.integers(max(dims), 10 ** 6), label="max_work")
    shape = data.draw(fst.shapes(head_dims=dims, max_head_dim=256, max_work=w))
    assert shape.head_dim in dims
    assert shape.work <= w


def test_default_work_bound():
    assert fst.DEFAULT_MAX_WORK == 200_000

    @settings(max_examples=100, deadline=None, database=None)
    @given(fst.shapes())
    def check(shape):
        assert shape.work <= fst.DEFAULT_MAX_WORK
        assert shape.nq <= 64 and shape.nk <= 64 and shape.head_dim <= 128
        assert shape.batch <= 2 and shape.heads <= 4

    check()


TILE_EDGES = {15, 16, 17, 31, 32, 33, 63, 64}
ODD_COMMON_DIMS = {1, 3, 31, 33, 63, 127}

COVERAGE = {
    "Nq=1": lambda s: s.nq == 1 and s.nk > 1,
    "Nk=1": lambda s: s.nk == 1 and s.nq > 1,
    "Nq>Nk": lambda s: s.nq > s.nk > 1,
    "Nq<Nk": lambda s: 1 < s.nq < s.nk,
    "Nq=Nk>1": lambda s: s.nq == s.nk > 1,
    "MHA H>1": lambda s: s.heads == s.kv_heads > 1,
    "GQA": lambda s: 1 < s.kv_heads < s.heads,
    "MQA": lambda s: s.kv_heads == 1 < s.heads,
    "odd D > 1": lambda s: s.head_dim % 2 == 1 and s.head_dim > 1,
    "D=128": lambda s: s.head_dim == 128,
    "D=80": lambda s: s.head_dim == 80,
    "tile edge Nq": lambda s: s.nq in TILE_EDGES,
    "tile edge Nk": lambda s: s.nk in TILE_EDGES,
    "Nq=Nk=64": lambda s: s.nq == s.nk == 64,
    "prime Nk>7": lambda s: s.nk in (11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61),
    "B=2": lambda s: s.batch == 2,
}


@pytest.mark.parametrize("feature", list(COVERAGE))
def test_shapes_cover(feature):
    found = find(fst.shapes(), COVERAGE[feature], settings=FIND)
    assert COVERAGE[feature](found)


def test_shapes_cover_large_head_dims_when_allowed():
    big = fst.shapes(max_head_dim=256, max_work=10 ** 6)
    assert find(big, lambda s: s.head_dim == 256, settings=FIND).head_dim == 256
    assert find(big, lambda s: s.head_dim == 255, settings=FIND).head_dim == 255


def test_shapes_shrink_to_minimal():
    assert find(fst.shapes(), lambda s: True, settings=FIND) == fst.Shape(1, 1, 1, 1, 1, 1)


def _share(strategy, predicate, n=300) -> float:
    """The share of `n` derandomized draws from `strategy` that satisfy `predicate`."""
    hits = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x):
        hits.append(bool(predicate(x)))

    collect()
    return sum(hits) / len(hits)


def _unseen(strategy, features: dict, n: int) -> set:
    """The names of `features` (name -> predicate) that none of `n` derandomized draws has."""
    unseen = set(features)

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def search(x):
        unseen.difference_update({name for name in unseen if features[name](x)})

    search()
    return unseen


def is_long(shape) -> bool:
    return max(shape.nq, shape.nk) > 64


CI_SHAPES = fst.shapes(max_seq=257, typical_seq=64)
#: A kernel's head dims: long shapes must still cross tiles with D >= 16 in the work bound.
CI_KERNEL_SHAPES = fst.shapes(max_seq=257, typical_seq=64, head_dims=(16, 32, 64, 128))

LONG_COVERAGE = {
    "Nq=Nk=257": (CI_SHAPES, lambda s: s.nq == s.nk == 257),
    "Nk at 128 +- 1, Nq > 64": (CI_SHAPES, lambda s: s.nk in (127, 128, 129) and s.nq > 64),
    "Nq>128, Nk>64": (CI_SHAPES, lambda s: s.nq > 128 and s.nk > 64),
    "GQA, Nk>64": (CI_SHAPES, lambda s: s.nk > 64 and 1 < s.kv_heads < s.heads),
    "D>=16: Nq, Nk > 64": (CI_KERNEL_SHAPES, lambda s: s.nq > 64 and s.nk > 64),
    "D>=16: Nk > 128": (CI_KERNEL_SHAPES, lambda s: s.nk > 128),
    "D>=64: Nk>128": (CI_KERNEL_SHAPES, lambda s: s.head_dim >= 64 and s.nk > 128),
}


def test_long_shapes_cross_tiles_of_64_and_128():
    for strategy in (CI_SHAPES, CI_KERNEL_SHAPES):
        features = {name: f for name, (s, f) in LONG_COVERAGE.items() if s is strategy}
        assert not _unseen(strategy, features, n=500)


def test_long_shapes_are_a_minority():
    for strategy in (CI_SHAPES, CI_KERNEL_SHAPES):
        assert 0.1 <= _share(strategy, is_long) <= 0.35
    assert _share(fst.shapes(), is_long) == 0  # without typical_seq, max_seq (64) bounds all


def test_long_shapes_shrink_to_minimal():
    assert find(CI_SHAPES, is_long, settings=FIND) == fst.Shape(1, 1, 1, 65, 65, 1)


def test_favoured_seq_lengths():
    assert fst.favoured_seq_lengths(64) == (
        1, 2, 3, 5, 7, 11, 13, 15, 16, 17, 19, 23, 29, 31, 32, 33, 37, 41, 43, 47, 53, 59, 61,
        63, 64)
    assert fst.favoured_seq_lengths(1) == (1,)


def test_shape_validation():
    with pytest.raises(InvalidArgumentError, match="divisible"):
        fst.Shape(1, 3, 2, 4, 4, 8)
    with pytest.raises(InvalidArgumentError, match=r"Shape.nq=0"):
        fst.Shape(1, 1, 1, 0, 4, 8)
    with pytest.raises(InvalidArgumentError, match="tuple"):
        fst.Shape.coerce((1, 2, 3))
    s = fst.Shape(2, 4, 2, 3, 5, 7)
    assert s.group_size == 2 and s.q_shape == (2, 4, 3, 7) and s.kv_shape == (2, 2, 5, 7)
    assert s.work == 2 * 4 * 3 * 5 * 7
    assert fst.Shape.of(fst.make_problem("normal", s, "fp32", 0)) == s


# --- the other strategies -----------------------------------------------------------------------
def test_dtypes_causal_modes_scales():
    assert {find(fst.dtypes(), lambda d, t=t: d == t, settings=FIND) for t in DTYPE_NAMES} \
        == set(DTYPE_NAMES)
    assert find(fst.dtypes(["half"]), lambda d: True, settings=FIND) == "fp16"
    modes = {(False, "bottom-right"), (True, "bottom-right"), (True, "top-left")}
    assert {find(fst.causal_modes(), lambda m, t=t: m == t, settings=FIND) for t in modes} == modes
    assert find(fst.scales(), lambda s: True, settings=FIND) is None
    assert find(fst.scales(), lambda s: s == 0.3, settings=FIND) == 0.3
    assert find(fst.problems(), lambda p: p.scale is not None, settings=FIND).scale \
        in fst.EXPLICIT_SCALES


@settings(max_examples=200, deadline=None, database=None)
@given(fst.scales())
def test_scales_values(scale):
    assert scale is None or (math.isfinite(scale) and scale > 0)


def test_problems_cover_causal_with_fully_masked_rows():
    p = find(fst.problems(causal=st.just((True, "bottom-right"))),
             lambda p: p.masked_rows.any(), settings=FIND)
    assert p.nq > p.nk


@pytest.mark.parametrize("call, match", [
    (lambda: fst.shapes(max_seq=0), r"max_seq=0"),
    (lambda: fst.shapes(max_batch=1.5), r"max_batch=1.5"),
    (lambda: fst.shapes(gqa="yes"), r"gqa='yes'"),
    (lambda: fst.shapes(head_dims=[256]), r"max_head_dim=128"),
    (lambda: fst.shapes(head_dims=[]), r"head_dims"),
    (lambda: fst.shapes(typical_seq=0), r"typical_seq=0"),
    (lambda: fst.problems(score_profiles="rise"), r"score_profiles='rise'.*st.none"),
    (lambda: fst.make_problem("normal+rise(step=9)", (1, 1, 1, 1, 1, 1), "fp16", 0), r"rise\(step=9\)"),
    (lambda: fst.make_problem(None, (1, 1, 1, 1, 1, 1), "fp16", 0), r"distribution=None"),
    (lambda: fst.ScoreProfile("climb", 9.0, 16, 0), r"kind='climb'"),
    (lambda: fst.ScoreProfile("rise", 100.0, 16, 0, count=7), r"span of 600"),
    (lambda: fst.ScoreProfile("rise", 0.0, 16, 0), r"step=0.0"),
    (lambda: fst.ScoreProfile("spike", 9.0, 0, 0), r"every=0"),
    (lambda: fst.dtypes(["fp64"]), r"fp64"),
    (lambda: fst.dtypes([]), r"names"),
    (lambda: fst.distributions(["gauss"]), r"gauss"),
    (lambda: fst.causal_modes(alignments=["left"]), r"left"),
    (lambda: fst.scales([-1.0]), r"explicit"),
    (lambda: fst.problems(dtypes="fp16"), r"dtypes='fp16'.*st.just"),
    (lambda: fst.make_problem("gauss", (1, 1, 1, 1, 1, 1), "fp16", 0), r"gauss"),
    (lambda: fst.make_problem("normal", (1, 1, 1, 1, 1, 1), "fp16", -1), r"seed=-1"),
    (lambda: fst.make_problem("fp16_extremes", (1, 1, 1, 4, 4, 8), "fp32", 0, scale=1e300),
     r"fp32 overflow"),
])
def test_argument_errors(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call()


# --- distributions: what each promises ----------------------------------------------------------
def test_fa3_outlier_rate_and_variance():
    n = 3_000_000
    x = fst.fa3_outlier_values(np.random.default_rng(12345), n)
    # |x| > 5: an N(0,1) element almost never (5.7e-7); an outlier (variance 1 + 100) with
    # probability P(|z| > 5/sqrt(101)).
    p_big_outlier = math.erfc(5 / math.sqrt(101) / math.sqrt(2))
    p_big_normal = math.erfc(5 / math.sqrt(2))
    p = 1e-3 * p_big_outlier + (1 - 1e-3) * p_big_normal
    count = int((np.abs(x) > 5).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(count - n * p) < 5 * sigma, (count, n * p, sigma)
    # Variance 1 + 0.001 * 100 = 1.1 (100 read as the variance); Var(x^2) = E x^4 - 1.1^2.
    e4 = (1 - 1e-3) * 3 + 1e-3 * 3 * 101 ** 2
    sigma_var = math.sqrt((e4 - 1.1 ** 2) / n)
    assert abs(x.var() - 1.1) < 5 * sigma_var, (x.var(), sigma_var)
    # The problem generator uses the same law for q, k and v.
    q, k, v = fst.DISTRIBUTIONS["fa3_outliers"](np.random.default_rng(7),
                                              fst.Shape(1, 1, 1, 1000, 1000, 500), "fp32")
    for t in (q, k, v):
        frac = (np.abs(t) > 5).mean()
        assert abs(frac - p) < 6 * math.sqrt(p / t.size), frac


@FAST
@given(fst.problems(distributions=st.just("dominant_key"), causal=st.just((False, "bottom-right")),
                    scale=fst.scales(), score_profiles=st.none()))
def test_dominant_key_takes_all_probability(problem):
    p = softmax(problem)
    worst = p.max(axis=-1).min()
    assert worst >= 1 - problem.nk * math.exp(-20), worst


def test_dominant_key_at_every_dtype_and_larger_shapes():
    for dtype in DTYPE_NAMES:
        for seed in range(6):
            for scale in (None, 0.125, 1.0):
                prob = fst.make_problem("dominant_key", (2, 4, 2, 50, 60, 256), dtype, seed,
                                        scale=scale)
                assert softmax(prob).max(axis=-1).min() >= 1 - 60 * math.exp(-20)


@settings(max_examples=40, deadline=None, database=None)
@given(fst.problems(distributions=st.just("large_logits"), score_profiles=st.none()))
def test_large_logits_reach_their_range(problem):
    # The peak is set before masking and rounding: look at all scores, unmasked.
    k, _ = problem.kv64()
    peak = np.abs(problem.scale_value * np.einsum("bhid,bhjd->bhij", problem.q64(), k)).max()
    lo, hi = 50.0, 500.0
    assert 0.97 * lo <= peak <= 1.03 * hi, peak
    assert np.abs(problem.q64()).max() <= 1e4 and np.abs(problem.k.astype(np.float64)).max() <= 1e4


def test_large_logits_spread_over_the_range():
    peaks = []
    for seed in range(60):
        prob = fst.make_problem("large_logits", (1, 2, 2, 8, 8, 16), "fp32", seed)
        k, _ = prob.kv64()
        peaks.append(np.abs(prob.scale_value * np.einsum("bhid,bhjd->bhij", prob.q64(), k)).max())
    assert min(peaks) < 100 and max(peaks) > 250


@FAST
@given(fst.problems(distributions=st.just("ties"), shapes=fst.shapes().filter(lambda s: s.nk >= 2),
                    score_profiles=st.none()))
def test_ties_duplicate_keys(problem):
    k = problem.k.astype(np.float64)
    for b in range(problem.batch):
        for h in range(problem.kv_heads):
            assert len(np.unique(k[b, h], axis=0)) < problem.nk


@FAST
@given(fst.problems(distributions=st.just("constant_rows"), score_profiles=st.none()))
def test_constant_rows(problem):
    v = problem.v.astype(np.float64)
    v_constant = (v == v[:, :, :1, :]).all()
    q_zero = (problem.q64() == 0).all()
    assert v_constant or q_zero


def test_constant_rows_uses_every_mode():
    modes = set()
    for seed in range(30):
        prob = fst.make_problem("constant_rows", (1, 1, 1, 4, 5, 3), "fp32", seed)
        v = prob.v.astype(np.float64)
        modes.add(((v == v[:, :, :1, :]).all(), (prob.q64() == 0).all()))
    assert modes == {(True, False), (False, True), (True, True)}


def test_fp16_extremes_values():
    for dtype in DTYPE_NAMES:
        prob = fst.make_problem("fp16_extremes", (1, 2, 2, 30, 40, 32), dtype, 3)
        v, q = np.abs(prob.v.astype(np.float64)), np.abs(prob.q64())
        assert v.max() >= 64000 and v.max() <= 65536
        assert ((v > 0) & (v < 2.0 ** -14)).any()  # fp16 subnormal magnitudes
        assert ((q > 0) & (q < 2.0 ** -14)).any() and q.max() < 10


def test_tiny_is_subnormal_scale():
    for dtype in DTYPE_NAMES:
        info = finfo(dtype)
        prob = fst.make_problem("tiny", (1, 2, 2, 30, 40, 32), dtype, 5)
        for x in (prob.q64(), prob.k.astype(np.float64), prob.v.astype(np.float64)):
            x = np.abs(x)
            assert x.max() <= 4 * float(info.smallest_normal)
            assert (x < float(info.smallest_normal)).mean() > 0.5  # mostly subnormal (or 0)
            assert ((x > 0) & (x < float(info.smallest_normal))).any()


# --- score profiles: the row max rises, falls or jumps late --------------------------------------
def test_score_profile_offsets():
    rise = fst.ScoreProfile("rise", 89.0, 64, 64, count=2)
    c = rise.offsets(129)
    assert (c[:64] == -89).all() and (c[64:128] == 0).all() and c[128] == 89
    assert (fst.ScoreProfile("fall", 10.0, 16, 0, count=3).offsets(40)
            == np.repeat([5.0, -5.0, -15.0], [16, 16, 8])).all()
    spike = fst.ScoreProfile("spike", 100.0, 5, -1, count=3).offsets(10)  # only the last key fits
    assert spike[-1] == 50 and (spike[:-1] == -50).all()
    late = fst.ScoreProfile("spike", 20.0, 64, 300).offsets(70)  # past the end: the last key
    assert late.argmax() == 69 and np.ptp(late) == 20


@settings(max_examples=200, deadline=None, database=None)
@given(fst.score_profiles())
def test_score_profiles_are_valid_and_round_trip(profile):
    assert fst.ScoreProfile.parse(str(profile)) == profile
    assert profile.kind == "spike" or profile.step * profile.count <= 600
    c = profile.offsets(300)
    assert np.ptp(c) <= 600 and abs(c.max() + c.min()) <= profile.step * profile.count


PROFILED = fst.problems(score_profiles=fst.score_profiles(), shapes=CI_SHAPES)


def _parts(problem):
    name, _, text = dict(problem.tags)["distribution"].partition("+")
    return name, fst.ScoreProfile.parse(text) if text else None


@settings(max_examples=60, deadline=None, database=None)
@given(PROFILED)
def test_profiled_problems_carry_their_offsets(problem):
    _, profile = _parts(problem)
    # coordinate 0 adds the profile's offset to every score, within the rounding of k
    q0, k0 = problem.q64()[..., 0], problem.k.astype(np.float64)[..., 0]
    assert (q0 == q0.flat[0]).all() and q0.flat[0] >= 1
    added = problem.scale_value * q0.flat[0] * k0  # [B, Hkv, Nk]
    c = profile.offsets(problem.nk)
    u = 2.0 ** -finfo(problem.dtype).nmant
    assert (np.abs(added - c) <= np.abs(c) * u + 1e-9).all()
    assert np.abs(problem.k.astype(np.float64)).max() <= 1e4


def _late_rise(problem, first: int = 64) -> float:
    """The most any row's max over keys >= `first` exceeds its max over the keys before."""
    s = np.where(problem.mask, scaled_scores(problem), -np.inf)
    rise = s[..., first:].max(axis=-1) - s[..., :first].max(axis=-1)
    return float(np.where(np.isfinite(rise), rise, -np.inf).max())


EXP_FP32 = math.log(float(finfo("fp32").max))  # 88.72

PROFILE_COVERAGE = {
    "rise": lambda p: p.kind == "rise",
    "fall": lambda p: p.kind == "fall",
    "spike at the last key": lambda p: p.kind == "spike" and p.start == -1,
    "step at fp32's exp overflow edge": lambda p: abs(p.step - EXP_FP32) < 0.5,
    "step at fp16's exp overflow edge": lambda p: abs(p.step - math.log(65504)) < 0.5,
    "step at fp32's exp underflow edge": lambda p: abs(p.step - 103.28) < 0.5,
    "steps every 64 keys": lambda p: p.every == 64 and p.count > 1,
    "steps one off a tile": lambda p: p.every in (15, 17, 31, 33, 63, 65, 127, 129),
    "first step at key 128": lambda p: p.start == 128,
}


def test_score_profiles_cover():
    assert not _unseen(fst.score_profiles(), PROFILE_COVERAGE, n=300)


@pytest.mark.parametrize("first", [64, 128])
def test_default_problems_raise_the_max_late_beyond_fp32s_exp_range(first):
    """What a kernel keeping its first tile's max cannot survive in fp32: a row whose max after
    key `first` exceeds its max before by more than ln(fp32 max), in the ci profile's problems."""
    problems = fst.problems(shapes=fst.shapes(max_seq=257, typical_seq=64, max_work=200_000))
    assert not _unseen(problems, {"late rise": lambda p: p.nk > first and _late_rise(p, first) > EXP_FP32},
                       n=300)


def test_problems_draw_profiles_in_a_third():
    assert 0.15 <= _share(fst.problems(), lambda p: "+" in dict(p.tags)["distribution"]) <= 0.5
    assert _share(fst.problems(score_profiles=st.none()), lambda p: "+" in dict(p.tags)["distribution"]) == 0


def test_profiled_problem_rebuilds():
    name = "fa3_outliers+spike(step=103.3,every=64,start=-1,count=1)"
    a = fst.make_problem(name, (1, 2, 1, 7, 70, 16), "bf16", 4, causal=True)
    assert dict(a.tags)["distribution"] == name
    assert _same(a, fst.make_problem(name.replace(",", ", "), (1, 2, 1, 7, 70, 16), "bf16", 4,
                                     causal=True))
    assert _late_rise(a) > 100  # the last key, 103.3 logits above the rest


# --- determinism --------------------------------------------------------------------------------
def _same(a: AttentionProblem, b: AttentionProblem) -> bool:
    return (a.tags == b.tags and a.causal == b.causal and a.causal_alignment == b.causal_alignment
            and a.scale == b.scale and a.dtype == b.dtype
            and all(x.tobytes() == y.tobytes() and x.shape == y.shape
                    for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v))))


@settings(max_examples=30, deadline=None, database=None)
@given(fst.problems())
def test_problem_rebuilds_from_its_tags(problem):
    tags = dict(problem.tags)
    again = fst.make_problem(tags["distribution"], fst.Shape.of(problem), problem.dtype,
                             tags["seed"], causal=problem.causal,
                             causal_alignment=problem.causal_alignment, scale=problem.scale)
    assert _same(problem, again)


@pytest.mark.parametrize("name", fst.DISTRIBUTION_NAMES)
def test_seed_determines_values(name):
    shape = (2, 4, 2, 9, 12, 16)
    a = fst.make_problem(name, shape, "bf16", 99)
    assert _same(a, fst.make_problem(name, shape, "bf16", 99))
    others = [fst.make_problem(name, shape, "bf16", s) for s in (100, 101)]
    assert not all(_same(a, o) for o in others)


def test_hypothesis_replays_the_same_problems():
    def run() -> list:
        seen = []

        @settings(max_examples=10, derandomize=True, database=None, deadline=None)
        @given(fst.problems())
        def collect(problem):
            seen.append(problem)

        collect()
        return seen

    a, b = run(), run()
    assert len(a) == len(b) > 0
    assert all(_same(x, y) for x, y in zip(a, b))
