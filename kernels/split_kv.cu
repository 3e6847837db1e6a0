// split_kv.cu: split-KV decode attention (FlashDecoding style) over a ragged batch, in two launches.
//
// The batch is B sequences; sequence b has Nq_b query rows (decode: 1, speculative decode: a few)
// and Nk_b keys, and its causal mask is bottom-right (query i sees key j iff j <= i + Nk_b - Nq_b).
// q is packed [total_q, H, D]: sequence b's rows are cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 (a
// paged problem's q [B, Nq, H, D] is the same memory with cu_seqlens_q[b] = b * Nq). The keys are
//   varlen (PAGED = false): k, v packed [total_k, Hkv, D], sequence b's keys from row
//     seqlens_k[b] (seqlens_k = cu_seqlens_k, [B+1]), Nk_b = seqlens_k[b+1] - seqlens_k[b];
//   paged (PAGED = true): k, v caches [num_blocks, page_size, Hkv, D]; key j of sequence b is slot
//     j % page_size of page block_table[b * max_blocks + j / page_size]; Nk_b = seqlens_k[b]
//     (seqlens_k = cache_seqlens, [B]).
// Query head h reads key/value head h / (H / Hkv).
// Variants, flash-attn 2's conventions (fa_verify/problem.py) with each sequence's own diagonal
// offset o = Nk_b - Nq_b: query i sees keys i + o - window_left ..= i + o + window_right (-1:
// unbounded; causal means window_right = 0); scores are scale q.k, then softcap tanh(s / softcap)
// when softcap > 0, then minus slope |i + o - j| (alibi_slopes [H], or [B, H] with
// alibi_batch_stride = H; null: off). A sink (sinks [H]; null: off) joins the merged softmax's
// denominator once, in the combine kernel: counted in every split it would be counted
// num_splits times.
//
// 1. split_kv_<layout>_<dtype>_d<D>, grid (num_splits, H, B): block (s, h, b) takes the key
//    tiles s * tiles_per_split .. (s + 1) * tiles_per_split - 1 of sequence b, where
//    tiles_per_split = ceil(ceil(max_seqlen_k / BLOCK_N) / num_splits) is the same for every
//    sequence (as FlashAttention-2 splits) and each sequence's own Nk_b bounds its keys. It runs
//    the FA2 tile loop of fa2.cu over them for every query tile of the sequence (fp32 scores and
//    online softmax, P rounded to T before P V) and writes the split's partial result in fp32:
//    o_partial [num_splits, total_q, H, D] = acc / l, and the split's LSE lse_s = m + log l as the
//    pair it stands for, lse_partial [2, num_splits, H, total_q] = (m, l). A split that sees no
//    key of a row writes o = 0, m = -inf, l = 0 for it. The pair, not m + log l rounded to fp32:
//    an fp32 LSE of magnitude 200 is off by up to 8e-6, and the merge's weights exp(lse_s - lse)
//    would pass that on to o as relative error (fp32 problems of large logits failed the honest-
//    ensemble rule so; the pair keeps the weights as accurate as fa2.cu's rescaling).
// 2. split_kv_combine_<layout>_<dtype>_d<D>, grid (B, H): the LSE-weighted merge of the splits,
//    with M = max_s m_s: w_s = l_s exp(m_s - M) = exp(lse_s - M), lse = M + log sum_s w_s,
//    o = sum_s w_s o_s / sum_s w_s, a sink adding e^(sink - M) to the sum (a split that saw no
//    key weighs 0; a row no split saw gets o = 0 and lse = -inf, or the sink), o rounded to T into out [total_q, H, D] and lse into the layout's LSE:
//    varlen [H, total_q], paged [B, H, Nq].
// FP8 KV cache (paged only: split_kv_paged_<e4m3|e5m2>_d<D>), FlashAttention-3's FP8 convention:
// q, k_cache, v_cache stored in FP8 with float32 descales q_descale, k_descale, v_descale, each
// [B, Hkv] (the host broadcasts a per-tensor k_scale / v_scale [1]); true value = stored x
// descale, q's read at the kv head of its group. The q.k descales fold into the softmax scale,
// (scale qd) kd; P = exp(s - m) 2^8 is rounded once to e4m3 (P_OFFSET_LOG2 = 8) with the row sum
// from fp32 P; a split's output is acc / l times v's descale, its pair (m, l 2^-8) so that the
// LSE needs no compensation. The combine writes bf16. Other entries pass null descales (1) and
// round P to T with no offset: their arithmetic is unchanged.
// The host side (tile sizes, grids, shared memory, scratch, num_splits' heuristic) is
// fa_verify/kernels/split_kv.py. Precision model: PrecisionModel.flash(dtype) (FP8: fa3_fp8).

