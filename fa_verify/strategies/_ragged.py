"""Strategies for ragged batches (fa_verify.ragged): varlen and paged KV, with split counts.

`ragged_problems(layout, ...)` draws batches where ragged kernels break: lengths of 1, a tile
+- 1, all equal, one long among many short, exact multiples of the page size; queries for
decode (Nq = 1), speculative decode (a few) and prefill (Nq = Nk); page sizes below, equal to
and above the kernel's key tile, tables shuffled (and entries past each sequence's pages random)
and pages shared by sequences with a common prefix; split counts 1, 2, k and 0 (auto); the
variants the target implements. Everything is drawn within a target's declared `Limits`
(per sequence) and page sizes.

`paged_fp8_problems(...)` draws paged batches of FP8 sequences (an FP8 KV cache, kind
"paged-fp8") with `_fp8.py`'s draws: descales non-unit, distinct across q, k, v, sequences and
heads, never powers of two; stored values subnormal, ordinary or at the format's saturation
edge (448 in e4m3), with +-max and the smallest subnormals sprinkled in; logits where P's
offset matters; cache lengths at and around multiples of 128 (`PAGED_FP8_KEYS`) in a fixed
share; per-tensor scales ([1], as KV caches carry them) in `PER_TENSOR_KV_SHARE`, else [B, Hkv].
`make_paged_fp8_problem` builds one from its choices without Hypothesis.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import HEAD_LAYOUTS, Limits, _layout
from fa_verify.ragged import LAYOUTS, PageLayout, RaggedProblem
from fa_verify.fp8 import DESCALES
from fa_verify.strategies._fp8 import (
    LOGIT_SPREADS,
    OFFSET_GAPS,
    OFFSET_SHARE,
    TILE_EDGE_KEYS,
    VALUE_SPREADS,
    _distinct,
    _in_share,
    make_fp8_problem,
)
from fa_verify.strategies._problems import make_problem
from fa_verify.strategies._shapes import Shape
from fa_verify.strategies._variants import DEFAULT_TILE, SOFTCAPS, alibi_slopes, sink_logits, window_sides

LENGTH_PATTERNS = ("ones", "tile_edges", "equal", "one_long", "random", "page_multiples")
QUERY_PATTERNS = ("decode", "speculative", "prefill", "random")
#: Value distributions drawn per batch (fa_verify.strategies.DISTRIBUTIONS).
DISTRIBUTIONS = ("normal", "uniform", "large_logits", "fa3_outliers")


def _lengths(draw, pattern: str, batch: int, tile: int, page_size: int, max_seq: int) -> list:
    small = st.integers(1, min(8, max_seq))
    if pattern == "ones":
        return [1] * batch
    if pattern == "tile_edges":
        return draw(st.lists(st.sampled_from([1, tile - 1, tile, tile + 1]), min_size=batch, max_size=batch))
    if pattern == "equal":
        return [draw(st.integers(1, max_seq))] * batch
    if pattern == "one_long":
        lengths = draw(st.lists(small, min_size=batch, max_size=batch))
        lengths[draw(st.integers(0, batch - 1))] = draw(st.integers(min(tile + 1, max_seq), max_seq))
        return lengths
    if pattern == "page_multiples":
        most = max(max_seq // page_size, 1)
        return [page_size * draw(st.integers(1, most)) for _ in range(batch)]
    return draw(st.lists(st.integers(1, max_seq), min_size=batch, max_size=batch))


def _query_length(draw, pattern: str, nk: int, max_seq: int) -> int:
    if pattern == "decode":
        return 1
    if pattern == "speculative":
        return draw(st.integers(2, 4))
    return nk if pattern == "prefill" else draw(st.integers(1, max_seq))


def _within(limits: Limits, n: int) -> int:
    """n moved to the nearest length the limits allow."""
    allowed = limits.nearest_seq(n)
    if allowed is None:
        raise InvalidArgumentError(f"the declared limits ({limits.describe()}) allow no sequence length")
    return allowed


def _page_sizes(page_sizes, tile: int) -> tuple:
    """Below, equal to and above the tile (and 1), or the declared ones."""
    return tuple(page_sizes) if page_sizes else (1, max(tile // 4, 2), tile, 2 * tile)


@st.composite
def ragged_problems(draw, layout: str, dtypes=DTYPE_NAMES, limits: Limits = Limits(), features: tuple = (),
                    page_sizes: tuple | None = None, splits: bool = False, tile: int = DEFAULT_TILE,
                    max_batch: int = 4, max_seq: int = 2 * DEFAULT_TILE + 1):
    """A `RaggedProblem` in `layout` (see the module's doc): dtypes, per-sequence `limits`,
    variants (`features`, keys of fa_verify.problem.FEATURES) and page sizes a target runs;
    `splits`: whether it honours num_splits; `tile`: its key tile."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout={layout!r}; use one of {LAYOUTS}")
    dtypes = [d for d in dtypes if limits.dtypes is None or d in limits.dtypes]
    dtype = draw(st.sampled_from(dtypes))
    heads, kv_heads = _layout(*draw(st.sampled_from([(2, 2), (4, 2), (4, 1), (1, 1)])),
                              limits.heads or HEAD_LAYOUTS, limits.group_sizes)
    head_dim = draw(st.sampled_from(limits.head_dims or (8, 16, 32)))
    causal = draw(st.sampled_from(limits.causal))
    batch = draw(st.integers(1, max_batch))
    page_size = draw(st.sampled_from(_page_sizes(page_sizes, tile))) if layout == "paged" else 1
    max_seq = max(max_seq, limits.seq_lo)
    seqlens_k = [_within(limits, n) for n in
                 _lengths(draw, draw(st.sampled_from(LENGTH_PATTERNS)), batch, tile, page_size, max_seq)]
    query_pattern = draw(st.sampled_from(QUERY_PATTERNS))
    if limits.equal_seq:
        seqlens_q = list(seqlens_k)
        if layout == "paged":  # equal Nq and Nq = Nk: every sequence has one length
            seqlens_q = seqlens_k = [seqlens_k[0]] * batch
    elif layout == "paged":  # q [B, Nq, H, D]: one Nq for the batch
        seqlens_q = [_within(limits, _query_length(draw, query_pattern, min(seqlens_k), max_seq))] * batch
    else:
        seqlens_q = [_within(limits, _query_length(draw, query_pattern, nk, max_seq)) for nk in seqlens_k]
    distribution = draw(st.sampled_from(DISTRIBUTIONS))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    sequences = [make_problem(distribution, Shape(1, heads, kv_heads, nq, nk, head_dim), dtype, seed + b,
                              causal=causal)
                 for b, (nq, nk) in enumerate(zip(seqlens_q, seqlens_k))]
    sequences = _with_variants(draw, sequences, features, tile)
    pages = None
    if layout == "paged":
        sequences, pages = _paged(draw, sequences, page_size, np.random.default_rng(seed))
    num_splits = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(3, 8))) if splits else 0
    return RaggedProblem(tuple(sequences), layout, pages=pages, num_splits=num_splits,
                         tags=(("distribution", distribution), ("seed", seed)))


