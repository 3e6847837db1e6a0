// fa2_bwd.cu: a FlashAttention-2 style backward pass on CUDA cores, every dtype.
//
// Given the forward's inputs q [B,H,Nq,D], k, v [B,Hkv,Nk,D], its out [B,H,Nq,D] and lse [B,H,Nq]
// (fp32, natural log, -inf for a row that sees no key) and the upstream gradient dout [B,H,Nq,D],
// with P = exp(S - lse) (0 where masked) and S as fa2.cu computes it (scale q.k, then the softcap,
// then ALiBi; the same masks, diagonal offset o = causal_offset):
//   dV = P^T dO,  dP = dO V^T,  Delta_i = sum_c dO_ic O_ic,  dS = P o (dP - Delta)
//   (times 1 - tanh^2(scale q.k / softcap) with a softcap),  dQ = scale dS K,  dK = scale dS^T Q,
//   dsink_h = -sum_i exp(sink_h - lse_i) Delta_i.
// Four entries, launched in this order by fa_verify/kernels/backward.py:
// 1. fa2_bwd_pre_<dtype>_d<D>, grid (ceil(Nq / PRE_ROWS), H, B), PRE_ROWS threads: Delta in fp32,
//    one thread per row; zeroes the rows of the fp32 dQ workspace (when there is one) and adds
//    the block's share of dsinks (fp32 [H]) with one atomicAdd per warp (when sinks are on).
// 2. fa2_bwd_<dtype>_d<D>, grid (ceil(Nk / BLOCK_N), Hkv, B): one block per key tile of a kv
//    head. It holds the tile's K, V in shared memory and its dK, dV accumulators in fp32
//    registers, and loops over the query heads of the kv head's GQA group and, per head, over the
//    query tiles whose rows see a key of the tile: S recomputed in fp32 from Q, K; P = exp(S - lse)
//    in fp32; P rounded to T for dV += P^T dO; dP = dO V^T in fp32; dS = P (dP - Delta) in fp32,
//    rounded to T for dK += dS^T Q and for dQ's partial dS K, added (times scale) to the fp32 dQ
//    workspace [B,H,Nq,D] with atomicAdd (skipped when the workspace is null: deterministic
//    mode). The whole group in one block: dK, dV sum over the group's heads in registers, in a
//    fixed order, with no workspace, and are written once, scaled (dK) and rounded to T.
// 3. fa2_bwd_convert_<dtype>_d<D>, grid (ceil(B H Nq D / CONVERT_THREADS)): dq = workspace
//    rounded to T.
//    Deterministic mode instead runs
// 3'. fa2_bwd_dq_<dtype>_d<D>, grid (ceil(Nq / BLOCK_M), H, B): one block per query tile of a
//    head, looping over the key tiles it sees in order, dQ accumulated in fp32 registers (the same
//    P and dS as step 2, bit for bit) and written once: no atomics, a fixed order.
// dout (and out, in step 1) may be strided: batch, head and row strides in elements, columns
// contiguous. Everything else is contiguous. Precision model: FA2's backward (P and dS rounded to
// T before their products, fp32 accumulation). Shared memory holds the tiles in fp32 with rows
// padded by one float; backward.py computes its size.

#include "fa_common.cuh"

// Parameters of the main and dQ entries (one list: each uses what it needs).
#define FA2_BWD_PARAMS(T)                                                                                   \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout, \
        const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_accum,       \
        T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, int B, int H, int Hkv, int Nq, int Nk, \
        float scale, int causal, int causal_offset, int do_batch_stride, int do_head_stride,              \
        int do_row_stride, int window_left, int window_right, float softcap,                              \
        const float* __restrict__ alibi_slopes, int alibi_batch_stride
#define FA2_BWD_ARGS                                                                                        \
    q, k, v, dout, lse, delta, dq_accum, dq, dk, dv, B, H, Hkv, Nq, Nk, scale, causal, causal_offset,      \
        do_batch_stride, do_head_stride, do_row_stride, window_left, window_right, softcap, alibi_slopes, \
        alibi_batch_stride

