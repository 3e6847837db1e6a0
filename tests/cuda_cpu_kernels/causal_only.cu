// A decoder-only attention kernel: always causal, so it takes no causal flag. Query i sees key j
// iff j <= i (Nq = Nk). bf16 or fp16 q, k, v, o in [B, N, H, D]; key tiles of 32 in shared
// memory; one thread per query row; the tiles past a block's last row are never loaded.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#define ROWS 32
#define KEYS 32

__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

template <typename T, int HEAD_DIM>
__global__ void decoder_attention(const T* q, const T* k, const T* v, T* o, int n, int heads, float scale) {
    __shared__ float k_tile[KEYS][HEAD_DIM];
    __shared__ float v_tile[KEYS][HEAD_DIM];
    const int head = blockIdx.y, batch = blockIdx.z;
    const int row = blockIdx.x * ROWS + threadIdx.x;
    const size_t stride = (size_t)heads * HEAD_DIM;  // between consecutive positions
    const size_t base = (size_t)batch * n * stride + (size_t)head * HEAD_DIM;
    float acc[HEAD_DIM] = {0.f};
    float m = -INFINITY, l = 0.f;
    const int last_row = min(n, (int)(blockIdx.x + 1) * ROWS) - 1;
    for (int key0 = 0; key0 <= last_row; key0 += KEYS) {
        for (int i = threadIdx.x; i < KEYS * HEAD_DIM; i += ROWS) {
            const int key = key0 + i / HEAD_DIM;
            k_tile[i / HEAD_DIM][i % HEAD_DIM] = key < n ? as_float(k[base + key * stride + i % HEAD_DIM]) : 0.f;
            v_tile[i / HEAD_DIM][i % HEAD_DIM] = key < n ? as_float(v[base + key * stride + i % HEAD_DIM]) : 0.f;
        }
        __syncthreads();
        for (int j = 0; j < KEYS && key0 + j <= row && row < n; ++j) {
            float s = 0.f;
            for (int c = 0; c < HEAD_DIM; ++c) s += as_float(q[base + row * stride + c]) * k_tile[j][c];
            s *= scale;
            const float m_new = fmaxf(m, s), rescale = expf(m - m_new), w = expf(s - m_new);
            l = l * rescale + w;
            for (int c = 0; c < HEAD_DIM; ++c) acc[c] = acc[c] * rescale + w * v_tile[j][c];
            m = m_new;
        }
        __syncthreads();
    }
    if (row < n)
        for (int c = 0; c < HEAD_DIM; ++c) store(o + base + row * stride + c, acc[c] / l);
}
