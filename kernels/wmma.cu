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

// One 16x16 fragment of C = A B (fp32), run by one warp, over the inner dimension K in 16-wide
// slices: A row-major at a (row stride lda), slice k 16 k elements on; B at b as FragB loads it
// (stride ldb), slice k k * b_step elements on; C stored row-major at c (row stride ldc).
template <typename FragB, int K, typename T>
__device__ __forceinline__ void wmma_fragment_product(float* c, int ldc, const T* a, int lda, const T* b, int ldb,
                                                      int b_step) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kf = 0; kf < K / 16; ++kf) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
        FragB b_frag;
        wmma::load_matrix_sync(a_frag, a + 16 * kf, lda);
        wmma::load_matrix_sync(b_frag, b + kf * b_step, ldb);
        wmma::mma_sync(acc, a_frag, b_frag, acc);
    }
    wmma::store_matrix_sync(c, acc, ldc, wmma::mem_row_major);
}

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
    using FragKt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;  // K^T
    using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;

    extern __shared__ __align__(16) unsigned char smem[];
    SmemCarver carve{smem};
    T* Qs = carve.take<T>(BLOCK_M * LDT);
    T* Ks = carve.take<T>(BLOCK_N * LDT);
    T* Vs = carve.take<T>(BLOCK_N * LDT);
    float* Ss = carve.take<float>(BLOCK_M * LDS);
    T* Ps = carve.take<T>(BLOCK_M * LDP);
    float* PVs = carve.take<float>(BLOCK_M * LDO);
    float* row_alpha = carve.take<float>(BLOCK_M);   // this tile's rescale factor, then l

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int q0 = blockIdx.x * BLOCK_M, h = blockIdx.y, b = blockIdx.z;
    const int kv_h = h / (H / Hkv);
    const T* q_head = q + fa_row_offset(b, h, H, Nq, 0, D);
    const T* k_head = k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    const T* v_head = v + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);

    // Q tile -> shared, rows past Nq zero.
    fa_load_rows<BLOCK_M, D, LDT, THREADS>(Qs, q_head, q0, Nq);

    // Softmax state of row `tid` (threads tid < BLOCK_M) and this thread's accumulator entries:
    // rows warp + WARPS i, columns lane + 32 c.
    float m_i = -INFINITY, l_i = 0.0f;
    float acc[O_ROWS][O_COLS] = {};

    const int n_end = fa_key_end(q0, BLOCK_M, Nq, Nk, causal, causal_offset);

    for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
        // K, V tiles -> shared, keys past Nk zero.
        fa_load_rows<BLOCK_N, D, LDT, THREADS>(Ks, k_head, Vs, v_head, n0, Nk);
        __syncthreads();

        // 1. S = Q K^T on tensor cores, 16x16 fragment f = (row block rf, key block nf) per warp:
        //    Q rows 16 rf.. times K^T columns 16 nf.. (K rows, read column-major), D deep.
        for (int f = warp; f < S_FRAGS; f += WARPS) {
            const int rf = f / (BLOCK_N / 16), nf = f % (BLOCK_N / 16);
            wmma_fragment_product<FragKt, D>(Ss + 16 * rf * LDS + 16 * nf, LDS, Qs + 16 * rf * LDT, LDT,
                                             Ks + 16 * nf * LDT, LDT, 16);
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
            const float shift = fa_softmax_shift(m_new);
            const float alpha = expf(m_i - shift);
            // P = exp(S - m_new): the row sum takes fp32 P, P V takes P rounded to T (into Ps).
            const float p_sum =
                fa_exp_row<BLOCK_N>(s_row, shift, [&](int j, float p) { Ps[tid * LDP + j] = from_float<T>(p); });
            l_i = alpha * l_i + p_sum;
            m_i = m_new;
            row_alpha[tid] = alpha;
        }
        __syncthreads();

        // 3a. This tile's P V on tensor cores, fragment f = (row block rf, column block df) per warp:
        //     P rows 16 rf.. times V columns 16 df.., BLOCK_N deep (V's 16-row slices LDT * 16 apart).
        for (int f = warp; f < O_FRAGS; f += WARPS) {
            const int rf = f / (D / 16), df = f % (D / 16);
            wmma_fragment_product<FragV, BLOCK_N>(PVs + 16 * rf * LDO + 16 * df, LDO, Ps + 16 * rf * LDP, LDP,
                                                  Vs + 16 * df, LDT, 16 * LDT);
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
    fa_store_output<D, BLOCK_M>(acc, m_i, l_i, row_alpha, o, lse, b, h, H, Nq, q0);
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
