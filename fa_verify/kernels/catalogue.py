"""The kernel catalogue: what each CUDA kernel family in kernels/ is and how to launch it.

A family is one .cu file whose entry points (extern "C", so that PyCUDA finds them by name) are named `<family>_<dtype>_d<D>`, one per
problem dtype and head dimension it instantiates (`<family>_<dtype>_d<D>v<D_v>` for an instantiation
whose v and output have D_v != D columns, e.g. fa2_bf16_d192v128). Every entry takes the common ABI (see
kernels/fa_common.cuh):

    (const T* q, const T* k, const T* v, T* o, float* lse,
     int B, int H, int Hkv, int Nq, int Nk, float scale, int causal, int causal_offset)

plus, for families with a `scratch` dtype (naive, naive16), a trailing pointer to B*H*Nq*Nk
elements of that dtype ("fp32", or "input" for the problem dtype) where S and P are materialised,
and, for families that implement the variants (fa2: `features`), VARIANT_SIGNATURE's parameters

    (int window_left, int window_right, float softcap, const float* alibi_slopes,
     int alibi_batch_stride, const float* sinks)

(window_size with each side capped at Nq + Nk, softcap 0 = off, null pointers = off; alibi_batch_stride is H for [B, H]
slopes, 0 for [H]). causal_offset is always the diagonal offset (Nk - Nq bottom-right, 0
top-left): the window and ALiBi use it whether or not the problem is causal.
A family of kind "fp8" (fa3_fp8: FP8 problems, fa_verify.fp8) takes q, k, v in its FP8 format
(`<family>_<e4m3|e5m2>_d<D>`), writes a bf16 o, and takes the descales after the common ABI,

    (const float* q_descale, const float* k_descale, const float* v_descale)

each float32 [B, Hkv] (a per-tensor descale is passed broadcast to that shape).
The catalogue is the Python half of each family: its tile configuration per head dimension, or
per (D, D_v) pair (which must match the instantiation lines `FA_FOR_EACH_*DTYPE(<FAMILY>_ENTRY, D, ...)`
and `FA_FOR_EACH_*DTYPE(<FAMILY>_ENTRY_V, D, D_v, ...)` of the
.cu; tests/test_kernels.py checks that they do), the launch grid, block and dynamic shared
memory, and the precision model the error model judges it by. Runners (PyCUDA on a GPU, the
CUDA-on-CPU runner elsewhere) launch kernels from a `Launch` and need nothing else.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.errors import InvalidArgumentError
from fa_verify.fp8 import DESCALES
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem, unsupported_features

#: Environment variable naming the folder that holds the .cu sources (default: the repository's kernels/).
KERNELS_DIR_ENV = "FA_VERIFY_KERNELS_DIR"
#: Shared memory a block may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_SHARED_LIMIT = 48 * 1024
#: Regions of dynamic shared memory are each rounded up to this many bytes (FA_SMEM_ALIGN in fa_common.cuh).
SMEM_ALIGN = 128
#: Options every compiler gets (nvcc, PyCUDA's SourceModule); the CPU runner compiles as C++17 too.
NVCC_OPTIONS = ("-std=c++17",)

_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
#: The parameter kinds of the common ABI, as the CPU runner's signatures spell them.
BASE_SIGNATURE = ("ptr",) * 5 + ("int",) * 5 + ("float", "int", "int")
#: The variants' parameters after the common ABI, for families with `features`.
VARIANT_SIGNATURE = ("int", "int", "float", "ptr", "int", "ptr")
#: The descales' parameters after the common ABI, for families of kind "fp8".
FP8_SIGNATURE = ("ptr",) * 3
#: The kinds of problem a family runs: dense attention, or FP8 (fa_verify.fp8).
FAMILY_KINDS = ("dense", "fp8")


def kernels_dir() -> Path:
    """The folder of the .cu sources: $FA_VERIFY_KERNELS_DIR, else kernels/ beside the package."""
    override = os.environ.get(KERNELS_DIR_ENV)
    if override:
        path = Path(override).expanduser()
        if not (path / "fa_common.cuh").is_file():
            raise InvalidArgumentError(
                f"{KERNELS_DIR_ENV}={override!r} does not hold the kernel sources (no fa_common.cuh there)")
        return path.resolve()
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parent.parent / "kernels"):  # packaged copy, then a checkout
        if (candidate / "fa_common.cuh").is_file():
            return candidate
    raise InvalidArgumentError(
        f"the kernel sources were not found beside the package ({here.parent.parent / 'kernels'}); "
        f"set {KERNELS_DIR_ENV} to the folder that holds fa_common.cuh and the .cu files")


def cached_source(label: str, file_name: str, text: str, includes: tuple = ()) -> Path:
    """`text` saved as `file_name` beside a copy of fa_common.cuh (and of the kernels/ files named in
    `includes`, which it includes), in a folder of the runner's cache named by `label` and the text it
    builds from. A fixed path lets the content-addressed build cache (whose units name their source)
    serve every process, test and later run; an edited kernel gets a new folder."""
    from fa_verify.cuda_cpu import default_cache_dir

    beside = {name: (kernels_dir() / name).read_text() for name in ("fa_common.cuh", *includes)}
    digest = hashlib.sha256("".join((text, *beside.values())).encode()).hexdigest()[:16]
    folder = default_cache_dir().parent / "mutants" / f"{label}-{digest}"
    if not (folder / file_name).is_file():
        # Written aside and renamed into place: a concurrent process never sees half a folder.
        folder.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=folder.parent))
        for name, content in beside.items():
            (staged / name).write_text(content)
        (staged / file_name).write_text(text)
        try:
            os.replace(staged, folder)
        except OSError:  # another process published it first
            shutil.rmtree(staged, ignore_errors=True)
    return folder / file_name


def _round_up(n: int) -> int:
    return -(-n // SMEM_ALIGN) * SMEM_ALIGN


@dataclass(frozen=True)
class TileConfig:
    """One head dimension's instantiation: query rows per block, keys per K/V tile, threads."""

    block_m: int
    #: keys per K/V tile; None for kernels without key tiles (naive)
    block_n: int | None
    threads: int


