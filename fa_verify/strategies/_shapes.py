"""Problem shapes: `Shape` and the `shapes()` strategy.

Shapes are built *within* their bounds rather than filtered: each dimension is drawn with a
cap that leaves room for the ones still to come, so that B*H*Nq*Nk*D <= max_work always holds
and no example is thrown away. The dimensions are drawn in a random order (head dim, sequence
lengths and heads; batch last) so that no one of them is always squeezed by the work bound.

Interesting values are favoured: for sequence lengths 1, small primes and tile boundaries
t-1, t, t+1 (t = 16, 32, ..., 1024), with Nq == Nk, Nq < Nk and Nq > Nk; for heads MHA, GQA
and MQA; for head dims the common ones (64, 128, ...) and odd ones (1, 3, 31, 33, 63, 127, ...).
An arbitrary in-bounds integer is always possible too, so nothing in range is unreachable.
Everything shrinks towards B = H = Hkv = Nq = Nk = D = 1.

With `typical_seq` below `max_seq`, most shapes keep Nq, Nk <= typical_seq and one choice in
1/LONG_SHARE (about one shape in five: Hypothesis' draws lean to the simpler) is *long*: its
sequence lengths are drawn first, so they get the work budget, and one of them (both, when
they are equal) lies above typical_seq — a tile edge (65, 127, 128, 129, 255, 256, 257, ...),
anything, or the most the budget allows — so that kernels' second and third query and key
tiles (of 64 or 128) are reached at a small cost per property. A long shape also keeps
B*H*Nq*Nk <= max_seq**2, as judging an example costs per score.

Declared limits (`fa_verify.limits`) are drawn within, not filtered: sequence lengths on a grid
(a multiple of `seq_multiple`, from `seq_min`) are drawn as grid units with the same choices as
plain lengths, `equal_seq` draws Nq = Nk, `head_layouts` restricts MHA / GQA / MQA, `group_sizes` draws H/Hkv
from the declared ones, and the work
budget keeps room for the smallest allowed length and head layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st

from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import ANY_HEAD_DIM_V
from fa_verify.shape import Shape
from fa_verify.validation import check_bool, check_int, check_names

#: Default bound on B*H*Nq*Nk*D: small enough for an mpmath oracle and a slow backend.
DEFAULT_MAX_WORK = 200_000

#: Small primes favoured as sequence lengths (filtered by the bounds).
SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61,
                67, 97, 127, 131, 251, 257, 509, 521, 1021)

#: Tile sizes whose boundaries t-1, t, t+1 are favoured as sequence lengths.
TILE_SIZES = (16, 32, 64, 128, 256, 512, 1024)

#: Share of long shapes (Nq or Nk above typical_seq) when shapes() is given a typical_seq.
LONG_SHARE = 1 / 4

#: Where a target runs D_v != D, one shape in this many draws its own D_v (choice 0, D_v = D, is
#: where shrinking goes; Hypothesis' draws lean to the simpler, so somewhat fewer in practice).
OTHER_HEAD_DIM_V_SLOTS = 3

#: Head dims favoured: the common ones and odd ones around them (filtered by the bounds).
COMMON_HEAD_DIMS = (1, 3, 8, 16, 31, 32, 33, 63, 64, 80, 96, 127, 128, 160, 192, 255, 256)


def favoured_seq_lengths(cap: int) -> tuple:
    """The favoured sequence lengths <= cap: 1, tile boundaries, small primes, and cap itself."""
    return tuple(sorted({v for v in (1, cap, *_TILE_EDGES, *SMALL_PRIMES) if 1 <= v <= cap}))


_TILE_EDGES = tuple(sorted({n for t in TILE_SIZES for n in (t - 1, t, t + 1)}))


@dataclass(frozen=True)
class _SeqGrid:
    """The allowed sequence lengths lowest, lowest + multiple, ...: drawn as units u >= 1 (unit 1
    is the lowest length), so the plain grid (1, 1) draws exactly as lengths."""

    multiple: int = 1
    #: the smallest allowed length, a multiple of `multiple`
    lowest: int = 1

    def units(self, cap: int) -> int:
        """How many allowed lengths are <= cap."""
        return cap // self.multiple - self.lowest // self.multiple + 1

    def length(self, unit: int) -> int:
        return self.lowest + self.multiple * (unit - 1)

# How the draws below stay shrinkable: every cap depends on dimensions drawn earlier. A strategy
# whose *structure* follows the cap (sampled_from a list that shrinks to one element, one_of
# losing a branch) changes how many choices are read, so shrinking an earlier dimension would
# misalign the later ones and the shrinker stalls. So each draw reads the same choices whatever
# the cap: integers whose bounds move (one choice either way), and indices into fixed lists,
# mapped monotonically into range (choice 0 is always the smallest value, so everything still
# shrinks towards 1).


def _favoured(draw, values: tuple, cap: int) -> int:
    """One of the sorted `values` (values[0] <= cap); one above cap becomes the largest <= cap."""
    v = values[draw(st.integers(0, len(values) - 1))]
    return v if v <= cap else max(x for x in values if x <= cap)


def _seq_len(draw, cap: int) -> int:
    """A sequence length in [1, cap]: 1, a tile edge, a small prime, any, or cap itself."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return 1
    if kind == 1:
        return _favoured(draw, (1, *_TILE_EDGES), cap)
    if kind == 2:
        return _favoured(draw, (1, *SMALL_PRIMES), cap)
    if kind == 3:
        return draw(st.integers(1, cap))
    return cap


