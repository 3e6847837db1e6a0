// naive.cu: standard attention that materialises S, the baseline of the FlashAttention-3 and
// Golden et al. (2024) accuracy comparisons. No tiling over keys, no online softmax:
//   1. S = scale Q K^T (fp32 dot products), stored to global memory as S_T;
//   2. P = softmax(S) row by row (fp32 max, exp and sum; P normalised), stored over S as S_T;
//   3. O = P V (fp32 accumulation), rounded to T.
// Two families from one body, by the type S_T of the materialised S and P:
//   naive_<dtype>_d<D>    S_T = float: softmax in fp32, only O rounded to T (every dtype).
//                          Precision model: PrecisionModel.fp32_accumulate(dtype).
//   naive16_<dtype>_d<D>  S_T = T (fp16/bf16): as eager PyTorch computes softmax(QK^T)V in the
//                          input dtype, S and P rounded to T. Precision model: score and P in T
//                          (S is accumulated in fp32 and rounded once; the model's "score
//                          accumulated in T" over-covers it), P V in fp32.
//
// Signature: the common one plus a trailing scratch pointer for S and P:
//   naive_<dtype>_d<D>(q, k, v, o, lse, B, H, Hkv, Nq, Nk, scale, causal, causal_offset, S_T* scratch)
// scratch holds B * H * Nq * Nk elements of S_T. Grid (ceil(Nq / ROWS), H, B), THREADS threads,
// no shared memory.

#include "fa_common.cuh"

template <typename T, typename S_T, int D, int ROWS, int THREADS>
__device__ void naive_forward(FA_PARAMS(T), S_T* __restrict__ scratch) {
    static_assert(THREADS % 32 == 0 && ROWS % (THREADS / 32) == 0, "rows split evenly over warps");
    constexpr int WARPS = THREADS / 32;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int q0 = blockIdx.x * ROWS, h = blockIdx.y, b = blockIdx.z;
    const int kv_h = h / (H / Hkv);
    const T* k_head = k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    const T* v_head = v + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    S_T* s_block = scratch + fa_row_offset(b, h, H, Nq, q0, Nk);  // S rows q0 .. q0 + ROWS - 1

    // 1. S = scale * Q K^T, stored as S_T; masked entries -inf.
    for (int idx = tid; idx < ROWS * Nk; idx += THREADS) {
        const int r = idx / Nk, j = idx % Nk, i = q0 + r;
        if (i >= Nq) continue;
        const T* q_row = q + fa_row_offset(b, h, H, Nq, i, D);
        const T* k_row = k_head + static_cast<size_t>(j) * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += to_float(q_row[d]) * to_float(k_row[d]);
        const bool allowed = j < fa_key_limit(i, Nk, causal, causal_offset);
        s_block[static_cast<size_t>(r) * Nk + j] = from_float<S_T>(allowed ? dot * scale : -INFINITY);
    }
    __syncthreads();

    // 2. P = softmax(S) row by row, one warp per row. Every warp runs ROWS / WARPS rows, rows
    //    past Nq included (as empty rows), so that all threads reach the same shuffles.
    for (int r = warp; r < ROWS; r += WARPS) {
        const int i = q0 + r;
        const bool valid = i < Nq;
        S_T* s_row = s_block + static_cast<size_t>(r) * Nk;
        float m = -INFINITY;
        if (valid)
            for (int j = lane; j < Nk; j += 32) m = fmaxf(m, to_float(s_row[j]));
        m = warp_max(m);
        const float shift = fa_softmax_shift(m);
        float l = 0.0f;
        if (valid)
            for (int j = lane; j < Nk; j += 32) l += expf(to_float(s_row[j]) - shift);
        l = warp_sum(l);
        if (valid)
            for (int j = lane; j < Nk; j += 32)
                s_row[j] = from_float<S_T>(l > 0.0f ? expf(to_float(s_row[j]) - shift) / l : 0.0f);
        if (valid && lane == 0)
            lse[(static_cast<size_t>(b) * H + h) * Nq + i] = fa_lse(m, l);
    }
    __syncthreads();

    // 3. O = P V, fp32 accumulation, rounded to T.
    for (int idx = tid; idx < ROWS * D; idx += THREADS) {
        const int r = idx / D, c = idx % D, i = q0 + r;
        if (i >= Nq) continue;
        const S_T* p_row = s_block + static_cast<size_t>(r) * Nk;
        float acc = 0.0f;
        for (int j = 0; j < Nk; ++j) acc += to_float(p_row[j]) * to_float(v_head[static_cast<size_t>(j) * D + c]);
        o[fa_row_offset(b, h, H, Nq, i, D) + c] = from_float<T>(acc);
    }
}

#define NAIVE_ENTRY(DT, T, D, ROWS, THREADS)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS) naive_##DT##_d##D(FA_PARAMS(T), float* scratch) { \
        naive_forward<T, float, D, ROWS, THREADS>(FA_ARGS, scratch);                               \
    }
#define NAIVE16_ENTRY(DT, T, D, ROWS, THREADS)                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) naive16_##DT##_d##D(FA_PARAMS(T), T* scratch) { \
        naive_forward<T, T, D, ROWS, THREADS>(FA_ARGS, scratch);                                   \
    }

// FA_CONFIG(D, ROWS, THREADS)
FA_FOR_EACH_DTYPE(NAIVE_ENTRY, 16, 16, 128)
FA_FOR_EACH_DTYPE(NAIVE_ENTRY, 32, 16, 128)
FA_FOR_EACH_DTYPE(NAIVE_ENTRY, 64, 16, 128)
FA_FOR_EACH_DTYPE(NAIVE_ENTRY, 96, 16, 128)
FA_FOR_EACH_DTYPE(NAIVE_ENTRY, 128, 16, 128)
FA_FOR_EACH_DTYPE(NAIVE_ENTRY, 256, 16, 128)
FA_FOR_EACH_HALF_DTYPE(NAIVE16_ENTRY, 16, 16, 128)
FA_FOR_EACH_HALF_DTYPE(NAIVE16_ENTRY, 32, 16, 128)
FA_FOR_EACH_HALF_DTYPE(NAIVE16_ENTRY, 64, 16, 128)
FA_FOR_EACH_HALF_DTYPE(NAIVE16_ENTRY, 96, 16, 128)
FA_FOR_EACH_HALF_DTYPE(NAIVE16_ENTRY, 128, 16, 128)
FA_FOR_EACH_HALF_DTYPE(NAIVE16_ENTRY, 256, 16, 128)
