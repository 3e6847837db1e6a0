// wmma.cu: a FlashAttention-2 style forward kernel on tensor cores (nvcuda::wmma 16x16x16,
// fp32 accumulation), fp16 and bf16, D a multiple of 16.
//
// Same tile loop as fa2.cu: grid (ceil(Nq / BLOCK_M), H, B), K/V tiles of BLOCK_N keys streamed
// through shared memory, running max m and sum l per row in fp32, output rescaled per tile.
// Per key tile:
//   1. S = Q K^T on tensor cores, 16x16 fragments stored to shared memory (fp32);
//   2. online softmax on shared memory, one thread per row: mask, scale, m_new, alpha, P (fp32 P
//      into the row sum, P rounded to T for the product);
//   3. the tile's P V on tensor cores (fp32), stored to shared memory, then added to the fp32
//      accumulator: acc = alpha acc + P V, each thread owning fixed (row, column) entries.
// Fragments are only loaded from and stored to shared memory: the kernel never relies on which
// element of a fragment a lane holds, and never stores a fragment over memory the same warp
// reads into a fragment in the same step. Precision model: PrecisionModel.flash(dtype).

#include "fa_common.cuh"
#include <mma.h>

using namespace nvcuda;

template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
__device__ void wmma_forward(FA_PARAMS(T)) {
    static_assert(D % 16 == 0 && BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "16x16x16 tiles");
    static_assert(THREADS % 32 == 0 && THREADS >= BLOCK_M, "one softmax thread per query row");
    constexpr int WARPS = THREADS / 32;
    // Every warp runs the same number of fragment products (the CPU runner needs it too).
    constexpr int S_FRAGS = (BLOCK_M / 16) * (BLOCK_N / 16), O_FRAGS = (BLOCK_M / 16) * (D / 16);
    static_assert(S_FRAGS % WARPS == 0 && O_FRAGS % WARPS == 0, "fragments split evenly over warps");
    static_assert(BLOCK_M % WARPS == 0, "accumulator rows split over warps");
    constexpr int LDT = D + 8;                   // padded rows (elements) of the Q, K, V tiles
    constexpr int LDS = BLOCK_N + 4;             // S tile (fp32)
    constexpr int LDP = BLOCK_N + 8;             // P tile (T)
    constexpr int LDO = D + 4;                   // this tile's P V (fp32)
    constexpr int O_ROWS = BLOCK_M / WARPS, O_COLS = (D + 31) / 32;  // accumulator entries per thread
    using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
    using FragKt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;  // K^T
    using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
    using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

    extern __shared__ __align__(16) unsigned char smem[];
    SmemCarver carve{smem};
    T* Qs = carve.take<T>(BLOCK_M * LDT);
    T* Ks = carve.take<T>(BLOCK_N * LDT);
    T* Vs = carve.take<T>(BLOCK_N * LDT);
    float* Ss = carve.take<float>(BLOCK_M * LDS);
    T* Ps = carve.take<T>(BLOCK_M * LDP);
    float* PVs = carve.take<float>(BLOCK_M * LDO);
    float* row_alpha = carve.take<float>(BLOCK_M);   // this tile's rescale factor, then 1 / l

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int q0 = blockIdx.x * BLOCK_M, h = blockIdx.y, b = blockIdx.z;
    const int kv_h = h / (H / Hkv);
    const T* q_head = q + fa_row_offset(b, h, H, Nq, 0, D);
    const T* k_head = k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    const T* v_head = v + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    const T zero = from_float<T>(0.0f);

    // Q tile -> shared, rows past Nq zero.
    for (int idx = tid; idx < BLOCK_M * D; idx += THREADS) {
        int r = idx / D, c = idx % D;
        Qs[r * LDT + c] = q0 + r < Nq ? q_head[static_cast<size_t>(q0 + r) * D + c] : zero;
    }

    // Softmax state of row `tid` (threads tid < BLOCK_M) and this thread's accumulator entries:
    // rows warp + WARPS i, columns lane + 32 c.
    float m_i = -INFINITY, l_i = 0.0f;
    float acc[O_ROWS][O_COLS];
#pragma unroll
    for (int i = 0; i < O_ROWS; ++i)
#pragma unroll
        for (int c = 0; c < O_COLS; ++c) acc[i][c] = 0.0f;

    const int last_row = (q0 + BLOCK_M < Nq ? q0 + BLOCK_M : Nq) - 1;
    const int n_end = fa_key_limit(last_row, Nk, causal, causal_offset);

    for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
        // K, V tiles -> shared, keys past Nk zero.
        for (int idx = tid; idx < BLOCK_N * D; idx += THREADS) {
            int r = idx / D, c = idx % D;
            bool in = n0 + r < Nk;
            size_t g = static_cast<size_t>(n0 + r) * D + c;
            Ks[r * LDT + c] = in ? k_head[g] : zero;
            Vs[r * LDT + c] = in ? v_head[g] : zero;
        }
        __syncthreads();

        // 1. S = Q K^T on tensor cores, 16x16 fragment f = (row block, key block) per warp.
        for (int f = warp; f < S_FRAGS; f += WARPS) {
            const int rf = f / (BLOCK_N / 16), nf = f % (BLOCK_N / 16);
            FragAcc s;
            wmma::fill_fragment(s, 0.0f);
            for (int kf = 0; kf < D / 16; ++kf) {
                FragA a;
                FragKt kt;
                wmma::load_matrix_sync(a, Qs + 16 * rf * LDT + 16 * kf, LDT);
                wmma::load_matrix_sync(kt, Ks + 16 * nf * LDT + 16 * kf, LDT);
                wmma::mma_sync(s, a, kt, s);
            }
            wmma::store_matrix_sync(Ss + 16 * rf * LDS + 16 * nf, s, LDS, wmma::mem_row_major);
        }
        __syncthreads();

        // 2. Online softmax: thread r masks and scales row r, updates its running max and sum.
        if (tid < BLOCK_M) {
            const int limit = fa_key_limit(q0 + tid, Nk, causal, causal_offset);
            float* s_row = Ss + tid * LDS;
            float m_tile = -INFINITY;
            for (int j = 0; j < BLOCK_N; ++j) {
                s_row[j] = n0 + j < limit ? s_row[j] * scale : -INFINITY;
                m_tile = fmaxf(m_tile, s_row[j]);
            }
            const float m_new = fmaxf(m_i, m_tile);
            const float shift = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: no -inf - -inf
            const float alpha = expf(m_i - shift);
            float p_sum = 0.0f;
            for (int j = 0; j < BLOCK_N; ++j) {
                float p = expf(s_row[j] - shift);
                p_sum += p;                               // the row sum takes fp32 P ...
                Ps[tid * LDP + j] = from_float<T>(p);     // ... P V takes P rounded to T
            }
            l_i = alpha * l_i + p_sum;
            m_i = m_new;
            row_alpha[tid] = alpha;
        }
        __syncthreads();

        // 3a. This tile's P V on tensor cores, fragment f = (row block, column block) per warp.
        for (int f = warp; f < O_FRAGS; f += WARPS) {
            const int rf = f / (D / 16), df = f % (D / 16);
            FragAcc pv;
            wmma::fill_fragment(pv, 0.0f);
            for (int kf = 0; kf < BLOCK_N / 16; ++kf) {
                FragA p;
                FragV vf;
                wmma::load_matrix_sync(p, Ps + 16 * rf * LDP + 16 * kf, LDP);
                wmma::load_matrix_sync(vf, Vs + 16 * kf * LDT + 16 * df, LDT);
                wmma::mma_sync(pv, p, vf, pv);
            }
            wmma::store_matrix_sync(PVs + 16 * rf * LDO + 16 * df, pv, LDO, wmma::mem_row_major);
        }
        __syncthreads();

        // 3b. acc = alpha * acc + P V (fp32, thread-owned entries: no fragment layout needed).
#pragma unroll
        for (int i = 0; i < O_ROWS; ++i) {
            const int r = warp + i * WARPS;
            const float alpha = row_alpha[r];
#pragma unroll
            for (int c = 0; c < O_COLS; ++c)
                if (lane + 32 * c < D) acc[i][c] = alpha * acc[i][c] + PVs[r * LDO + lane + 32 * c];
        }
        __syncthreads();  // the next tile overwrites K, V, S, P, alpha
    }

    // Epilogue: o = acc / l, lse = m + log l; rows that attended nothing get 0 and -inf.
    if (tid < BLOCK_M) {
        row_alpha[tid] = l_i;
        if (q0 + tid < Nq)
            lse[(static_cast<size_t>(b) * H + h) * Nq + q0 + tid] = l_i > 0.0f ? m_i + logf(l_i) : -INFINITY;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < O_ROWS; ++i) {
        const int r = warp + i * WARPS;
        if (q0 + r >= Nq) continue;
        const float l = row_alpha[r];
        T* o_row = o + fa_row_offset(b, h, H, Nq, q0 + r, D);
#pragma unroll
        for (int c = 0; c < O_COLS; ++c)
            if (lane + 32 * c < D) o_row[lane + 32 * c] = from_float<T>(l > 0.0f ? acc[i][c] / l : 0.0f);
    }
}

// One extern "C" entry per (dtype, D): wmma_<dtype>_d<D>, with the tile configuration the
// catalogue (fa_verify/kernels/catalogue.py, WMMA) lists for that D.
#define WMMA_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) wmma_##DT##_d##D(FA_PARAMS(T)) {        \
        wmma_forward<T, D, BLOCK_M, BLOCK_N, THREADS>(FA_ARGS);                                    \
    }

// FA_CONFIG(D, BLOCK_M, BLOCK_N, THREADS)
FA_FOR_EACH_HALF_DTYPE(WMMA_ENTRY, 16, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(WMMA_ENTRY, 32, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(WMMA_ENTRY, 64, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(WMMA_ENTRY, 96, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(WMMA_ENTRY, 128, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(WMMA_ENTRY, 256, 32, 32, 128)