@dataclass(frozen=True)
class Launch:
    """Everything a runner needs to launch one problem: entry, grid, block, shared memory, args."""

    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    #: dynamic shared memory in bytes
    shared_bytes: int
    #: parameter kinds in order: 'ptr' | 'int' | 'float'
    signature: tuple[str, ...]
    #: the scalar arguments after (q, k, v, o, lse): B, H, Hkv, Nq, Nk, scale, causal, causal_offset
    scalars: tuple
    #: elements of the trailing scratch array, 0 when the entry takes none
    scratch_elements: int = 0
    #: numpy-ready dtype name of the scratch elements ("fp32", "fp16", "bf16"), None without one
    scratch_dtype: str | None = None
    #: the arguments after the common ABI (and the scratch), the last of `signature`: for families
    #: with features the variants' (VARIANT_SIGNATURE: window_left, window_right, softcap, alibi
    #: slopes, alibi_batch_stride, sinks), for FP8 families the descales (FP8_SIGNATURE), else
    #: none; an array argument is a tuple of its float32 values (flattened), or None for a null pointer
    trailing_args: tuple = ()
    #: the fa_verify dtype of o: the problem's dtype, or bf16 for FP8 families
    output_dtype: str = ""

    def trailing_arguments(self) -> list:
        """The trailing arguments as the kernel takes them: array tuples as float32 arrays."""
        return [np.array(a, dtype=np.float32) if isinstance(a, tuple) else a for a in self.trailing_args]

    @property
    def trailing_signature(self) -> tuple[str, ...]:
        """The parameter kinds of `trailing_args`."""
        return self.signature[len(self.signature) - len(self.trailing_args):]


