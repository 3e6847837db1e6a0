"""Run CUDA C kernels on a machine without a GPU.

The same ``.cu`` source that nvcc/PyCUDA compile is built with the host g++ against a shim
(``include/``) and run by a fiber scheduler (``runtime/``): one fiber per CUDA thread, blocks in
order, deterministic. Launches run in a worker process, so crashes, hangs and AddressSanitizer
reports become exceptions::

    from fa_verify.cuda_cpu import CpuKernelModule
    mod = CpuKernelModule("kernels/fa2.cu", {"fa2_fp16_d64": ["ptr"] * 5 + ["int"] * 5 + ["float", "int", "int"]})
    mod.launch("fa2_fp16_d64", grid=(nq_tiles, H, B), block=128, shared_bytes=smem, args=[q, k, v, o, lse, ...],
               shared_opt_in=smem)  # cudaFuncAttributeMaxDynamicSharedMemorySize, needed above 48 KiB

An entry may be a template instantiation (``"flash_fwd<64, 32, __half>"``), and a published file
builds as it is with ``set_aside_host_code=True``; `fa_verify check kernel.cu --spec kernel.toml`
(fa_verify.kernels.spec) does both from a kernel spec.

``racecheck=True`` builds the race detector's version (runtime/race_runtime.cpp): a launch raises
KernelRaceError, with both accesses' file:line, for conflicting accesses to shared or global memory
that no __syncthreads, __syncwarp or atomics order.

Modules: _build (compile + cache), _ptx (inline PTX into calls of include/fa_cuda_cpu_ptx.h),
_rewrite (__shared__ and unsupported constructs), _host_code (a published file's host code set
aside), _shared_limits (the 48 KiB default and the arch's maximum), _trampolines (typed
launchers), _diagnostics (build-error hints), _module (CpuKernelModule), _process (the worker's
parent side), _worker / _exec (the worker's side), _race (the race detector's reports).
"""

from fa_verify.cuda_cpu._build import SHIM_DIR, BuildResult, build, default_cache_dir
from fa_verify.cuda_cpu._module import ORDERS, CpuKernelModule, Inside
from fa_verify.cuda_cpu._process import shutdown_workers

#: What a kernel may use on the CPU runner. Anything else fails the build, naming the construct.
SUPPORTED = (
    "__global__/__device__/__host__/__forceinline__/__noinline__/__launch_bounds__/__align__/__restrict__",
    "threadIdx, blockIdx, blockDim, gridDim, warpSize; dim3, uint3 and the CUDA vector types (float4, int2, ...)",
    "static __shared__, in kernels, templates and inline functions (per block; NaN-filled at block start) and "
    "extern __shared__ arrays (dynamic: 48 KiB without the opt-in, the arch's maximum with it)",
    "template kernels: an entry is a name or an instantiation written as in C++ ('flash_fwd<64, 32, __half>')",
    "__syncthreads, __syncthreads_count/_and/_or, __syncwarp, __threadfence*, __nanosleep (yields)",
    "__shfl_sync, __shfl_up_sync, __shfl_down_sync, __shfl_xor_sync (with width), __ballot_sync, "
    "__any_sync, __all_sync, __activemask",
    "cuda_fp16.h / cuda_bf16.h: __half, __half2, __nv_bfloat16, __nv_bfloat162, conversions (_rn/_rz/_rd/_ru, "
    "bit-exact, NaN -> 0x7FFF), operators, __hadd/__hmul/__hfma/__hmax/..., hexp/hlog/hsqrt/...",
    "cuda_fp8.h: __nv_fp8_storage_t/x2/x4, __nv_saturation_t, __nv_fp8_interpretation_t, __nv_cvt_{float,double,"
    "halfraw,bfloat16raw}[2]_to_fp8[x2], __nv_cvt_fp8[x2]_to_halfraw[2], __nv_fp8{,x2,x4}_{e4m3,e5m2} (constructors "
    "saturating, explicit widening conversions), bit-exact with CUDA's header (round to nearest even; SATFINITE "
    "and NOSAT as CUDA has them)",
    "mma.h: nvcuda::wmma fragments m16n16k16/m32n8k16/m8n32k16, __half/__nv_bfloat16 inputs, float/__half "
    "accumulators, and m16n16k8 precision::tf32 inputs with float accumulators (wmma::__float_to_tf32 rounds "
    "as cvt.rna; mma_sync reads the inputs' 19 high bits), fill_fragment, load_matrix_sync, mma_sync, "
    "store_matrix_sync (whole tile per thread)",
    "libm float/double math (expf, exp2f, logf, fmaxf, rsqrtf, ...); __expf, __logf, __powf, __fdividef "
    "as the GPU's approximation formulas; min/max overloads; __float_as_int and friends; __popc, __clz, __ffs, __brev",
    "atomicAdd/Sub/Exch/Min/Max/And/Or/Xor/Inc/Dec/CAS on int, unsigned, unsigned long long (and float/double add)",
    "__ldg/__ldcg/__ldcs/... and __stcg/__stcs/... (plain memory), printf, assert, __trap, clock64 (a counter)",
    "math_constants.h (CUDART_*), cuda_runtime.h (no host API)",
    "inline PTX (asm statements): mma.sync.aligned.m16n8k16/m16n8k8.row.col.f32.{f16,bf16}.{f16,bf16}.f32, "
    "ldmatrix.sync.aligned.m8n8.x1/.x2/.x4{.trans}{.shared}.b16 (the ISA's fragment layouts, exchanged between "
    "the lanes of a warp), cp.async.ca/.cg.shared.global (src-size zero fill) with commit_group/wait_group/"
    "wait_all (copies land at the wait), ld.global{.nc}{.v2,.v4}.{b32,u32,s32,f32}, ex2.approx{.ftz}.f32, "
    "tanh.approx.f32, cvt.rn.f16x2/bf16x2.f32, shfl.sync.up/down/bfly/idx.b32; "
    "__cvta_generic_to_shared",
    "cooperative_groups: this_thread_block() (sync, thread_rank, size, ...), tiled_partition<N> for N a power of two "
    "up to 32 (sync, thread_rank, meta_group_rank/size, shfl, shfl_xor/up/down, ballot/any/all), cg::reduce with "
    "plus/less/greater/bit_and/bit_or/bit_xor (a butterfly over the tile)",
)

#: Refused with a clear build error.
UNSUPPORTED = (
    "any other inline assembly (the build error names the instruction), asm labels, __managed__ memory",
    "cooperative_groups' grid, multi-grid, cluster and coalesced groups and dynamic tiled_partition; "
    "the use of cuda_pipeline (use cp.async PTX), cuda_awbarrier and cg::memcpy_async "
    "(their headers may be included unused); cuda_fp8.h's e8m0, e2m1, e2m3, e3m2 (CUDA 12.8+) and fp8 arithmetic",
    "wmma with integer or sub-byte types; atomics on __half/__nv_bfloat16",
    "texture and surface objects, dynamic parallelism, host runtime API calls inside the source",
)

__all__ = [
    "SHIM_DIR",
    "SUPPORTED",
    "UNSUPPORTED",
    "ORDERS",
    "BuildResult",
    "CpuKernelModule",
    "Inside",
    "build",
    "default_cache_dir",
    "shutdown_workers",
]