#define FA2_BWD_PRE_PARAMS(T)                                                                          \
    const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,             \
        float* __restrict__ delta, float* __restrict__ dq_accum, float* __restrict__ dsinks,          \
        const float* __restrict__ sinks, int B, int H, int Nq, int o_batch_stride, int o_head_stride, \
        int o_row_stride, int do_batch_stride, int do_head_stride, int do_row_stride

// Element offset of row i of head h in batch b of a strided [B, H, N, D] tensor.
FA_DEVICE size_t fa2_bwd_strided_row(int b, int h, int i, int batch_stride, int head_stride, int row_stride) {
    return static_cast<size_t>(b) * batch_stride + static_cast<size_t>(h) * head_stride +
           static_cast<size_t>(i) * row_stride;
}

// 1. Delta = rowsum(dO o O), the dQ workspace zeroed, dsinks += -sum_i exp(sink - lse_i) Delta_i.
template <typename T, int D, int ROWS>
__device__ void fa2_bwd_pre(FA2_BWD_PRE_PARAMS(T)) {
    const int tid = threadIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int i = blockIdx.x * ROWS + tid;
    const size_t row = (static_cast<size_t>(b) * H + h) * Nq + i;
    float sink_term = 0.0f;
    if (i < Nq) {
        const T* o_row = out + fa2_bwd_strided_row(b, h, i, o_batch_stride, o_head_stride, o_row_stride);
        const T* do_row = dout + fa2_bwd_strided_row(b, h, i, do_batch_stride, do_head_stride, do_row_stride);
        float d = 0.0f;
        for (int c = 0; c < D; ++c) d += to_float(do_row[c]) * to_float(o_row[c]);
        delta[row] = d;
        // lse >= sink whenever there is a sink: the exp never overflows.
        if (sinks) sink_term = -expf(sinks[h] - lse[row]) * d;
        if (dq_accum)
            for (int c = 0; c < D; ++c) dq_accum[row * D + c] = 0.0f;
    }
    const float warp_term = warp_sum(sink_term);
    if (sinks && tid % 32 == 0) atomicAdd(dsinks + h, warp_term);
}

// The block's shared tiles (fp32, rows padded by one float) and per-row vectors, carved in the
// order backward.py sums them.
template <int D, int BLOCK_M, int BLOCK_N>
struct Fa2BwdTiles {
    static constexpr int LD = D + 1, LDS = BLOCK_N + 1;
    float *Qs, *dOs, *Ks, *Vs, *Ps, *dSs, *row_lse, *row_delta;
    FA_DEVICE explicit Fa2BwdTiles(unsigned char* smem) {
        SmemCarver carve{smem};
        Qs = carve.take<float>(BLOCK_M * LD);
        dOs = carve.take<float>(BLOCK_M * LD);
        Ks = carve.take<float>(BLOCK_N * LD);
        Vs = carve.take<float>(BLOCK_N * LD);
        Ps = carve.take<float>(BLOCK_M * LDS);   // P rounded to T
        dSs = carve.take<float>(BLOCK_M * LDS);  // dS rounded to T (without the scale)
        row_lse = carve.take<float>(BLOCK_M);
        row_delta = carve.take<float>(BLOCK_M);
    }
};

// Query rows m0 .. m0 + BLOCK_M - 1 of head h: Q and dO tiles, lse and Delta (rows past Nq: 0).
// The caller syncs.
template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
FA_DEVICE void fa2_bwd_load_queries(const Fa2BwdTiles<D, BLOCK_M, BLOCK_N>& t, FA2_BWD_PARAMS(T), int b, int h,
                                    int m0) {
    constexpr int LD = D + 1;
    fa_load_rows<BLOCK_M, D, LD, THREADS>(t.Qs, q + fa_row_offset(b, h, H, Nq, 0, D), m0, Nq);
    fa_load_rows<BLOCK_M, D, LD, THREADS>(
        t.dOs, dout + fa2_bwd_strided_row(b, h, 0, do_batch_stride, do_head_stride, 0), m0, Nq, do_row_stride);
    for (int r = threadIdx.x; r < BLOCK_M; r += THREADS) {
        const size_t row = (static_cast<size_t>(b) * H + h) * Nq + m0 + r;
        t.row_lse[r] = m0 + r < Nq ? lse[row] : 0.0f;
        t.row_delta[r] = m0 + r < Nq ? delta[row] : 0.0f;
    }
}

