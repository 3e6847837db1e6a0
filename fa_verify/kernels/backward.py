"""The host half of kernels/fa2_bwd.cu: FlashAttention-2's backward pass, three launches.

`run_fa2_backward(problem, out, lse, dout)` returns (dq, dk, dv, dsinks) for an AttentionProblem
(q, k, v and the variants), the forward's out [B,H,Nq,D] (the problem dtype) and lse [B,H,Nq]
(float32), and the upstream gradient dout [B,H,Nq,D] (the problem dtype; any strides, columns
contiguous or not), on the CUDA-on-CPU runner ("cpu") or through PyCUDA ("pycuda": a GPU, or
the fake driver of tests/fake_cuda_driver). The launches (kernels/fa2_bwd.cu has the ABI):
1. `fa2_bwd_pre_<dtype>_d<D>`: Delta = rowsum(dO o O) in fp32, the fp32 dQ workspace zeroed,
   dsinks;
2. `fa2_bwd_<dtype>_d<D>`, grid (ceil(Nk / BLOCK_N), Hkv, B): dK, dV per key tile over the kv
   head's GQA group, dQ by atomicAdd into the workspace;
3. `fa2_bwd_convert_<dtype>_d<D>`: dq = the workspace rounded to the dtype;
or, deterministic, 2 without the workspace and 3' `fa2_bwd_dq_<dtype>_d<D>`, grid
(ceil(Nq / BLOCK_M), H, B): dQ per query tile over its key tiles in order, no atomics.
dq, dk, dv start NaN-filled, the workspace and Delta too: what the kernels never write shows.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels.catalogue import SMEM_ALIGN, TileConfig, cached_source, kernels_dir
from fa_verify.kernels.split_kv import KernelLaunch
from fa_verify.problem import AttentionProblem, unsupported_features

NAME, LABEL, SOURCE = "fa2_bwd", "fa2-bwd", "fa2_bwd.cu"
DTYPES = ("fp16", "bf16", "fp32")
#: Tile configuration per head dimension: (query rows, keys per tile, threads); matches the
#: `FA_FOR_EACH_DTYPE(FA2_BWD_ENTRY, D, ...)` lines of fa2_bwd.cu (tests/test_backward_kernel.py checks).
CONFIGS = {d: TileConfig(32, 32, 128) for d in (40, 64, 72, 128)}
#: Rows (and threads) per block of the preprocess entry: FA2_BWD_PRE_ROWS in fa2_bwd.cu.
PRE_ROWS = 128
CONVERT_THREADS = 256
FEATURES = ("window", "softcap", "alibi", "sinks")
RUNNERS = ("cpu", "pycuda")
#: Per entry kind: the parameter kinds (the CPU runner's signature), and the element type of each
#: pointer parameter ("input": the problem dtype), which the fake driver needs to read them.
_MAIN = (("ptr",) * 10 + ("int",) * 5 + ("float", "int", "int") + ("int",) * 3 + ("int", "int", "float", "ptr", "int"),
         ("input",) * 4 + ("fp32",) * 3 + ("input",) * 3 + ("fp32",))
ENTRY_KINDS = {
    "main": _MAIN,
    "dq": _MAIN,
    "pre": (("ptr",) * 7 + ("int",) * 9, ("input", "input") + ("fp32",) * 5),
    "convert": (("ptr", "ptr", "int"), ("fp32", "input")),
}


def entry(kind: str, dtype: str, head_dim: int) -> str:
    return f"{NAME}_{dtype}_d{head_dim}" if kind == "main" else f"{NAME}_{kind}_{dtype}_d{head_dim}"


def entry_kind(name: str) -> str:
    middle = name[len(NAME) + 1:].rsplit("_", 2)[0]
    return middle if middle in ENTRY_KINDS else "main"


def signatures() -> dict[str, list[str]]:
    """{entry: signature} of every entry, as CpuKernelModule takes them."""
    return {entry(kind, dtype, d): list(sig) for d in CONFIGS for dtype in DTYPES for kind, (sig, _) in ENTRY_KINDS.items()}


def pointer_kinds(name: str) -> tuple[str, ...]:
    """"input" or "fp32" for each pointer parameter of entry `name`."""
    return ENTRY_KINDS[entry_kind(name)][1]


def shared_bytes(head_dim: int) -> int:
    """The main and dQ entries' dynamic shared memory: Q, dO, K, V tiles and P, dS in fp32 with
    padded rows, two row vectors (Fa2BwdTiles' carving)."""
    c = CONFIGS[head_dim]
    ld, lds = head_dim + 1, c.block_n + 1
    regions = (4 * c.block_m * ld,) * 2 + (4 * c.block_n * ld,) * 2 + (4 * c.block_m * lds,) * 2 + (4 * c.block_m,) * 2
    return sum(-(-n // SMEM_ALIGN) * SMEM_ALIGN for n in regions)


def supports(problem: AttentionProblem, shared_limit: int | None = None) -> str | None:
    """None if fa2_bwd.cu runs `problem`, else why not."""
    if problem.dtype not in DTYPES:
        return f"{NAME} has no {problem.dtype} entry (it has {', '.join(DTYPES)})"
    if problem.head_dim not in CONFIGS:
        return f"{NAME} has no entry for D={problem.head_dim} (it has D in {', '.join(map(str, CONFIGS))})"
    missing = unsupported_features(NAME, problem, FEATURES)
    if missing:
        return missing
    if problem.heads > 65535 or problem.batch > 65535:
        return f"grid dimensions H={problem.heads}, B={problem.batch} exceed CUDA's limit of 65535"
    if problem.q.size >= 2**31 or problem.k.size >= 2**31:
        return f"{NAME} indexes with 32-bit strides: q and k must hold fewer than 2^31 elements"
    if shared_limit is not None and shared_bytes(problem.head_dim) > shared_limit:
        return f"{NAME} needs {shared_bytes(problem.head_dim)} bytes of shared memory per block; this device allows {shared_limit}"
    return None


def _strided(name: str, x, problem: AttentionProblem) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(the memory of a [B,H,Nq,D] array as a contiguous buffer, its (batch, head, row) strides in
    elements): an array whose axes are a permutation of a contiguous one (bhsd, bshd, ...) with
    contiguous columns is passed as it lies, anything else copied to bhsd."""
    from fa_verify.backends.cuda_kernels import _bits

    x = np.asarray(x)
    if x.shape != problem.out_shape or x.dtype != problem.q.dtype:
        raise InvalidArgumentError(f"{name} must be {problem.q.dtype} of shape {problem.out_shape}; "
                                   f"got {x.dtype} {x.shape}")
    order = np.argsort([-s for s in x.strides], kind="stable")
    memory = x.transpose(order)
    if not (memory.flags.c_contiguous and x.strides[3] == x.itemsize) or min(x.strides) < 0:
        x = memory = np.ascontiguousarray(x)
    return _bits(memory), tuple(s // x.itemsize for s in x.strides[:3])


@dataclass(frozen=True)
class BackwardPlan:
    """The launches of one backward pass, and the buffers they read and write: {name: array}
    (None: a null pointer); a launch's str argument names a buffer."""

    launches: tuple
    buffers: dict
    #: names of the buffers the launches write that the caller gets back
    outputs: tuple = ("dq", "dk", "dv", "dsinks")


def plan(problem: AttentionProblem, out, lse, dout, *, deterministic: bool = False) -> BackwardPlan:
    """The launches of `problem`'s backward pass (run_fa2_backward's arguments), and their buffers:
    the inputs as the kernels read them, the outputs NaN-filled."""
    from fa_verify.backends.cuda_kernels import _bits

    reason = supports(problem)
    if reason is not None:
        raise InvalidArgumentError(f"cannot run the backward pass of {problem.describe()}: {reason}")
    dtype, D = problem.dtype, problem.head_dim
    B, H, Hkv, Nq, Nk = problem.batch, problem.heads, problem.kv_heads, problem.nq, problem.nk
    cfg = CONFIGS[D]
    lse = np.asarray(lse)
    if lse.shape != problem.lse_shape or lse.dtype != np.float32:
        raise InvalidArgumentError(f"lse must be float32 of shape {problem.lse_shape}; got {lse.dtype} {lse.shape}")
    out_bits, o_strides = _strided("out", out, problem)
    dout_bits, do_strides = _strided("dout", dout, problem)
    unwritten = np.full(problem.out_shape, np.nan, np.float32)

    def gradient(shape):  # NaN in the problem dtype's bits: an element never written shows
        return np.full(shape, 0xFFFF, np.uint16) if problem.q.dtype.itemsize == 2 else np.full(shape, np.nan, np.float32)

    slopes, sinks = problem.alibi_slopes, problem.sinks
    buffers = {
        "q": _bits(np.ascontiguousarray(problem.q)), "k": _bits(np.ascontiguousarray(problem.k)),
        "v": _bits(np.ascontiguousarray(problem.v)), "out": out_bits, "dout": dout_bits,
        "lse": np.ascontiguousarray(lse), "delta": np.full(problem.lse_shape, np.nan, np.float32),
        "dq_accum": None if deterministic else unwritten,
        "dq": gradient(problem.out_shape), "dk": gradient(problem.k.shape), "dv": gradient(problem.k.shape),
        "dsinks": None if sinks is None else np.zeros(H, np.float32),
        "sinks": None if sinks is None else np.ascontiguousarray(sinks, np.float32),
        "alibi_slopes": None if slopes is None else np.ascontiguousarray(slopes, np.float32),
    }
    # A window side of Nq + Nk keys or more reaches every key: capped there, it fits the kernel's int.
    left, right = (min(side, Nq + Nk) for side in problem.window_size)
    scalars = (B, H, Hkv, Nq, Nk, problem.scale_value, int(problem.causal), problem.diagonal_offset, *do_strides,
               left, right, float(problem.softcap), "alibi_slopes", H if slopes is not None and slopes.ndim == 2 else 0)
    tensors = ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dq", "dk", "dv")
    smem, threads = shared_bytes(D), (cfg.threads, 1, 1)

    def launch(kind, grid, block, shared, args):
        return KernelLaunch(entry(kind, dtype, D), grid, block, shared, ENTRY_KINDS[kind][0], args)

    launches = [
        launch("pre", (math.ceil(Nq / PRE_ROWS), H, B), (PRE_ROWS, 1, 1), 0,
               ("out", "dout", "lse", "delta", "dq_accum", "dsinks", "sinks", B, H, Nq, *o_strides, *do_strides)),
        launch("main", (math.ceil(Nk / cfg.block_n), Hkv, B), threads, smem, tensors + scalars),
    ]
    if deterministic:
        launches.append(launch("dq", (math.ceil(Nq / cfg.block_m), H, B), threads, smem, tensors + scalars))
    else:
        count = B * H * Nq * D
        launches.append(launch("convert", (math.ceil(count / CONVERT_THREADS), 1, 1), (CONVERT_THREADS, 1, 1), 0,
                               ("dq_accum", "dq", count)))
    return BackwardPlan(tuple(launches), buffers)


@dataclass(frozen=True)
class Fa2BackwardKernel:
    """fa2_bwd.cu as the mutant machinery (fa_verify.kernels.mutants), the nvcc check
    (fa_verify.kernels.nvcc.compile_file) and the CPU runner's module cache
    (fa_verify.backends.cuda_kernels.cpu_module) see a kernel: a name, a source (in `folder`, or
    kernels_dir()), the entries, their signatures and launch resources."""

    name: str = NAME
    label: str = LABEL
    source: str = SOURCE
    dtypes: tuple = DTYPES
    #: the gradients, not attention's output: the forward property suite cannot judge its mutants
    backward: bool = True
    folder: Path | None = None

    @property
    def source_path(self) -> Path:
        return (self.folder or kernels_dir()) / self.source

    def signatures(self) -> dict[str, list[str]]:
        return signatures()

    def entries(self) -> list[str]:
        return list(signatures())

    def resources(self, name: str) -> tuple[int, int]:
        """(threads per block, dynamic shared memory in bytes) that entry `name` is launched with."""
        kind, head_dim = entry_kind(name), int(name.rsplit("_d", 1)[1])
        if kind == "pre":
            return PRE_ROWS, 0
        if kind == "convert":
            return CONVERT_THREADS, 0
        return CONFIGS[head_dim].threads, shared_bytes(head_dim)


FA2_BWD = Fa2BackwardKernel()


# --- the runners ----------------------------------------------------------------------------------------

def cpu_kernel(source: str | None = None) -> Fa2BackwardKernel:
    """fa2_bwd.cu, or `source` (a mutated copy's text) saved beside fa_common.cuh in the runner's cache."""
    if source is None:
        return FA2_BWD
    return replace(FA2_BWD, folder=cached_source(NAME, SOURCE, source).parent)


def run_plan_on_cpu(the_plan: BackwardPlan, module) -> None:
    """Every launch of `the_plan` on `module` (a CpuKernelModule of fa2_bwd.cu); writes its buffers."""
    for launch in the_plan.launches:
        args = [the_plan.buffers[a] if isinstance(a, str) else a for a in launch.args]
        module.launch(launch.entry, launch.grid, launch.block, launch.shared_bytes, args,
                      shared_opt_in=launch.shared_bytes or None)


_GPU_MODULES: dict = {}
_GPU_LOCK = threading.Lock()


def _run_plan_on_pycuda(the_plan: BackwardPlan, source: str) -> None:
    """Every launch of `the_plan` through PyCUDA, in the selected device's primary context."""
    from fa_verify.kernels.pycuda_runner import cached_cubin, load_in_primary_context, run_launches

    key = hashlib.sha256(source.encode()).hexdigest()
    with _GPU_LOCK:
        if key not in _GPU_MODULES:
            folder = kernels_dir()
            _GPU_MODULES[key] = load_in_primary_context(lambda cuda, arch: cuda.module_from_buffer(cached_cubin(
                source, SOURCE, arch, [str(folder)], key_parts=[(folder / "fa_common.cuh").read_text()])))
        context, module = _GPU_MODULES[key]
    run_launches(context, module, the_plan.launches, the_plan.buffers, the_plan.outputs, what=NAME)


def run_fa2_backward(problem: AttentionProblem, out, lse, dout, *, runner: str = "cpu", deterministic: bool = False,
                     source: str | None = None):
    """(dq, dk, dv, dsinks) of `problem`: dq [B,H,Nq,D], dk, dv [B,Hkv,Nk,D] in the problem dtype, dsinks
    float32 [H] (None without sinks). out, lse: the forward's; dout: the upstream gradient of out.
    runner: "cpu" (the CUDA-on-CPU runner) or "pycuda"; deterministic: dQ without atomics, in a
    fixed order; source: the text to compile instead of kernels/fa2_bwd.cu (a mutant's)."""
    if runner not in RUNNERS:
        raise InvalidArgumentError(f"runner={runner!r}; use one of {', '.join(RUNNERS)}")
    the_plan = plan(problem, out, lse, dout, deterministic=deterministic)
    if runner == "cpu":
        from fa_verify.backends.cuda_kernels import cpu_module

        run_plan_on_cpu(the_plan, cpu_module(cpu_kernel(source)))
    else:
        _run_plan_on_pycuda(the_plan, source if source is not None else FA2_BWD.source_path.read_text())
    return gradients(the_plan, problem)


def gradients(the_plan: BackwardPlan, problem: AttentionProblem):
    """(dq, dk, dv, dsinks) as the plan's launches left them, dq/dk/dv in the problem dtype."""
    dq, dk, dv, dsinks = (the_plan.buffers[name] for name in the_plan.outputs)
    return (*(x.view(problem.q.dtype) for x in (dq, dk, dv)), dsinks)
