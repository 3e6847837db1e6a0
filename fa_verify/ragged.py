"""Ragged batches: varlen (packed sequences) and paged KV, flash-attn 2's conventions.

A `RaggedProblem` is B sequences of different lengths, each exactly a dense `AttentionProblem`
with B = 1 (its own Nq_b and Nk_b): causal, window and ALiBi use each sequence's own diagonal
offset Nk_b - Nq_b (bottom-right), so the oracle, the error model and the verdict run per
sequence with the dense code. The sequences share H, Hkv, D, the dtype and every option; ALiBi
slopes may differ per sequence (a batch's [B, H] slopes, row b for sequence b).

Layouts (flash-attn 2's `flash_attn_varlen_func` and `flash_attn_with_kvcache`):
- "varlen": q [total_q, H, D], k and v [total_k, Hkv, D]; sequence b holds rows
  cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of q (likewise k, v with cu_seqlens_k); cu_seqlens_*
  are int32 [B+1], starting at 0, non-decreasing, ending at the total. Output [total_q, H, D],
  LSE [H, total_q].
- "paged": q [B, Nq, H, D] (every sequence has the same Nq); k_cache and v_cache
  [num_blocks, page_size, Hkv, D]; key j of sequence b is slot j % page_size of page
  block_table[b, j // page_size] (block_table int32 [B, max_blocks]); sequence b has
  cache_seqlens[b] keys (int32 [B]). Table entries past a sequence's last page are never read
  and may hold anything; pages may be shared by sequences (their keys must then agree). Output
  [B, Nq, H, D], LSE [B, H, Nq].
LSE: natural log, float32. Empty sequences (Nq_b or Nk_b = 0) are not supported.

FP8 KV cache (the kind "paged-fp8"): the sequences of a paged batch may instead be FP8 problems
(`fa_verify.fp8.FP8Problem` with B = 1: FlashAttention-3's convention, q, k_cache and v_cache
stored in e4m3 or e5m2 and true value = stored x scale), each judged by the FP8 oracle, error
model and ensemble as a dense FP8 problem is. The batch's scales are float32 of shape [1] (per
tensor, as FP8 KV caches carry them) or [B, Hkv] (FlashAttention-3's descales), passed by the
paged protocol's names `q_descale`, `k_scale`, `v_scale` (`PAGED_SCALES`); sequence b's
descales are the [1] values or row b. Pages shared by sequences share stored values; with
[B, Hkv] scales their true values may differ per sequence, as in a real cache.
`num_splits` is the split-KV count asked of a kernel (0: the kernel's own choice).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fa_verify.dtypes import FP8_DTYPES, dtype_name, numpy_dtype
from fa_verify.errors import InvalidArgumentError, InvalidProblemError
from fa_verify.fp8 import DESCALES, FP8Problem, checked_descale
from fa_verify.outputs import attention_outputs
from fa_verify.problem import FEATURES, FINITE_ATTENTION, AttentionProblem

LAYOUTS = ("varlen", "paged")
#: Options every sequence must share (alibi_slopes may differ: a [B, H] batch's rows).
SHARED_OPTIONS = ("causal", "causal_alignment", "scale", "window_size", "softcap")
#: The problem types a batch's sequences may be, by their kind (all of one type per batch).
PART_TYPES = {"dense": AttentionProblem, "fp8": FP8Problem}
#: The descales of FP8 sequences, by the paged protocol's keyword for the batch's array.
PAGED_SCALES = dict(zip(DESCALES, ("q_descale", "k_scale", "v_scale")))



def _shared(name: str) -> property:
    """A property of the batch that every sequence has alike: the first sequence's `name`."""
    return property(lambda self: getattr(self.first, name), doc=f"The sequences' {name} (equal in all).")