// P and dS of query rows m0.. (head h) against keys n0.. from the shared tiles, both rounded to T
// into t.Ps, t.dSs; masked entries (and rows past Nq, keys past Nk) are 0. Thread: key column
// j = tid % BLOCK_N, rows tid / BLOCK_N + STEP i. The caller syncs before and after.
template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
FA_DEVICE void fa2_bwd_p_and_ds(const Fa2BwdTiles<D, BLOCK_M, BLOCK_N>& t, FA2_BWD_PARAMS(T), int b, int h,
                                int m0, int n0) {
    static_assert(THREADS % BLOCK_N == 0 && (BLOCK_M * BLOCK_N) % THREADS == 0, "S tile split");
    constexpr int LD = D + 1, LDS = BLOCK_N + 1;
    constexpr int STEP = THREADS / BLOCK_N, PER_THREAD = BLOCK_M * BLOCK_N / THREADS;
    const int j = threadIdx.x % BLOCK_N, r0 = threadIdx.x / BLOCK_N, key = n0 + j;
    const int right = causal ? 0 : window_right;
    const float slope = alibi_slopes ? alibi_slopes[b * alibi_batch_stride + h] : 0.0f;
    float s[PER_THREAD], dp[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) s[i] = dp[i] = 0.0f;
    for (int d = 0; d < D; ++d) {
        const float kd = t.Ks[j * LD + d], vd = t.Vs[j * LD + d];
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            s[i] += t.Qs[(r0 + i * STEP) * LD + d] * kd;
            dp[i] += t.dOs[(r0 + i * STEP) * LD + d] * vd;
        }
    }
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int r = r0 + i * STEP, diag = m0 + r + causal_offset;
        // fa2.cu's order: scale, then the soft cap, then the ALiBi bias.
        float x = s[i] * scale, dtanh = 1.0f;
        if (softcap > 0.0f) {
            const float th = tanhf(x / softcap);
            x = softcap * th;
            dtanh = 1.0f - th * th;
        }
        x -= slope * static_cast<float>(abs(diag - key));
        const bool allowed = m0 + r < Nq && fa2_first_key(diag, window_left) <= key && key < fa2_key_limit(diag, right, Nk);
        // Masked entries never reach expf: a row that sees no key has lse = -inf.
        const float p = allowed ? expf(x - t.row_lse[r]) : 0.0f;
        float ds = p * (dp[i] - t.row_delta[r]);
        ds *= dtanh;
        t.Ps[r * LDS + j] = round_through<T>(p);
        t.dSs[r * LDS + j] = round_through<T>(ds);
    }
}

// acc[i][c] += sum_j dS[r][j] K[j][c] over the key tile, for query rows r = warp + WARPS i and
// columns lane + 32 c (in fp32; T, the input dtype, is what dS and K hold).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS, int ROWS, int COLS>
FA_DEVICE void fa2_bwd_ds_k(const Fa2BwdTiles<D, BLOCK_M, BLOCK_N>& t, float (&acc)[ROWS][COLS]) {
    constexpr int LD = D + 1, LDS = BLOCK_N + 1, WARPS = THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
        for (int j = 0; j < BLOCK_N; ++j) {
            const float ds = t.dSs[(warp + i * WARPS) * LDS + j];
#pragma unroll
            for (int c = 0; c < COLS; ++c)
                if (lane + 32 * c < D) acc[i][c] += ds * t.Ks[j * LD + lane + 32 * c];
        }
}

// store(at, scale acc[i][c]) for this thread's dQ entries below Nq and D: query row m0 + r
// (r = warp + WARPS i), column lane + 32 c, `at` its offset in a [B, H, Nq, D] tensor.
template <int D, int THREADS, int ROWS, int COLS, typename Store>
FA_DEVICE void fa2_bwd_each_dq(const float (&acc)[ROWS][COLS], int b, int h, int H, int Nq, int m0, float scale,
                               Store store) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int r = warp + i * (THREADS / 32);
        if (m0 + r >= Nq) continue;
        const size_t row = fa_row_offset(b, h, H, Nq, m0 + r, D);
#pragma unroll
        for (int c = 0; c < COLS; ++c)
            if (lane + 32 * c < D) store(row + lane + 32 * c, scale * acc[i][c]);
    }
}

