// fa_common.cuh: what every fa_verify attention kernel shares.
//
// The kernel ABI (fa_verify/kernels/catalogue.py describes each family in Python):
//
//   extern "C" __global__ void <family>_<dtype>_d<D>(
//       const T* q, const T* k, const T* v, T* o, float* lse,
//       int B, int H, int Hkv, int Nq, int Nk, float scale, int causal, int causal_offset);
//
//   T = __half (fp16), __nv_bfloat16 (bf16) or float (fp32); q [B,H,Nq,D], k and v [B,Hkv,Nk,D],
//   o [B,H,Nq,D], lse [B,H,Nq] (float32, natural log), all contiguous. Query head h reads key/value
//   head h / (H / Hkv). Query i attends key j iff !causal || j <= i + causal_offset, where
//   causal_offset = Nk - Nq aligns the mask bottom-right and 0 top-left. A row that attends no
//   key gets o = 0 and lse = -INFINITY, never NaN.
//
// The sources compile with nvcc and, through fa_verify's CUDA-on-CPU runner, with g++ and a
// force-included shim: they use only threadIdx/blockIdx/blockDim/gridDim, __shared__ memory,
// __syncthreads, full-warp shuffles reached by every thread of the block, the fp16/bf16
// conversions below, fp32 math functions and nvcuda::wmma (never its fragment layout).

#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define FA_DEVICE __device__ __forceinline__

// ---- element types ----------------------------------------------------------------------------

FA_DEVICE float to_float(float x) { return x; }
FA_DEVICE float to_float(__half x) { return __half2float(x); }
FA_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round a float to T (round to nearest even), as the kernel stores it.
template <typename T> FA_DEVICE T from_float(float x);
template <> FA_DEVICE float from_float<float>(float x) { return x; }
template <> FA_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> FA_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// x rounded to T and back: a value a kernel stores in T but keeps computing with in fp32.
template <typename T> FA_DEVICE float round_through(float x) { return to_float(from_float<T>(x)); }

// ---- problem geometry -------------------------------------------------------------------------

// How many keys query row i attends: keys 0 .. fa_key_limit - 1 (0 for a fully masked row).
FA_DEVICE int fa_key_limit(int i, int Nk, int causal, int causal_offset) {
    if (!causal) return Nk;
    int limit = i + causal_offset + 1;
    return limit < 0 ? 0 : (limit > Nk ? Nk : limit);
}

// Element offset of row `row` of head `head` in batch `b` of a [B, heads, N, D] tensor.
FA_DEVICE size_t fa_row_offset(int b, int head, int heads, int N, int row, int D) {
    return ((static_cast<size_t>(b) * heads + head) * N + row) * static_cast<size_t>(D);
}

// ---- dynamic shared memory ----------------------------------------------------------------------

// Each kernel declares `extern __shared__ __align__(16) unsigned char smem[];` in its body and
// carves it with SmemCarver{smem}. Regions of dynamic shared memory are carved in order, each rounded up to 128 bytes (wmma
// needs 256-bit aligned tile pointers). fa_verify/kernels/catalogue.py sums sizes by the same rule.
#define FA_SMEM_ALIGN 128

struct SmemCarver {
    unsigned char* next;
    template <typename U> FA_DEVICE U* take(int count) {
        U* region = reinterpret_cast<U*>(next);
        size_t bytes = static_cast<size_t>(count) * sizeof(U);
        next += (bytes + FA_SMEM_ALIGN - 1) / FA_SMEM_ALIGN * FA_SMEM_ALIGN;
        return region;
    }
};

// ---- warp reductions (every lane of the warp must call them) ------------------------------------

FA_DEVICE float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

FA_DEVICE float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// ---- entry points -------------------------------------------------------------------------------

#define FA_PARAMS(T)                                                                               \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o, \
        float* __restrict__ lse, int B, int H, int Hkv, int Nq, int Nk, float scale, int causal,  \
        int causal_offset
#define FA_ARGS q, k, v, o, lse, B, H, Hkv, Nq, Nk, scale, causal, causal_offset

// X(dtype_name, T, ...) once per problem dtype.
#define FA_FOR_EACH_DTYPE(X, ...)          \
    X(fp16, __half, __VA_ARGS__)           \
    X(bf16, __nv_bfloat16, __VA_ARGS__)    \
    X(fp32, float, __VA_ARGS__)

#define FA_FOR_EACH_HALF_DTYPE(X, ...)     \
    X(fp16, __half, __VA_ARGS__)           \
    X(bf16, __nv_bfloat16, __VA_ARGS__)