@dataclass(frozen=True, eq=False)
class PageLayout:
    """Where a paged KV cache keeps each sequence's keys (see the module's doc)."""

    #: keys per page
    page_size: int
    #: int32 [B, max_blocks]: the page holding each sequence's keys page_size*p .. page_size*(p+1) - 1
    block_table: np.ndarray
    #: pages in the cache
    num_blocks: int

    def __post_init__(self):
        for name in ("page_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
                raise InvalidProblemError(f"{name}={value!r} must be an integer >= 1")
            object.__setattr__(self, name, int(value))
        table = np.asarray(self.block_table)
        if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
            raise InvalidProblemError(
                f"block_table must be an integer array [B, max_blocks], got dtype={table.dtype} "
                f"shape={list(table.shape)}; pass e.g. np.int32 page indices, one row per sequence")
        if table.size and (table.min() < np.iinfo(np.int32).min or table.max() > np.iinfo(np.int32).max):
            raise InvalidProblemError("block_table holds values that do not fit int32")
        object.__setattr__(self, "block_table", table.astype(np.int32))

    @property
    def max_blocks(self) -> int:
        return self.block_table.shape[1]

    @property
    def capacity(self) -> int:
        """Keys a table row can address: max_blocks * page_size."""
        return self.max_blocks * self.page_size

    def key_slots(self, b: int, nk: int) -> tuple[np.ndarray, np.ndarray]:
        """(page, slot) of keys 0 .. nk-1 of sequence b, int64 [nk] each."""
        j = np.arange(nk)
        return self.block_table[b, j // self.page_size].astype(np.int64), j % self.page_size

    @classmethod
    def contiguous(cls, seqlens_k, page_size: int, spare_blocks: int = 0) -> "PageLayout":
        """Sequence after sequence in page order, each from a fresh page; unused table entries 0."""
        pages = [-(-int(n) // page_size) for n in seqlens_k]
        table = np.zeros((len(pages), max(pages)), dtype=np.int32)
        start = 0
        for b, n in enumerate(pages):
            table[b, :n] = np.arange(start, start + n)
            start += n
        return cls(page_size, table, start + spare_blocks)

    def shuffled(self, rng: np.random.Generator, seqlens_k) -> "PageLayout":
        """The same sharing of pages under a random permutation of the cache's pages, and random
        in-range entries past each sequence's last page (which no kernel may read)."""
        permutation = rng.permutation(self.num_blocks).astype(np.int32)
        noise = rng.integers(0, self.num_blocks, size=self.block_table.shape, dtype=np.int32)
        return PageLayout(self.page_size, np.where(self.used_entries(seqlens_k), permutation[self.block_table], noise),
                          self.num_blocks)

    def used_entries(self, seqlens_k) -> np.ndarray:
        """Boolean [B, max_blocks]: the table entries sequences of these lengths read."""
        used = -(-np.asarray(seqlens_k, dtype=np.int64) // self.page_size)
        return np.arange(self.max_blocks)[None, :] < used[:, None]


@dataclass(frozen=True, eq=False)
class RaggedProblem:
    """B sequences of different lengths in one layout (see the module's doc)."""

    #: the sequences, each an AttentionProblem (or, paged, each an FP8Problem) with batch 1
    sequences: tuple
    #: "varlen" or "paged"
    layout: str
    #: required for "paged": where the cache keeps each sequence's keys
    pages: PageLayout | None = None
    #: split-KV count asked of the kernel; 0 = the kernel's own choice
    num_splits: int = 0
    tags: tuple = ()
    #: what a paged cache's slots that no sequence uses hold (NaN: a kernel reading them shows it)
    cache_fill: float = float("nan")

    def __post_init__(self):
        sequences = tuple(self.sequences)
        object.__setattr__(self, "sequences", sequences)
        if not sequences:
            raise InvalidProblemError("a ragged problem needs at least one sequence")
        part_type = type(sequences[0]) if type(sequences[0]) in PART_TYPES.values() else AttentionProblem
        for b, seq in enumerate(sequences):
            if type(seq) is not part_type or seq.batch != 1:
                raise InvalidProblemError(
                    f"sequence {b} must be an {part_type.__name__} with batch 1 (all sequences of one type: "
                    f"{' or '.join(t.__name__ for t in PART_TYPES.values())}), got "
                    f"{seq.describe() if isinstance(seq, tuple(PART_TYPES.values())) else type(seq).__name__}")
        _check_shared(sequences)
        if self.layout not in LAYOUTS:
            raise InvalidProblemError(f"layout={self.layout!r}; use one of {LAYOUTS}")
        if part_type is FP8Problem and self.layout != "paged":
            raise InvalidProblemError(
                "FP8 sequences are supported in the paged layout (an FP8 KV cache, flash_attn_with_kvcache's "
                "q_descale / k_scale / v_scale); pass layout='paged' with pages=PageLayout(...)")
        n = self.num_splits
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n < 0:
            raise InvalidProblemError(f"num_splits={n!r} must be an integer >= 0 (0: the kernel's own choice)")
        object.__setattr__(self, "num_splits", int(n))
        if self.layout == "varlen":
            if self.pages is not None:
                raise InvalidProblemError("pages is for layout='paged'; a varlen problem has no page table")
            return
        if not isinstance(self.pages, PageLayout):
            raise InvalidProblemError("layout='paged' needs pages=PageLayout(page_size, block_table, num_blocks)")
        if len({seq.nq for seq in sequences}) > 1:
            raise InvalidProblemError(
                f"paged KV takes q [B, Nq, H, D]: every sequence needs the same Nq, got "
                f"{[seq.nq for seq in sequences]}; use layout='varlen' for ragged queries")
        _check_pages(self.pages, self.seqlens_k)
        self._cache  # keys that two table entries share must agree

    # --- construction from a kernel's inputs -----------------------------------------------
    @classmethod
    def from_varlen(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                    alibi_slopes=None, num_splits: int = 0, tags: tuple = (), **options) -> "RaggedProblem":
        """From flash_attn_varlen_func's inputs; `options` are AttentionProblem's (causal, scale,
        window_size, softcap, sinks, causal_alignment); alibi_slopes [H] or [B, H]."""
        q, k, v = (_array(name, x, 3, "[total, heads, D]") for name, x in (("q", q), ("k", k), ("v", v)))
        cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        if len(cu_q) != len(cu_k):
            raise InvalidProblemError(
                f"cu_seqlens_q has {len(cu_q)} entries and cu_seqlens_k {len(cu_k)}: both must be [B+1]")
        if v.shape[:2] != k.shape[:2]:
            raise InvalidProblemError(
                f"k.shape={k.shape!r} and v.shape={v.shape!r} must agree on [total, Hkv] (v's last dim, D_v, may "
                "differ from k's)")
        _check_nonempty(np.diff(cu_q), np.diff(cu_k), "cu_seqlens_q / cu_seqlens_k")
        for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
            longest = int(np.diff(cu).max())
            if given is not None and int(given) < longest:
                raise InvalidProblemError(
                    f"{name}={given!r} is below the longest sequence ({longest}); pass at least {longest}")
        slopes = _per_sequence_slopes(alibi_slopes, len(cu_q) - 1)
        sequences = tuple(
            AttentionProblem(*(_dense(x[lo:hi]) for x, (lo, hi) in
                               ((q, cu_q[b:b + 2]), (k, cu_k[b:b + 2]), (v, cu_k[b:b + 2]))),
                             alibi_slopes=slopes[b], **options)
            for b in range(len(cu_q) - 1))
        return cls(sequences, "varlen", num_splits=num_splits, tags=tags)

    @classmethod
    def from_paged(cls, q, k_cache, v_cache, block_table, cache_seqlens, alibi_slopes=None,
                   num_splits: int = 0, tags: tuple = (), q_descale=None, k_scale=None, v_scale=None,
                   **options) -> "RaggedProblem":
        """From flash_attn_with_kvcache's inputs (see from_varlen for `options`). An FP8 cache
        (q, k_cache, v_cache in e4m3 or e5m2) takes its scales, float32 [1] or [B, Hkv] (None: 1),
        and FP8Problem's options (causal, causal_alignment, scale, output_dtype)."""
        q = _array("q", q, 4, "[B, Nq, H, D]")
        k_cache, v_cache = (_array(name, x, 4, "[num_blocks, page_size, Hkv, D]")
                            for name, x in (("k_cache", k_cache), ("v_cache", v_cache)))
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise InvalidProblemError(
                f"k_cache.shape={k_cache.shape!r} and v_cache.shape={v_cache.shape!r} must agree on [num_blocks, "
                "page_size, Hkv] (v_cache's last dim, D_v, may differ from k_cache's)")
        pages = PageLayout(k_cache.shape[1], block_table, k_cache.shape[0])
        B = q.shape[0]
        seqlens = np.asarray(cache_seqlens)
        if seqlens.shape != (B,) or not np.issubdtype(seqlens.dtype, np.integer):
            raise InvalidProblemError(
                f"cache_seqlens must be an integer array [B] = [{B}], got dtype={seqlens.dtype} "
                f"shape={list(seqlens.shape)}")
        if pages.block_table.shape[0] != B:
            raise InvalidProblemError(
                f"block_table has {pages.block_table.shape[0]} rows for B={B} sequences: it must be [B, max_blocks]")
        _check_nonempty(np.full(B, q.shape[1]), seqlens, "q's Nq / cache_seqlens")
        _check_pages(pages, seqlens)
        slopes = _per_sequence_slopes(alibi_slopes, B)
        scales = _batch_scales(dtype_name(k_cache.dtype), B, k_cache.shape[2], q_descale=q_descale, k_scale=k_scale,
                               v_scale=v_scale)
        if scales and alibi_slopes is not None:
            raise InvalidProblemError("alibi_slopes: FP8 sequences have no variants (FlashAttention-3's FP8 kernel)")
        sequences = []
        for b in range(B):
            page, slot = pages.key_slots(b, int(seqlens[b]))
            q_b, k_b, v_b = _dense(q[b]), _dense(k_cache[page, slot]), _dense(v_cache[page, slot])
            if scales:
                sequences.append(FP8Problem(q_b, k_b, v_b, **sequence_scales(scales, b), **options))
            else:
                sequences.append(AttentionProblem(q_b, k_b, v_b, alibi_slopes=slopes[b], **options))
        return cls(tuple(sequences), "paged", pages=pages, num_splits=num_splits, tags=tags)

    # --- the layout's inputs ---------------------------------------------------------------
    def varlen_inputs(self) -> dict:
        """q [total_q, H, D], k [total_k, Hkv, D], v [total_k, Hkv, D_v] (problem dtype), cu_seqlens_q, cu_seqlens_k
        (int32 [B+1]), max_seqlen_q, max_seqlen_k (ints)."""
        return {"q": np.concatenate([_packed(s.q) for s in self.sequences]),
                "k": np.concatenate([_packed(s.k) for s in self.sequences]),
                "v": np.concatenate([_packed(s.v) for s in self.sequences]),
                "cu_seqlens_q": self.cu_seqlens_q, "cu_seqlens_k": self.cu_seqlens_k,
                "max_seqlen_q": self.max_seqlen_q, "max_seqlen_k": self.max_seqlen_k}

    def paged_inputs(self, fill=None) -> dict:
        """q [B, Nq, H, D], k_cache [num_blocks, page_size, Hkv, D], v_cache [.., D_v] (slots no sequence
        uses hold `fill`), block_table int32 [B, max_blocks], cache_seqlens int32 [B]."""
        self._require("paged")
        fill = self.cache_fill if fill is None else fill
        k_cache, v_cache, used = self._cache
        dtype = numpy_dtype(self.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            fill_value = np.asarray(fill, dtype=np.float64).astype(dtype)
        k_cache, v_cache = (np.where(used[..., None, None], x, fill_value) for x in (k_cache, v_cache))
        return {"q": np.stack([_packed(s.q) for s in self.sequences]), "k_cache": k_cache, "v_cache": v_cache,
                "block_table": self.pages.block_table.copy(), "cache_seqlens": np.asarray(self.seqlens_k, np.int32),
                **self.scales()}

    def scales(self) -> dict:
        """An FP8 batch's scales by the paged protocol's names (`PAGED_SCALES`), float32: [1] when
        every sequence has the same per-tensor value, else [B, Hkv]; {} for other sequences."""
        if self.first.kind != "fp8":
            return {}
        found = {}
        for name, keyword in PAGED_SCALES.items():
            per_sequence = [getattr(seq, name) for seq in self.sequences]
            if all(x.shape == (1,) and x[0] == per_sequence[0][0] for x in per_sequence):
                found[keyword] = per_sequence[0].copy()
            else:
                found[keyword] = np.concatenate([seq.descale(name) for seq in self.sequences]).astype(np.float32)
        return found

    def with_scales(self, **scales) -> "RaggedProblem":
        """The batch with some of its scales (paged keywords: q_descale, k_scale, v_scale; [1] or
        [B, Hkv]) replaced, sliced per sequence."""
        unknown = set(scales) - set(PAGED_SCALES.values())
        if self.first.kind != "fp8" or unknown:
            raise InvalidArgumentError(f"with_scales takes {', '.join(PAGED_SCALES.values())} of an FP8 batch, got "
                                       f"{', '.join(sorted(scales))} for a {self.kind} problem")
        checked = {name: checked_descale(name, x, self.batch, self.kv_heads) for name, x in scales.items()}
        return self.replace(sequences=tuple(seq.replace(**sequence_scales(checked, b))
                                            for b, seq in enumerate(self.sequences)))

    def inputs(self) -> dict:
        """The layout's inputs (paged: unused cache slots hold `cache_fill`), the same arrays on
        every call: `Backend.run` checks that a target leaves them unchanged."""
        return self._inputs

    @cached_property
    def _inputs(self) -> dict:
        return self.paged_inputs() if self.layout == "paged" else self.varlen_inputs()

    # --- saved to disk (reproducers) ----------------------------------------------------------
    def saved(self) -> tuple[dict, dict]:
        """(parameters, arrays) that `from_saved` rebuilds it from: each sequence's, the layout,
        split count and page table."""
        parameters = {"layout": self.layout, "num_splits": self.num_splits, "part_kind": self.first.kind,
                      "tags": [list(t) for t in self.tags], "sequences": []}
        arrays = {}
        for b, seq in enumerate(self.sequences):
            seq_parameters, seq_arrays = seq.saved(prefix=f"s{b}_")
            parameters["sequences"].append(seq_parameters)
            arrays.update(seq_arrays)
        if self.pages is not None:
            parameters["pages"] = {"page_size": self.pages.page_size, "num_blocks": self.pages.num_blocks}
            arrays["block_table"] = self.pages.block_table
        return parameters, arrays

    @classmethod
    def from_saved(cls, parameters: dict, arrays) -> "RaggedProblem":
        part_type = PART_TYPES[parameters.get("part_kind", "dense")]
        sequences = tuple(part_type.from_saved(seq, arrays, f"s{b}_")
                          for b, seq in enumerate(parameters["sequences"]))
        pages = (PageLayout(block_table=arrays["block_table"], **parameters["pages"])
                 if "pages" in parameters else None)
        return cls(sequences, parameters["layout"], pages=pages, num_splits=parameters["num_splits"],
                   tags=tuple(tuple(t) for t in parameters["tags"]))

    # --- the kind protocol (fa_verify.kinds) --------------------------------------------------
    finite_because = FINITE_ATTENTION

    @property
    def kind(self) -> str:
        """The layout ("varlen", "paged"), or "paged-fp8" for a batch of FP8 sequences."""
        return self.layout if self.first.kind == "dense" else f"{self.layout}-{self.first.kind}"

    def outputs(self, precision) -> tuple:
        """What a run returns (`fa_verify.outputs`): out (in the sequences' output dtype) and the
        LSE (optional), in the layout's shapes."""
        return attention_outputs(self, precision.replace(output=self.first.outputs(precision)[0].dtype))

    @property
    def out_label(self) -> str:
        return "[total_q,H,D]" if self.layout == "varlen" else "[B,Nq,H,D]"

    @property
    def lse_label(self) -> str:
        return "[H,total_q]" if self.layout == "varlen" else "[B,H,Nq]"

    def parts(self) -> tuple:
        """The sequences, each judged as the dense problem it is."""
        return self.sequences

    def map_parts(self, change) -> "RaggedProblem":
        return self.replace(sequences=tuple(change(seq) for seq in self.sequences))

    def part_label(self, b: int) -> str:
        """Sequence b, its lengths and where its rows are in the layout."""
        seq = self.sequences[b]
        rows = (f"rows {self.cu_seqlens_q[b]}..{self.cu_seqlens_q[b + 1] - 1} of the varlen output"
                if self.layout == "varlen" else f"q[{b}]")
        return f"sequence {b} of {self.batch} (Nq={seq.nq}, Nk={seq.nk}; {rows})"

    def input_arrays(self) -> dict:
        return {name: x for name, x in self.inputs().items() if isinstance(x, np.ndarray)}

    def unsupported_by(self, backend) -> str | None:
        """Why `backend` cannot run this batch beyond its dtypes and kinds: page sizes, splits,
        each sequence's variants and limits; None when it can."""
        if self.pages is not None and backend.page_sizes is not None and self.pages.page_size not in backend.page_sizes:
            return (f"{backend.name} does not run page_size={self.pages.page_size} (it runs "
                    f"{', '.join(map(str, backend.page_sizes))}; declared by --page-sizes)")
        if self.num_splits > 1 and not backend.splits:
            return f"{backend.name} does not split the keys (num_splits={self.num_splits}); it is no split-KV kernel"
        for b, seq in enumerate(self.sequences):
            reason = seq.unsupported_by(backend)
            if reason:
                return f"sequence {b}: {reason}"
        return None

    @cached_property
    def _cache(self):
        """(k_cache, v_cache, used [num_blocks, page_size]) with every sequence's keys scattered
        into its pages; raises if a slot that two keys share (a shared page) gets different keys."""
        shape = (self.pages.num_blocks, self.pages.page_size, self.kv_heads)
        dtype = numpy_dtype(self.dtype)
        k_cache, v_cache = np.zeros(shape + (self.head_dim,), dtype), np.zeros(shape + (self.head_dim_v,), dtype)
        used = np.zeros(shape[:2], dtype=bool)
        slots = [self.pages.key_slots(b, seq.nk) for b, seq in enumerate(self.sequences)]
        for seq, (page, slot) in zip(self.sequences, slots):
            k_cache[page, slot], v_cache[page, slot] = _packed(seq.k), _packed(seq.v)
            used[page, slot] = True
        for b, (seq, (page, slot)) in enumerate(zip(self.sequences, slots)):
            lost = ~((k_cache[page, slot] == _packed(seq.k)).all(axis=(1, 2))
                     & (v_cache[page, slot] == _packed(seq.v)).all(axis=(1, 2)))
            if lost.any():
                j = int(np.argmax(lost))
                raise InvalidProblemError(
                    f"block_table puts key {j} of sequence {b} in page {page[j]} slot {slot[j]}, which another "
                    "key with different values shares; pages shared by sequences must hold the same keys for each")
        return k_cache, v_cache, used

    # --- outputs ---------------------------------------------------------------------------
    @property
    def out_shape(self) -> tuple:
        H, D = self.heads, self.head_dim_v
        return (sum(self.seqlens_q), H, D) if self.layout == "varlen" else (self.batch, self.max_seqlen_q, H, D)

    @property
    def lse_shape(self) -> tuple:
        return (self.heads, sum(self.seqlens_q)) if self.layout == "varlen" else (self.batch, self.heads, self.max_seqlen_q)

    def split(self, out, lse=None) -> list:
        """Per sequence (out [1, H, Nq_b, D], lse [1, H, Nq_b] or None), from the layout's shapes."""
        for name, x, shape in (("out", out, self.out_shape), ("lse", lse, self.lse_shape)):
            if x is not None and np.shape(x) != shape:
                raise InvalidArgumentError(
                    f"{name}.shape={np.shape(x)} is not the {self.layout} layout's {shape} for {self.describe()}")
        if self.layout == "paged":
            return [(out[b:b + 1].transpose(0, 2, 1, 3), None if lse is None else lse[b:b + 1])
                    for b in range(self.batch)]
        cu = self.cu_seqlens_q
        return [(out[lo:hi].transpose(1, 0, 2)[None], None if lse is None else lse[None, :, lo:hi])
                for lo, hi in zip(cu[:-1], cu[1:])]

    def join(self, per_sequence) -> tuple:
        """The layout's (out, lse) from per-sequence (out [1,H,Nq_b,D], lse [1,H,Nq_b] or None);
        lse is None if any sequence's is."""
        outs, lses = zip(*per_sequence)
        if self.layout == "paged":
            out = np.concatenate([o.transpose(0, 2, 1, 3) for o in outs])
            lse = None if any(x is None for x in lses) else np.concatenate(lses)
        else:
            out = np.concatenate([o[0].transpose(1, 0, 2) for o in outs])
            lse = None if any(x is None for x in lses) else np.concatenate([x[0] for x in lses], axis=1)
        return out, lse

    def row_owner(self, row: int) -> tuple[int, int]:
        """(sequence, its row) of a varlen output row, or of a paged one's (b, i) flattened b*Nq + i."""
        if self.layout == "paged":
            return divmod(int(row), self.max_seqlen_q)
        b = int(np.searchsorted(self.cu_seqlens_q, row, side="right")) - 1
        return b, int(row) - int(self.cu_seqlens_q[b])

    def unwritten_rows(self, out: np.ndarray) -> list[tuple[int, int]]:
        """(sequence, row) of every output row that still holds the unwritten-output sentinel
        (`buffers.SENTINEL_BITS`) somewhere: rows a target given `buffers.output_buffers`
        never wrote."""
        from fa_verify.backends.buffers import SENTINEL_BITS  # here: the problem model needs no backend code

        bits = out.view({2: np.uint16, 4: np.uint32}[out.dtype.itemsize])
        rows = (bits == SENTINEL_BITS[out.dtype.itemsize]).reshape(-1, self.heads * self.head_dim_v).any(axis=1)
        return [self.row_owner(r) for r in np.flatnonzero(rows)]

    # --- variations ------------------------------------------------------------------------
    def replace(self, **changes) -> "RaggedProblem":
        return dataclasses.replace(self, **changes)

    def as_varlen(self) -> "RaggedProblem":
        return self.replace(layout="varlen", pages=None)

    def as_paged(self, pages: PageLayout) -> "RaggedProblem":
        return self.replace(layout="paged", pages=pages)

    # --- derived ---------------------------------------------------------------------------
    def _require(self, layout: str) -> None:
        if self.layout != layout:
            raise InvalidArgumentError(f"this is a {self.layout} problem; as_{layout}() converts it")

    @property
    def batch(self) -> int:
        return len(self.sequences)

    @property
    def first(self):
        """Sequence 0 (an AttentionProblem, or an FP8Problem)."""
        return self.sequences[0]

    # What every sequence shares (checked at construction), read from the first.
    heads = _shared('heads')
    kv_heads = _shared('kv_heads')
    head_dim = _shared('head_dim')
    head_dim_v = _shared('head_dim_v')
    dtype = _shared('dtype')
    causal = _shared('causal')
    scale = _shared('scale')
    window_size = _shared('window_size')
    softcap = _shared('softcap')
    sinks = _shared('sinks')

    @property
    def alibi_slopes(self) -> np.ndarray | None:
        """[H] when every sequence has the same slopes, else [B, H]; None without ALiBi."""
        slopes = [s.alibi_slopes for s in self.sequences]
        if slopes[0] is None:
            return None
        if all(np.array_equal(x, slopes[0]) for x in slopes):
            return slopes[0]
        return np.stack(slopes)

    @property
    def options(self) -> dict:
        """The options as from_varlen / from_paged take them."""
        return {"causal": self.causal, "causal_alignment": self.first.causal_alignment, "scale": self.scale,
                "window_size": self.window_size, "softcap": self.softcap, "sinks": self.sinks,
                "alibi_slopes": self.alibi_slopes}

    @property
    def features(self) -> tuple:
        return tuple(f for f in FEATURES if any(f in s.features for s in self.sequences))

    @property
    def seqlens_q(self) -> tuple:
        return tuple(s.nq for s in self.sequences)

    @property
    def seqlens_k(self) -> tuple:
        return tuple(s.nk for s in self.sequences)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k)

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seqlens_q)]).astype(np.int32)

    @property
    def cu_seqlens_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seqlens_k)]).astype(np.int32)

    def __repr__(self) -> str:  # short: Hypothesis prints failing examples, the arrays are in the tags' seed
        return f"<RaggedProblem {self.describe()} tags={dict(self.tags)}>"

    def describe(self) -> str:
        """One line: layout, lengths, pages, splits and the shared options."""
        dense = self.first.describe().split(" descales ")[0]  # an FP8 sequence's descales: the batch's below
        shared = dense[dense.index(" H="):].replace(f" Nq={self.first.nq} Nk={self.first.nk}", "")
        shared += "".join(f" {name}{list(x.shape)}" for name, x in self.scales().items())
        lengths = f"seqlens_q={list(self.seqlens_q)} seqlens_k={list(self.seqlens_k)}"
        pages = (f" page_size={self.pages.page_size} num_blocks={self.pages.num_blocks}"
                 f" max_blocks={self.pages.max_blocks}" if self.pages else "")
        return (f"{self.layout} B={self.batch}{shared} {lengths}{pages}"
                + (f" num_splits={self.num_splits}" if self.num_splits else ""))


