// fa_common.cuh: what every fa_verify attention kernel shares.
//
// The kernel ABI (fa_verify/kernels/catalogue.py describes each family in Python):
//
//   extern "C" __global__ void <family>_<dtype>_d<D>(
//       const T* q, const T* k, const T* v, T* o, float* lse,
//       int B, int H, int Hkv, int Nq, int Nk, float scale, int causal, int causal_offset);
//
//   T = __half (fp16), __nv_bfloat16 (bf16) or float (fp32) (fa3_fp8.cu: __nv_fp8_e4m3 or
//   __nv_fp8_e5m2 with a bf16 o, FA_PARAMS_OUT, and its descales after); q [B,H,Nq,D], k and v [B,Hkv,Nk,D],
//   o [B,H,Nq,D], lse [B,H,Nq] (float32, natural log), all contiguous. Query head h reads key/value
//   head h / (H / Hkv). Query i attends key j iff !causal || j <= i + causal_offset, where
//   causal_offset = Nk - Nq aligns the mask bottom-right and 0 top-left (passed whether or not
//   the problem is causal: fa2's window and ALiBi use it too). A row that attends no key gets
//   o = 0 and lse = -INFINITY, never NaN. fa2 takes the variants after these parameters
//   (FA2_VARIANT_PARAMS in fa2.cu).
//
// The sources compile with nvcc and, through fa_verify's CUDA-on-CPU runner, with g++ and a
// force-included shim: they use only threadIdx/blockIdx/blockDim/gridDim, __shared__ memory,
// __syncthreads, full-warp shuffles reached by every thread of the block, the fp16/bf16
// conversions below, fp32 math functions, nvcuda::wmma (never its fragment layout) and, in
// mma_ptx.cu, inline PTX that relies on the PTX ISA's fragment layouts.

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

// The first key, and one past the last, that the query row with diagonal key `diag` (i + causal_offset)
// sees in flash-attn 2's window (left, right) (-1: unbounded; causal passes right = 0), within Nk.
FA_DEVICE int fa2_first_key(int diag, int left) { return left < 0 ? 0 : max(diag - left, 0); }
FA_DEVICE int fa2_key_limit(int diag, int right, int Nk) { return right < 0 ? Nk : max(0, min(diag + right + 1, Nk)); }

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

// ---- pieces of the FA2 tile loop (fa2.cu, wmma.cu) -----------------------------------------------
//
// Both kernels keep the softmax state of query row r (running max m, running sum l, fp32) in
// thread r < ROWS, and the fp32 output accumulator spread over the block: thread (warp, lane)
// owns acc[i][c] = row warp + WARPS i, column lane + 32 c of the block's ROWS x D tile.

// A shared-memory tile of U takes elements of T as they are (U = T) or widened to fp32 (U = float).
template <typename U> struct TileElement {
    template <typename T> static FA_DEVICE U from(T x) { return x; }
};
template <> struct TileElement<float> {
    template <typename T> static FA_DEVICE float from(T x) { return to_float(x); }
};

// Rows row0 .. row0 + ROWS - 1 of a [N, D] head (rows `row_stride` elements apart: D when
// contiguous) -> a shared tile of U with row stride LD; rows past N are zero. All THREADS threads
// of the block take part; the caller syncs. `zero` is converted once, before the loop:
// converting it per element costs nvcc a branch per element.
template <int ROWS, int D, int LD, int THREADS, typename U, typename T>
FA_DEVICE void fa_load_rows(U* tile, const T* head, int row0, int N, size_t row_stride = D) {
    const U zero = from_float<U>(0.0f);
    for (int idx = threadIdx.x; idx < ROWS * D; idx += THREADS) {
        const int r = idx / D, c = idx % D;
        tile[r * LD + c] = row0 + r < N ? TileElement<U>::from(head[static_cast<size_t>(row0 + r) * row_stride + c]) : zero;
    }
}