// 2. One key tile of one kv head: dK, dV over the group's query heads, dQ's partials by atomicAdd.
template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
__device__ void fa2_bwd_key_tile(FA2_BWD_PARAMS(T)) {
    static_assert(THREADS % 32 == 0 && BLOCK_N % (THREADS / 32) == 0 && BLOCK_M % (THREADS / 32) == 0, "rows over warps");
    constexpr int LD = D + 1, LDS = BLOCK_N + 1, WARPS = THREADS / 32, COLS = (D + 31) / 32;
    constexpr int KV_ROWS = BLOCK_N / WARPS, Q_ROWS = BLOCK_M / WARPS;
    extern __shared__ __align__(16) unsigned char smem[];
    const Fa2BwdTiles<D, BLOCK_M, BLOCK_N> t(smem);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * BLOCK_N, kv_h = blockIdx.y, b = blockIdx.z, group = H / Hkv;
    const int right = causal ? 0 : window_right;

    fa_load_rows<BLOCK_N, D, LD, THREADS>(t.Ks, k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D), t.Vs,
                                          v + fa_row_offset(b, kv_h, Hkv, Nk, 0, D), n0, Nk);
    // Thread (warp, lane) owns dK, dV of key rows warp + WARPS i, columns lane + 32 c.
    float dk_acc[KV_ROWS][COLS] = {}, dv_acc[KV_ROWS][COLS] = {};

    // Query rows that see a key of n0 .. n1 - 1: diag + right >= n0 and diag - left <= n1 - 1.
    const int n1 = min(n0 + BLOCK_N, Nk);
    const int m_first = right < 0 ? 0 : max(0, n0 - causal_offset - right);
    const int m_end = window_left < 0 ? Nq : max(0, min(Nq, n1 - causal_offset + window_left));
    for (int g = 0; g < group; ++g) {
        const int h = kv_h * group + g;
        for (int m0 = m_first / BLOCK_M * BLOCK_M; m0 < m_end; m0 += BLOCK_M) {
            fa2_bwd_load_queries<T, D, BLOCK_M, BLOCK_N, THREADS>(t, FA2_BWD_ARGS, b, h, m0);
            __syncthreads();
            fa2_bwd_p_and_ds<T, D, BLOCK_M, BLOCK_N, THREADS>(t, FA2_BWD_ARGS, b, h, m0, n0);
            __syncthreads();
            // dV += P^T dO, dK += dS^T Q.
#pragma unroll
            for (int i = 0; i < KV_ROWS; ++i) {
                const int j = warp + i * WARPS;
                for (int r = 0; r < BLOCK_M; ++r) {
                    const float p = t.Ps[r * LDS + j], ds = t.dSs[r * LDS + j];
#pragma unroll
                    for (int c = 0; c < COLS; ++c)
                        if (lane + 32 * c < D) {
                            dv_acc[i][c] += p * t.dOs[r * LD + lane + 32 * c];
                            dk_acc[i][c] += ds * t.Qs[r * LD + lane + 32 * c];
                        }
                }
            }
            if (dq_accum) {
                float dq_part[Q_ROWS][COLS] = {};
                fa2_bwd_ds_k<T, D, BLOCK_M, BLOCK_N, THREADS>(t, dq_part);
                fa2_bwd_each_dq<D, THREADS>(dq_part, b, h, H, Nq, m0, scale,
                                            [&](size_t at, float x) { atomicAdd(dq_accum + at, x); });
            }
            __syncthreads();  // the next query tile overwrites Q, dO, P and dS
        }
    }

    // dK = scale dS^T Q and dV, rounded to T, for the tile's keys below Nk.
#pragma unroll
    for (int i = 0; i < KV_ROWS; ++i) {
        const int j = warp + i * WARPS;
        if (n0 + j >= Nk) continue;
        const size_t at = fa_row_offset(b, kv_h, Hkv, Nk, n0 + j, D);
#pragma unroll
        for (int c = 0; c < COLS; ++c)
            if (lane + 32 * c < D) {
                dk[at + lane + 32 * c] = from_float<T>(scale * dk_acc[i][c]);
                dv[at + lane + 32 * c] = from_float<T>(dv_acc[i][c]);
            }
    }
}

