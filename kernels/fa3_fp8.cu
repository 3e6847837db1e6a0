// fa3_fp8.cu: FlashAttention-3's FP8 forward numerics on fa2's tile loop (CUDA cores).
//
// q, k, v are e4m3 (or e5m2) values stored with float32 descales of shape [B, Hkv] each (the
// true value is stored x descale; q's descale is indexed by the kv head of its query head's
// group). The entries take fa2's common ABI with FP8 q, k, v and a bf16 o, then the descales:
//
//   extern "C" __global__ void fa3_fp8_<e4m3|e5m2>_d<D>(
//       const __nv_fp8_<fmt>* q, const __nv_fp8_<fmt>* k, const __nv_fp8_<fmt>* v, __nv_bfloat16* o,
//       float* lse, int B, int H, int Hkv, int Nq, int Nk, float scale, int causal, int causal_offset,
//       const float* q_descale, const float* k_descale, const float* v_descale);
//
// (a per-tensor descale, [1], is passed broadcast to [B, Hkv] by the host.) Numerics, as
// PrecisionModel.fa3_fp8 and fa_verify/fp8_emulation.py model them: the stored values widened
// exactly to fp32; scores fp32 with the q.k descales folded into the softmax scale,
// fl(fl(scale dq) dk); P = exp(s - m) 2^8 rounded once to e4m3 (round to nearest even,
// saturating), the row sum from the fp32 P; P V in fp32; v's descale on the accumulator at the
// end; o = acc / l in bf16; lse = m + log l - 8 ln 2 (natural log). No variants (window, softcap,
// ALiBi, sinks).

#include "fa_common.cuh"
#include <cuda_fp8.h>

// The stored values widened to fp32 (exact), as fa2's tile loads read them.
FA_DEVICE float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
FA_DEVICE float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

#define FA2_TEMPLATE_ONLY
#include "fa2.cu"

// P is offset by 2^FA3_P_OFFSET before it is rounded to e4m3: exp(s - m) <= 1 would otherwise
// leave most of e4m3's range unused and flush probabilities below 2^-10 to zero.
constexpr int FA3_P_OFFSET = 8;
constexpr float FA3_LN2 = 0.693147180559945309f;

// FlashAttention-3's FP8 numerics for fa2_forward (see Fa2Numerics in fa2.cu).
struct Fa3Fp8Numerics {
    float v_descale;  // of this block's (batch, kv head)

    static FA_DEVICE float p_scale() { return static_cast<float>(1 << FA3_P_OFFSET); }
    FA_DEVICE float round_p(float p) const {
        return static_cast<float>(__nv_fp8_e4m3(p * p_scale()));
    }
    template <int O_ROWS, int O_COLS>
    FA_DEVICE void finish(float (&acc)[O_ROWS][O_COLS], float& m) const {
#pragma unroll
        for (int i = 0; i < O_ROWS; ++i)
#pragma unroll
            for (int c = 0; c < O_COLS; ++c) acc[i][c] *= v_descale;
        m -= FA3_P_OFFSET * FA3_LN2;  // the LSE of exp(s - m) 2^8 summed, less the offset's 8 ln 2
    }
};

// The descales of query head h's group in batch b: the softmax scale with q's and k's folded in,
// and v's, for the epilogue.
struct Fa3Descales {
    float scale;
    Fa3Fp8Numerics numerics;
};
FA_DEVICE Fa3Descales fa3_descales(const float* q_descale, const float* k_descale, const float* v_descale,
                                   float scale, int b, int h, int H, int Hkv) {
    const int kv = b * Hkv + h / (H / Hkv);
    const float q_scale = q_descale[kv], k_scale = k_descale[kv];
    return {scale * q_scale * k_scale, {v_descale[kv]}};
}

template <typename T, int D, int BLOCK_M, int BLOCK_N, int THREADS>
__device__ void fa3_fp8_forward(FA_PARAMS_OUT(T, __nv_bfloat16), const float* __restrict__ q_descale,
                                const float* __restrict__ k_descale, const float* __restrict__ v_descale) {
    const Fa3Descales d = fa3_descales(q_descale, k_descale, v_descale, scale, blockIdx.z, blockIdx.y, H, Hkv);
    fa2_forward<T, D, BLOCK_M, BLOCK_N, THREADS, D, __nv_bfloat16>(
        q, k, v, o, lse, B, H, Hkv, Nq, Nk, d.scale, causal, causal_offset,
        -1, -1, 0.0f, nullptr, 0, nullptr, d.numerics);  // no window, softcap, ALiBi or sinks
}

// One extern "C" entry per (format, D): fa3_fp8_<format>_d<D>, with the tile configuration the
// catalogue (fa_verify/kernels/catalogue.py, FA3_FP8) lists for that D.
#define FA3_FP8_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) fa3_fp8_##DT##_d##D(                         \
        FA_PARAMS_OUT(T, __nv_bfloat16), const float* __restrict__ q_descale,                          \
        const float* __restrict__ k_descale, const float* __restrict__ v_descale) {                    \
        fa3_fp8_forward<T, D, BLOCK_M, BLOCK_N, THREADS>(FA_ARGS, q_descale, k_descale, v_descale);   \
    }

// FA_CONFIG(D, BLOCK_M, BLOCK_N, THREADS)
FA_FOR_EACH_FP8_DTYPE(FA3_FP8_ENTRY, 8, 64, 32, 128)
FA_FOR_EACH_FP8_DTYPE(FA3_FP8_ENTRY, 16, 64, 32, 128)
FA_FOR_EACH_FP8_DTYPE(FA3_FP8_ENTRY, 32, 64, 32, 128)
FA_FOR_EACH_FP8_DTYPE(FA3_FP8_ENTRY, 64, 64, 32, 128)
FA_FOR_EACH_FP8_DTYPE(FA3_FP8_ENTRY, 128, 64, 32, 128)
