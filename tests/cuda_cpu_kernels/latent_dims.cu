// Attention whose values have their own head dim (multi-head latent attention, FlashAttention-3's
// 192/128): q and k [B, H, N, D], v and o [B, H, N, DV], DV != D. fp16; one thread per query
// row; key tiles of 16 in shared memory; causal (bottom-right) by a flag.
#include <cuda_fp16.h>
#include <math.h>

#define ROWS 16
#define KEYS 16

template <int D, int DV>
__global__ void latent_attention(const __half* q, const __half* k, const __half* v, __half* o, float* lse,
                                 int nq, int nk, int causal, float scale) {
    __shared__ float k_tile[KEYS][D];
    __shared__ float v_tile[KEYS][DV];
    const int head = blockIdx.y, heads = gridDim.y, batch = blockIdx.z;
    const int row = blockIdx.x * ROWS + threadIdx.x;
    const size_t bh = (size_t)batch * heads + head;
    const __half* q_row = q + (bh * nq + row) * D;
    float acc[DV] = {0.f};
    float m = -INFINITY, l = 0.f;
    const int last_key = causal ? row + nk - nq : nk - 1;
    for (int key0 = 0; key0 < nk; key0 += KEYS) {
        for (int i = threadIdx.x; i < KEYS * D; i += ROWS) {
            const int key = key0 + i / D;
            k_tile[i / D][i % D] = key < nk ? __half2float(k[(bh * nk + key) * D + i % D]) : 0.f;
        }
        for (int i = threadIdx.x; i < KEYS * DV; i += ROWS) {
            const int key = key0 + i / DV;
            v_tile[i / DV][i % DV] = key < nk ? __half2float(v[(bh * nk + key) * DV + i % DV]) : 0.f;
        }
        __syncthreads();
        for (int j = 0; j < KEYS && key0 + j < nk && key0 + j <= last_key && row < nq; ++j) {
            float s = 0.f;
            for (int c = 0; c < D; ++c) s += __half2float(q_row[c]) * k_tile[j][c];
            s *= scale;
            const float m_new = fmaxf(m, s), rescale = expf(m - m_new), w = expf(s - m_new);
            l = l * rescale + w;
            for (int c = 0; c < DV; ++c) acc[c] = acc[c] * rescale + w * v_tile[j][c];
            m = m_new;
        }
        __syncthreads();
    }
    if (row < nq) {
        for (int c = 0; c < DV; ++c) o[(bh * nq + row) * DV + c] = __float2half_rn(l > 0.f ? acc[c] / l : 0.f);
        lse[bh * nq + row] = l > 0.f ? m + logf(l) : -INFINITY;
    }
}
