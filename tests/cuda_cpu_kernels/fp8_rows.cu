// An FP8 forward as a user might write it first: one thread per query row, q, k and v of
// cuda_fp8.h's __nv_fp8_e4m3 or __nv_fp8_e5m2 (the template's T), with FlashAttention-3's float32
// descales [B, Hkv] (true value = stored value x descale, q's descale of its kv head); compiled
// with PER_TENSOR_KV, k's and v's descales are an FP8 KV cache's k_scale / v_scale, one value each.
// Scores in float32 with the q.k descales folded into the scale, an online softmax in float32 (P is
// not rounded to FP8), v's descale at the end, bf16 output, natural-log LSE. Layout [B, H, N, D];
// GQA; optional causal masking with the diagonal offset Nk - Nq.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math.h>

#define MAX_HEAD_DIM 64
#ifndef ROWS_PER_BLOCK  // the rows a block covers: its threads (a launch of another width overlaps blocks)
#define ROWS_PER_BLOCK blockDim.x
#endif

template <typename T>
__global__ void fp8_rows_fwd(const T* q, const T* k, const T* v, const float* q_descale, const float* k_descale,
                             const float* v_descale, __nv_bfloat16* o, float* lse, int heads, int kv_heads, int n_q,
                             int n_k, int head_dim, float scale, int causal, int causal_offset) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    if (row >= n_q) return;
    const int kv_head = head / (heads / kv_heads);
    const int group = batch * kv_heads + kv_head;
#ifdef PER_TENSOR_KV
    const float dk = k_descale[0], dv = v_descale[0];
#else
    const float dk = k_descale[group], dv = v_descale[group];
#endif
    const float folded = scale * q_descale[group] * dk;
    const T* q_row = q + ((size_t)(batch * heads + head) * n_q + row) * head_dim;
    const T* k_head = k + (size_t)group * n_k * head_dim;
    const T* v_head = v + (size_t)group * n_k * head_dim;
    float q_values[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    for (int c = 0; c < head_dim; ++c) {
        q_values[c] = static_cast<float>(q_row[c]);
        acc[c] = 0.f;
    }
    const int visible = causal ? min(n_k, row + causal_offset + 1) : n_k;  // keys 0 .. visible - 1
    float m = -INFINITY, l = 0.f;
    for (int j = 0; j < visible; ++j) {
        float s = 0.f;
        for (int c = 0; c < head_dim; ++c) s += q_values[c] * static_cast<float>(k_head[j * head_dim + c]);
        s *= folded;
        const float m_new = fmaxf(m, s), rescale = expf(m - m_new), p = expf(s - m_new);
        l = l * rescale + p;
        for (int c = 0; c < head_dim; ++c) acc[c] = acc[c] * rescale + p * static_cast<float>(v_head[j * head_dim + c]);
        m = m_new;
    }
    __nv_bfloat16* o_row = o + ((size_t)(batch * heads + head) * n_q + row) * head_dim;
    for (int c = 0; c < head_dim; ++c) o_row[c] = __float2bfloat16(l > 0.f ? acc[c] / l * dv : 0.f);
    lse[(batch * heads + head) * n_q + row] = l > 0.f ? m + logf(l) : -INFINITY;
}