@dataclass(frozen=True)
class KernelFamily:
    """One .cu file of kernels: its entries, launch geometry and precision model."""

    name: str
    #: name used for backends ("<label>-cpu", "<label>-pycuda")
    label: str
    source: str
    description: str
    dtypes: tuple[str, ...]
    #: TileConfig by head dim D (D_v = D) or by (D, D_v) pair (D_v != D)
    configs: dict = field(repr=False)
    precision_model: Callable[[str], PrecisionModel] = field(repr=False)
    #: byte sizes of the dynamic shared memory regions, in the order the kernel carves them
    smem_regions: Callable[[int, str, TileConfig], tuple[int, ...]] = field(repr=False)
    #: dtype of the trailing scratch array: None (no scratch), "fp32", or "input" (the problem dtype)
    scratch: str | None = None
    notes: str = ""
    #: oldest GPU architecture the source compiles for (80 = sm_80; 0: whatever nvcc targets), and why
    min_arch: int = 0
    min_arch_reason: str = ""
    #: the variants it implements (keys of fa_verify.problem.FEATURES); its entries then take
    #: VARIANT_SIGNATURE's parameters
    features: tuple = ()
    #: the kind of problem it runs (FAMILY_KINDS); "fp8": FP8 q, k, v, a bf16 o, FP8_SIGNATURE's descales
    kind: str = "dense"
    #: other kernels/ files its source includes (besides fa_common.cuh): a mutant's copy needs them
    includes: tuple = ()

    # --- what exists --------------------------------------------------------------------------
    @property
    def head_dims(self) -> tuple[int, ...]:
        """The head dims D instantiated with D_v = D."""
        return tuple(sorted(d for d in self.configs if isinstance(d, int)))

    @property
    def head_dim_pairs(self) -> tuple[tuple[int, int], ...]:
        """The (D, D_v) pairs instantiated with D_v != D."""
        return tuple(sorted(d for d in self.configs if isinstance(d, tuple)))

    @property
    def head_dims_v(self) -> tuple[int, ...] | None:
        """The D_v != D it instantiates (`Limits.head_dims_v`), or None."""
        return tuple(sorted({dv for _, dv in self.head_dim_pairs})) or None

    @property
    def source_path(self) -> Path:
        return kernels_dir() / self.source

    def entry(self, dtype: str, head_dim: int, head_dim_v: int | None = None) -> str:
        dv = "" if head_dim_v in (None, head_dim) else f"v{head_dim_v}"
        return f"{self.name}_{dtype}_d{head_dim}{dv}"

    def entries(self) -> list[str]:
        return [self.entry(dt, *_dims(key)) for key in self.configs for dt in self.dtypes]

    @property
    def signature(self) -> tuple[str, ...]:
        trailing = VARIANT_SIGNATURE if self.features else FP8_SIGNATURE if self.kind == "fp8" else ()
        return BASE_SIGNATURE + (("ptr",) if self.scratch else ()) + trailing

    def output_dtype(self, dtype: str) -> str:
        """The dtype of o for inputs of `dtype`: bf16 for FP8 families, else `dtype`."""
        return "bf16" if self.kind == "fp8" else dtype

    def signatures(self) -> dict[str, list[str]]:
        """{entry: signature} for every entry, as the CPU runner's CpuKernelModule takes them."""
        return {entry: list(self.signature) for entry in self.entries()}

    def precision(self, dtype) -> PrecisionModel:
        return self.precision_model(dtype)

    def resources(self, entry: str) -> tuple[int, int]:
        """(threads per block, dynamic shared memory in bytes) that `entry` is launched with."""
        _, dtype, d = entry.rsplit("_", 2)
        dims = tuple(int(x) for x in d[1:].split("v"))
        return self.config(*dims).threads, self.shared_bytes(dims[0], dtype, dims[-1])

    # --- per problem --------------------------------------------------------------------------
    def config(self, head_dim: int, head_dim_v: int | None = None) -> TileConfig:
        key = _key(head_dim, head_dim_v)
        if key not in self.configs:
            raise InvalidArgumentError(
                f"kernel family {self.name!r} has no entry for {_spelled(key)}; it instantiates "
                f"{self.describe_head_dims()}")
        return self.configs[key]

    def describe_head_dims(self) -> str:
        pairs = "".join(f", D={d} with D_v={dv}" for d, dv in self.head_dim_pairs)
        return f"D in {', '.join(map(str, self.head_dims))}{pairs}"

    def shared_bytes(self, head_dim: int, dtype: str, head_dim_v: int | None = None) -> int:
        """Dynamic shared memory of the (dtype, D[, D_v]) entry, in bytes (tiles as wide as the wider dim)."""
        config = self.config(head_dim, head_dim_v)
        return sum(_round_up(n) for n in self.smem_regions(max(head_dim, head_dim_v or 0), dtype, config))

    def supports(self, problem: AttentionProblem, shared_limit: int | None = None) -> str | None:
        """None if an entry of this family runs `problem`, else why not."""
        if problem.kind != self.kind:
            return f"{self.name} runs {self.kind} problems, not {problem.kind} ones"
        if problem.dtype not in self.dtypes:
            return f"{self.name} has no {problem.dtype} entry (it has {', '.join(self.dtypes)})"
        if self.kind == "fp8" and problem.output_dtype != self.output_dtype(problem.dtype):
            return f"{self.name} writes a {self.output_dtype(problem.dtype)} output, not {problem.output_dtype}"
        key = _key(problem.head_dim, problem.head_dim_v)
        if key not in self.configs:
            return f"{self.name} has no entry for {_spelled(key)} (it has {self.describe_head_dims()})"
        missing = unsupported_features(self.name, problem, self.features)
        if missing:
            return missing
        if problem.heads > 65535 or problem.batch > 65535:
            return f"grid dimensions H={problem.heads}, B={problem.batch} exceed CUDA's limit of 65535"
        if shared_limit is not None:
            need = self.shared_bytes(problem.head_dim, problem.dtype, problem.head_dim_v)
            if need > shared_limit:
                return (f"{self.entry(problem.dtype, problem.head_dim, problem.head_dim_v)} needs {need} bytes of shared "
                        f"memory per block; this device allows {shared_limit}")
        return None

    def launch(self, problem: AttentionProblem) -> Launch:
        """The launch of `problem`: grid (ceil(Nq / BLOCK_M), H, B), the config's threads."""
        reason = self.supports(problem)
        if reason is not None:
            raise InvalidArgumentError(f"cannot launch {problem.describe()}: {reason}")
        return self.launch_for(problem.batch, problem.heads, problem.kv_heads, problem.nq, problem.nk,
                               problem.head_dim, problem.dtype, causal=problem.causal,
                               causal_alignment=problem.causal_alignment, scale=problem.scale_value,
                               window_size=problem.window_size, softcap=problem.softcap,
                               alibi_slopes=problem.alibi_slopes, sinks=problem.sinks, head_dim_v=problem.head_dim_v,
                               descales=tuple(problem.descale(n) for n in DESCALES) if self.kind == "fp8" else None)

    def launch_for(self, B: int, H: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: str, *,
                   causal: bool = False, causal_alignment: str = "bottom-right",
                   scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                   alibi_slopes=None, sinks=None, head_dim_v: int | None = None, descales=None) -> Launch:
        """The launch for these shapes (e.g. of torch tensors), without an AttentionProblem; head_dim_v:
        v's D_v (None: D). The variants, taken as given (AttentionProblem validates them), need a
        family with features; an FP8 family needs `descales`, q's, k's and v's, each [B, Hkv]."""
        if dtype not in self.dtypes:
            raise InvalidArgumentError(f"{self.name} has no {dtype} entry (it has {', '.join(self.dtypes)})")
        if causal_alignment not in ("bottom-right", "top-left"):
            raise InvalidArgumentError(f"causal_alignment={causal_alignment!r}; use 'bottom-right' or 'top-left'")
        cfg = self.config(D, head_dim_v)
        causal_offset = Nk - Nq if causal_alignment == "bottom-right" else 0
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        scalars = (B, H, Hkv, Nq, Nk, scale, int(bool(causal)), causal_offset)
        scratch = B * H * Nq * Nk if self.scratch else 0
        scratch_dtype = None if not self.scratch else dtype if self.scratch == "input" else self.scratch
        trailing = ()
        if self.kind == "fp8":
            if descales is None or len(descales) != 3:
                raise InvalidArgumentError(f"{self.name} takes q's, k's and v's descales ([B, Hkv] each): "
                                           f"descales={descales!r}")
            trailing = tuple(tuple(map(float, np.broadcast_to(np.asarray(d, np.float32), (B, Hkv)).ravel()))
                             for d in descales)
        if self.features:
            slopes, sinks = (None if x is None else np.asarray(x, dtype=np.float32) for x in (alibi_slopes, sinks))
            # A side of Nq + Nk keys or more reaches every key: capped there, it fits the kernel's int.
            left, right = (min(int(side), Nq + Nk) for side in window_size)
            trailing = (left, right, float(softcap),
                            None if slopes is None else tuple(map(float, slopes.ravel())),
                            H if slopes is not None and slopes.ndim == 2 else 0,
                            None if sinks is None else tuple(map(float, sinks.ravel())))
        elif window_size != (-1, -1) or softcap or alibi_slopes is not None or sinks is not None:
            raise InvalidArgumentError(f"{self.name} implements no variant (window_size, softcap, "
                                       "alibi_slopes, sinks); leave them at their defaults")
        return Launch(entry=self.entry(dtype, D, head_dim_v), grid=(math.ceil(Nq / cfg.block_m), H, B),
                      block=(cfg.threads, 1, 1), shared_bytes=self.shared_bytes(D, dtype, head_dim_v),
                      signature=self.signature, scalars=scalars, scratch_elements=scratch,
                      scratch_dtype=scratch_dtype, trailing_args=trailing, output_dtype=self.output_dtype(dtype))


