// An FP8 forward as a user might write it first: one thread per query row, q, k and v stored as
// e4m3 (or, compiled with FP8_E5M2, e5m2) bytes decoded by its own function (no cuda_fp8.h), with
// FlashAttention-3's float32 descales [B, Hkv] (true value = stored value x descale, q's descale
// of its kv head). Scores in float32 with the q.k descales folded into the scale, an online
// softmax in float32 (P is not rounded to FP8), v's descale at the end, bf16 output, natural-log
// LSE. Layout [B, H, N, D]; GQA; optional causal masking with the diagonal offset Nk - Nq.
#include <cuda_bf16.h>
#include <math.h>

#define MAX_HEAD_DIM 64

__device__ float fp8_to_float(unsigned char bits) {
    const float sign = (bits & 0x80) ? -1.f : 1.f;
#ifdef FP8_E5M2
    const int exponent = (bits >> 2) & 0x1f, mantissa = bits & 0x3;
    if (exponent == 0x1f) return mantissa ? NAN : sign * INFINITY;
    if (exponent == 0) return sign * ldexpf((float)mantissa, -16);           // m / 4 * 2^-14
    return sign * ldexpf(1.f + mantissa / 4.f, exponent - 15);
#else
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
    if (exponent == 0xf && mantissa == 0x7) return NAN;                       // e4m3fn: no infinity
    if (exponent == 0) return sign * ldexpf((float)mantissa, -9);            // m / 8 * 2^-6
    return sign * ldexpf(1.f + mantissa / 8.f, exponent - 7);
#endif
}

extern "C" __global__ void fp8_rows_fwd(const unsigned char* q, const unsigned char* k, const unsigned char* v,
                                        const float* q_descale, const float* k_descale, const float* v_descale,
                                        __nv_bfloat16* o, float* lse, int heads, int kv_heads, int n_q, int n_k,
                                        int head_dim, float scale, int causal, int causal_offset) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    if (row >= n_q) return;
    const int kv_head = head / (heads / kv_heads);
    const int group = batch * kv_heads + kv_head;
    const float folded = scale * q_descale[group] * k_descale[group];
    const unsigned char* q_row = q + ((size_t)(batch * heads + head) * n_q + row) * head_dim;
    const unsigned char* k_head = k + (size_t)group * n_k * head_dim;
    const unsigned char* v_head = v + (size_t)group * n_k * head_dim;
    float q_values[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    for (int c = 0; c < head_dim; ++c) {
        q_values[c] = fp8_to_float(q_row[c]);
        acc[c] = 0.f;
    }
    const int visible = causal ? min(n_k, row + causal_offset + 1) : n_k;  // keys 0 .. visible - 1
    float m = -INFINITY, l = 0.f;
    for (int j = 0; j < visible; ++j) {
        float s = 0.f;
        for (int c = 0; c < head_dim; ++c) s += q_values[c] * fp8_to_float(k_head[j * head_dim + c]);
        s *= folded;
        const float m_new = fmaxf(m, s), rescale = expf(m - m_new), p = expf(s - m_new);
        l = l * rescale + p;
        for (int c = 0; c < head_dim; ++c) acc[c] = acc[c] * rescale + p * fp8_to_float(v_head[j * head_dim + c]);
        m = m_new;
    }
    __nv_bfloat16* o_row = o + ((size_t)(batch * heads + head) * n_q + row) * head_dim;
    for (int c = 0; c < head_dim; ++c) o_row[c] = __float2bfloat16(l > 0.f ? acc[c] / l * v_descale[group] : 0.f);
    lse[(batch * heads + head) * n_q + row] = l > 0.f ? m + logf(l) : -INFINITY;
}
