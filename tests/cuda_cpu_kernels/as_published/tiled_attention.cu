// fp16 attention with fp32 accumulation, [B, H, N, D]: 64 query rows per block, one per thread,
// keys in tiles of kKeyTile. The launcher (attention_api.cuh) refuses key counts that are not a
// multiple of the tile, so the kernel never checks the last tile's bounds: elsewhere it reads
// past the end of K and V.
#include "attention_api.cuh"

template <int HEAD_DIM>
__global__ void tiled_attention(const __half* q, const __half* k, const __half* v, __half* o, int n_q, int n_k,
                                float scale) {
    __shared__ float k_tile[kKeyTile][HEAD_DIM];
    __shared__ float v_tile[kKeyTile][HEAD_DIM];
    const size_t head = blockIdx.y;
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    float acc[HEAD_DIM] = {0.f};
    float m = -INFINITY, l = 0.f;
    for (int start = 0; start < n_k; start += kKeyTile) {
        for (int i = threadIdx.x; i < kKeyTile * HEAD_DIM; i += blockDim.x) {
            const size_t at = (head * n_k + start) * HEAD_DIM + i;
            k_tile[i / HEAD_DIM][i % HEAD_DIM] = __half2float(k[at]);
            v_tile[i / HEAD_DIM][i % HEAD_DIM] = __half2float(v[at]);
        }
        __syncthreads();
        for (int j = 0; j < kKeyTile && row < n_q; ++j) {
            float s = 0.f;
            for (int d = 0; d < HEAD_DIM; ++d) s += __half2float(q[(head * n_q + row) * HEAD_DIM + d]) * k_tile[j][d];
            s *= scale;
            const float m_new = fmaxf(m, s), correction = __expf(m - m_new), p = __expf(s - m_new);
            l = l * correction + p;
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] = acc[d] * correction + p * v_tile[j][d];
            m = m_new;
        }
        __syncthreads();
    }
    if (row < n_q)
        for (int d = 0; d < HEAD_DIM; ++d) o[(head * n_q + row) * HEAD_DIM + d] = __float2half(acc[d] / l);
}