def _with_variants(draw, sequences: list, features: tuple, tile: int) -> list:
    """The sequences with a drawn subset of `features` switched on, shared by the batch (ALiBi
    slopes [H], or a row of [B, H] per sequence)."""
    chosen = draw(st.lists(st.sampled_from(features), unique=True, max_size=len(features))) if features else []
    changes = {}
    if "window" in chosen:
        sides = window_sides(max(s.nk for s in sequences), tile)
        changes["window_size"] = draw(st.tuples(sides, sides).filter(lambda w: w != (-1, -1)))
    if "softcap" in chosen:
        changes["softcap"] = draw(st.sampled_from(SOFTCAPS))
    if "sinks" in chosen:
        changes["sinks"] = draw(sink_logits(sequences[0].heads))
    slopes = draw(alibi_slopes(len(sequences), sequences[0].heads)) if "alibi" in chosen else None
    return [s.replace(**changes, **({} if slopes is None else
                                    {"alibi_slopes": slopes[b] if slopes.ndim == 2 else slopes}))
            for b, s in enumerate(sequences)]


def _paged(draw, sequences: list, page_size: int, rng: np.random.Generator):
    """(the sequences, a shuffled PageLayout), where sequences whose first page could hold
    sequence 0's first page may share it (their first page_size keys become sequence 0's)."""
    seqlens = [s.nk for s in sequences]
    layout = PageLayout.contiguous(seqlens, page_size, spare_blocks=draw(st.integers(0, 2)))
    full = [b for b, n in enumerate(seqlens) if b > 0 and n >= page_size and seqlens[0] >= page_size]
    if full and draw(st.booleans()):
        table = layout.block_table.copy()
        first = sequences[0]
        for b in full:
            k, v = sequences[b].k.copy(), sequences[b].v.copy()
            k[:, :, :page_size], v[:, :, :page_size] = first.k[:, :, :page_size], first.v[:, :, :page_size]
            sequences[b] = sequences[b].replace(k=k, v=v)
            table[b, 0] = table[0, 0]
        layout = PageLayout(page_size, table, layout.num_blocks)
    return sequences, layout.shuffled(rng, seqlens)


def batch_signature(problem: RaggedProblem) -> tuple:
    """All of a batch but its values: what makes a compiled ragged target compile again (its
    layout, lengths, heads, D, dtype, options, variants switched on, pages and split count)."""
    first = problem.first
    pages = problem.pages
    return (problem.layout, problem.seqlens_q, problem.seqlens_k, problem.heads, problem.kv_heads,
            problem.head_dim, problem.dtype, problem.causal, first.causal_alignment, first.scale,
            problem.window_size, problem.softcap, problem.features, problem.num_splits,
            None if pages is None else (pages.page_size, pages.num_blocks, pages.max_blocks))


