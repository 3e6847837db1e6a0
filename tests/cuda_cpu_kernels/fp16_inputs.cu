// An fp32 API over fp16 storage: q, k and v arrive as float32 [B, H, N, D] and are rounded to
// __half as each block stages them in shared memory (half the shared memory of float tiles);
// scores, softmax and P·V run in float32 on the rounded values, the output is float32. MHA,
// optional bottom-right causal masking, natural-log LSE. One thread per query row.
#include <cuda_fp16.h>
#include <math.h>

#define ROWS 64
#define KEYS 64
#define HEAD_DIM 64

extern "C" __global__ void attention_fp16_staged(const float* q, const float* k, const float* v, float* o,
                                                 float* lse, int n_q, int n_k, float scale, int causal) {
    __shared__ __half k_tile[KEYS * HEAD_DIM];
    __shared__ __half v_tile[KEYS * HEAD_DIM];
    const size_t head = blockIdx.y;
    const int row = blockIdx.x * ROWS + threadIdx.x;
    __half q_row[HEAD_DIM];
    for (int c = 0; c < HEAD_DIM; ++c)
        q_row[c] = __float2half_rn(row < n_q ? q[(head * n_q + row) * HEAD_DIM + c] : 0.f);
    float acc[HEAD_DIM] = {0.f};
    float m = -INFINITY, l = 0.f;
    const int visible = causal ? row + 1 + n_k - n_q : n_k;  // keys this row attends
    for (int key0 = 0; key0 < n_k; key0 += KEYS) {
        for (int i = threadIdx.x; i < KEYS * HEAD_DIM; i += ROWS) {
            const int key = key0 + i / HEAD_DIM;
            k_tile[i] = __float2half_rn(key < n_k ? k[(head * n_k + key) * HEAD_DIM + i % HEAD_DIM] : 0.f);
            v_tile[i] = __float2half_rn(key < n_k ? v[(head * n_k + key) * HEAD_DIM + i % HEAD_DIM] : 0.f);
        }
        __syncthreads();
        for (int j = 0; j < KEYS && key0 + j < min(n_k, visible) && row < n_q; ++j) {
            float s = 0.f;
            for (int c = 0; c < HEAD_DIM; ++c) s += __half2float(q_row[c]) * __half2float(k_tile[j * HEAD_DIM + c]);
            s *= scale;
            const float m_new = fmaxf(m, s), rescale = expf(m - m_new), w = expf(s - m_new);
            l = l * rescale + w;
            for (int c = 0; c < HEAD_DIM; ++c) acc[c] = acc[c] * rescale + w * __half2float(v_tile[j * HEAD_DIM + c]);
            m = m_new;
        }
        __syncthreads();
    }
    if (row >= n_q) return;
    for (int c = 0; c < HEAD_DIM; ++c) o[(head * n_q + row) * HEAD_DIM + c] = l > 0.f ? acc[c] / l : 0.f;
    lse[head * n_q + row] = l > 0.f ? m + logf(l) : -INFINITY;
}
