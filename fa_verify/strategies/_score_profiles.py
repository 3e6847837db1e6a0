"""Score profiles: per-key logit offsets that make the online softmax's running max move.

A FlashAttention kernel keeps, per query row, a running max m of the scores seen so far and
rescales its row sum and accumulator by exp(m_old - m_new) whenever a key tile raises it.
Random values barely use that machinery: a row's max is set within its first few keys and
later tiles raise it by a logit or two. A `ScoreProfile` adds to the scores of key j an offset
c_j, the same for every query, so that the row max

    rise   climbs by `step` logits at keys start, start + every, ... (`count` steps);
    fall   drops the same way (later keys sink towards and past exp's underflow);
    spike  is reached by single keys start, start + every, ... (`count` of them), `step`
           logits above every other key ("one late key" with count = 1).

Offsets are centred on 0, so |c_j| <= step * count / 2 <= MAX_SPAN / 2. A kernel's tile size is
unknown, so `score_profiles()` draws `every` among the tile sizes kernels use (16 ... 128), one
off them, or anything, and `start` at tile edges, at the last keys, or anywhere; `step` at the
edges of exp's range in the accumulator and P dtypes (ln of the largest finite, smallest normal
and smallest subnormal value of fp32, bf16 and fp16: 88.7, 87.3, 103.3, 92.2, 11.1, 9.7, 16.6,
each +-0.5) or anywhere in [1, 200]. A kernel that keeps the max of its first tile, skips a
rescale, or exponentiates before subtracting the new max then overflows or loses the keys that
matter; a correct one gives the softmax of the top level's keys.

The offset rides on head-dim coordinate 0: q[..., 0] = a and k[..., j, 0] = c_j / (scale * a),
with a the smallest power of two (>= 1) that keeps |k| <= 1e4; the other coordinates keep the
base distribution's values, so the keys of one level still have an ordinary softmax among
themselves. Rounding k to the dtype moves an offset by at most its relative rounding error.

A profile has a canonical text form, ``rise(step=88.72,every=64,start=63,count=3)``, which
`make_problem` reads after a '+' in the distribution name (``"normal+rise(...)"``), so a problem
with a profile rebuilds from its tags like any other.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from fa_verify.dtypes import DTYPE_NAMES, finfo
from fa_verify.errors import InvalidArgumentError
from fa_verify.strategies._shapes import TILE_SIZES

KINDS = ("rise", "fall", "spike")
#: Largest distance between the highest and the lowest offset, in logits: several times fp32's
#: exp range, and small enough that scaled scores stay ordinary fp32 numbers.
MAX_SPAN = 600.0
#: Largest single step `score_profiles()` draws outside the exp edges.
MAX_STEP = 200.0
#: Most steps (or spikes) in one profile.
MAX_COUNT = 8
#: ln of the largest finite, the smallest normal and the smallest subnormal value of every
#: problem dtype: where exp overflows, leaves the normal range and underflows to 0.
EXP_EDGES = tuple(sorted({round(x, 3) for name in DTYPE_NAMES for x in (
    math.log(float(finfo(name).max)), -math.log(float(finfo(name).smallest_normal)),
    -math.log(float(finfo(name).smallest_subnormal)))}))
#: Elements of k stay within this magnitude (as in the steered distributions).
_K_LIMIT = 1.0e4
_KERNEL_TILES = tuple(t for t in TILE_SIZES if t <= 128)
_TEXT = re.compile(r"(\w+)\(step=([0-9.e+-]+),every=(\d+),start=(-?\d+),count=(\d+)\)")


@dataclass(frozen=True)
class ScoreProfile:
    """Offsets added to the scaled scores of each key (see the module docstring)."""

    kind: str
    #: logits per step (> 0)
    step: float
    #: keys from one step (or spike) to the next
    every: int
    #: key of the first step; negative counts from the end (-1: the last key). Positions past
    #: the last key are clamped to it.
    start: int
    #: number of steps (or spikes)
    count: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"ScoreProfile.kind={self.kind!r} must be one of {KINDS}")
        if not (isinstance(self.step, (int, float)) and 0 < self.step <= MAX_SPAN):
            raise InvalidArgumentError(f"ScoreProfile.step={self.step!r} must be in (0, {MAX_SPAN:g}] logits")
        for name, low in (("every", 1), ("count", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"ScoreProfile.{name}={value!r} must be an integer >= {low}")
        if isinstance(self.start, bool) or not isinstance(self.start, int):
            raise InvalidArgumentError(f"ScoreProfile.start={self.start!r} must be an integer")
        if self.kind != "spike" and self.step * self.count > MAX_SPAN:
            raise InvalidArgumentError(
                f"ScoreProfile step={self.step!r} x count={self.count!r} exceeds the span of "
                f"{MAX_SPAN:g} logits; use fewer or smaller steps")

    def __str__(self) -> str:
        return f"{self.kind}(step={self.step!r},every={self.every},start={self.start},count={self.count})"

    @classmethod
    def parse(cls, text: str) -> "ScoreProfile":
        """The profile written as `str(profile)`."""
        match = _TEXT.fullmatch(text.replace(" ", ""))
        if match is None:
            raise InvalidArgumentError(
                f"score profile {text!r} must read like 'rise(step=88.72,every=64,start=63,count=3)' "
                f"(kinds: {', '.join(KINDS)})")
        kind, step, every, start, count = match.groups()
        return cls(kind, float(step), int(every), int(start), int(count))

    def positions(self, nk: int) -> np.ndarray:
        """The keys where the steps (or spikes) are, for Nk keys (those within range)."""
        first = min(self.start, nk - 1) if self.start >= 0 else max(nk + self.start, 0)
        at = first + self.every * np.arange(self.count)
        return at[at < nk]

    def offsets(self, nk: int) -> np.ndarray:
        """The offset of each of Nk keys' scaled scores, float64, centred on 0."""
        at = self.positions(nk)
        if self.kind == "spike":
            return np.where(np.isin(np.arange(nk), at), self.step / 2, -self.step / 2)
        level = np.searchsorted(at, np.arange(nk), side="right")
        sign = 1.0 if self.kind == "rise" else -1.0
        return sign * self.step * (level - self.count / 2)

    def apply(self, q: np.ndarray, k: np.ndarray, scale: float) -> tuple:
        """(q, k) with coordinate 0 carrying the offsets (float64 copies; see the module)."""
        c = self.offsets(k.shape[2])
        a = 2.0 ** max(0, math.ceil(math.log2(float(np.abs(c).max(initial=1.0)) / (scale * _K_LIMIT))))
        q, k = np.array(q, dtype=np.float64), np.array(k, dtype=np.float64)
        q[..., 0] = a
        k[..., 0] = c / (scale * a)
        return q, k


