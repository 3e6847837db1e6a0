// A two-launch attention: split_pass splits the keys into n_splits chunks and writes, for each
// chunk, a partial output (normalised over the chunk) and the chunk's LSE to float32 workspaces;
// combine_pass merges the chunks of each row by their LSEs into o and lse. fp16 q, k, v, o in
// [B, H, N, D] (MHA, no masking), one thread per query row in both launches.
#include <cuda_fp16.h>
#include <math.h>

#define MAX_D 128

__global__ void split_pass(const __half* q, const __half* k, const __half* v, float* o_part, float* lse_part,
                           int n_q, int n_k, int d, int n_splits, float scale) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x, split = blockIdx.y;
    const size_t head = blockIdx.z, heads = gridDim.z;
    if (row >= n_q) return;
    const int chunk = (n_k + n_splits - 1) / n_splits;
    const int first = split * chunk, last = min(n_k, first + chunk);
    float acc[MAX_D];
    for (int c = 0; c < d; ++c) acc[c] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int j = first; j < last; ++j) {
        float s = 0.f;
        for (int c = 0; c < d; ++c)
            s += __half2float(q[(head * n_q + row) * d + c]) * __half2float(k[(head * n_k + j) * d + c]);
        s *= scale;
        const float m_new = fmaxf(m, s), rescale = expf(m - m_new), w = expf(s - m_new);
        l = l * rescale + w;
        for (int c = 0; c < d; ++c) acc[c] = acc[c] * rescale + w * __half2float(v[(head * n_k + j) * d + c]);
        m = m_new;
    }
    const size_t at = ((size_t)split * heads + head) * n_q + row;  // [n_splits, B * H, n_q]
    for (int c = 0; c < d; ++c) o_part[at * d + c] = l > 0.f ? acc[c] / l : 0.f;
    lse_part[at] = l > 0.f ? m + logf(l) : -INFINITY;  // an empty chunk weighs nothing
}

__global__ void combine_pass(const float* o_part, const float* lse_part, __half* o, float* lse, int n_q, int d,
                             int n_splits) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    const size_t head = blockIdx.y, heads = gridDim.y;
    if (row >= n_q) return;
    float m = -INFINITY;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, lse_part[((size_t)s * heads + head) * n_q + row]);
    float total = 0.f;
    for (int s = 0; s < n_splits; ++s) total += expf(lse_part[((size_t)s * heads + head) * n_q + row] - m);
    for (int c = 0; c < d; ++c) {
        float acc = 0.f;
        for (int s = 0; s < n_splits; ++s) {
            const size_t at = ((size_t)s * heads + head) * n_q + row;
            acc += expf(lse_part[at] - m) * o_part[at * d + c];
        }
        o[(head * n_q + row) * d + c] = __float2half_rn(acc / total);
    }
    lse[head * n_q + row] = m + logf(total);
}

void attention(const __half* q, const __half* k, const __half* v, __half* o, float* lse, float* workspace,
               int bh, int n_q, int n_k, int d) {
    const int n_splits = n_k >= 256 ? 4 : 2;
    float* o_part = workspace;
    float* lse_part = workspace + (size_t)n_splits * bh * n_q * d;
    split_pass<<<dim3((n_q + 63) / 64, n_splits, bh), 64>>>(q, k, v, o_part, lse_part, n_q, n_k, d, n_splits,
                                                           1.0f / sqrtf((float)d));
    combine_pass<<<dim3((n_q + 63) / 64, bh), 64>>>(o_part, lse_part, o, lse, n_q, d, n_splits);
}
