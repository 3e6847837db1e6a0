"""Attention problems: dtype, masking, scale and value strategies, and `problems()`.

A problem's values come from a numpy Generator seeded by an integer that Hypothesis draws, so
an example replays exactly from its seed, and shrinking works on the shape, the options and the
seed (not on individual elements). On top of them, about a quarter of the problems carry a
`ScoreProfile` that Hypothesis draws (and shrinks): offsets that make the row max rise, fall
or jump late. The distribution name (with the profile after a '+', as in
``"normal+rise(step=88.72,every=64,start=63,count=3)"``) and the seed are recorded in the
problem's tags, and `make_problem` rebuilds the same problem outside Hypothesis.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import CAUSAL_ALIGNMENTS, AttentionProblem
from fa_verify.strategies._score_profiles import ScoreProfile, score_profiles
from fa_verify.strategies._shapes import Shape, shapes
from fa_verify.validation import (
    check_bool,
    check_dtype,
    check_int,
    check_names,
    check_scale,
    check_strategy,
)
from fa_verify.strategies._values import DISTRIBUTION_NAMES, DISTRIBUTIONS

#: Seeds are drawn from [0, MAX_SEED].
MAX_SEED = 2 ** 32 - 1
#: Explicit scales `scales()` offers besides None: dyadic ones (exact) and non-dyadic ones.
EXPLICIT_SCALES = (1.0, 0.125, 0.5, 0.3, 0.1, 2.0)
#: Scaled scores must stay below this (fp32's max is 3.4e38) by the bound max|q|·max|k|·D·scale.
_FP32_SCORE_LIMIT = 3e38


def dtypes(names=DTYPE_NAMES):
    """Strategy for a problem dtype name, sampled from `names` (default fp16, bf16, fp32).

    Names may be any spelling fa_verify accepts ('half', np.float16, ...); draws are canonical.
    """
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise InvalidArgumentError(f"names={names!r} must be a sequence of dtype names") from None
    if not names:
        raise InvalidArgumentError(f"names={names!r} must name at least one of {DTYPE_NAMES}")
    return st.sampled_from(tuple(dict.fromkeys(check_dtype("names[...]", n) for n in names)))


def causal_modes(non_causal: bool = True, alignments=CAUSAL_ALIGNMENTS):
    """Strategy for (causal, alignment): (False, 'bottom-right') and (True, a) for each alignment.

    Non-causal problems carry the default alignment, which is then irrelevant. Shrinks towards
    non-causal, then bottom-right (FlashAttention >= 2.1) before top-left (torch SDPA).
    """
    non_causal = check_bool("non_causal", non_causal)
    alignments = check_names("alignments", alignments, CAUSAL_ALIGNMENTS, "causal alignment",
                             allow_empty=non_causal)
    modes = ([(False, "bottom-right")] if non_causal else []) + [(True, a) for a in alignments]
    return st.sampled_from(modes)


def scales(explicit=EXPLICIT_SCALES):
    """Strategy for the softmax scale: None (exactly 1/sqrt(D)) four times in five, otherwise one
    of `explicit` (finite positive floats). Shrinks towards None."""
    if isinstance(explicit, (int, float)):
        explicit = (explicit,)
    explicit = tuple(check_scale("explicit[...]", s) for s in explicit)
    if not explicit or None in explicit:
        raise InvalidArgumentError(
            f"explicit={explicit!r} must hold at least one finite positive float (None is "
            "already drawn most of the time)"
        )
    return st.integers(0, 4).flatmap(
        lambda n: st.none() if n < 4 else st.sampled_from(explicit))


def distributions(names=DISTRIBUTION_NAMES):
    """Strategy for a distribution name from `names` (default: every name in DISTRIBUTIONS)."""
    return st.sampled_from(check_names("names", names, DISTRIBUTION_NAMES, "distribution"))


def seeds():
    """Strategy for a generator seed in [0, 2^32 - 1] (shrinks towards 0)."""
    return st.integers(0, MAX_SEED)


def make_problem(distribution: str, shape, dtype, seed: int, *, causal: bool = False,
                 causal_alignment: str = "bottom-right", scale=None, tags=()) -> AttentionProblem:
    """The problem that `problems()` generates for these choices, without Hypothesis.

    Values come from ``DISTRIBUTIONS[name](numpy.random.default_rng(seed), shape, dtype,
    scale)``, rounded to `dtype`; `distribution` is a name from DISTRIBUTIONS, optionally
    followed by '+' and a score profile (``"normal+spike(step=100.0,every=64,start=-1,count=1)"``,
    see `ScoreProfile`), which then sets coordinate 0 of q and k. The tags are
    (("distribution", distribution), ("seed", seed)) followed by `tags`. Raises
    InvalidArgumentError if the scaled scores could overflow fp32 (only possible with an
    enormous explicit scale).
    """
    if not isinstance(distribution, str):
        raise InvalidArgumentError(f"distribution={distribution!r} must be a distribution name")
    name, plus, profile = distribution.partition("+")
    name = check_names("distribution", (name,), DISTRIBUTION_NAMES, "distribution")[0]
    profile = ScoreProfile.parse(profile) if plus else None
    distribution = name if profile is None else f"{name}+{profile}"
    shape = Shape.coerce(shape)
    dtype = check_dtype("dtype", dtype)
    seed = check_int("seed", seed, min_value=0)
    causal = check_bool("causal", causal)
    scale = check_scale("scale", scale)
    q, k, v = DISTRIBUTIONS[name](np.random.default_rng(seed), shape, dtype, scale)
    if profile is not None:
        q, k = profile.apply(q, k, 1.0 / math.sqrt(shape.head_dim) if scale is None else scale)
    problem = AttentionProblem.from_float(
        q, k, v, dtype, causal=causal, causal_alignment=causal_alignment, scale=scale,
        tags=(("distribution", distribution), ("seed", seed)) + tuple(tags))
    bound = (float(np.abs(problem.q64()).max()) * float(np.abs(problem.k.astype(np.float64)).max())
             * problem.head_dim * problem.scale_value)
    if not bound < _FP32_SCORE_LIMIT:
        raise InvalidArgumentError(
            f"scale={scale!r} lets the scaled scores of distribution={distribution!r} reach "
            f"{bound:.3g} > 3e38 (fp32 overflow); use a smaller scale"
        )
    return problem


@st.composite
def _problems(draw, shape_st, dtype_st, causal_st, distribution_st, scale_st, profile_st):
    shape = draw(shape_st)
    dtype = draw(dtype_st)
    causal, alignment = draw(causal_st)
    distribution = draw(distribution_st)
    scale = draw(scale_st)
    profile = draw(profile_st)
    seed = draw(seeds())
    if profile is not None:
        distribution = f"{distribution}+{_check_profile(profile)}"
    return make_problem(distribution, shape, dtype, seed, causal=causal,
                        causal_alignment=alignment, scale=scale)


def _check_profile(profile) -> ScoreProfile:
    if not isinstance(profile, ScoreProfile):
        raise InvalidArgumentError(
            f"score_profiles drew {profile!r}; it must draw ScoreProfile objects or None")
    return profile


def _sometimes_profiles():
    """None for choices 0 and 1 of three (shrinks towards None; Hypothesis' draws lean to the
    simpler, so about three problems in four), else a profile."""
    return st.integers(0, 2).flatmap(lambda n: score_profiles() if n == 2 else st.none())


def problems(shapes=None, dtypes=None, causal=None, distributions=None, scale=None,
             score_profiles=None):
    """Strategy for `AttentionProblem`, valid by construction (finite inputs exactly
    representable in the dtype, scaled scores finite in fp32).

    Each argument is a Hypothesis strategy, or None for its default:
      shapes: of `Shape` (default ``shapes()``, small: B*H*Nq*Nk*D <= 2e5);
      dtypes: of dtype names (default ``dtypes()``: fp16, bf16, fp32);
      causal: of (causal, alignment) pairs (default ``causal_modes()``);
      distributions: of distribution names (default ``distributions()``: all of them);
      scale: of None or a float (default ``scales()``: None, i.e. 1/sqrt(D), four times in
        five); pass ``st.none()`` to always use 1/sqrt(D);
      score_profiles: of `ScoreProfile` or None (default: ``score_profiles()`` for one choice
        in three, about a quarter of the problems, None otherwise); pass ``st.none()`` for the
        distributions' values alone, or ``fst.score_profiles()`` for a profile in every problem.
    Tags record the distribution (and profile) and the seed; ``make_problem`` rebuilds the
    problem from them.
    """
    return _problems(
        _default(shapes, _shapes_default, "shapes", "st.just(fst.Shape(1, 1, 1, 16, 16, 64))"),
        _default(dtypes, _dtypes_default, "dtypes", "st.just('fp16')"),
        _default(causal, causal_modes, "causal", "st.just((True, 'bottom-right'))"),
        _default(distributions, _distributions_default, "distributions", "st.just('normal')"),
        _default(scale, scales, "scale", "st.just(0.125) or st.none()"),
        _default(score_profiles, _sometimes_profiles, "score_profiles", "fst.score_profiles() or st.none()"),
    )


def _default(value, factory, name, example):
    return factory() if value is None else check_strategy(name, value, example)


# Module-level names `shapes`, `dtypes` and `distributions` are shadowed by problems()'s
# parameters; keep references to the default factories.
_shapes_default = shapes
_dtypes_default = dtypes
_distributions_default = distributions
