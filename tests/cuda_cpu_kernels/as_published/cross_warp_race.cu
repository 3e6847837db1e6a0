// fp32 attention, [B, H, N, D] with D = 64: two warps share each K/V tile in shared memory, one
// query row per thread. The barrier after the tile's use is missing, so a warp that is done
// overwrites the tile with the next one while the other warp still reads it: on a GPU, rows
// of one warp then mix keys of two tiles.
#include <cuda_runtime.h>

constexpr int kWarps = 2, kRows = 32 * kWarps, kKeys = 32, kDim = 64;

__global__ void cross_warp_race(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, float* __restrict__ o, int n, float scale) {
    __shared__ float k_s[kKeys * kDim];
    __shared__ float v_s[kKeys * kDim];
    const float* q_row = q + (static_cast<size_t>(blockIdx.y) * n + blockIdx.x * kRows + threadIdx.x) * kDim;
    const bool live = blockIdx.x * kRows + threadIdx.x < n;
    float out[kDim] = {}, best = -INFINITY, total = 0.f;
    for (int t = 0; t < n; t += kKeys) {
        for (int i = threadIdx.x; i < kKeys * kDim; i += kRows) {
            const bool in = t + i / kDim < n;
            const size_t at = (static_cast<size_t>(blockIdx.y) * n + t) * kDim + i;
            k_s[i] = in ? k[at] : 0.f;
            v_s[i] = in ? v[at] : 0.f;
        }
        __syncthreads();
        for (int j = 0; live && j < kKeys && t + j < n; ++j) {
            float s = 0.f;
            for (int d = 0; d < kDim; ++d) s += q_row[d] * k_s[j * kDim + d];
            s *= scale;
            const float next = fmaxf(best, s), c = __expf(best - next), p = __expf(s - next);
            total = total * c + p;
            for (int d = 0; d < kDim; ++d) out[d] = out[d] * c + p * v_s[j * kDim + d];
            best = next;
        }
        // (missing: __syncthreads(); before the next tile overwrites k_s and v_s)
    }
    if (live)
        for (int d = 0; d < kDim; ++d)
            o[(static_cast<size_t>(blockIdx.y) * n + blockIdx.x * kRows + threadIdx.x) * kDim + d] = out[d] / total;
}
