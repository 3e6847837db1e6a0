// An FA1-style forward kernel: the key/value tiles form the outer loop and the query rows the
// inner one, so each row's running max m, running sum l and (normalised) output o live in
// global memory between key tiles. The host must fill m with
// -inf, l with 0 and o with 0 before the launch (see fa1_global_stats.toml). fp32, [B, H, N, D]
// contiguous, Nq = Nk = N, no masking; one block per (batch, head), one thread per query row
// of the tile.
#include <cuda_runtime.h>
#include <math.h>

#define TILE 32
#define MAX_D 64

__global__ void fa1_forward(const float* q, const float* k, const float* v, int n, int d, float scale,
                            float* l, float* m, float* o) {
    __shared__ float k_tile[TILE][MAX_D];
    __shared__ float v_tile[TILE][MAX_D];
    const size_t head = blockIdx.x;
    const float* qh = q + head * n * d;
    const float* kh = k + head * n * d;
    const float* vh = v + head * n * d;
    float* oh = o + head * n * d;
    float* lh = l + head * n;
    float* mh = m + head * n;
    for (int key0 = 0; key0 < n; key0 += TILE) {
        const int keys = min(TILE, n - key0);
        for (int i = threadIdx.x; i < keys * d; i += blockDim.x) {
            k_tile[i / d][i % d] = kh[(size_t)(key0 + i / d) * d + i % d];
            v_tile[i / d][i % d] = vh[(size_t)(key0 + i / d) * d + i % d];
        }
        __syncthreads();
        for (int row = threadIdx.x; row < n; row += blockDim.x) {
            float s[TILE];
            float tile_max = -INFINITY;
            for (int j = 0; j < keys; ++j) {
                float dot = 0.f;
                for (int c = 0; c < d; ++c) dot += qh[(size_t)row * d + c] * k_tile[j][c];
                s[j] = dot * scale;
                tile_max = fmaxf(tile_max, s[j]);
            }
            float tile_sum = 0.f;
            for (int j = 0; j < keys; ++j) {
                s[j] = expf(s[j] - tile_max);
                tile_sum += s[j];
            }
            const float m_old = mh[row], l_old = lh[row];
            const float m_new = fmaxf(m_old, tile_max);
            const float old_weight = expf(m_old - m_new) * l_old, new_weight = expf(tile_max - m_new);
            const float l_new = old_weight + new_weight * tile_sum;
            for (int c = 0; c < d; ++c) {
                float pv = 0.f;
                for (int j = 0; j < keys; ++j) pv += s[j] * v_tile[j][c];
                oh[(size_t)row * d + c] = (old_weight * oh[(size_t)row * d + c] + new_weight * pv) / l_new;
            }
            mh[row] = m_new;
            lh[row] = l_new;
        }
        __syncthreads();
    }
}

__global__ void fill(float* x, float value, int count) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) x[i] = value;
}

// The host, as published: never built by fa_verify (the spec says what it does).
void fa1(const float* q, const float* k, const float* v, float* o, int b, int h, int n, int d) {
    float *l, *m;
    cudaMalloc(&l, sizeof(float) * b * h * n);
    cudaMalloc(&m, sizeof(float) * b * h * n);
    cudaMemset(l, 0, sizeof(float) * b * h * n);
    cudaMemset(o, 0, sizeof(float) * b * h * n * d);
    fill<<<64, 256>>>(m, -INFINITY, b * h * n);
    fa1_forward<<<b * h, TILE>>>(q, k, v, n, d, 1.0f / sqrtf(d), l, m, o);
    cudaFree(l);
    cudaFree(m);
}
