"""Deep and long-key problems: past the first query tile *and* the first key tile; keys in the thousands.

Ordinary shapes (`shapes()`) spend most examples on Nq, Nk <= 64 and reach long lengths in one
dimension or the other; a bug that acts only in later query tiles' later key tiles (a wrong
rescale of later rows), or an error that grows with the number of keys (P·V accumulated in
fp16), then shows in few examples, or only when the scores' rises are large enough to hide it.
Two shape strategies aim at them:

- `deep_shapes()`: Nq and Nk both span at least two tiles of a tile size T drawn for each
  (from DEEP_TILE_SIZES: query and key tiles drawn apart, as kernels' differ), at and around
  its multiples (2T - 1, 2T, 2T + 1, 3T, ..., 4T + 1), or anything or the most in range; the
  lengths are drawn first and take the work budget, so D, heads and batch are small when long;
- `long_key_shapes()`: Nk in the thousands (LONG_KEYS_RANGE, tile multiples +- 1 favoured), a
  few query rows (1 ... LONG_KEYS_ROWS), small D, within the work budget.

Both draw within a target's limits as `shapes()` does (`seq_multiple`, `seq_min`, `equal_seq`,
`head_layouts`, `group_sizes`, `head_dims`) and raise InvalidArgumentError when the limits and
budget leave no such shape. `deep_problems` and `long_key_problems` pair them with moderate
scores (MODERATE_DISTRIBUTIONS, LONG_KEY_DISTRIBUTIONS) and, in about half the problems, small
rises of the row max at tile boundaries (`small_rises()`: at most SMALL_RISE_MAX logits a step):
after a jump of tens of logits a wrong rescale factor is ~0 as the right one is, so large rises
hide such bugs. `depth_shares` mixes them into another strategy in fixed shares, picked by one
drawn slot (st.one_of is not weighted): DEEP_SHARE deep and LONG_KEYS_SHARE long-key draws.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import CAUSAL_ALIGNMENTS
from fa_verify.strategies._problems import causal_modes, distributions, problems
from fa_verify.strategies._score_profiles import MAX_COUNT, ScoreProfile
from fa_verify.strategies._shapes import DEFAULT_MAX_WORK, Shape, _favoured, _heads, _min_heads, _SeqGrid
from fa_verify.validation import check_bool, check_int, check_names, check_strategy

#: Tile sizes whose second (and later) tiles deep shapes reach, for queries and keys apart; the
#: first is the one shrinking goes to (64: FlashAttention's usual key tile, and half its 128).
DEEP_TILE_SIZES = (64, 128, 32, 16)
#: Deep lengths are drawn around m * T for these m (and +- 1): two to four tiles.
_DEEP_MULTIPLES = (2, 3, 4)
#: The range of Nk that long-key shapes draw from (within max_nk and the work budget).
LONG_KEYS_RANGE = (1000, 4096)
#: Long-key shapes have at most this many query rows (unless the limits' shortest is longer).
LONG_KEYS_ROWS = 8
#: Key counts favoured by long-key shapes: tile multiples +- 1.
_LONG_KEY_EDGES = tuple(sorted({m * t + d for t in (256, 512, 1024) for m in range(1, 17)
                                for d in (-1, 0, 1)}))
#: Head dims favoured when the budget is tight (small first: deep and long shapes are long).
_SMALL_HEAD_DIMS = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 63, 64)
#: Value distributions with moderate scores (N(0, 1), U(-1, 1) q and k: logits of a few units).
MODERATE_DISTRIBUTIONS = ("normal", "uniform")
#: Long keys draw half their problems with V constant along the keys (or q = 0: constant_rows):
#: an fp16/bf16 P·V accumulator's error then grows with every key, as it does for any V with a
#: common component (with zero-mean V it grows no faster than the error bound).
LONG_KEY_DISTRIBUTIONS = ("normal", "constant_rows")
#: Largest step of `small_rises()`, in logits: a rise this small leaves the old state's weight
#: exp(-step) far from 0, so a wrong rescale of it shows. The smallest is _SMALL_RISE_MIN.
SMALL_RISE_MAX = 10.0
_SMALL_RISE_MIN = 0.25
_TILES_UP = tuple(sorted(DEEP_TILE_SIZES))
#: Shares of `depth_shares`' draws: deep, long-key (the rest: the ordinary strategy).
DEEP_SHARE = 1 / 4
LONG_KEYS_SHARE = 1 / 8


def _snap(n: int, grid: _SeqGrid) -> int:
    """The smallest allowed length >= n."""
    return max(grid.lowest, grid.multiple * -(-n // grid.multiple))


def _floor(n: int, grid: _SeqGrid) -> int:
    """The largest allowed length <= n (n >= grid.lowest)."""
    return grid.multiple * (n // grid.multiple)


def _deep_lengths(tile: int, grid: _SeqGrid) -> tuple:
    """The favoured lengths of at least two tiles of `tile`, on the grid: m * tile + (-1, 0, 1)."""
    return tuple(sorted({_snap(m * tile + d, grid) for m in _DEEP_MULTIPLES for d in (-1, 0, 1)}))


# Each draw below reads the same choices whichever kind it picks (as in _shapes: shrinking
# compares choice sequences, so a kind that read fewer would be "simpler" and win), and choice 0
# is the smallest value: deep and long shapes shrink towards their shortest lengths and D = 1.


def _length(draw, favoured: tuple, cap: int, grid: _SeqGrid) -> int:
    """A length in [favoured[0], cap] on the grid: a favoured one, any, or the most allowed."""
    kind = draw(st.integers(0, 2))
    pick = _favoured(draw, favoured, cap)
    anything = grid.length(draw(st.integers(grid.units(favoured[0]), grid.units(cap))))
    return (pick, anything, _floor(cap, grid))[kind]


def _small_head_dim(draw, cap: int, head_dims) -> int:
    if head_dims is not None:
        return _favoured(draw, head_dims, cap)
    kind = draw(st.integers(0, 2))
    pick = _favoured(draw, _SMALL_HEAD_DIMS, cap)
    anything = draw(st.integers(1, cap))
    return (pick, anything, cap)[kind]


def _heads_and_batch(draw, max_heads, max_batch, room: int, layouts, group_sizes) -> tuple:
    """(batch, heads, kv_heads) with batch * heads <= room (room >= the fewest heads)."""
    heads, kv_heads = _heads(draw, min(max_heads, room), layouts, group_sizes)
    return draw(st.integers(1, min(max_batch, room // heads))), heads, kv_heads


@st.composite
def _deep(draw, pairs, grid, max_seq, max_work, max_scores, max_batch, max_heads, max_head_dim, head_dims,
          layouts, group_sizes, equal_seq, d_min, h_min):
    tq, tk = draw(st.sampled_from(pairs))
    lows = {t: _deep_lengths(t, grid) for t in (tq, tk)}
    if equal_seq:
        cap = min(max_seq, math.isqrt(max_scores // h_min), math.isqrt(max_work // (h_min * d_min)))
        nq = nk = _length(draw, lows[tq], cap, grid)
    else:
        least_nk = lows[tk][0]
        nq = _length(draw, lows[tq], min(max_seq, max_scores // (h_min * least_nk),
                                         max_work // (h_min * d_min * least_nk)), grid)
        nk = _length(draw, lows[tk], min(max_seq, max_scores // (h_min * nq), max_work // (h_min * d_min * nq)),
                     grid)
    d = _small_head_dim(draw, min(max_head_dim, max_work // (h_min * nq * nk)), head_dims)
    batch, heads, kv_heads = _heads_and_batch(draw, max_heads, max_batch,
                                              min(max_work // (nq * nk * d), max_scores // (nq * nk)),
                                              layouts, group_sizes)
    return Shape(batch, heads, kv_heads, nq, nk, d)


@st.composite
def _long_keys(draw, grid, low_nk, max_nk, max_nq, max_work, max_scores, max_batch, max_heads, max_head_dim,
               head_dims, layouts, group_sizes, d_min, h_min):
    favoured = (low_nk, *(e for e in _LONG_KEY_EDGES if _snap(e, grid) == e and e > low_nk))
    nk = _length(draw, favoured, min(max_nk, max_work // (h_min * d_min * grid.lowest),
                                     max_scores // (h_min * grid.lowest)), grid)
    rows_cap = min(max_nq, max_work // (h_min * d_min * nk), max_scores // (h_min * nk))
    nq = grid.length(draw(st.integers(1, grid.units(rows_cap))))
    d = _small_head_dim(draw, min(max_head_dim, max_work // (h_min * nq * nk)), head_dims)
    batch, heads, kv_heads = _heads_and_batch(draw, max_heads, max_batch,
                                              min(max_work // (nq * nk * d), max_scores // (nq * nk)),
                                              layouts, group_sizes)
    return Shape(batch, heads, kv_heads, nq, nk, d)


def _common(max_batch, max_heads, max_head_dim, head_dims, max_work, seq_multiple, seq_min, head_layouts,
            group_sizes) -> dict:
    """Checked arguments shared by both shape strategies, with the grid and the least D and heads."""
    max_head_dim, max_heads = check_int("max_head_dim", max_head_dim), check_int("max_heads", max_heads)
    if head_dims is not None:
        head_dims = tuple(sorted({check_int("head_dims[...]", d) for d in
                                  ((head_dims,) if isinstance(head_dims, int) else head_dims)}))
        head_dims = tuple(d for d in head_dims if d <= max_head_dim)
        if not head_dims:
            raise InvalidArgumentError(f"no head dim of head_dims is <= max_head_dim={max_head_dim!r}")
    layouts = ("mha", "mqa", "gqa") if head_layouts is None else tuple(
        h for h in ("mha", "mqa", "gqa")
        if h in check_names("head_layouts", head_layouts, ("mha", "mqa", "gqa"), "head layout"))
    if group_sizes is not None:
        group_sizes = tuple(sorted({check_int("group_sizes[...]", g) for g in group_sizes}))
    multiple = check_int("seq_multiple", seq_multiple)
    grid = _SeqGrid(multiple, multiple * -(-check_int("seq_min", seq_min) // multiple))
    h_min = _min_heads(layouts, group_sizes)
    if h_min > max_heads:
        raise InvalidArgumentError(f"head_layouts={layouts!r} and group_sizes={group_sizes!r} need "
                                   f"{h_min} heads > max_heads={max_heads!r}")
    return dict(max_batch=check_int("max_batch", max_batch), max_heads=max_heads,
                max_head_dim=max_head_dim, head_dims=head_dims, max_work=check_int("max_work", max_work),
                layouts=layouts, group_sizes=group_sizes, grid=grid,
                d_min=head_dims[0] if head_dims is not None else 1, h_min=h_min)


def deep_shapes(max_seq: int = 257, max_work: int = DEFAULT_MAX_WORK, max_scores=None,
                tile_sizes=DEEP_TILE_SIZES, max_batch: int = 2, max_heads: int = 4, max_head_dim: int = 128,
                head_dims=None, seq_multiple: int = 1, seq_min: int = 1, equal_seq: bool = False,
                head_layouts=None, group_sizes=None):
    """Strategy for `Shape` with Nq and Nk both at least two tiles long (see the module).

    For each of Nq and Nk a tile size T is drawn from those of `tile_sizes` that fit; the length
    is then a favoured one (2T - 1, 2T, 2T + 1, 3T - 1, ... 4T + 1), any, or the most allowed,
    within max_seq. B*H*Nq*Nk*D <= max_work and B*H*Nq*Nk <= max_scores (default max_seq**2:
    judging an example costs per score) by construction. The other arguments are `shapes()`'s.
    Raises InvalidArgumentError where no tile size fits.
    """
    common = _common(max_batch, max_heads, max_head_dim, head_dims, max_work, seq_multiple, seq_min,
                     head_layouts, group_sizes)
    max_seq = check_int("max_seq", max_seq)
    max_scores = max_seq ** 2 if max_scores is None else check_int("max_scores", max_scores)
    equal_seq = check_bool("equal_seq", equal_seq)
    tiles = tuple(dict.fromkeys(check_int("tile_sizes[...]", t, min_value=2) for t in tile_sizes))
    grid, d_min, h_min, work = common["grid"], common["d_min"], common["h_min"], common["max_work"]
    least = {t: _deep_lengths(t, grid)[0] for t in tiles}
    pairs = tuple((a, b) for a in tiles for b in tiles
                  if (a == b or not equal_seq) and max(least[a], least[b]) <= max_seq
                  and h_min * least[a] * least[b] <= max_scores and h_min * d_min * least[a] * least[b] <= work
                  and (not equal_seq or h_min * d_min * max(least[a], least[b]) ** 2 <= work))
    if not pairs:
        raise InvalidArgumentError(
            f"no tile size of {tiles} has two tiles of queries and keys within max_seq={max_seq!r}, "
            f"max_scores={max_scores!r} and max_work={work!r} (shortest deep length {min(least.values())})")
    return _deep(pairs, grid, max_seq, work, max_scores, common["max_batch"], common["max_heads"],
                 common["max_head_dim"], common["head_dims"], common["layouts"], common["group_sizes"], equal_seq,
                 d_min, h_min)


def long_key_shapes(max_nk: int = LONG_KEYS_RANGE[1], min_nk: int = LONG_KEYS_RANGE[0],
                    max_nq: int = LONG_KEYS_ROWS, max_work: int = DEFAULT_MAX_WORK, max_scores=None,
                    max_batch: int = 2,
                    max_heads: int = 4, max_head_dim: int = 128, head_dims=None, seq_multiple: int = 1,
                    seq_min: int = 1, equal_seq: bool = False, head_layouts=None, group_sizes=None):
    """Strategy for `Shape` with Nk in [min_nk, max_nk] (tile multiples +- 1 favoured), Nq in
    [1, max_nq], B*H*Nq*Nk*D <= max_work and B*H*Nq*Nk <= max_scores (None: no bound): the keys
    take the budget, so D and heads are small.

    The other arguments are `shapes()`'s. Raises InvalidArgumentError under equal_seq (Nq must be
    short) and where the budget leaves no Nk >= min_nk (or max_nk < min_nk).
    """
    common = _common(max_batch, max_heads, max_head_dim, head_dims, max_work, seq_multiple, seq_min,
                     head_layouts, group_sizes)
    max_nk, min_nk, max_nq = (check_int(n, v) for n, v in (("max_nk", max_nk), ("min_nk", min_nk),
                                                             ("max_nq", max_nq)))
    if check_bool("equal_seq", equal_seq):
        raise InvalidArgumentError("long-key shapes have a few query rows: not with equal_seq")
    grid, d_min, h_min, work = common["grid"], common["d_min"], common["h_min"], common["max_work"]
    low_nk = _snap(min_nk, grid)
    max_nq = max(max_nq, grid.lowest)
    # B*H*Nq*Nk <= max_work / D <= max_work: None is no bound
    max_scores = work if max_scores is None else check_int("max_scores", max_scores)
    if low_nk > max_nk or h_min * d_min * grid.lowest * low_nk > work or h_min * grid.lowest * low_nk > max_scores:
        raise InvalidArgumentError(
            f"no Nk in [{min_nk}, {max_nk}] on the grid fits max_work={work!r} and max_scores={max_scores!r} "
            f"(with Nq={grid.lowest}, D={d_min}, H={h_min})")
    return _long_keys(grid, low_nk, max_nk, max_nq, work, max_scores, common["max_batch"], common["max_heads"],
                      common["max_head_dim"], common["head_dims"], common["layouts"], common["group_sizes"],
                      d_min, h_min)


@st.composite
def _small_rises(draw):
    # log-uniform: as many steps below 1.6 logits as above (a 16-bit output shows a wrong rescale
    # by exp(-step) better for small steps)
    step = round(_SMALL_RISE_MIN * (SMALL_RISE_MAX / _SMALL_RISE_MIN) ** draw(st.floats(0.0, 1.0)), 3)
    every = draw(st.sampled_from(_TILES_UP))
    start = draw(st.sampled_from(_TILES_UP + (256,))) + draw(st.sampled_from((0, -1, 1)))
    return ScoreProfile("rise", step, every, start, draw(st.integers(1, MAX_COUNT)))


def small_rises():
    """Strategy for a rising `ScoreProfile` of small steps (0.25 ... SMALL_RISE_MAX logits,
    log-uniform) at or next to tile boundaries (16 ... 256), every 16 ... 128 keys: the row max
    keeps rising in later key tiles by amounts whose rescale factor is far from 0."""
    return _small_rises()


def _sometimes_small_rises():
    """None for choice 0 (shrinks to the plain distribution), a small rise for choice 1."""
    return st.integers(0, 1).flatmap(lambda n: small_rises() if n else st.none())


def _modes(non_causal: bool, alignments, long_keys: bool):
    alignments = check_names("alignments", alignments, CAUSAL_ALIGNMENTS, "causal alignment",
                             allow_empty=check_bool("non_causal", non_causal))
    if long_keys and (non_causal or set(alignments) - {"top-left"}):
        # top-left with a few rows sees a few keys only: the long keys are for the other modes
        alignments = tuple(a for a in alignments if a != "top-left")
    return causal_modes(non_causal=non_causal, alignments=alignments)


def deep_problems(shapes=None, dtypes=None, non_causal: bool = True, alignments=CAUSAL_ALIGNMENTS):
    """`problems()` of `shapes` (default `deep_shapes()`) with moderate scores
    (MODERATE_DISTRIBUTIONS) and, in about half of them, `small_rises()`."""
    return problems(shapes=deep_shapes() if shapes is None
                    else check_strategy("shapes", shapes, "fst.deep_shapes()"),
                    dtypes=dtypes, causal=_modes(non_causal, alignments, False),
                    distributions=distributions(MODERATE_DISTRIBUTIONS), score_profiles=_sometimes_small_rises())


def long_key_problems(shapes=None, dtypes=None, non_causal: bool = True, alignments=CAUSAL_ALIGNMENTS):
    """`problems()` of `shapes` (default `long_key_shapes()`) with LONG_KEY_DISTRIBUTIONS and, in
    about half of them, `small_rises()`; top-left causal only where no other mode is allowed
    (its few rows would see a few keys)."""
    return problems(shapes=long_key_shapes() if shapes is None
                    else check_strategy("shapes", shapes, "fst.long_key_shapes()"),
                    dtypes=dtypes, causal=_modes(non_causal, alignments, True),
                    distributions=distributions(LONG_KEY_DISTRIBUTIONS), score_profiles=_sometimes_small_rises())


#: Slots of `depth_shares`' draw: the last ones pick the deep and long-key branches.
_SLOTS = 8


def depth_shares(ordinary, deep=None, long_keys=None):
    """A strategy drawing from `deep` in DEEP_SHARE of the draws, from `long_keys` in
    LONG_KEYS_SHARE, and from `ordinary` otherwise (and in the share of a branch that is None).

    One slot of eight, drawn uniformly (st.sampled_from: Hypothesis' st.integers leans to small
    values, st.one_of is not weighted), picks the branch, so the shares are fixed: of the
    fresh draws. Hypothesis follows a fresh example with up to five mutations of it, which
    mostly keep its branch, so a short search sees them in runs and its realised share varies.
    Slot 0 is ordinary, so shrinking leaves the deep and long branches where it can. Works on
    any strategies: shapes or problems.
    """
    ordinary = check_strategy("ordinary", ordinary, "fst.shapes()")
    n_long, n_deep = round(LONG_KEYS_SHARE * _SLOTS), round(DEEP_SHARE * _SLOTS)

    def branch(slot: int):
        if slot >= _SLOTS - n_long and long_keys is not None:
            return long_keys
        if _SLOTS - n_long - n_deep <= slot < _SLOTS - n_long and deep is not None:
            return deep
        return ordinary

    if deep is None and long_keys is None:
        return ordinary
    return st.sampled_from(range(_SLOTS)).flatmap(branch)
