"""What a search draws and how long it searches: dtypes, masking, sizes, examples, seed."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis.database import ExampleDatabase

from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.profiles import DEFAULT_PROFILE, get_profile
from fa_verify.strategies import LONG_KEYS_RANGE
from fa_verify.validation import check_int


@dataclass(frozen=True)
class Selection:
    """What to draw and how long to search (defaults: the ci profile's)."""

    dtypes: tuple = DTYPE_NAMES
    #: causal modes allowed: (False,), (True,) or both
    causal: tuple = (False, True)
    max_examples: int = get_profile(DEFAULT_PROFILE).max_examples
    max_seq: int = get_profile(DEFAULT_PROFILE).max_seq
    max_work: int = get_profile(DEFAULT_PROFILE).max_work
    #: most draws keep Nq, Nk <= typical_seq, a minority reach max_seq (None: all may)
    typical_seq: int | None = get_profile(DEFAULT_PROFILE).typical_seq
    #: Hypothesis seed (None: random, with the example database)
    seed: int | None = 0
    #: shrink a failure to a minimal counterexample (off: faster, for counting examples-to-failure)
    shrink: bool = True
    #: Hypothesis example database (None: none); namespaced per property and target
    database: ExampleDatabase | None = None
    #: shape budget: each property draws from at most this many problem signatures (shape,
    #: dtype, causal mode, scale), so a JIT-compiled target compiles that often (None: no budget)
    shapes: int | None = None
    #: search on after a first failure (and after a failing edge case) for failures of other
    #: kinds (rules, dtypes, causal modes), reporting each; only with shrink (without it, the
    #: search stops at its first failure, as Hypothesis does)
    distinct_failures: bool = True
    #: the longest key sequence of the agreement properties' long-key share (a few rows over
    #: thousands of keys); a user's --max-seq caps it too
    max_long_keys: int = LONG_KEYS_RANGE[1]
    #: the fixed edge cases run before the search (properties that have them), at most this many,
    #: spread over them (None: all of them)
    max_edge_cases: int | None = None
    #: time.monotonic() after which no further example is drawn (`check --budget`; None: no limit):
    #: a search stops drawing, and says so (`PropertyOutcome.budget_spent`)
    stop_at: float | None = None

    def __post_init__(self):
        if self.shapes is not None:
            check_int("Selection.shapes", self.shapes)

    @classmethod
    def from_profile(cls, name: str, **overrides) -> "Selection":
        """The profile's sizes and seed; keyword overrides that are None are ignored."""
        profile = get_profile(name)
        fields = dict(max_examples=profile.max_examples, max_seq=profile.max_seq, max_work=profile.max_work,
                      typical_seq=profile.typical_seq, seed=profile.seed)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)
