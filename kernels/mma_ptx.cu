// mma_ptx.cu: a FlashAttention-2 forward kernel on tensor cores written with inline PTX, as
// hand-tuned kernels are: cp.async tile copies, ldmatrix fragments, mma.sync.m16n8k16 (fp32
// accumulation), ex2.approx and shfl.sync; fp16 and bf16, D a multiple of 16.
//
// Grid (ceil(Nq / BLOCK_M), H, B); each warp owns 16 query rows (BLOCK_M = 16 * warps) and keeps
// everything about them in registers, in the PTX ISA's fragment layouts (g = lane / 4,
// t = lane % 4): its Q fragments, the S = Q K^T accumulators of the current key tile, the running
// max and sum of rows g and g + 8, and the output accumulator O. Per key tile of BLOCK_N keys:
//   1. cp.async K (one group) and V (a second group) into shared memory, rows past Nk zero-filled;
//   2. wait for K only; S = Q K^T with K fragments from ldmatrix (K rows are B's columns);
//   3. online softmax in registers, in the log2 domain: s * scale * log2(e), row max over the
//      4 lanes holding a row (shfl.sync.bfly 1, 2), P = ex2(s - m), O and l rescaled by
//      ex2(m_old - m_new); l sums fp32 P, P V takes P rounded to T;
//   4. wait for V; O += P V, P's A fragments built from the S accumulators' registers (the C
//      layout of one m16n8 tile pair is the A layout of one m16k16 slice), V fragments from
//      ldmatrix.trans.
// Epilogue: l summed over the row's 4 lanes, o = O / l, lse = m ln 2 + log l (0 and -inf for a
// row that attended no key). Precision model: PrecisionModel.flash(dtype).

#include "fa_common.cuh"

// ---- the PTX this kernel uses ----------------------------------------------------------------------

FA_DEVICE uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, asynchronously; src_bytes = 0 zero-fills the destination.
FA_DEVICE void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src), "r"(src_bytes));
}
FA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Until at most N of this thread's most recent groups are still in flight.
template <int N> FA_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8x8 b16 matrices; lanes 8j .. 8j + 7 give the rows of matrix j.
FA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}
FA_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}

// d += a b for one 16x8 tile: a 16x16 (row-major, 4 registers), b 16x8 (column-major, 2).
template <typename T> FA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> FA_DEVICE void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> FA_DEVICE void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

FA_DEVICE float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

FA_DEVICE float shfl_xor(float x, int lane_mask) {
    uint32_t y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=r"(y) : "r"(__float_as_uint(x)), "r"(lane_mask));
    return __uint_as_float(y);
}

// Over the 4 lanes (t = 0..3) that hold one row of an accumulator fragment.
FA_DEVICE float row_max(float x) {
    x = fmaxf(x, shfl_xor(x, 1));
    return fmaxf(x, shfl_xor(x, 2));
}
FA_DEVICE float row_sum(float x) {
    x += shfl_xor(x, 1);
    return x + shfl_xor(x, 2);
}

// Two floats rounded to T, packed low | high << 16 as an A-fragment register.
template <typename T> FA_DEVICE uint32_t pack(float lo, float hi) {
    const T l = from_float<T>(lo), h = from_float<T>(hi);
    uint16_t lb, hb;
    memcpy(&lb, &l, 2);
    memcpy(&hb, &h, 2);
    return static_cast<uint32_t>(lb) | (static_cast<uint32_t>(hb) << 16);
}

// ---- the kernel --------------------------------------------------------------------------------------

// Rows row0 .. row0 + ROWS - 1 of a [N, D] head -> a shared tile (row stride LD), 16 bytes per
// cp.async, rows past N zero-filled. All THREADS threads take part; the caller commits.
template <int ROWS, int D, int LD, int THREADS, typename T>
FA_DEVICE void load_tile_async(T* tile, const T* head, int row0, int N) {
    constexpr int CHUNKS = D / 8;  // 16-byte pieces of a row
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const bool in = row0 + r < N;
        const T* src = head + (in ? static_cast<size_t>(row0 + r) * D + 8 * c : 0);
        cp_async_16(tile + r * LD + 8 * c, src, in ? 16 : 0);
    }
}

