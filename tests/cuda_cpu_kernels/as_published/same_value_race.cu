// fp32 attention, [B, H, N, D] with D = 64, 64 query rows per block, one per thread. Every thread
// stores the softmax's base-2 scale into one __shared__ float before the barrier: the same value
// from 64 threads, a data race that no GPU turns into a wrong number (one thread should store it).
#include <cuda_runtime.h>

#define ROWS 64
#define KEYS 16
#define DIM 64

__global__ void same_value_race(const float* q, const float* k, const float* v, float* o, int n, float scale) {
    __shared__ float scale_log2;
    __shared__ float keys[KEYS][DIM], values[KEYS][DIM];
    scale_log2 = scale * 1.4426950408889634f;
    const size_t bh = blockIdx.y;
    const int row = blockIdx.x * ROWS + threadIdx.x;
    float acc[DIM] = {}, m = -INFINITY, l = 0.f;
    for (int base = 0; base < n; base += KEYS) {
        __syncthreads();
        for (int i = threadIdx.x; i < KEYS * DIM; i += ROWS) {
            const int key = base + i / DIM;
            keys[i / DIM][i % DIM] = key < n ? k[(bh * n + key) * DIM + i % DIM] : 0.f;
            values[i / DIM][i % DIM] = key < n ? v[(bh * n + key) * DIM + i % DIM] : 0.f;
        }
        __syncthreads();
        for (int j = 0; row < n && j < KEYS && base + j < n; ++j) {
            float s = 0.f;
            for (int d = 0; d < DIM; ++d) s += q[(bh * n + row) * DIM + d] * keys[j][d];
            s *= scale_log2;
            const float m_new = fmaxf(m, s), rescale = exp2f(m - m_new), p = exp2f(s - m_new);
            l = l * rescale + p;
            for (int d = 0; d < DIM; ++d) acc[d] = acc[d] * rescale + p * values[j][d];
            m = m_new;
        }
    }
    if (row < n)
        for (int d = 0; d < DIM; ++d) o[(bh * n + row) * DIM + d] = acc[d] / l;
}
