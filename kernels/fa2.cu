// fa2.cu: a FlashAttention-2 style forward kernel on CUDA cores, every dtype.
//
// Grid (ceil(Nq / BLOCK_M), H, B): one block per tile of BLOCK_M query rows of one head. The
// block streams K/V tiles of BLOCK_N keys through shared memory and keeps, per query row, the
// running max m, the running sum l (fp32, in the registers of the row's softmax thread) and
// the output accumulator (fp32, in registers, each thread owning fixed (row, column) entries).
// Per key tile:
//   1. S = scale * Q K^T (fp32), then softcap * tanhf(S / softcap) and the ALiBi bias, masked
//      entries -inf;
//   2. online softmax, one thread per row: m_new = max(m, rowmax S), alpha = exp(m - m_new),
//      P = exp(S - m_new), l = alpha l + rowsum P (fp32 P, as FA2), P rounded to T for P V;
//   3. acc = alpha acc + P V.
// At the end o = acc / l (rounded to T) and lse = m + log l.
// Variants, flash-attn 2's conventions (fa_verify/problem.py), with the diagonal offset
// o = causal_offset: query i sees keys i + o - window_left ..= i + o + window_right (-1:
// unbounded; causal means window_right = 0); key tiles outside every row's window are skipped.
// ALiBi subtracts slope |i + o - j| (slopes [H], or [B, H] with alibi_batch_stride = H; null:
// off). A sink (sinks [H]; null: off) joins each row's softmax after the last tile as one key
// of logit sinks[h] and value 0 (FlashAttention's finalize): one more rescale of m, l and the
// accumulator; it joins the denominator only, and a row that sees no key gets lse = sink.
// Head dims: q and k have D columns, v and o have DV (D unless instantiated otherwise, as
// FlashAttention-3's 192/128); the tiles are as wide as the wider of the two.
// Precision model: PrecisionModel.flash(dtype). Shared memory holds the tiles in fp32 with
// rows padded by one float (conflict-free strided reads); the catalogue computes its size.
// What P is rounded to and what the epilogue does are the `Numerics` parameter's: Fa2Numerics<T>
// (P rounded to T), or FlashAttention-3's FP8 (fa3_fp8.cu: P offset by 2^8 and rounded to e4m3,
// v's descale and the LSE's compensation at the end), which instantiates this template with FP8
// q, k, v and a bf16 output O.

#include "fa_common.cuh"

// softcap's tanh: tanhf (a few ulp), or with FA2_TANH_APPROX the hardware tanh.approx.f32 (sm_75+,
// relative error up to 2^-10.987), as FlashAttention's softcap uses it; fa2_tanh_approx.cu builds
// that variant, judged under a precision model that declares it (tanh=approx).
#ifdef FA2_TANH_APPROX
__device__ __forceinline__ float fa2_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else
__device__ __forceinline__ float fa2_tanh(float x) { return tanhf(x); }
#endif

// FA2's numerics: P = exp(s - m) rounded to T for P V, the row sum of the fp32 P, o = acc / l and
// lse = m + log l as they are. A Numerics type has these members (fa3_fp8.cu's is the other).
template <typename T>
struct Fa2Numerics {
    static FA_DEVICE float p_scale() { return 1.0f; }  // P's factor before rounding (the row sum's too)
    static FA_DEVICE float round_p(float p) { return round_through<T>(p); }
    template <int O_ROWS, int O_COLS>
    static FA_DEVICE void finish(float (&)[O_ROWS][O_COLS], float&) {}  // acc and m before the epilogue
};

// fa2's parameters after the common ABI (FA_PARAMS).
#define FA2_VARIANT_PARAMS                                                                      \
    int window_left, int window_right, float softcap, const float* __restrict__ alibi_slopes, \
        int alibi_batch_stride, const float* __restrict__ sinks
#define FA2_VARIANT_ARGS window_left, window_right, softcap, alibi_slopes, alibi_batch_stride, sinks

// K and V rows n0 .. n0 + ROWS - 1 into their tiles: in one pass where DV = D, else one per tile.
template <int ROWS, int D, int DV, int LD, int THREADS, typename T>
__device__ void fa2_load_kv(float* Ks, const T* k_head, float* Vs, const T* v_head, int n0, int Nk) {
    if constexpr (D == DV) {
        fa_load_rows<ROWS, D, LD, THREADS>(Ks, k_head, Vs, v_head, n0, Nk);
    } else {
        fa_load_rows<ROWS, D, LD, THREADS>(Ks, k_head, n0, Nk);
        fa_load_rows<ROWS, DV, LD, THREADS>(Vs, v_head, n0, Nk);
    }
}