def _key(head_dim: int, head_dim_v: int | None):
    """A family's configs key: D where D_v = D, else (D, D_v)."""
    return head_dim if head_dim_v in (None, head_dim) else (head_dim, head_dim_v)


def _dims(key) -> tuple:
    """(D, D_v) of a configs key."""
    return key if isinstance(key, tuple) else (key, key)


def _spelled(key) -> str:
    d, dv = _dims(key)
    return f"D={d}" if d == dv else f"D={d} with D_v={dv}"


# --- the families ------------------------------------------------------------------------------------

def _fa2_smem(d: int, dtype: str, c: TileConfig) -> tuple[int, ...]:
    ld = d + 1  # tiles held in fp32, rows padded by one float (d: the wider of D and D_v)
    return (4 * c.block_m * ld, 4 * c.block_n * ld, 4 * c.block_n * ld,
            4 * c.block_m * (c.block_n + 1), 4 * c.block_m, 4 * c.block_m)


def _wmma_smem(d: int, dtype: str, c: TileConfig) -> tuple[int, ...]:
    t = _ITEMSIZE[dtype]
    ldt = d + 8
    return (t * c.block_m * ldt, t * c.block_n * ldt, t * c.block_n * ldt,
            4 * c.block_m * (c.block_n + 4), t * c.block_m * (c.block_n + 8),
            4 * c.block_m * (d + 4), 4 * c.block_m)