// The same rows of two heads (K and V) into two tiles, in one pass: nvcc gives two passes up
// to 30% more registers in wmma.cu.
template <int ROWS, int D, int LD, int THREADS, typename U, typename T>
FA_DEVICE void fa_load_rows(U* tile_a, const T* head_a, U* tile_b, const T* head_b, int row0, int N) {
    const U zero = from_float<U>(0.0f);
    for (int idx = threadIdx.x; idx < ROWS * D; idx += THREADS) {
        const int r = idx / D, c = idx % D;
        const bool in = row0 + r < N;
        const size_t g = static_cast<size_t>(row0 + r) * D + c;
        tile_a[r * LD + c] = in ? TileElement<U>::from(head_a[g]) : zero;
        tile_b[r * LD + c] = in ? TileElement<U>::from(head_b[g]) : zero;
    }
}

// The keys that query rows q0 .. q0 + ROWS - 1 attend all lie below this bound (the last row sees
// the most): key tiles at or past it are fully masked, and the tile loop stops before them.
FA_DEVICE int fa_key_end(int q0, int rows, int Nq, int Nk, int causal, int causal_offset) {
    const int last_row = (q0 + rows < Nq ? q0 + rows : Nq) - 1;
    return fa_key_limit(last_row, Nk, causal, causal_offset);
}

// What softmax subtracts before exp: the row max m, or 0 while the row has seen only masked
// keys (m = -inf), so that a masked score gives exp(-inf) = 0 and never exp(-inf - -inf) = NaN.
FA_DEVICE float fa_softmax_shift(float m) { return m == -INFINITY ? 0.0f : m; }

// P = exp(s - shift) over s_row[0 .. N): hands each p to store_p(j, p) and returns the fp32 sum of
// the p (FA2 sums P before it is rounded for P V).
template <int N, typename StoreP>
FA_DEVICE float fa_exp_row(const float* s_row, float shift, StoreP store_p) {
    float p_sum = 0.0f;
    for (int j = 0; j < N; ++j) {
        const float p = expf(s_row[j] - shift);
        p_sum += p;
        store_p(j, p);
    }
    return p_sum;
}

// The LSE of a row whose running max is m and sum of exp(s - m) is l: -inf for a row that
// attended no key (l = 0).
FA_DEVICE float fa_lse(float m, float l) { return l > 0.0f ? m + logf(l) : -INFINITY; }

// The epilogue of the tile loop: o = acc / l (rounded to T) and lse = m + log l for rows q0 .. q0 +
// ROWS - 1 of head h in batch b; a row that attended no key gets o = 0 and lse = -inf, never NaN.
// m and l are thread r's row r (r < ROWS); row_l is ROWS floats of shared memory that hand l to the
// threads owning the row's accumulator entries. Every thread of the block calls it.
template <int D, int ROWS, int O_ROWS, int O_COLS, typename T>
FA_DEVICE void fa_store_output(const float (&acc)[O_ROWS][O_COLS], float m, float l, float* row_l, T* o,
                               float* lse, int b, int h, int H, int Nq, int q0) {
    constexpr int WARPS = ROWS / O_ROWS;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    if (tid < ROWS) {
        row_l[tid] = l;
        if (q0 + tid < Nq) lse[(static_cast<size_t>(b) * H + h) * Nq + q0 + tid] = fa_lse(m, l);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < O_ROWS; ++i) {
        const int r = warp + i * WARPS;
        if (q0 + r >= Nq) continue;
        const float l_r = row_l[r];
        T* o_row = o + fa_row_offset(b, h, H, Nq, q0 + r, D);
#pragma unroll
        for (int c = 0; c < O_COLS; ++c)
            if (lane + 32 * c < D) o_row[lane + 32 * c] = from_float<T>(l_r > 0.0f ? acc[i][c] / l_r : 0.0f);
    }
}

// ---- entry points -------------------------------------------------------------------------------

#define FA_PARAMS(T) FA_PARAMS_OUT(T, T)
// The same with an output of another type O (fa3_fp8.cu: FP8 inputs, a bf16 output).
#define FA_PARAMS_OUT(T, O)                                                                        \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, O* __restrict__ o, \
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

// X(format_name, T, ...) once per FP8 format (a source using it includes <cuda_fp8.h>: fa3_fp8.cu).
#define FA_FOR_EACH_FP8_DTYPE(X, ...)      \
    X(e4m3, __nv_fp8_e4m3, __VA_ARGS__)    \
    X(e5m2, __nv_fp8_e5m2, __VA_ARGS__)