#include "fa_common.cuh"
#include <cuda_fp8.h>

FA_DEVICE float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
FA_DEVICE float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }
template <> FA_DEVICE __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }

#define SPLIT_KV_PARAMS(T)                                                                           \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,                       \
        float* __restrict__ o_partial, float* __restrict__ lse_partial,                              \
        const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqlens_k,                     \
        const int* __restrict__ block_table, int B, int H, int Hkv, int max_seqlen_k, int max_blocks, \
        int page_size, int num_splits, float scale, int causal, int window_left, int window_right,   \
        float softcap, const float* __restrict__ alibi_slopes, int alibi_batch_stride,              \
        const float* __restrict__ q_descale, const float* __restrict__ k_descale,                    \
        const float* __restrict__ v_descale
#define SPLIT_KV_ARGS                                                                                \
    q, k, v, o_partial, lse_partial, cu_seqlens_q, seqlens_k, block_table, B, H, Hkv, max_seqlen_k,  \
        max_blocks, page_size, num_splits, scale, causal, window_left, window_right, softcap,        \
        alibi_slopes, alibi_batch_stride, q_descale, k_descale, v_descale

#define SPLIT_KV_COMBINE_PARAMS(T)                                                                   \
    const float* __restrict__ o_partial, const float* __restrict__ lse_partial, T* __restrict__ o,   \
        float* __restrict__ lse, const int* __restrict__ cu_seqlens_q, int B, int H, int num_splits,   \
        const float* __restrict__ sinks
#define SPLIT_KV_COMBINE_ARGS o_partial, lse_partial, o, lse, cu_seqlens_q, B, H, num_splits, sinks

// Keys of sequence b: cache_seqlens[b] (paged), or the difference of cu_seqlens_k (varlen).
template <bool PAGED> FA_DEVICE int sequence_keys(const int* seqlens_k, int b) {
    return PAGED ? seqlens_k[b] : seqlens_k[b + 1] - seqlens_k[b];
}

// Row of the K/V tensor (a [rows, Hkv, D] view of the packed keys or of the cache) holding key j
// of sequence b.
template <bool PAGED>
FA_DEVICE size_t key_row(const int* seqlens_k, const int* block_table, int max_blocks, int page_size, int b, int j) {
    if (!PAGED) return static_cast<size_t>(seqlens_k[b]) + j;
    const int page = block_table[static_cast<size_t>(b) * max_blocks + j / page_size];
    return static_cast<size_t>(page) * page_size + j % page_size;
}

// Keys key_lo .. key_hi - 1 that the query row with diagonal key `diag` (i + Nk - Nq) sees in
// the window (left, right) (-1: unbounded; causal passes right = 0), within the sequence's Nk.
FA_DEVICE int window_key_lo(int diag, int left) { return left < 0 ? 0 : max(diag - left, 0); }
FA_DEVICE int window_key_hi(int diag, int right, int Nk) { return right < 0 ? Nk : max(0, min(diag + right + 1, Nk)); }

// Index in the layout's LSE of row i of sequence b (its first packed row q_start), head h.
template <bool PAGED> FA_DEVICE size_t lse_index(int b, int h, int H, int q_start, int i, int Nq, int total_q) {
    return PAGED ? (static_cast<size_t>(b) * H + h) * Nq + i : static_cast<size_t>(h) * total_q + q_start + i;
}