def _mma_ptx_smem(d: int, dtype: str, c: TileConfig) -> tuple[int, ...]:
    t = _ITEMSIZE[dtype]
    ld = d + 8
    return (t * c.block_m * ld, t * c.block_n * ld, t * c.block_n * ld)


def _no_smem(d: int, dtype: str, c: TileConfig) -> tuple[int, ...]:
    return ()


def _naive16_precision(dtype) -> PrecisionModel:
    # S and P are stored in the input dtype; the model's "score accumulated in T" is the closest
    # it can say (the kernel accumulates q.k in fp32 and rounds once: the model over-covers it).
    return PrecisionModel(input=dtype, score_accumulation=dtype, p_rounding=dtype, pv_accumulation="fp32")


FA2 = KernelFamily(
    name="fa2", label="fa2", source="fa2.cu",
    description="FlashAttention-2 style on CUDA cores: K/V tiles through shared memory, online "
                "softmax in fp32, P rounded to the input dtype before P·V",
    dtypes=DTYPE_NAMES,
    configs={16: TileConfig(64, 32, 128), 32: TileConfig(64, 32, 128), 64: TileConfig(64, 32, 128),
             96: TileConfig(64, 32, 128), 128: TileConfig(64, 32, 128), 256: TileConfig(32, 16, 128),
             # FlashAttention-3's D = 192 with D_v = 128 (v and the output 128 wide)
             (192, 128): TileConfig(32, 16, 128)},
    precision_model=PrecisionModel.flash, smem_regions=_fa2_smem,
    features=("window", "softcap", "alibi", "sinks"))