template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
__device__ void mma_ptx_forward(FA_PARAMS(T)) {
    constexpr int WARPS = THREADS / 32;
    static_assert(BLOCK_M == 16 * WARPS, "one warp per 16 query rows");
    static_assert(D % 16 == 0 && BLOCK_N % 16 == 0, "m16n8k16 tiles");
    constexpr int LD = D + 8;  // row stride (elements): rows stay 16-byte aligned, and the 8 rows
                               // of one ldmatrix matrix fall in different shared-memory banks
    constexpr int KD = D / 16, NT = BLOCK_N / 8, DT = D / 8;
    constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

    extern __shared__ __align__(16) unsigned char smem[];
    SmemCarver carve{smem};
    T* Qs = carve.take<T>(BLOCK_M * LD);
    T* Ks = carve.take<T>(BLOCK_N * LD);
    T* Vs = carve.take<T>(BLOCK_N * LD);

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int q0 = blockIdx.x * BLOCK_M, h = blockIdx.y, b = blockIdx.z;
    const int kv_h = h / (H / Hkv);
    const T* q_head = q + fa_row_offset(b, h, H, Nq, 0, D);
    const T* k_head = k + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);
    const T* v_head = v + fa_row_offset(b, kv_h, Hkv, Nk, 0, D);

    // Q -> shared -> this warp's A fragments, one per 16-wide slice of D. ldmatrix.x4 matrices:
    // (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15)
    // of the slice: registers a0..a3 of the A layout; lane l gives row l % 16, column 8 (l / 16).
    load_tile_async<BLOCK_M, D, LD, THREADS>(Qs, q_head, q0, Nq);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) ldmatrix_x4(qf[kk], Qs + (16 * warp + lane % 16) * LD + 16 * kk + 8 * (lane / 16));

    // Rows g and g + 8 of this warp's 16: i = 0, 1 below.
    const int rows[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};
    const int limits[2] = {fa_key_limit(rows[0], Nk, causal, causal_offset),
                           fa_key_limit(rows[1], Nk, causal, causal_offset)};
    const float scale_log2 = scale * LOG2E;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // m in the log2 domain; l this lane's part
    float o_acc[DT][4] = {};

    const int n_end = fa_key_end(q0, BLOCK_M, Nq, Nk, causal, causal_offset);
    for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
        load_tile_async<BLOCK_N, D, LD, THREADS>(Ks, k_head, n0, Nk);
        cp_async_commit();
        load_tile_async<BLOCK_N, D, LD, THREADS>(Vs, v_head, n0, Nk);
        cp_async_commit();
        cp_async_wait<1>();  // K has landed (V may still be in flight)
        __syncthreads();

        // 2. S = Q K^T. B(k, n) = K[key n][d k]: ldmatrix (not .trans) of K rows gives B's
        //    registers; x4 matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7),
        //    (keys 8-15, d 8-15) of a 16-key block: b0, b1 of tile 2nb, b0, b1 of tile 2nb + 1.
        float s[NT][4] = {};
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
#pragma unroll
            for (int nb = 0; nb < NT / 2; ++nb) {
                uint32_t kf[4];
                ldmatrix_x4(kf, Ks + (16 * nb + lane % 8 + 8 * (lane / 16)) * LD + 16 * kk + 8 * ((lane / 8) % 2));
                mma_16816<T>(s[2 * nb], qf[kk], kf[0], kf[1]);
                mma_16816<T>(s[2 * nb + 1], qf[kk], kf[2], kf[3]);
            }

        // 3. Online softmax; this lane holds columns 8 nt + 2 t + j of rows g (regs 0, 1) and g + 8 (2, 3).
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float& x = s[nt][2 * i + j];
                    x = n0 + 8 * nt + 2 * t + j < limits[i] ? x * scale_log2 : -INFINITY;
                    tile_max = fmaxf(tile_max, x);
                }
            const float m_new = fmaxf(m[i], row_max(tile_max));
            const float shift = fa_softmax_shift(m_new);
            const float alpha = ex2(m[i] - shift);
            float p_sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float& x = s[nt][2 * i + j];
                    x = ex2(x - shift);
                    p_sum += x;
                }
            l[i] = alpha * l[i] + p_sum;
            m[i] = m_new;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o_acc[dt][2 * i] *= alpha;
                o_acc[dt][2 * i + 1] *= alpha;
            }
        }

        cp_async_wait<0>();  // V has landed
        __syncthreads();

        // 4. O += P V over 16-key slices kk. A = P (16 rows x 16 keys): a0, a1 = rows g, g + 8 of
        //    tile 2kk; a2, a3 = the same rows of tile 2kk + 1. B(k, n) = V[key k][d n]:
        //    ldmatrix.trans of V rows; x4 matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7),
        //    (keys 0-7, d 8-15), (keys 8-15, d 8-15): b0, b1 of d tile 2dn, b0, b1 of 2dn + 1.
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            const uint32_t pf[4] = {pack<T>(s[2 * kk][0], s[2 * kk][1]), pack<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dn = 0; dn < D / 16; ++dn) {
                uint32_t vf[4];
                ldmatrix_x4_trans(vf, Vs + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * LD + 16 * dn + 8 * (lane / 16));
                mma_16816<T>(o_acc[2 * dn], pf, vf[0], vf[1]);
                mma_16816<T>(o_acc[2 * dn + 1], pf, vf[2], vf[3]);
            }
        }
        __syncthreads();  // the next tile's copies overwrite K and V
    }

    // Epilogue: rows g and g + 8, columns 8 dt + 2 t + (0, 1).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float l_row = row_sum(l[i]);
        if (rows[i] >= Nq) continue;
        T* o_row = o + fa_row_offset(b, h, H, Nq, rows[i], D);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                o_row[8 * dt + 2 * t + j] = from_float<T>(l_row > 0.0f ? o_acc[dt][2 * i + j] / l_row : 0.0f);
        if (t == 0)
            lse[(static_cast<size_t>(b) * H + h) * Nq + rows[i]] = l_row > 0.0f ? m[i] * LN2 + logf(l_row) : -INFINITY;
    }
}

// One extern "C" entry per (dtype, D): mma_ptx_<dtype>_d<D>, with the tile configuration the
// catalogue (fa_verify/kernels/catalogue.py, MMA_PTX) lists for that D.
#define MMA_PTX_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) mma_ptx_##DT##_d##D(FA_PARAMS(T)) {     \
        mma_ptx_forward<T, D, BLOCK_M, BLOCK_N, THREADS>(FA_ARGS);                                 \
    }

// FA_CONFIG(D, BLOCK_M, BLOCK_N, THREADS)
FA_FOR_EACH_HALF_DTYPE(MMA_PTX_ENTRY, 16, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(MMA_PTX_ENTRY, 32, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(MMA_PTX_ENTRY, 64, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(MMA_PTX_ENTRY, 96, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(MMA_PTX_ENTRY, 128, 64, 32, 128)
FA_FOR_EACH_HALF_DTYPE(MMA_PTX_ENTRY, 256, 32, 16, 64)
