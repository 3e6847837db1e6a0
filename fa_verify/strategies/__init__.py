"""Hypothesis strategies for attention problems.

    from hypothesis import given
    from fa_verify import strategies as fst

    @given(fst.problems())
    def test_my_kernel(problem): ...

`problems()` combines `shapes()`, `dtypes()`, `causal_modes()`, `distributions()` and
`scales()`; each can be narrowed (``fst.problems(dtypes=fst.dtypes(["bf16"]))``). Values come
from the named generators in `DISTRIBUTIONS`, seeded from Hypothesis; `make_problem` rebuilds
a problem from its tags (distribution, seed) without Hypothesis.
"""

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
from fa_verify.strategies._shapes import (
    COMMON_HEAD_DIMS,
    DEFAULT_MAX_WORK,
    Shape,
    favoured_seq_lengths,
    shapes,
)
from fa_verify.strategies._values import (
    DISTRIBUTION_NAMES,
    DISTRIBUTIONS,
    fa3_outlier_values,
)

__all__ = [
    "COMMON_HEAD_DIMS",
    "DEFAULT_MAX_WORK",
    "DISTRIBUTIONS",
    "DISTRIBUTION_NAMES",
    "EXPLICIT_SCALES",
    "Shape",
    "causal_modes",
    "distributions",
    "dtypes",
    "fa3_outlier_values",
    "favoured_seq_lengths",
    "make_problem",
    "problems",
    "scales",
    "seeds",
    "shapes",
]