// 3'. Deterministic dQ: one query tile of one head over its key tiles in order.
template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
__device__ void fa2_bwd_query_tile(FA2_BWD_PARAMS(T)) {
    constexpr int LD = D + 1, WARPS = THREADS / 32, COLS = (D + 31) / 32, Q_ROWS = BLOCK_M / WARPS;
    extern __shared__ __align__(16) unsigned char smem[];
    const Fa2BwdTiles<D, BLOCK_M, BLOCK_N> t(smem);
    const int m0 = blockIdx.x * BLOCK_M, h = blockIdx.y, b = blockIdx.z, kv_h = h / (H / Hkv);
    const int right = causal ? 0 : window_right;

    fa2_bwd_load_queries<T, D, BLOCK_M, BLOCK_N, THREADS>(t, FA2_BWD_ARGS, b, h, m0);
    float dq_acc[Q_ROWS][COLS] = {};
    // Key tiles before the first row's window or at or past the last row's limit are fully masked.
    const int n_begin = fa2_first_key(m0 + causal_offset, window_left) / BLOCK_N * BLOCK_N;
    const int n_end = fa2_key_limit(min(m0 + BLOCK_M, Nq) - 1 + causal_offset, right, Nk);
    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        fa_load_rows<BLOCK_N, D, LD, THREADS>(t.Ks, k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D), t.Vs,
                                              v + fa_row_offset(b, kv_h, Hkv, Nk, 0, D), n0, Nk);
        __syncthreads();
        fa2_bwd_p_and_ds<T, D, BLOCK_M, BLOCK_N, THREADS>(t, FA2_BWD_ARGS, b, h, m0, n0);
        __syncthreads();
        fa2_bwd_ds_k<T, D, BLOCK_M, BLOCK_N, THREADS>(t, dq_acc);
        __syncthreads();  // the next key tile overwrites K, V, P and dS
    }
    fa2_bwd_each_dq<D, THREADS>(dq_acc, b, h, H, Nq, m0, scale, [&](size_t at, float x) { dq[at] = from_float<T>(x); });
}

// 3. dq = the fp32 workspace rounded to T.
template <typename T>
__device__ void fa2_bwd_convert(const float* __restrict__ dq_accum, T* __restrict__ dq, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) dq[i] = from_float<T>(dq_accum[i]);
}

// Entries per (dtype, D), with the tile configuration fa_verify/kernels/backward.py lists.
#define FA2_BWD_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS) fa2_bwd_##DT##_d##D(FA2_BWD_PARAMS(T)) {           \
        fa2_bwd_key_tile<T, D, BLOCK_M, BLOCK_N, THREADS>(FA2_BWD_ARGS);                                    \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS) fa2_bwd_dq_##DT##_d##D(FA2_BWD_PARAMS(T)) {        \
        fa2_bwd_query_tile<T, D, BLOCK_M, BLOCK_N, THREADS>(FA2_BWD_ARGS);                                  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA2_BWD_PRE_ROWS) fa2_bwd_pre_##DT##_d##D(FA2_BWD_PRE_PARAMS(T)) { \
        fa2_bwd_pre<T, D, FA2_BWD_PRE_ROWS>(out, dout, lse, delta, dq_accum, dsinks, sinks, B, H, Nq,       \
                                            o_batch_stride, o_head_stride, o_row_stride, do_batch_stride,   \
                                            do_head_stride, do_row_stride);                                 \
    }                                                                                                        \
    extern "C" __global__ void fa2_bwd_convert_##DT##_d##D(const float* __restrict__ dq_accum, T* __restrict__ dq, \
                                                           int count) {                                      \
        fa2_bwd_convert<T>(dq_accum, dq, count);                                                             \
    }

// Rows per block (and threads) of the preprocess entry.
#define FA2_BWD_PRE_ROWS 128

// (D, BLOCK_M, BLOCK_N, THREADS)
FA_FOR_EACH_DTYPE(FA2_BWD_ENTRY, 40, 32, 32, 128)
FA_FOR_EACH_DTYPE(FA2_BWD_ENTRY, 64, 32, 32, 128)
FA_FOR_EACH_DTYPE(FA2_BWD_ENTRY, 72, 32, 32, 128)
FA_FOR_EACH_DTYPE(FA2_BWD_ENTRY, 128, 32, 32, 128)