template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS, int DV = D, typename O = T,
          typename Numerics = Fa2Numerics<T>>
__device__ void fa2_forward(FA_PARAMS_OUT(T, O), FA2_VARIANT_PARAMS, Numerics numerics = {}) {
    static_assert(THREADS % 32 == 0 && THREADS >= BLOCK_M, "one softmax thread per query row");
    static_assert(THREADS % BLOCK_N == 0 && (BLOCK_M * BLOCK_N) % THREADS == 0, "S tile split");
    static_assert(BLOCK_M % (THREADS / 32) == 0, "P V rows split over warps");
    constexpr int LD = (D > DV ? D : DV) + 1;          // padded row of a Q/K/V tile (floats)
    constexpr int LDS = BLOCK_N + 1;                   // padded row of the S/P tile
    constexpr int S_ROWS_STEP = THREADS / BLOCK_N;     // step 1: thread -> (rows, one key)
    constexpr int S_PER_THREAD = BLOCK_M * BLOCK_N / THREADS;
    constexpr int WARPS = THREADS / 32;                // step 3: lane -> columns, warp -> rows
    constexpr int O_ROWS = BLOCK_M / WARPS;
    constexpr int O_COLS = (DV + 31) / 32;

    extern __shared__ __align__(16) unsigned char smem[];
    SmemCarver carve{smem};
    float* Qs = carve.take<float>(BLOCK_M * LD);
    float* Ks = carve.take<float>(BLOCK_N * LD);
    float* Vs = carve.take<float>(BLOCK_N * LD);
    float* Ss = carve.take<float>(BLOCK_M * LDS);      // scores, then P (rounded to T)
    float* row_alpha = carve.take<float>(BLOCK_M);     // this tile's rescale factor per row
    float* row_l = carve.take<float>(BLOCK_M);         // final row sums, for the epilogue

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int q0 = blockIdx.x * BLOCK_M, h = blockIdx.y, b = blockIdx.z;
    const int kv_h = h / (H / Hkv);
    const T* q_head = q + fa_row_offset(b, h, H, Nq, 0, D);
    const T* k_head = k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    const T* v_head = v + fa_row_offset(b, kv_h, Hkv, Nk, 0, DV);
    const int right = causal ? 0 : window_right;
    const float slope = alibi_slopes ? alibi_slopes[b * alibi_batch_stride + h] : 0.0f;

    // Q tile -> shared (fp32), rows past Nq zero.
    fa_load_rows<BLOCK_M, D, LD, THREADS>(Qs, q_head, q0, Nq);

    // Softmax state of row `tid` (threads tid < BLOCK_M) and this thread's accumulator entries
    // (rows warp + WARPS i, columns lane + 32 c).
    float m_i = -INFINITY, l_i = 0.0f;
    float acc[O_ROWS][O_COLS] = {};

    // Key tiles wholly before the first row's window or at or past the last row's limit are
    // fully masked: the loop runs over the others only.
    const int last_row = min(q0 + BLOCK_M, Nq) - 1;
    const int n_begin = fa2_first_key(q0 + causal_offset, window_left) / BLOCK_N * BLOCK_N;
    const int n_end = fa2_key_limit(last_row + causal_offset, right, Nk);

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        // K, V tiles -> shared (fp32), keys past Nk zero.
        fa2_load_kv<BLOCK_N, D, DV, LD, THREADS>(Ks, k_head, Vs, v_head, n0, Nk);
        __syncthreads();

        // 1. S = scale * Q K^T; thread owns key column j and rows r0, r0 + S_ROWS_STEP, ...
        {
            const int j = tid % BLOCK_N, r0 = tid / BLOCK_N;
            float s[S_PER_THREAD];
#pragma unroll
            for (int i = 0; i < S_PER_THREAD; ++i) s[i] = 0.0f;
            for (int d = 0; d < D; ++d) {
                float kd = Ks[j * LD + d];
#pragma unroll
                for (int i = 0; i < S_PER_THREAD; ++i) s[i] += Qs[(r0 + i * S_ROWS_STEP) * LD + d] * kd;
            }
#pragma unroll
            for (int i = 0; i < S_PER_THREAD; ++i) {
                const int r = r0 + i * S_ROWS_STEP, diag = q0 + r + causal_offset, key = n0 + j;
                float x = s[i] * scale;
                if (softcap > 0.0f) x = softcap * fa2_tanh(x / softcap);
                x -= slope * static_cast<float>(abs(diag - key));
                bool allowed = fa2_first_key(diag, window_left) <= key && key < fa2_key_limit(diag, right, Nk);
                Ss[r * LDS + j] = allowed ? x : -INFINITY;
            }
        }
        __syncthreads();

        // 2. Online softmax: thread r updates row r's running max and sum.
        if (tid < BLOCK_M) {
            float* s_row = Ss + tid * LDS;
            float m_tile = -INFINITY;
            for (int j = 0; j < BLOCK_N; ++j) m_tile = fmaxf(m_tile, s_row[j]);
            const float m_new = fmaxf(m_i, m_tile);
            const float shift = fa_softmax_shift(m_new);
            const float alpha = expf(m_i - shift);
            // P = exp(S - m_new): the row sum takes fp32 P, P V takes P rounded (over S); both
            // times the numerics' P scale (a power of two: the sum scales exactly).
            const float p_sum = numerics.p_scale() *
                fa_exp_row<BLOCK_N>(s_row, shift, [&](int j, float p) { s_row[j] = numerics.round_p(p); });
            l_i = alpha * l_i + p_sum;
            m_i = m_new;
            row_alpha[tid] = alpha;
        }
        __syncthreads();

        // 3. acc = alpha * acc + P V; lane owns columns lane, lane + 32, ..., warp owns rows.
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
                    if (lane + 32 * c < DV) acc[i][c] += p * Vs[j * LD + lane + 32 * c];
            }
        }
        __syncthreads();  // the next tile overwrites K, V and S
    }

    // The sink: m, l and the accumulator rescaled to m_new = max(m, sink), l += exp(sink - m_new).
    if (sinks) {
        if (tid < BLOCK_M) {
            const float m_new = fmaxf(m_i, sinks[h]);
            const float alpha = expf(m_i - m_new);  // 0 for a row that saw no key
            l_i = alpha * l_i + expf(sinks[h] - m_new);
            m_i = m_new;
            row_alpha[tid] = alpha;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < O_ROWS; ++i)
#pragma unroll
            for (int c = 0; c < O_COLS; ++c) acc[i][c] *= row_alpha[warp + i * WARPS];
    }

    // Epilogue: o = acc / l, lse = m + log l; rows that attended nothing get 0 and -inf.
    numerics.finish(acc, m_i);
    fa_store_output<DV, BLOCK_M>(acc, m_i, l_i, row_l, o, lse, b, h, H, Nq, q0);
}

