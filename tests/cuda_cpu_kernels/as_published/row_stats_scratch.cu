// FA1-style: each thread keeps its query row's running max and sum in global memory, in a buffer
// the host allocates (pairs filled with -inf and 0) beside O. fp32, [B, H, N, D] with D = 64.
#include <cuda_runtime.h>

__global__ void row_stats_attention(const float* q, const float* k, const float* v, float* o, float* stats,
                                    int n, float scale) {
    const size_t row = static_cast<size_t>(blockIdx.y) * n + blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x * blockDim.x + threadIdx.x >= n) return;
    const float* keys = k + static_cast<size_t>(blockIdx.y) * n * 64;
    const float* values = v + static_cast<size_t>(blockIdx.y) * n * 64;
    for (int j = 0; j < n; ++j) {
        float s = 0.f;
        for (int d = 0; d < 64; ++d) s += q[row * 64 + d] * keys[j * 64 + d];
        s *= scale;
        const float m_old = stats[2 * row], m_new = fmaxf(m_old, s);
        const float c = expf(m_old - m_new), p = expf(s - m_new);
        for (int d = 0; d < 64; ++d) o[row * 64 + d] = o[row * 64 + d] * c + p * values[j * 64 + d];
        stats[2 * row + 1] = stats[2 * row + 1] * c + p;
        stats[2 * row] = m_new;
    }
    for (int d = 0; d < 64; ++d) o[row * 64 + d] /= stats[2 * row + 1];
}