// P is rounded to P_T after multiplying it by 2^P_OFFSET_LOG2 (FP8: e4m3 and 8; else T and 0).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS, bool PAGED, typename P_T, int P_OFFSET_LOG2>
__device__ void split_kv_partial(SPLIT_KV_PARAMS(T)) {
    static_assert(THREADS % 32 == 0 && THREADS >= BLOCK_M, "one softmax thread per query row");
    static_assert(THREADS % BLOCK_N == 0 && (BLOCK_M * BLOCK_N) % THREADS == 0, "S tile split");
    static_assert(BLOCK_M % (THREADS / 32) == 0, "P V rows split over warps");
    constexpr int LD = D + 1;                          // padded row of a Q/K/V tile (floats)
    constexpr int LDS = BLOCK_N + 1;                   // padded row of the S/P tile
    constexpr int S_ROWS_STEP = THREADS / BLOCK_N;     // S: thread -> (rows, one key)
    constexpr int S_PER_THREAD = BLOCK_M * BLOCK_N / THREADS;
    constexpr int WARPS = THREADS / 32;                // P V: lane -> columns, warp -> rows
    constexpr int O_ROWS = BLOCK_M / WARPS;
    constexpr int O_COLS = (D + 31) / 32;

    extern __shared__ __align__(16) unsigned char smem[];
    SmemCarver carve{smem};
    float* Qs = carve.take<float>(BLOCK_M * LD);
    float* Ks = carve.take<float>(BLOCK_N * LD);
    float* Vs = carve.take<float>(BLOCK_N * LD);
    float* Ss = carve.take<float>(BLOCK_M * LDS);      // scores, then P (rounded to T)
    float* row_alpha = carve.take<float>(BLOCK_M);     // this tile's rescale factor per row
    float* row_l = carve.take<float>(BLOCK_M);         // final row sums, for the epilogue

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kv_h = h / (H / Hkv);
    const int total_q = cu_seqlens_q[B];
    const int q_start = cu_seqlens_q[b], Nq = cu_seqlens_q[b + 1] - q_start;
    const int Nk = sequence_keys<PAGED>(seqlens_k, b);
    const int offset = Nk - Nq;                        // bottom-right diagonal of the sequence
    const int right = causal ? 0 : window_right;
    const float slope = alibi_slopes ? alibi_slopes[b * alibi_batch_stride + h] : 0.0f;
    // FP8: the q.k descales folded into the softmax scale, v's applied to the split's output
    const size_t group = static_cast<size_t>(b) * Hkv + kv_h;
    const float qk_scale = q_descale ? (scale * q_descale[group]) * k_descale[group] : scale;
    const float v_scale = v_descale ? v_descale[group] : 1.0f;
    constexpr float P_OFFSET = static_cast<float>(1 << P_OFFSET_LOG2);

    // This split's keys: the same tile range in every sequence, cut at the sequence's own end.
    const int tiles_per_split = ((max_seqlen_k + BLOCK_N - 1) / BLOCK_N + num_splits - 1) / num_splits;
    const int split_begin = split * tiles_per_split * BLOCK_N;
    const int split_end = min(Nk, split_begin + tiles_per_split * BLOCK_N);

    for (int q0 = 0; q0 < Nq; q0 += BLOCK_M) {
        // Q tile -> shared (fp32), rows past Nq zero.
        for (int idx = tid; idx < BLOCK_M * D; idx += THREADS) {
            const int r = idx / D, c = idx % D;
            Qs[r * LD + c] = q0 + r < Nq ? to_float(q[(static_cast<size_t>(q_start + q0 + r) * H + h) * D + c]) : 0.0f;
        }
        float m_i = -INFINITY, l_i = 0.0f;
        float acc[O_ROWS][O_COLS] = {};
        const int n_end = min(split_end, window_key_hi(min(q0 + BLOCK_M, Nq) - 1 + offset, right, Nk));

        for (int n0 = split_begin; n0 < n_end; n0 += BLOCK_N) {
            // K, V tiles -> shared (fp32), gathered key by key; keys past the split zero.
            for (int idx = tid; idx < BLOCK_N * D; idx += THREADS) {
                const int r = idx / D, c = idx % D;
                float kd = 0.0f, vd = 0.0f;
                if (n0 + r < n_end) {
                    const size_t row = key_row<PAGED>(seqlens_k, block_table, max_blocks, page_size, b, n0 + r);
                    const size_t g = (row * Hkv + kv_h) * D + c;
                    kd = to_float(k[g]);
                    vd = to_float(v[g]);
                }
                Ks[r * LD + c] = kd;
                Vs[r * LD + c] = vd;
            }
            __syncthreads();

            // S = scale * Q K^T; thread owns key column j and rows r0, r0 + S_ROWS_STEP, ...
            {
                const int j = tid % BLOCK_N, r0 = tid / BLOCK_N;
                float s[S_PER_THREAD];
#pragma unroll
                for (int i = 0; i < S_PER_THREAD; ++i) s[i] = 0.0f;
                for (int d = 0; d < D; ++d) {
                    const float kd = Ks[j * LD + d];
#pragma unroll
                    for (int i = 0; i < S_PER_THREAD; ++i) s[i] += Qs[(r0 + i * S_ROWS_STEP) * LD + d] * kd;
                }
#pragma unroll
                for (int i = 0; i < S_PER_THREAD; ++i) {
                    const int r = r0 + i * S_ROWS_STEP, diag = q0 + r + offset, key = n0 + j;
                    const bool allowed = key < n_end && window_key_lo(diag, window_left) <= key &&
                                         key < window_key_hi(diag, right, Nk);
                    // flash-attn 2's order: scale, then the soft cap, then the ALiBi bias.
                    float x = s[i] * qk_scale;
                    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                    x -= slope * fabsf(static_cast<float>(diag - key));
                    Ss[r * LDS + j] = allowed ? x : -INFINITY;
                }
            }
            __syncthreads();

            // Online softmax: thread r updates row r's running max and sum.
            if (tid < BLOCK_M) {
                float* s_row = Ss + tid * LDS;
                float m_tile = -INFINITY;
                for (int j = 0; j < BLOCK_N; ++j) m_tile = fmaxf(m_tile, s_row[j]);
                const float m_new = fmaxf(m_i, m_tile);
                const float shift = fa_softmax_shift(m_new);
                const float alpha = expf(m_i - shift);
                const float p_sum = fa_exp_row<BLOCK_N>(
                    s_row, shift, [&](int j, float p) { s_row[j] = round_through<P_T>(p * P_OFFSET); });
                l_i = alpha * l_i + p_sum * P_OFFSET;
                m_i = m_new;
                row_alpha[tid] = alpha;
            }
            __syncthreads();

            // acc = alpha * acc + P V; lane owns columns lane, lane + 32, ..., warp owns rows.
#pragma unroll
            for (int i = 0; i < O_ROWS; ++i) {
                const int r = warp + i * WARPS;
                const float alpha = row_alpha[r];
#pragma unroll
                for (int c = 0; c < O_COLS; ++c) acc[i][c] *= alpha;
                for (int j = 0; j < BLOCK_N; ++j) {
                    const float p = Ss[r * LDS + j];
#pragma unroll
                    for (int c = 0; c < O_COLS; ++c)
                        if (lane + 32 * c < D) acc[i][c] += p * Vs[j * LD + lane + 32 * c];
                }
            }
            __syncthreads();  // the next tile overwrites K, V and S
        }

        // The split's partial result: o = acc / l and (m, l) (0, -inf and 0 for a row it saw no key of).
        if (tid < BLOCK_M) {
            row_l[tid] = l_i;
            if (q0 + tid < Nq) {
                const size_t at = (static_cast<size_t>(split) * H + h) * total_q + q_start + q0 + tid;
                lse_partial[at] = m_i;
                lse_partial[static_cast<size_t>(num_splits) * H * total_q + at] = l_i / P_OFFSET;
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < O_ROWS; ++i) {
            const int r = warp + i * WARPS;
            if (q0 + r >= Nq) continue;
            const float l_r = row_l[r];
            float* o_row = o_partial + ((static_cast<size_t>(split) * total_q + q_start + q0 + r) * H + h) * D;
#pragma unroll
            for (int c = 0; c < O_COLS; ++c)
                if (lane + 32 * c < D) o_row[lane + 32 * c] = l_r > 0.0f ? acc[i][c] / l_r * v_scale : 0.0f;
        }
        __syncthreads();  // the next query tile overwrites Q and row_l
    }
}

template <typename T, int D, bool PAGED>
__device__ void split_kv_combine(SPLIT_KV_COMBINE_PARAMS(T)) {
    const int b = blockIdx.x, h = blockIdx.y;
    const int total_q = cu_seqlens_q[B];
    const float* m_partial = lse_partial;                                          // [num_splits, H, total_q]
    const float* l_partial = lse_partial + static_cast<size_t>(num_splits) * H * total_q;
    const int q_start = cu_seqlens_q[b], Nq = cu_seqlens_q[b + 1] - q_start;
    for (int i = 0; i < Nq; ++i) {
        const int row = q_start + i;
        // Every thread merges the row's (m, l) pairs itself (num_splits is small): no barrier needed.
        // A sink joins the merged softmax once, as one more split of max sinks[h] and sum 1.
        float m = sinks ? sinks[h] : -INFINITY;
        for (int s = 0; s < num_splits; ++s) m = fmaxf(m, m_partial[(static_cast<size_t>(s) * H + h) * total_q + row]);
        const float shift = fa_softmax_shift(m);
        // w_s = l_s exp(m_s - M): 0 for a split that saw no key (l_s = 0, m_s = -inf).
        const auto weight = [&](int s) {
            const size_t at = (static_cast<size_t>(s) * H + h) * total_q + row;
            return l_partial[at] * expf(m_partial[at] - shift);
        };
        float l = sinks ? expf(sinks[h] - shift) : 0.0f;
        for (int s = 0; s < num_splits; ++s) l += weight(s);
        if (threadIdx.x == 0) lse[lse_index<PAGED>(b, h, H, q_start, i, Nq, total_q)] = fa_lse(m, l);
        for (int c = threadIdx.x; c < D; c += blockDim.x) {
            float acc = 0.0f;
            for (int s = 0; s < num_splits; ++s)
                acc += weight(s) * o_partial[((static_cast<size_t>(s) * total_q + row) * H + h) * D + c];
            o[(static_cast<size_t>(row) * H + h) * D + c] = from_float<T>(l > 0.0f ? acc / l : 0.0f);
        }
    }
}

// Entries per (layout, dtype, D), with the tile configuration fa_verify/kernels/split_kv.py lists.
#define SPLIT_KV_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) split_kv_varlen_##DT##_d##D(SPLIT_KV_PARAMS(T)) { \
        split_kv_partial<T, D, BLOCK_M, BLOCK_N, THREADS, false, T, 0>(SPLIT_KV_ARGS);                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) split_kv_paged_##DT##_d##D(SPLIT_KV_PARAMS(T)) {  \
        split_kv_partial<T, D, BLOCK_M, BLOCK_N, THREADS, true, T, 0>(SPLIT_KV_ARGS);                     \
    }                                                                                                      \
    extern "C" __global__ void split_kv_combine_varlen_##DT##_d##D(SPLIT_KV_COMBINE_PARAMS(T)) {            \
        split_kv_combine<T, D, false>(SPLIT_KV_COMBINE_ARGS);                                             \
    }                                                                                                      \
    extern "C" __global__ void split_kv_combine_paged_##DT##_d##D(SPLIT_KV_COMBINE_PARAMS(T)) {             \
        split_kv_combine<T, D, true>(SPLIT_KV_COMBINE_ARGS);                                              \
    }