// One extern "C" entry per (dtype, D): fa2_<dtype>_d<D>, with the tile configuration the
// catalogue (fa_verify/kernels/catalogue.py, FA2) lists for that D.
#define FA2_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                     \
        fa2_##DT##_d##D(FA_PARAMS(T), FA2_VARIANT_PARAMS) {                                    \
        fa2_forward<T, D, BLOCK_M, BLOCK_N, THREADS>(FA_ARGS, FA2_VARIANT_ARGS);              \
    }

// fa2_<dtype>_d<D>v<DV>: an entry whose v and o have DV != D columns.
#define FA2_ENTRY_V(DT, T, D, DV, BLOCK_M, BLOCK_N, THREADS)                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                     \
        fa2_##DT##_d##D##v##DV(FA_PARAMS(T), FA2_VARIANT_PARAMS) {                             \
        fa2_forward<T, D, BLOCK_M, BLOCK_N, THREADS, DV>(FA_ARGS, FA2_VARIANT_ARGS);          \
    }

// FA_CONFIG(D, BLOCK_M, BLOCK_N, THREADS), FA_CONFIG_V(D, DV, BLOCK_M, BLOCK_N, THREADS). fa2_key_tiles.cu
// includes this file for the template alone (FA2_TEMPLATE_ONLY) and instantiates it at other key-tile sizes.
#ifndef FA2_TEMPLATE_ONLY
FA_FOR_EACH_DTYPE(FA2_ENTRY, 16, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_ENTRY, 32, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_ENTRY, 64, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_ENTRY, 96, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_ENTRY, 128, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_ENTRY, 256, 32, 16, 128)
FA_FOR_EACH_DTYPE(FA2_ENTRY_V, 192, 128, 32, 16, 128)
#endif
