// wmma_tf32.cu: C = A B with tf32 wmma (m16n16k8, fp32 accumulation), one warp per 16x16 tile of C;
// A (M x K) and B (K x N) row-major floats. `convert`: each loaded element goes through
// wmma::__float_to_tf32 first, as CUDA asks; without it the tensor cores see unrounded floats.
#include <mma.h>

using namespace nvcuda;

extern "C" __global__ void gemm_tf32(const float* A, const float* B, float* C, int M, int N, int K, int convert) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int tiles_n = N / 16;
    const int tm = warp / tiles_n, tn = warp % tiles_n;
    if (tm * 16 >= M) return;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < K; k += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b;
        wmma::load_matrix_sync(a, A + tm * 16 * K + k, K);
        wmma::load_matrix_sync(b, B + k * N + tn * 16, N);
        if (convert) {
            for (int i = 0; i < a.num_elements; ++i) a.x[i] = wmma::__float_to_tf32(a.x[i]);
            for (int i = 0; i < b.num_elements; ++i) b.x[i] = wmma::__float_to_tf32(b.x[i]);
        }
        wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(C + tm * 16 * N + tn * 16, acc, N, wmma::mem_row_major);
}