def _check_shared(sequences) -> None:
    first = sequences[0]
    for b, seq in enumerate(sequences[1:], 1):
        differs = [f"{name} {a} vs {c}" for name, a, c in (
            ("H", first.heads, seq.heads), ("Hkv", first.kv_heads, seq.kv_heads),
            ("D", first.head_dim, seq.head_dim), ("D_v", first.head_dim_v, seq.head_dim_v), ("dtype", first.dtype, seq.dtype))
            if a != c]
        differs += [f"{name} {getattr(first, name)!r} vs {getattr(seq, name)!r}"
                    for name in SHARED_OPTIONS + ("output_dtype",)
                    if getattr(first, name, None) != getattr(seq, name, None)]
        if not _same_optional(first.sinks, seq.sinks):
            differs.append("sinks")
        if (first.alibi_slopes is None) != (seq.alibi_slopes is None):
            differs.append("alibi_slopes (given for one, not the other)")
        if differs:
            raise InvalidProblemError(
                f"sequence {b} disagrees with sequence 0 on {', '.join(differs)}; the sequences of a "
                "batch share H, Hkv, D, the dtype and the options (only ALiBi slopes may differ)")


def _batch_scales(dtype: str, batch: int, kv_heads: int, **scales) -> dict:
    """A paged cache's scales (`PAGED_SCALES`' keywords) checked under their own names, float32
    [1] or [B, Hkv] (None: 1); {} for a cache that is not FP8 (which must be given none)."""
    given = [name for name, x in scales.items() if x is not None]
    if dtype not in FP8_DTYPES:
        if given:
            raise InvalidProblemError(
                f"{given[0]} is for an FP8 cache (k_cache and v_cache in {' or '.join(FP8_DTYPES)}), but k_cache is "
                f"{dtype}; leave it out, or store the cache in FP8")
        return {}
    return {name: checked_descale(name, np.ones(1, np.float32) if x is None else x, batch, kv_heads)
            for name, x in scales.items()}