def _head_dim(draw, cap: int, head_dims) -> int:
    if head_dims is not None:
        return _favoured(draw, head_dims, cap)
    if draw(st.booleans()):
        return draw(st.integers(1, cap))
    return _favoured(draw, COMMON_HEAD_DIMS, cap)


def _head_dims(draw, cap: int, head_dims, head_dims_v) -> tuple:
    """(D, D_v): D as `_head_dim` draws it and D_v = D, unless `head_dims_v` allows another D_v:
    ANY_HEAD_DIM_V draws D_v like D, independently, one draw in OTHER_HEAD_DIM_V_SLOTS; (D, D_v)
    pairs give one of those (with both dims within cap) as often. Shrinks towards D_v = D."""
    d = _head_dim(draw, cap, head_dims)
    if head_dims_v is None or draw(st.integers(0, OTHER_HEAD_DIM_V_SLOTS - 1)) < OTHER_HEAD_DIM_V_SLOTS - 1:
        return d, d
    if head_dims_v == ANY_HEAD_DIM_V:
        return d, _head_dim(draw, cap, None)
    fitting = [pair for pair in head_dims_v if max(pair) <= cap]
    choice = draw(st.integers(0, len(head_dims_v) - 1))
    return fitting[choice % len(fitting)] if fitting else (d, d)


def _long_seq_len(draw, cap: int, typical: int) -> int:
    """A sequence length in (typical, cap] (cap itself if that is empty): a tile edge, any,
    or cap itself."""
    low = min(typical + 1, cap)
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return _favoured(draw, (low, *(e for e in _TILE_EDGES if e > low)), cap)
    if kind == 1:
        return draw(st.integers(low, cap))
    return cap