def revalued(problem: RaggedProblem, seed: int) -> RaggedProblem:
    """The same batch (signature, page table, variants) with q, k and v drawn afresh from its
    distribution with `seed`; keys in page slots that sequences share stay shared (the first
    sequence using a slot sets it)."""
    distribution = dict(problem.tags).get("distribution", "normal")
    fresh, slots = [], {}
    for b, seq in enumerate(problem.sequences):
        new = make_problem(distribution, Shape.of(seq), seq.dtype, seed + b, causal=seq.causal,
                           causal_alignment=seq.causal_alignment, scale=seq.scale)
        k, v = new.k.copy(), new.v.copy()
        if problem.pages is not None:
            for j, slot in enumerate(zip(*problem.pages.key_slots(b, seq.nk))):
                first = slots.setdefault(slot, (k[:, :, j].copy(), v[:, :, j].copy()))
                k[:, :, j], v[:, :, j] = first
        fresh.append(seq.replace(q=new.q, k=k, v=v, tags=new.tags))
    return problem.replace(sequences=tuple(fresh), tags=(("distribution", distribution), ("seed", seed)))


#: Cache lengths of paged FP8 batches in the tile-edge share: at and around multiples of 128.
PAGED_FP8_KEYS = TILE_EDGE_KEYS + (383, 384, 385)
#: Share of cache lengths drawn from PAGED_FP8_KEYS (the others: 1 .. 64).
PAGED_FP8_EDGE_SHARE = 0.4
#: Share of batches with per-tensor scales ([1]); the others have [B, Hkv].
PER_TENSOR_KV_SHARE = 0.5
#: Page sizes drawn for a target that declares none (FlashAttention's paged KV takes multiples of 16).
PAGED_FP8_PAGE_SIZES = (16, 64, 128, 256)


def make_paged_fp8_problem(seqlens_k, nq: int, fmt: str, seed: int, *, heads: tuple = (2, 1), head_dim: int = 16,
                           page_size: int = 64, per_tensor: bool = False, num_splits: int = 0,
                           **fp8_options) -> RaggedProblem:
    """A paged batch of FP8 sequences (`make_fp8_problem`'s, sequence b with seed + b; `fp8_options`
    are its options), in a shuffled page table; scales per tensor (sequence 0's for all) or
    [B, Hkv] (each sequence's own row, distinct across the batch)."""
    H, Hkv = heads
    rng = np.random.default_rng(seed)
    sequences = [make_fp8_problem((1, H, Hkv, nq, nk, head_dim), fmt, seed + b, per_tensor=per_tensor,
                                  **fp8_options) for b, nk in enumerate(seqlens_k)]
    if per_tensor:
        first = sequences[0]
        sequences = [seq.replace(**{name: getattr(first, name) for name in DESCALES}) for seq in sequences]
    else:
        batch = _distinct(rng, [np.concatenate([getattr(seq, name) for seq in sequences]) for name in DESCALES])
        sequences = [seq.replace(**{name: x[b:b + 1] for name, x in zip(DESCALES, batch)})
                     for b, seq in enumerate(sequences)]
    pages = PageLayout.contiguous(seqlens_k, page_size).shuffled(rng, seqlens_k)
    tags = (("fp8", fmt), ("per_tensor", per_tensor), *(t for t in sequences[0].tags if t[0] not in ("fp8", "per_tensor")))
    return RaggedProblem(tuple(sequences), "paged", pages=pages, num_splits=num_splits, tags=tags)


@st.composite
def paged_fp8_problems(draw, formats=FP8_DTYPES, causal=(False, True), page_sizes: tuple | None = None,
                       splits: bool = False, max_batch: int = 3, max_nq: int = 4, head_dims: tuple = (8, 16, 32)):
    """Paged batches of FP8 sequences in `formats` (see the module's doc); `page_sizes`, `splits`
    and `head_dims` as a target declares them (`ragged_problems`)."""
    fmt = draw(st.sampled_from(formats))
    H, Hkv = draw(st.sampled_from([(2, 1), (4, 2), (2, 2), (1, 1)]))
    head_dim = draw(st.sampled_from(tuple(head_dims)))
    batch = draw(st.integers(1, max_batch))
    page_size = draw(st.sampled_from(tuple(page_sizes) if page_sizes else PAGED_FP8_PAGE_SIZES))
    seqlens_k = [draw(st.sampled_from(PAGED_FP8_KEYS)) if _in_share(draw, PAGED_FP8_EDGE_SHARE)
                 else draw(st.integers(1, 64)) for _ in range(batch)]
    nq = draw(st.integers(1, max_nq))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    problem = make_paged_fp8_problem(
        seqlens_k, nq, fmt, seed, heads=(H, Hkv), head_dim=head_dim, page_size=page_size,
        per_tensor=_in_share(draw, PER_TENSOR_KV_SHARE), causal=draw(st.sampled_from(causal)),
        spread=draw(st.sampled_from(tuple(VALUE_SPREADS))), logit_spread=draw(st.sampled_from(LOGIT_SPREADS)),
        offset_gap=draw(st.sampled_from(OFFSET_GAPS)) if _in_share(draw, OFFSET_SHARE) else None,
        num_splits=draw(st.sampled_from([0, 1, 2, 3])) if splits else 0)
    sequences, pages = _paged(draw, list(problem.sequences), page_size, np.random.default_rng(seed))
    return problem.replace(sequences=tuple(sequences), pages=pages)