def sequence_scales(scales: dict, b: int) -> dict:
    """Sequence b's descales (FP8Problem's names) from the batch's scales (paged keywords)."""
    return {name: scales[keyword] if scales[keyword].shape == (1,) else scales[keyword][b:b + 1]
            for name, keyword in PAGED_SCALES.items() if keyword in scales}


def _same_optional(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def _check_nonempty(seqlens_q, seqlens_k, source: str) -> None:
    for name, lengths in (("Nq", seqlens_q), ("Nk", seqlens_k)):
        empty = np.flatnonzero(np.asarray(lengths) <= 0)
        if empty.size:
            raise InvalidProblemError(
                f"sequence {int(empty[0])} has {name} = 0 (from {source}): empty sequences are not "
                "supported; leave them out of the batch")


def _check_pages(pages: PageLayout, seqlens_k) -> None:
    """Every sequence fits its table row, and every page it uses is in the cache."""
    seqlens = np.asarray(seqlens_k, dtype=np.int64)
    if pages.block_table.shape[0] != len(seqlens):
        raise InvalidProblemError(
            f"block_table has {pages.block_table.shape[0]} rows for {len(seqlens)} sequences: it must be [B, max_blocks]")
    over = np.flatnonzero(seqlens > pages.capacity)
    if over.size:
        b = int(over[0])
        raise InvalidProblemError(
            f"cache_seqlens[{b}]={int(seqlens[b])} is beyond the block table's capacity max_blocks*page_size = "
            f"{pages.max_blocks}*{pages.page_size} = {pages.capacity}; widen block_table or shorten the sequence")
    table = pages.block_table
    used = pages.used_entries(seqlens)
    bad = used & ((table < 0) | (table >= pages.num_blocks))
    if bad.any():
        b, p = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidProblemError(
            f"block_table[{b}, {p}]={int(table[b, p])} points past the cache's num_blocks={pages.num_blocks} "
            f"pages (valid: 0 .. {pages.num_blocks - 1}); sequence {b} uses that page for its keys "
            f"{p * pages.page_size} .. {min((p + 1) * pages.page_size, int(seqlens[b])) - 1}")


def _cu_seqlens(name: str, cu, total: int) -> np.ndarray:
    cu = np.asarray(cu)
    if cu.ndim != 1 or len(cu) < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise InvalidProblemError(
            f"{name} must be an integer array [B+1] with B >= 1, got dtype={cu.dtype} shape={list(cu.shape)}")
    if cu[0] != 0:
        raise InvalidProblemError(f"{name}[0]={int(cu[0])} must be 0: sequence 0 starts at row 0")
    steps = np.diff(cu.astype(np.int64))
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise InvalidProblemError(
            f"{name} must be non-decreasing (cumulative sequence lengths), but {name}[{b + 1}]={int(cu[b + 1])} "
            f"< {name}[{b}]={int(cu[b])}")
    if cu[-1] != total:
        raise InvalidProblemError(
            f"{name}[-1]={int(cu[-1])} must be the number of packed rows, {total}; the last sequence ends there")
    return cu.astype(np.int64)


def _per_sequence_slopes(alibi_slopes, batch: int) -> list:
    """alibi_slopes [H] (shared) or [B, H] as a list of B per-sequence [H] (or None)."""
    if alibi_slopes is None:
        return [None] * batch
    slopes = np.asarray(alibi_slopes)
    if slopes.ndim == 2:
        if slopes.shape[0] != batch:
            raise InvalidProblemError(
                f"alibi_slopes.shape={list(slopes.shape)} must be [H] or [B, H] with B={batch}")
        return list(slopes)
    return [slopes] * batch


def _array(name: str, x, ndim: int, spelled: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != ndim:
        raise InvalidProblemError(
            f"{name} must be a numpy array {spelled}, got "
            f"{f'shape={list(x.shape)}' if isinstance(x, np.ndarray) else type(x).__name__}")
    dtype_name(x.dtype)  # names the dtype in its error if it is not one fa_verify knows
    return x


def _dense(rows: np.ndarray) -> np.ndarray:
    """[N, heads, D] rows of one sequence as a dense [1, heads, N, D] array."""
    return np.ascontiguousarray(rows.transpose(1, 0, 2))[None]


def _packed(x: np.ndarray) -> np.ndarray:
    """A sequence's [1, heads, N, D] array as packed [N, heads, D] rows."""
    return x[0].transpose(1, 0, 2)
