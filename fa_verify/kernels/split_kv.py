"""The host half of kernels/split_kv.cu: split-KV decode over varlen or paged K/V, two launches.

A ragged problem (fa_verify.ragged.RaggedProblem) runs as
1. `split_kv_<layout>_<dtype>_d<D>`, grid (num_splits, H, B): each block writes one split's
   partial result in fp32 into scratch: o_partial [num_splits, total_q, H, D] and its LSE as the
   (row max, row sum) pair lse_partial [2, num_splits, H, total_q] (kernels/split_kv.cu says why);
2. `split_kv_combine_<layout>_<dtype>_d<D>`, grid (B, H): the LSE-weighted merge into out
   [total_q, H, D] (the problem dtype) and LSE (varlen [H, total_q], paged [B, H, Nq]).
A paged problem's q [B, Nq, H, D] is passed as packed rows with cu_seqlens_q = b * Nq. An FP8
KV cache (kind "paged-fp8", `FP8_DTYPES`, paged only) runs `split_kv_paged_<e4m3|e5m2>_d<D>`
with its scales broadcast to [B, Hkv] (q_descale, k_scale as k_descale, v_scale as v_descale;
null for the other dtypes) and a bf16 output: FlashAttention-3's FP8 model (`precision`).
`num_splits` = 0 asks for the kernel's own choice (`auto_num_splits`). Runners (the CUDA-on-CPU
runner, PyCUDA) take a `SplitKvPlan` and need nothing else; the kernel's ABI is in the .cu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels.catalogue import SMEM_ALIGN, TileConfig, kernels_dir
from fa_verify.precision import PrecisionModel

NAME, LABEL, SOURCE = "split_kv", "split-kv", "split_kv.cu"
DTYPES = ("fp16", "bf16", "fp32")
#: The FP8 KV cache's formats (paged entries only).
FP8_DTYPES = ("e4m3", "e5m2")
#: Tile configuration per head dimension: (query rows, keys per tile, threads); matches the
#: `FA_FOR_EACH_DTYPE(SPLIT_KV_ENTRY, D, ...)` lines of split_kv.cu (tests/test_split_kv.py checks).
CONFIGS = {64: TileConfig(16, 32, 128), 128: TileConfig(16, 32, 128)}
COMBINE_THREADS = 128
#: Streaming multiprocessors the heuristic fills (an A100's 108): enough blocks to occupy them.
HEURISTIC_SMS = 108
#: The most splits the heuristic picks (FlashAttention-2 caps at 128; past a few dozen the
#: combine's reads outweigh the gain).
MAX_AUTO_SPLITS = 32
#: Parameter kinds of the split entries and of the combine entries (the CPU runner's signatures).
SPLIT_SIGNATURE = ("ptr",) * 8 + ("int",) * 7 + ("float", "int", "int", "int", "float", "ptr", "int") + ("ptr",) * 3
COMBINE_SIGNATURE = ("ptr",) * 5 + ("int",) * 3 + ("ptr",)
#: The variants the kernel implements (keys of fa_verify.problem.FEATURES).
FEATURES = ("window", "softcap", "alibi", "sinks")
LAYOUTS = ("varlen", "paged")


def precision(dtype) -> PrecisionModel:
    """FA2's: fp32 scores and accumulators, P rounded to the input dtype; partials in fp32 (FP8:
    FlashAttention-3's FP8 model, P offset by 2^8 in e4m3, bf16 output)."""
    return PrecisionModel.flash(dtype)


def split_entry(layout: str, dtype: str, head_dim: int) -> str:
    return f"{NAME}_{layout}_{dtype}_d{head_dim}"


def combine_entry(layout: str, dtype: str, head_dim: int) -> str:
    return f"{NAME}_combine_{layout}_{dtype}_d{head_dim}"


def signatures() -> dict[str, list[str]]:
    """{entry: signature} of every entry, as CpuKernelModule takes them."""
    found = {}
    for d in CONFIGS:
        for layout, dtype in [(layout, dtype) for dtype in DTYPES for layout in LAYOUTS] + [
                ("paged", dtype) for dtype in FP8_DTYPES]:
            found[split_entry(layout, dtype, d)] = list(SPLIT_SIGNATURE)
            found[combine_entry(layout, dtype, d)] = list(COMBINE_SIGNATURE)
    return found


