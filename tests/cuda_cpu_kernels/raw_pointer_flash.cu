// A plain raw-pointer attention kernel (fp32, [B, H, N, D] contiguous, no causal masking): K and V
// tiles of BLOCK_N keys in dynamic shared memory, one thread per query row. With BLOCK_N = 128 and
// D = 64 the tiles need 64 KiB: more than the 48 KiB a launch gets without the opt-in.
#include <cuda_runtime.h>
#include <cstdio>

#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#define BLOCK_M 64
#define HEAD_DIM 64

extern "C" __global__ void attention_fwd(const float* q, const float* k, const float* v, float* o, int n_q,
                                         int n_k, float scale) {
    extern __shared__ float smem[];
    float* k_tile = smem;
    float* v_tile = smem + BLOCK_N * HEAD_DIM;
    const size_t head = blockIdx.y;
    const int row = blockIdx.x * BLOCK_M + threadIdx.x;
    float acc[HEAD_DIM] = {0.f};
    float m = -INFINITY, l = 0.f;
    for (int start = 0; start < n_k; start += BLOCK_N) {
        for (int i = threadIdx.x; i < BLOCK_N * HEAD_DIM; i += BLOCK_M) {
            const int key = start + i / HEAD_DIM;
            k_tile[i] = key < n_k ? k[(head * n_k + key) * HEAD_DIM + i % HEAD_DIM] : 0.f;
            v_tile[i] = key < n_k ? v[(head * n_k + key) * HEAD_DIM + i % HEAD_DIM] : 0.f;
        }
        __syncthreads();
        for (int j = 0; j < BLOCK_N && start + j < n_k && row < n_q; ++j) {
            float s = 0.f;
            for (int d = 0; d < HEAD_DIM; ++d) s += q[(head * n_q + row) * HEAD_DIM + d] * k_tile[j * HEAD_DIM + d];
            s *= scale;
            const float m_new = fmaxf(m, s), correction = expf(m - m_new), p = expf(s - m_new);
            l = l * correction + p;
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] = acc[d] * correction + p * v_tile[j * HEAD_DIM + d];
            m = m_new;
        }
        __syncthreads();
    }
    if (row < n_q)
        for (int d = 0; d < HEAD_DIM; ++d) o[(head * n_q + row) * HEAD_DIM + d] = acc[d] / l;
}

int main() {
    const int n = 128, bytes = n * HEAD_DIM * sizeof(float), smem = 2 * BLOCK_N * HEAD_DIM * sizeof(float);
    float *q, *k, *v, *o;
    cudaMalloc(&q, bytes); cudaMalloc(&k, bytes); cudaMalloc(&v, bytes); cudaMalloc(&o, bytes);
    cudaFuncSetAttribute(attention_fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    attention_fwd<<<dim3((n + BLOCK_M - 1) / BLOCK_M, 1), BLOCK_M, smem>>>(q, k, v, o, n, n, 0.125f);
    printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
    return 0;
}
