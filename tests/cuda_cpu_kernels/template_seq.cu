// A kernel specialised on the key count and the head dim at compile time, as kernels for a fixed
// context length are: template <int N_KEYS, int HEAD_DIM>. fp32 q, k, v, o in [B, H, N, D], MHA,
// no masking; one warp-sized block per 32 query rows; all N_KEYS scores of a row are kept in
// registers, so the softmax is two-pass (max, then sum) rather than online.
#include <cuda_runtime.h>
#include <math.h>

template <int N_KEYS, int HEAD_DIM>
__global__ void attention_fixed_keys(const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, float* __restrict__ o, int n_q, float scale) {
    const size_t head = blockIdx.y;
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n_q) return;
    const float* q_row = q + (head * n_q + row) * HEAD_DIM;
    const float* keys = k + head * N_KEYS * HEAD_DIM;
    const float* values = v + head * N_KEYS * HEAD_DIM;
    float s[N_KEYS];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < N_KEYS; ++j) {
        float dot = 0.f;
        for (int c = 0; c < HEAD_DIM; ++c) dot += q_row[c] * keys[j * HEAD_DIM + c];
        s[j] = dot * scale;
        m = fmaxf(m, s[j]);
    }
    float l = 0.f;
    for (int j = 0; j < N_KEYS; ++j) l += (s[j] = expf(s[j] - m));
    for (int c = 0; c < HEAD_DIM; ++c) {
        float acc = 0.f;
        for (int j = 0; j < N_KEYS; ++j) acc += s[j] * values[j * HEAD_DIM + c];
        o[(head * n_q + row) * HEAD_DIM + c] = acc / l;
    }
}

// The host dispatches on the context length it was built for.
void attention(const float* q, const float* k, const float* v, float* o, int bh, int n_q, int n_k) {
    dim3 grid((n_q + 31) / 32, bh);
    if (n_k == 64) attention_fixed_keys<64, 64><<<grid, 32>>>(q, k, v, o, n_q, 0.125f);
    else if (n_k == 128) attention_fixed_keys<128, 64><<<grid, 32>>>(q, k, v, o, n_q, 0.125f);
}