WMMA = KernelFamily(
    name="wmma", label="wmma", source="wmma.cu",
    description="FlashAttention-2 style on tensor cores (nvcuda::wmma 16x16x16, fp32 accumulation): "
                "S = QK^T and P·V as fragments, softmax in fp32 on shared memory",
    dtypes=("fp16", "bf16"),
    configs={16: TileConfig(64, 32, 128), 32: TileConfig(64, 32, 128), 64: TileConfig(64, 32, 128),
             96: TileConfig(64, 32, 128), 128: TileConfig(64, 32, 128), 256: TileConfig(32, 32, 128)},
    precision_model=PrecisionModel.flash, smem_regions=_wmma_smem,
    notes="tensor-core sums may not round as IEEE fp32 additions; judged by the FA2 model",
    min_arch=80, min_arch_reason="bf16 wmma fragments")

MMA_PTX = KernelFamily(
    name="mma_ptx", label="mma-ptx", source="mma_ptx.cu",
    description="FlashAttention-2 style on tensor cores in inline PTX (cp.async, ldmatrix, "
                "mma.sync.m16n8k16 with fp32 accumulation, ex2.approx, shfl.sync): S, P and O in "
                "registers in the ISA's fragment layouts, one warp per 16 query rows",
    dtypes=("fp16", "bf16"),
    configs={16: TileConfig(64, 32, 128), 32: TileConfig(64, 32, 128), 64: TileConfig(64, 32, 128),
             96: TileConfig(64, 32, 128), 128: TileConfig(64, 32, 128), 256: TileConfig(32, 16, 64)},
    precision_model=PrecisionModel.flash, smem_regions=_mma_ptx_smem,
    notes="tensor-core sums may not round as IEEE fp32 additions; exp is ex2.approx; judged by the FA2 model",
    min_arch=80, min_arch_reason="mma.sync.m16n8k16 with bf16, cp.async")

NAIVE = KernelFamily(
    name="naive", label="naive-cuda", source="naive.cu",
    description="standard attention materialising S and P in global memory in fp32 (fp32 dot "
                "products, softmax and P·V; only O rounded to the input dtype)",
    dtypes=DTYPE_NAMES,
    configs={d: TileConfig(16, None, 128) for d in (16, 32, 64, 96, 128, 256)},
    precision_model=PrecisionModel.fp32_accumulate, smem_regions=_no_smem, scratch="fp32",
    notes="takes a trailing float* scratch of B*H*Nq*Nk elements")

