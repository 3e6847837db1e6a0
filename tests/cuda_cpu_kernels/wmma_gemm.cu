// wmma_gemm.cu: C = A B (+ C) with nvcuda::wmma, one warp per 16x16 output tile, fp32 accumulation.
// A is M x K row-major; B is K x N, row-major or (b_col_major) column-major; C is M x N row-major.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <type_traits>

using namespace nvcuda;

template <typename T, typename LayoutB>
__device__ void gemm(const T* A, const T* B, float* C, int M, int N, int K, float alpha) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int tiles_n = N / 16;
    const int tm = warp / tiles_n, tn = warp % tiles_n;
    if (tm * 16 >= M) return;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < K; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> b;
        wmma::load_matrix_sync(a, A + tm * 16 * K + k, K);
        if (std::is_same<LayoutB, wmma::row_major>::value)
            wmma::load_matrix_sync(b, B + k * N + tn * 16, N);
        else
            wmma::load_matrix_sync(b, B + tn * 16 * K + k, K);
        wmma::mma_sync(acc, a, b, acc);
    }
    for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= alpha;  // elementwise: layout-free
    wmma::store_matrix_sync(C + tm * 16 * N + tn * 16, acc, N, wmma::mem_row_major);
}

extern "C" __global__ void gemm_f16_rr(const __half* A, const __half* B, float* C, int M, int N, int K, float alpha) {
    gemm<__half, wmma::row_major>(A, B, C, M, N, K, alpha);
}
extern "C" __global__ void gemm_f16_rc(const __half* A, const __half* B, float* C, int M, int N, int K, float alpha) {
    gemm<__half, wmma::col_major>(A, B, C, M, N, K, alpha);
}
extern "C" __global__ void gemm_bf16_rr(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, int M, int N, int K,
                                        float alpha) {
    gemm<__nv_bfloat16, wmma::row_major>(A, B, C, M, N, K, alpha);
}

// A misaligned tile pointer: undefined on the GPU, a trap on the CPU runner.
extern "C" __global__ void gemm_misaligned(const __half* A, float* C) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::load_matrix_sync(a, A + 1, 16);
    C[0] = __half2float(a.x[0]);
}
