"""Strategies for the variants of a problem: sliding windows, softcap, ALiBi slopes, sinks.

`variant_problems(features=...)` draws a problem from `problems()` and switches on a
non-empty subset of `features` (only those the target implements), each drawn where kernels
break: window edges on either side of a tile boundary and on the diagonal, left = 0, windows
wider than the sequence; softcaps small enough to bind on ordinary scores; ALiBi slopes from
the recipe 2^(-8 i / H) or random, per head or per batch entry and head; sink logits far
below, near and far above the scores.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import FEATURES
from fa_verify.strategies._problems import problems as _problems

#: A kernel's usual key tile: window edges are drawn on either side of its multiples.
DEFAULT_TILE = 64
#: Softcaps from Gemma-2 (50, 30) down to caps that bind on N(0, 1) scores.
SOFTCAPS = (0.25, 1.0, 5.0, 30.0, 50.0)


def window_sides(nk: int, tile: int = DEFAULT_TILE):
    """Strategy for one side of a window: unbounded, 0 (the diagonal), a few keys, a tile
    boundary +- 1, or wider than the sequence."""
    edges = [t + d for t in range(tile, nk + tile, tile) for d in (-1, 0, 1)]
    return st.one_of(st.sampled_from([-1, 0]), st.integers(1, 8), st.sampled_from(edges),
                     st.integers(nk, 2 * nk + 1))


def alibi_slopes(batch: int, heads: int):
    """Strategy for slopes [H] or [B, H]: the ALiBi recipe 2^(-8 i / H), i = 1..H, or random in
    (0, 2]."""
    recipe = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    random = st.builds(lambda seed, shape: np.random.default_rng(seed).uniform(1e-3, 2.0, shape),
                       st.integers(0, 2 ** 32 - 1), st.sampled_from([(heads,), (batch, heads)]))
    return st.one_of(st.just(recipe), random)


def sink_logits(heads: int):
    """Strategy for sinks [H]: logits far below, near and far above ordinary scores (|s| ~ 1)."""
    logit = st.one_of(st.sampled_from([-30.0, -5.0, 0.0, 5.0, 30.0]), st.floats(-40.0, 40.0, width=32))
    return st.lists(logit, min_size=heads, max_size=heads).map(lambda x: np.array(x, np.float32))


def _check_features(features) -> tuple:
    features = tuple(features)
    unknown = [f for f in features if f not in FEATURES]
    if unknown or not features:
        raise InvalidArgumentError(f"features={features!r} must be a non-empty subset of {tuple(FEATURES)}")
    return features


@st.composite
def _switched_on(draw, problem_st, features, always, tile):
    problem = draw(problem_st)
    chosen = draw(st.lists(st.sampled_from(features), min_size=0 if always else 1, max_size=len(features),
                           unique=True)) + list(always)
    changes = {}
    if "window" in chosen:
        sides = window_sides(problem.nk, tile)
        window = draw(st.tuples(sides, sides).filter(lambda w: w != (-1, -1)))
        if problem.causal and window[0] == -1:  # causal fixes right = 0: the left side makes the window
            window = (draw(sides.filter(lambda s: s >= 0)), window[1])
        changes["window_size"] = window
    if "softcap" in chosen:
        changes["softcap"] = draw(st.one_of(st.sampled_from(SOFTCAPS), st.floats(0.05, 100.0)))
    if "alibi" in chosen:
        changes["alibi_slopes"] = draw(alibi_slopes(problem.batch, problem.heads))
    if "sinks" in chosen:
        changes["sinks"] = draw(sink_logits(problem.heads))
    return problem.replace(**changes)


def variant_problems(problems=None, features=tuple(FEATURES), always=(), tile: int = DEFAULT_TILE):
    """Strategy for problems with a non-empty subset of `features` (keys of
    fa_verify.problem.FEATURES) switched on, `always` among them. `problems`: the strategy of
    the dense problems to start from (default ``problems()``); `tile`: the key tile whose
    boundaries window edges straddle."""
    features = _check_features(features)
    always = _check_features(always) if always else ()
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise InvalidArgumentError(f"tile={tile!r} must be an integer >= 1")
    return _switched_on(_problems() if problems is None else problems, features, always, tile)