def _seq_lengths(draw, cap: int, max_seq: int, typical: int | None = None, grid: _SeqGrid = _SeqGrid(),
                 equal: bool = False) -> tuple:
    """(nq, nk) on `grid` with nq*nk <= cap: equal, or one drawn first and the other within what
    is left. With `typical`, the first (both when equal) lies above it where the cap allows."""
    def one(cap_len, long):
        units = grid.units(cap_len)
        return grid.length(_long_seq_len(draw, units, max(0, grid.units(typical))) if long else _seq_len(draw, units))

    how = "equal" if equal else draw(st.sampled_from(("equal", "q_first", "k_first")))
    if how == "equal":
        n = one(min(max_seq, math.isqrt(cap)), typical is not None)
        return n, n
    first = one(min(max_seq, cap // grid.lowest), typical is not None)
    second = one(min(max_seq, cap // first), False)
    return (first, second) if how == "q_first" else (second, first)


def _heads(draw, cap: int, layouts: tuple, group_sizes=None) -> tuple:
    """(heads, kv_heads) with heads <= cap, of one of `layouts`: MHA, MQA (Hkv=1) and GQA
    (1 < Hkv < H); a kind that does not fit under cap falls back to the next simpler one."""
    if group_sizes is not None:
        return _grouped_heads(draw, cap, layouts, group_sizes)
    kind = draw(st.sampled_from(layouts)) if len(layouts) > 1 else layouts[0]
    if kind == "gqa":
        kv_choice, group_choice = draw(st.integers(0, cap)), draw(st.integers(0, cap))
        if cap >= 4:
            kv = 2 + kv_choice % (cap // 2 - 1)
            return kv * (2 + group_choice % (cap // kv - 1)), kv
        kind = "mqa" if "mqa" in layouts or "mha" not in layouts else "mha"
    h = draw(st.integers(1, cap))
    if kind == "mqa" and cap >= 2:
        return max(h, 2), 1
    return h, h


def _grouped_heads(draw, cap: int, layouts: tuple, group_sizes: tuple) -> tuple:
    """(heads, kv_heads) with heads <= cap and H/Hkv in `group_sizes`, of one of `layouts` that
    fits (the reserve for heads guarantees one does)."""
    groups = [g for g in group_sizes if 1 < g <= cap]
    fitting = {"mha": 1 in group_sizes, "mqa": bool(groups), "gqa": any(2 * g <= cap for g in groups)}
    kind = draw(st.sampled_from([k for k in layouts if fitting[k]]))
    if kind == "mha":
        h = draw(st.integers(1, cap))
        return h, h
    if kind == "mqa":
        return draw(st.sampled_from(groups)), 1
    group = draw(st.sampled_from([g for g in groups if 2 * g <= cap]))
    kv = draw(st.integers(2, cap // group))
    return kv * group, kv


def _min_heads(layouts: tuple, group_sizes=None) -> int:
    """The fewest query heads of the simplest allowed layout (and group size)."""
    if group_sizes is None:
        return 1 if "mha" in layouts else 2 if "mqa" in layouts else 4
    groups = [g for g in group_sizes if g > 1]
    fewest = ([1] if "mha" in layouts and 1 in group_sizes else []) + [
        k * min(groups) for k, kind in ((1, "mqa"), (2, "gqa")) if groups and kind in layouts]
    return min(fewest, default=math.inf)


@st.composite
def _shapes(draw, max_batch, max_heads, max_seq, max_head_dim, head_dims, layouts, max_work, typical_seq,
            grid, equal_seq, group_sizes, head_dims_v):
    got = {}
    # What the groups not yet drawn need at least, so that each draw leaves room for them.
    reserve = {"d": head_dims[0] if head_dims is not None else 1, "nq": grid.lowest, "nk": grid.lowest,
               "h": _min_heads(layouts, group_sizes)}

    def left(*drawing) -> int:
        """The cap for the next dimension(s): the work left, keeping room for the smallest D, lengths
        and heads still to draw; for a long shape also B*H*Nq*Nk <= max_seq**2 (the cost of
        judging grows with the scores)."""
        pending = [key for key in reserve if key not in got and key not in drawing]
        cap = max_work // (math.prod(got.values()) * math.prod(reserve[key] for key in pending))
        if long:
            scores = math.prod(v for key, v in got.items() if key != "d")
            cap = min(cap, max_seq ** 2 // (scores * math.prod(reserve[key] for key in pending if key != "d")))
        return cap

    # Choice 0 (short) is the one shrinking goes to; the last of 1/LONG_SHARE choices is long.
    slots = round(1 / LONG_SHARE)
    long = typical_seq < max_seq and draw(st.integers(0, slots - 1)) == slots - 1
    order = draw(st.permutations(("head_dim", "seq", "heads")))
    if long:  # the long lengths take the work budget first
        order = ("seq",) + tuple(g for g in order if g != "seq")
    for group in order:
        if group == "head_dim":
            cap = min(max_head_dim, max_work // (math.prod(got.values()) * math.prod(
                v for key, v in reserve.items() if key not in got and key != "d")))
            dims = _head_dims(draw, cap, head_dims, head_dims_v)
            got["d"] = max(dims)  # the larger product, q.k or P.v, is the work
        elif group == "seq" and long:
            got["nq"], got["nk"] = _seq_lengths(draw, left("nq", "nk"), max_seq, typical_seq, grid, equal_seq)
        elif group == "seq":
            got["nq"], got["nk"] = _seq_lengths(draw, left("nq", "nk"), max(typical_seq, grid.lowest), None,
                                                grid, equal_seq)
        else:
            got["h"], kv_heads = _heads(draw, min(max_heads, left("h")), layouts, group_sizes)
    batch = draw(st.integers(1, min(max_batch, left())))
    return Shape(batch, got["h"], kv_heads, got["nq"], got["nk"], dims[0], head_dim_v=dims[1])


def shapes(max_batch: int = 2, max_heads: int = 4, max_seq: int = 64, max_head_dim: int = 128,
           head_dims=None, gqa: bool = True, max_work: int = DEFAULT_MAX_WORK, typical_seq=None,
           seq_multiple: int = 1, seq_min: int = 1, equal_seq: bool = False, head_layouts=None,
           group_sizes=None, head_dims_v=None):
    """Strategy for `Shape` with every bound respected by construction.

    max_batch, max_heads, max_seq, max_head_dim: upper bounds of B, H (query heads), Nq and Nk,
        and D. All >= 1.
    typical_seq: if given and below max_seq, most shapes keep Nq, Nk <= typical_seq and one in
        LONG_SHARE choices (about one shape in five) has Nq or Nk (or both) in (typical_seq, max_seq], within
        max_work (so the other dimensions are small). None: every shape up to max_seq.
    head_dims: if given, D is drawn from these values only (each must be <= max_head_dim and
        <= max_work); otherwise D favours COMMON_HEAD_DIMS and may be any integer in range.
    gqa: if True, H is a multiple of Hkv (MHA, GQA, MQA); if False, Hkv == H (MHA only).
    max_work: bound on B*H*Nq*Nk*D, the size of one attention product. The default (2e5) keeps
        an mpmath oracle and slow backends at around a second per example; raise it together
        with max_seq for longer sequences.
    seq_multiple, seq_min: Nq and Nk are multiples of seq_multiple and >= seq_min.
    equal_seq: Nq == Nk always.
    head_layouts: the layouts drawn, a subset of ("mha", "mqa", "gqa") (None: by `gqa`).
    group_sizes: if given, H/Hkv is drawn from these values only (1: MHA).
    head_dims_v: v's head dim D_v. None: D_v = D always; "any" (ANY_HEAD_DIM_V): in about one shape
        in three D_v is drawn independently of D (as D is, up to max_head_dim); a sequence of
        (D, D_v) pairs: as often one of those pairs, where max_work allows (what a
        kernel instantiated for, e.g., (192, 128) runs). Shrinks towards D_v = D.
    """
    max_batch = check_int("max_batch", max_batch)
    max_heads = check_int("max_heads", max_heads)
    max_seq = check_int("max_seq", max_seq)
    max_head_dim = check_int("max_head_dim", max_head_dim)
    gqa = check_bool("gqa", gqa)
    max_work = check_int("max_work", max_work)
    typical_seq = max_seq if typical_seq is None else min(check_int("typical_seq", typical_seq), max_seq)
    if head_dims is not None:
        if isinstance(head_dims, int) and not isinstance(head_dims, bool):
            head_dims = (head_dims,)
        try:
            head_dims = tuple(head_dims)
        except TypeError:
            raise InvalidArgumentError(
                f"head_dims={head_dims!r} must be None or a sequence of integers >= 1"
            ) from None
        if not head_dims:
            raise InvalidArgumentError(f"head_dims={head_dims!r} must hold at least one head dim, or be None")
        head_dims = tuple(sorted({check_int("head_dims[...]", d) for d in head_dims}))
        too_big = [d for d in head_dims if d > min(max_head_dim, max_work)]
        if too_big:
            raise InvalidArgumentError(
                f"head_dims={head_dims!r} holds {too_big!r} > max_head_dim={max_head_dim!r} "
                f"or max_work={max_work!r}; raise max_head_dim (and max_work) or drop them"
            )
    layouts = (("mha", "mqa", "gqa") if gqa else ("mha",)) if head_layouts is None else tuple(
        h for h in ("mha", "mqa", "gqa") if h in check_names("head_layouts", head_layouts, ("mha", "mqa", "gqa"),
                                                               "head layout"))
    multiple = check_int("seq_multiple", seq_multiple)
    grid = _SeqGrid(multiple, multiple * -(-check_int("seq_min", seq_min) // multiple))
    if group_sizes is not None:
        group_sizes = tuple(sorted({check_int("group_sizes[...]", g) for g in group_sizes}))
    fewest_heads = _min_heads(layouts, group_sizes)
    least = grid.lowest ** 2 * fewest_heads * (head_dims[0] if head_dims is not None else 1)
    if grid.lowest > max_seq or least > max_work or fewest_heads > max_heads:
        raise InvalidArgumentError(
            f"seq_multiple={seq_multiple!r}, seq_min={seq_min!r}, head_layouts={layouts!r} and "
            f"group_sizes={group_sizes!r} leave no shape "
            f"with Nq, Nk <= max_seq={max_seq!r}, H <= max_heads={max_heads!r} and B*H*Nq*Nk*D <= "
            f"max_work={max_work!r}; raise max_seq or max_work")
    return _shapes(max_batch, max_heads, max_seq, max_head_dim, head_dims, layouts, max_work, typical_seq,
                   grid, check_bool("equal_seq", equal_seq), group_sizes, _checked_head_dims_v(head_dims_v))


def _checked_head_dims_v(head_dims_v):
    """None, ANY_HEAD_DIM_V, or a non-empty tuple of (D, D_v) pairs of integers >= 1."""
    if head_dims_v is None or head_dims_v == ANY_HEAD_DIM_V:
        return head_dims_v
    try:
        pairs = tuple((check_int("head_dims_v[...][0]", d), check_int("head_dims_v[...][1]", dv))
                      for d, dv in head_dims_v)
    except (TypeError, ValueError):
        pairs = ()
    if not pairs:
        raise InvalidArgumentError(
            f"head_dims_v={head_dims_v!r} must be None, {ANY_HEAD_DIM_V!r} or (D, D_v) pairs, e.g. ((192, 128),)")
    return pairs