NAIVE16 = KernelFamily(
    name="naive16", label="naive16-cuda", source="naive.cu",
    description="standard attention as eager PyTorch runs it in fp16/bf16: S and P materialised "
                "in global memory in the input dtype, P·V accumulated in fp32",
    dtypes=("fp16", "bf16"),
    configs={d: TileConfig(16, None, 128) for d in (16, 32, 64, 96, 128, 256)},
    precision_model=_naive16_precision, smem_regions=_no_smem, scratch="input",
    notes="takes a trailing T* scratch of B*H*Nq*Nk elements; its precision model (scores in "
          "the input dtype) gives an infinite error-model bound for most rows, so the ensemble "
          "rule judges it")

FA3_FP8 = KernelFamily(
    name="fa3_fp8", label="fa3-fp8", source="fa3_fp8.cu",
    description="FlashAttention-3's FP8 forward on fa2's tile loop: e4m3/e5m2 q, k, v with [B, Hkv] "
                "descales, q.k descales folded into the softmax scale, P = exp(s - m) 2^8 rounded to "
                "e4m3, v's descale and the LSE's compensation at the end, bf16 output",
    dtypes=("e4m3", "e5m2"),
    configs={d: TileConfig(64, 32, 128) for d in (8, 16, 32, 64, 128)},
    precision_model=PrecisionModel.fa3_fp8, smem_regions=_fa2_smem, kind="fp8", includes=("fa2.cu",),
    notes="FP8 problems (fa_verify.fp8); a per-tensor descale ([1]) is passed broadcast to [B, Hkv]")

#: Every kernel family, by name.
FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (FA2, WMMA, MMA_PTX, NAIVE, NAIVE16, FA3_FP8)}


def _fa2_tanh_approx_precision(dtype) -> PrecisionModel:
    return PrecisionModel.flash(dtype).replace(tanh="approx")


#: fa2's kernel with softcap's tanh as the hardware tanh.approx.f32 (FlashAttention's softcap),
#: judged under FA2's model with tanh declared "approx". Not in FAMILIES: one variant of fa2 for
#: the declared-accuracy tests, not a backend every sweep should run.
FA2_TANH_APPROX = KernelFamily(
    name="fa2_tanh_approx", label="fa2-tanh-approx", source="fa2_tanh_approx.cu",
    description="fa2's kernel with softcap's tanh computed by tanh.approx.f32, as FlashAttention's",
    dtypes=DTYPE_NAMES, configs={d: FA2.config(d) for d in (32, 64, 128)},
    precision_model=_fa2_tanh_approx_precision, smem_regions=_fa2_smem, features=FA2.features,
    notes="tanh.approx.f32 errs by up to 2^-10.987 relative; the CPU runner emulates it near that bound",
    min_arch=75, min_arch_reason="tanh.approx.f32")


def _fa2_key_tile(block_n: int) -> KernelFamily:
    return KernelFamily(
        name=f"fa2_k{block_n}", label=f"fa2-k{block_n}", source="fa2_key_tiles.cu",
        description=f"fa2's kernel with key tiles of {block_n} keys (bf16, D = 64)",
        dtypes=("bf16",), configs={64: TileConfig(64, block_n, 128)},
        precision_model=PrecisionModel.flash, smem_regions=_fa2_smem, features=FA2.features,
        notes="instantiated for the report's key-tile study (fa_verify.report.golden); not a "
              "backend of the sweeps")


#: fa2's kernel by key-tile size (BLOCK_N) at D = 64 in bf16: fa2 itself for 32 (its D = 64
#: configuration), fa2_key_tiles.cu for the others. Not in FAMILIES: they are one kernel's
#: variants for one study, not backends every sweep and test should run.
FA2_KEY_TILES: dict[int, KernelFamily] = {
    n: FA2 if n == FA2.config(64).block_n else _fa2_key_tile(n) for n in (16, 32, 64, 128)}


def get_family(name: str) -> KernelFamily:
    if name not in FAMILIES:
        raise InvalidArgumentError(f"kernel={name!r} is unknown; kernel families: {', '.join(FAMILIES)}")
    return FAMILIES[name]
