// A FlashAttention forward kernel laid out the way kernel authors publish them: a template
// kernel, a host launcher with <<<>>>, torch extension glue, a cuBLAS include and a main.
// fa_verify checks it as it is, with tests/cuda_cpu_kernels/published_flash.toml:
//   python3 -m fa_verify check tests/cuda_cpu_kernels/published_flash.cu \
//       --spec tests/cuda_cpu_kernels/published_flash.toml
#include <torch/extension.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdio>

#define CHECK_INPUT(x) TORCH_CHECK(x.is_cuda() && x.is_contiguous(), #x " must be a contiguous CUDA tensor")

template <typename T> __device__ __forceinline__ float load(const T* p);
template <> __device__ __forceinline__ float load<__half>(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float load<float>(const float* p) { return *p; }
template <typename T> __device__ __forceinline__ void store(T* p, float x);
template <> __device__ __forceinline__ void store<__half>(__half* p, float x) { *p = __float2half_rn(x); }
template <> __device__ __forceinline__ void store<float>(float* p, float x) { *p = x; }

// q, o: [B, Nq, H, D]; k, v: [B, Nk, Hkv, D]; lse: [B, H, Nq] (natural log). One thread per query
// row; K and V tiles of BLOCK_N keys go through static shared memory; online softmax in fp32.
// Causal masking is bottom-right aligned: query i sees key j iff j <= i + Nk - Nq.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, typename T>
__global__ void __launch_bounds__(BLOCK_M)
flash_fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                 float* __restrict__ lse, int H, int Hkv, int Nq, int Nk, float softmax_scale, bool is_causal) {
    __shared__ float k_tile[BLOCK_N][HEAD_DIM];
    __shared__ float v_tile[BLOCK_N][HEAD_DIM];
    const int b = blockIdx.z, h = blockIdx.y, kv_h = h / (H / Hkv);
    const int row = blockIdx.x * BLOCK_M + threadIdx.x;
    const bool active = row < Nq;
    float q_row[HEAD_DIM], acc[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) {
        q_row[d] = active ? load(q + ((size_t(b) * Nq + row) * H + h) * HEAD_DIM + d) : 0.f;
        acc[d] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const int last_key = is_causal ? min(Nk, (blockIdx.x + 1) * BLOCK_M + Nk - Nq) : Nk;
    for (int start = 0; start < last_key; start += BLOCK_N) {
        for (int i = threadIdx.x; i < BLOCK_N * HEAD_DIM; i += BLOCK_M) {
            const int key = start + i / HEAD_DIM, d = i % HEAD_DIM;
            const size_t at = ((size_t(b) * Nk + key) * Hkv + kv_h) * HEAD_DIM + d;
            k_tile[i / HEAD_DIM][d] = key < Nk ? load(k + at) : 0.f;
            v_tile[i / HEAD_DIM][d] = key < Nk ? load(v + at) : 0.f;
        }
        __syncthreads();
        for (int j = 0; j < BLOCK_N && active; ++j) {
            const int key = start + j;
            if (key >= Nk || (is_causal && key > row + Nk - Nq)) break;
            float s = 0.f;
            for (int d = 0; d < HEAD_DIM; ++d) s += q_row[d] * k_tile[j][d];
            s *= softmax_scale;
            const float m_new = fmaxf(m, s);
            const float correction = expf(m - m_new), p = expf(s - m_new);
            l = l * correction + p;
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] = acc[d] * correction + p * v_tile[j][d];
            m = m_new;
        }
        __syncthreads();
    }
    if (!active) return;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int d = 0; d < HEAD_DIM; ++d) store(o + ((size_t(b) * Nq + row) * H + h) * HEAD_DIM + d, acc[d] * inv);
    lse[(size_t(b) * H + h) * Nq + row] = l > 0.f ? m + logf(l) : -INFINITY;
}

// ---- host side: never built by fa_verify's CPU runner (the spec says how to launch) ----------

template <int HEAD_DIM>
void launch_flash_fwd(const __half* q, const __half* k, const __half* v, __half* o, float* lse, int B, int H,
                      int Hkv, int Nq, int Nk, float scale, bool causal, cudaStream_t stream) {
    constexpr int BLOCK_M = 64, BLOCK_N = 32;
    dim3 grid((Nq + BLOCK_M - 1) / BLOCK_M, H, B);
    flash_fwd_kernel<HEAD_DIM, BLOCK_M, BLOCK_N, __half><<<grid, BLOCK_M, 0, stream>>>(
        q, k, v, o, lse, H, Hkv, Nq, Nk, scale, causal);
}

std::vector<torch::Tensor> flash_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal) {
    CHECK_INPUT(q);
    CHECK_INPUT(k);
    CHECK_INPUT(v);
    const int B = q.size(0), Nq = q.size(1), H = q.size(2), D = q.size(3), Nk = k.size(1), Hkv = k.size(2);
    auto o = torch::empty_like(q);
    auto lse = torch::empty({B, H, Nq}, q.options().dtype(torch::kFloat32));
    TORCH_CHECK(D == 64, "only head dim 64 is instantiated");
    launch_flash_fwd<64>(reinterpret_cast<const __half*>(q.data_ptr()), reinterpret_cast<const __half*>(k.data_ptr()),
                         reinterpret_cast<const __half*>(v.data_ptr()), reinterpret_cast<__half*>(o.data_ptr()),
                         lse.data_ptr<float>(), B, H, Hkv, Nq, Nk, 1.0f / sqrtf(float(D)), causal, 0);
    return {o, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &flash_forward, "FlashAttention forward (fp16, D = 64)");
}

int main() {
    cublasHandle_t handle;
    cublasCreate(&handle);
    printf("see flash_forward\n");
    cublasDestroy(handle);
    return 0;
}
