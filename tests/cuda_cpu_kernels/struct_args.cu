// An attention kernel whose host passes everything in one struct by value, as many published
// kernels do (a "params" struct): fp16 q, k, v, o in [B, H, N, D], float32 LSE, GQA through
// heads_per_kv, optional bottom-right causal masking. The int before the first pointer and the
// bool at the end leave padding the spec's layout must reproduce (see struct_args.toml).
#include <cuda_fp16.h>
#include <math.h>

struct AttentionParams {
    int batch;                  // 4 bytes, then 4 of padding before the pointers
    const __half* q;
    const __half* k;
    const __half* v;
    __half* o;
    float* lse;
    int heads, heads_per_kv, n_q, n_k, head_dim;
    float softmax_scale;
    bool causal;                // 1 byte, then padding to the struct's 8-byte alignment
};

__global__ void attention_struct(AttentionParams p) {
    const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / p.heads_per_kv;
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= p.n_q) return;
    const int kv_heads = p.heads / p.heads_per_kv;
    const __half* q_row = p.q + (((size_t)batch * p.heads + head) * p.n_q + row) * p.head_dim;
    const __half* keys = p.k + ((size_t)batch * kv_heads + kv_head) * p.n_k * p.head_dim;
    const __half* values = p.v + ((size_t)batch * kv_heads + kv_head) * p.n_k * p.head_dim;
    const int last = p.causal ? min(p.n_k, row + 1 + p.n_k - p.n_q) : p.n_k;
    float acc[128];
    for (int c = 0; c < p.head_dim; ++c) acc[c] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int j = 0; j < last; ++j) {
        float s = 0.f;
        for (int c = 0; c < p.head_dim; ++c) s += __half2float(q_row[c]) * __half2float(keys[(size_t)j * p.head_dim + c]);
        s *= p.softmax_scale;
        const float m_new = fmaxf(m, s), rescale = expf(m - m_new), w = expf(s - m_new);
        l = l * rescale + w;
        for (int c = 0; c < p.head_dim; ++c)
            acc[c] = acc[c] * rescale + w * __half2float(values[(size_t)j * p.head_dim + c]);
        m = m_new;
    }
    __half* o_row = p.o + (((size_t)batch * p.heads + head) * p.n_q + row) * p.head_dim;
    for (int c = 0; c < p.head_dim; ++c) o_row[c] = __float2half_rn(l > 0.f ? acc[c] / l : 0.f);
    p.lse[((size_t)batch * p.heads + head) * p.n_q + row] = l > 0.f ? m + logf(l) : -INFINITY;
}

void attention(const AttentionParams& params) {
    dim3 grid((params.n_q + 63) / 64, params.heads, params.batch);
    attention_struct<<<grid, 64>>>(params);
}