def _near(values, offsets) -> st.SearchStrategy:
    """One of `values` plus one of `offsets`."""
    return st.tuples(st.sampled_from(values), st.sampled_from(offsets)).map(sum)


@st.composite
def _profiles(draw):
    kind = draw(st.sampled_from(KINDS))
    step = draw(st.one_of(st.sampled_from(EXP_EDGES).flatmap(lambda e: st.floats(e - 0.5, e + 0.5)),
                          st.floats(1.0, MAX_STEP)))
    step = round(step, 3)
    every = draw(st.one_of(_near(_KERNEL_TILES, (0, -1, 1)), st.integers(1, 2 * _KERNEL_TILES[-1])))
    start = draw(st.one_of(_near(_KERNEL_TILES + (256,), (0, -1, 1)), st.integers(-3, -1),
                           st.integers(0, 2 * _KERNEL_TILES[-1])))
    most = MAX_COUNT if kind == "spike" else max(1, min(MAX_COUNT, int(MAX_SPAN // step)))
    return ScoreProfile(kind, step, every, start, draw(st.integers(1, most)))


def score_profiles():
    """Strategy for a `ScoreProfile`: a rise, fall or spike of the row max, with steps at the
    exp edges or anywhere up to 200 logits, on or off the tile sizes 16 ... 128, early or late.

    Shrinks towards a rising profile with small, few, early steps. `problems()` draws one in about a
    quarter of its examples.
    """
    return _profiles()
