"""Hypothesis strategies for attention problems.

    from hypothesis import given
    from fa_verify import strategies as fst

    @given(fst.problems())
    def test_my_kernel(problem): ...

`problems()` combines `shapes()`, `dtypes()`, `causal_modes()`, `distributions()`, `scales()`
and `score_profiles()`; each can be narrowed (``fst.problems(dtypes=fst.dtypes(["bf16"]))``).
Values come from the named generators in `DISTRIBUTIONS`, seeded from Hypothesis; in about
a quarter of the problems a `ScoreProfile` drawn by Hypothesis then makes the row max rise,
fall or jump late, by up to hundreds of logits, to drive a kernel's online softmax.
`make_problem` rebuilds a problem from its tags (distribution with its profile, seed) without
Hypothesis. `variant_problems(features=...)` switches on sliding windows, softcap, ALiBi and
sinks (fa_verify.problem) for targets that implement them. `deep_shapes()` (Nq and Nk past
their first tiles) and `long_key_shapes()` (Nk in the thousands, a few rows), paired with moderate
scores and `small_rises()` by `deep_problems()` / `long_key_problems()`, are mixed into another
strategy in fixed shares by `depth_shares()`. `ragged_problems(layout)` draws
varlen and paged batches (fa_verify.ragged) with page tables and split counts;
`paged_fp8_problems()` paged batches of FP8 sequences (an FP8 KV cache with k_scale / v_scale).
`backward_problems(forwards)` pairs forward problems with upstream gradients (`DOUT_DISTRIBUTIONS`),
a fixed share with rows `anti_aligned` to every key (very negative LSE), for backward targets;
`make_backward_problem` is one of them without Hypothesis (a report sweep's points).
`fp8_problems()` draws FP8 problems (fa_verify.fp8) where FP8 bugs live: non-unit, distinct
descales, values at the format's edges, logits where P's offset matters, key lengths around
multiples of 128; `make_fp8_problem` is one of them without Hypothesis; `make_descaled_problem`
the report's FP8 sweep point (a dense problem's values stored under descales of a range).
"""

from fa_verify.strategies._backward import DOUT_DISTRIBUTIONS, anti_aligned, backward_problems, make_backward_problem
from fa_verify.strategies._fp8 import fp8_problems, make_descaled_problem, make_fp8_problem
from fa_verify.strategies._depth import (
    DEEP_SHARE,
    DEEP_TILE_SIZES,
    LONG_KEYS_RANGE,
    LONG_KEYS_SHARE,
    deep_problems,
    deep_shapes,
    depth_shares,
    long_key_problems,
    long_key_shapes,
    small_rises,
)
from fa_verify.strategies._problems import (
    EXPLICIT_SCALES,
    causal_modes,
    distributions,
    dtypes,
    make_problem,
    problems,
    scales,
    seeds,
)
from fa_verify.strategies._ragged import (
    batch_signature,
    make_paged_fp8_problem,
    paged_fp8_problems,
    ragged_problems,
    revalued,
)
from fa_verify.strategies._score_profiles import ScoreProfile, score_profiles
from fa_verify.strategies._shapes import (
    COMMON_HEAD_DIMS,
    DEFAULT_MAX_WORK,
    Shape,
    favoured_seq_lengths,
    shapes,
)
from fa_verify.strategies._variants import (
    SOFTCAPS,
    alibi_slopes,
    sink_logits,
    variant_problems,
    window_sides,
)
from fa_verify.strategies._values import (
    DISTRIBUTION_NAMES,
    DISTRIBUTIONS,
    fa3_outlier_values,
)

__all__ = [
    "COMMON_HEAD_DIMS",
    "DEEP_SHARE",
    "DEEP_TILE_SIZES",
    "DEFAULT_MAX_WORK",
    "DISTRIBUTIONS",
    "DISTRIBUTION_NAMES",
    "DOUT_DISTRIBUTIONS",
    "EXPLICIT_SCALES",
    "LONG_KEYS_RANGE",
    "LONG_KEYS_SHARE",
    "SOFTCAPS",
    "ScoreProfile",
    "Shape",
    "alibi_slopes",
    "anti_aligned",
    "backward_problems",
    "batch_signature",
    "causal_modes",
    "deep_problems",
    "deep_shapes",
    "depth_shares",
    "distributions",
    "dtypes",
    "fa3_outlier_values",
    "fp8_problems",
    "favoured_seq_lengths",
    "long_key_problems",
    "long_key_shapes",
    "make_backward_problem",
    "make_descaled_problem",
    "make_fp8_problem",
    "make_paged_fp8_problem",
    "make_problem",
    "paged_fp8_problems",
    "problems",
    "ragged_problems",
    "revalued",
    "scales",
    "score_profiles",
    "seeds",
    "shapes",
    "sink_logits",
    "small_rises",
    "variant_problems",
    "window_sides",
]