// An FP8 KV cache's entries (paged): P in e4m3 offset by 2^8, the combine's output bf16.
#define SPLIT_KV_FP8_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) split_kv_paged_##DT##_d##D(SPLIT_KV_PARAMS(T)) {  \
        split_kv_partial<T, D, BLOCK_M, BLOCK_N, THREADS, true, __nv_fp8_e4m3, 8>(SPLIT_KV_ARGS);         \
    }                                                                                                      \
    extern "C" __global__ void split_kv_combine_paged_##DT##_d##D(SPLIT_KV_COMBINE_PARAMS(__nv_bfloat16)) { \
        split_kv_combine<__nv_bfloat16, D, true>(SPLIT_KV_COMBINE_ARGS);                                  \
    }
#define SPLIT_KV_FOR_EACH_FP8(X, ...) X(e4m3, __nv_fp8_e4m3, __VA_ARGS__) X(e5m2, __nv_fp8_e5m2, __VA_ARGS__)

// (D, BLOCK_M, BLOCK_N, THREADS)
FA_FOR_EACH_DTYPE(SPLIT_KV_ENTRY, 64, 16, 32, 128)
FA_FOR_EACH_DTYPE(SPLIT_KV_ENTRY, 128, 16, 32, 128)
SPLIT_KV_FOR_EACH_FP8(SPLIT_KV_FP8_ENTRY, 64, 16, 32, 128)
SPLIT_KV_FOR_EACH_FP8(SPLIT_KV_FP8_ENTRY, 128, 16, 32, 128)
