// The torch extension's side of tiled_attention.cu, in a header as many projects keep it: the
// includes, the launcher with its shape checks, and the module definition. None of it is device
// code; fa_verify sets it aside line for line.
#pragma once
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_fp16.h>
#include <vector>

constexpr int kKeyTile = 32;

template <int HEAD_DIM>
__global__ void tiled_attention(const __half* q, const __half* k, const __half* v, __half* o, int n_q, int n_k,
                                float scale);

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

torch::Tensor attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
    TORCH_CHECK(q.is_cuda() && q.scalar_type() == torch::kHalf, "q must be a CUDA fp16 tensor");
    TORCH_CHECK(k.size(2) % kKeyTile == 0, "the number of keys must be a multiple of ", kKeyTile);
    TORCH_CHECK(q.size(3) == 64, "only head dim 64 is built");
    auto o = torch::empty_like(q);
    const int n_q = q.size(2), n_k = k.size(2);
    dim3 grid(ceil_div(n_q, 64), q.size(0) * q.size(1));
    tiled_attention<64><<<grid, 64, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __half*>(q.data_ptr()), reinterpret_cast<const __half*>(k.data_ptr()),
        reinterpret_cast<const __half*>(v.data_ptr()), reinterpret_cast<__half*>(o.data_ptr()), n_q, n_k,
        1.0f / std::sqrt(static_cast<float>(q.size(3))));
    return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &attention_forward, "tiled attention forward (fp16)");
}