def shared_bytes(head_dim: int) -> int:
    """The split entry's dynamic shared memory: Q, K, V tiles and S in fp32 with padded rows, two row vectors."""
    c = CONFIGS[head_dim]
    ld = head_dim + 1
    regions = (4 * c.block_m * ld, 4 * c.block_n * ld, 4 * c.block_n * ld, 4 * c.block_m * (c.block_n + 1),
               4 * c.block_m, 4 * c.block_m)
    return sum(-(-n // SMEM_ALIGN) * SMEM_ALIGN for n in regions)


def auto_num_splits(batch: int, heads: int, max_seqlen_k: int, block_n: int) -> int:
    """The kernel's own split count: enough splits that B * H * splits blocks fill HEURISTIC_SMS,
    never more than the longest sequence has key tiles, nor MAX_AUTO_SPLITS."""
    blocks = batch * heads
    tiles = math.ceil(max_seqlen_k / block_n)
    return max(1, min(math.ceil(HEURISTIC_SMS / blocks), tiles, MAX_AUTO_SPLITS))


def supports(problem, shared_limit: int | None = None) -> str | None:
    """None if split_kv.cu runs `problem` (a RaggedProblem), else why not."""
    if problem.dtype not in DTYPES + (FP8_DTYPES if problem.layout == "paged" else ()):
        return (f"{NAME} has no {problem.layout} {problem.dtype} entry (it has {', '.join(DTYPES)}, and "
                f"{', '.join(FP8_DTYPES)} for a paged FP8 KV cache)")
    if problem.head_dim not in CONFIGS:
        return f"{NAME} has no entry for D={problem.head_dim} (it has D in {', '.join(map(str, CONFIGS))})"
    if problem.first.causal and problem.first.causal_alignment != "bottom-right":
        return f"{NAME} aligns the causal mask bottom-right per sequence (flash-attn's), not top-left"
    if problem.heads > 65535 or problem.batch > 65535:
        return f"grid dimensions H={problem.heads}, B={problem.batch} exceed CUDA's limit of 65535"
    if shared_limit is not None and shared_bytes(problem.head_dim) > shared_limit:
        return f"{NAME} needs {shared_bytes(problem.head_dim)} bytes of shared memory per block; this device allows {shared_limit}"
    return None


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: entry, grid, block, dynamic shared memory and its arguments, where a str
    names a buffer of the plan (`SplitKvPlan.buffers`) and anything else is a scalar."""

    entry: str
    grid: tuple
    block: tuple
    shared_bytes: int
    signature: tuple
    args: tuple

    @property
    def opt_in(self) -> int:
        """The dynamic shared memory the host opts in to: what the launch asks."""
        return self.shared_bytes


@dataclass(frozen=True)
class SplitKvPlan:
    """Both launches of one problem, and the buffers they read and write."""

    num_splits: int
    split: KernelLaunch
    combine: KernelLaunch
    #: {name: buffer}: inputs (q, k, v, int32 metadata; block_table None for varlen; float32
    #: alibi_slopes and sinks, None when off), scratch
    #: (o_partial, lse_partial, NaN-filled: a partial never written shows in the output) as numpy
    #: arrays in the shapes the kernel reads them, and the outputs (out, lse) as `plan` got them
    buffers: dict

    @property
    def launches(self) -> tuple:
        return self.split, self.combine


def plan(problem, inputs: dict, out, lse) -> SplitKvPlan:
    """The launches of `problem` (a RaggedProblem) on `inputs` (`problem.inputs()`: the layout's
    arrays), writing into `out` and `lse`: the layout's shapes, pre-filled by the caller, passed
    as the runner takes them (arrays, the CPU runner's `Inside` pointers, `GuardedOutput`s)."""
    from fa_verify.backends.cuda_kernels import _bits

    reason = supports(problem)
    if reason is not None:
        raise InvalidArgumentError(f"cannot launch {problem.describe()}: {reason}")
    layout, dtype, D = problem.layout, problem.dtype, problem.head_dim
    B, H, Hkv = problem.batch, problem.heads, problem.kv_heads
    cfg = CONFIGS[D]
    splits = problem.num_splits or auto_num_splits(B, H, problem.max_seqlen_k, cfg.block_n)
    q = np.ascontiguousarray(inputs["q"]).reshape(-1, H, D)  # paged [B, Nq, H, D] as packed rows
    total_q = q.shape[0]
    if layout == "paged":
        cu_seqlens_q = np.arange(B + 1, dtype=np.int32) * problem.max_seqlen_q
        k, v, seqlens_k = inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"]
        block_table = inputs["block_table"]
        max_blocks, page_size = block_table.shape[1], k.shape[1]
    else:
        cu_seqlens_q, k, v, seqlens_k = inputs["cu_seqlens_q"], inputs["k"], inputs["v"], inputs["cu_seqlens_k"]
        block_table, max_blocks, page_size = None, 0, 0
    buffers = {
        "q": _bits(q), "k": _bits(k), "v": _bits(v),
        "cu_seqlens_q": np.ascontiguousarray(cu_seqlens_q, dtype=np.int32),
        "seqlens_k": np.ascontiguousarray(seqlens_k, dtype=np.int32),
        "block_table": None if block_table is None else np.ascontiguousarray(block_table, dtype=np.int32),
        # an FP8 cache's scales ([1] or [B, Hkv]) as the [B, Hkv] descales the kernel reads; None otherwise
        **{descale: None if name not in inputs else np.ascontiguousarray(np.broadcast_to(inputs[name], (B, Hkv)),
                                                                          dtype=np.float32)
           for descale, name in (("q_descale", "q_descale"), ("k_descale", "k_scale"), ("v_descale", "v_scale"))},
        "o_partial": np.full((splits, total_q, H, D), np.nan, np.float32),
        "lse_partial": np.full((2, splits, H, total_q), np.nan, np.float32),
        "out": out, "lse": lse,
    }
    scale = problem.first.scale_value
    # Window sides capped at every key (Nq + Nk) so that any size fits the kernel's int.
    cap = problem.max_seqlen_q + problem.max_seqlen_k
    left, right = (-1 if side < 0 else min(side, cap) for side in problem.window_size)
    slopes = problem.alibi_slopes
    buffers["alibi_slopes"] = None if slopes is None else np.ascontiguousarray(slopes, dtype=np.float32)
    buffers["sinks"] = None if problem.sinks is None else np.ascontiguousarray(problem.sinks, dtype=np.float32)
    alibi_batch_stride = H if slopes is not None and slopes.ndim == 2 else 0
    split = KernelLaunch(
        split_entry(layout, dtype, D), (splits, H, B), (cfg.threads, 1, 1), shared_bytes(D), SPLIT_SIGNATURE,
        ("q", "k", "v", "o_partial", "lse_partial", "cu_seqlens_q", "seqlens_k", "block_table",
         B, H, Hkv, problem.max_seqlen_k, max_blocks, page_size, splits, scale, int(problem.causal),
         left, right, float(problem.softcap), "alibi_slopes", alibi_batch_stride, "q_descale", "k_descale",
         "v_descale"))
    combine = KernelLaunch(
        combine_entry(layout, dtype, D), (B, H, 1), (COMBINE_THREADS, 1, 1), 0, COMBINE_SIGNATURE,
        ("o_partial", "lse_partial", "out", "lse", "cu_seqlens_q", B, H, splits, "sinks"))
    return SplitKvPlan(splits, split, combine, buffers)


@dataclass(frozen=True)
class SplitKvKernel:
    """split_kv.cu as the mutant machinery (fa_verify.kernels.mutants) and the nvcc check
    (fa_verify.kernels.nvcc.compile_file) see a kernel family: a name, a source, the entries,
    their signatures and launch resources."""

    name: str = NAME
    label: str = LABEL
    source: str = SOURCE
    dtypes: tuple = DTYPES + FP8_DTYPES

    @property
    def source_path(self):
        return kernels_dir() / self.source

    def signatures(self) -> dict[str, list[str]]:
        return signatures()

    def entries(self) -> list[str]:
        return list(signatures())

    def resources(self, entry: str) -> tuple[int, int]:
        """(threads per block, dynamic shared memory in bytes) that `entry` is launched with."""
        head_dim = int(entry.rsplit("_d", 1)[1])
        if entry.startswith(f"{NAME}_combine_"):
            return COMBINE_THREADS, 0
        return CONFIGS[head_dim].threads, shared_bytes(head_dim)

    def precision(self, dtype) -> PrecisionModel:
        return precision(dtype)


SPLIT_KV = SplitKvKernel()
