// convert.cu: fp16 / bf16 conversions and arithmetic, element by element.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>

// mode 0..3: round to nearest even, toward zero, down, up.
extern "C" __global__ void float_to_half(const float* in, uint16_t* out, int n, int mode) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        __half h = mode == 0 ? __float2half_rn(in[i]) : mode == 1 ? __float2half_rz(in[i])
                 : mode == 2 ? __float2half_rd(in[i]) : __float2half_ru(in[i]);
        out[i] = __half_as_ushort(h);
    }
}
extern "C" __global__ void half_to_float(const __half* in, float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __half2float(in[i]);
}
extern "C" __global__ void double_to_half(const double* in, __half* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __double2half(in[i]);
}
extern "C" __global__ void float_to_bf16(const float* in, uint16_t* out, int n, int mode) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        __nv_bfloat16 b = mode == 0 ? __float2bfloat16_rn(in[i]) : mode == 1 ? __float2bfloat16_rz(in[i])
                        : mode == 2 ? __float2bfloat16_rd(in[i]) : __float2bfloat16_ru(in[i]);
        out[i] = __bfloat16_as_ushort(b);
    }
}
extern "C" __global__ void bf16_to_float(const __nv_bfloat16* in, float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __bfloat162float(in[i]);
}
// out = [a+b, a*b, a/b, fma(a,b,c)] per element, in __half.
extern "C" __global__ void half_arith(const __half* a, const __half* b, const __half* c, __half* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[4 * i + 0] = a[i] + b[i];
        out[4 * i + 1] = a[i] * b[i];
        out[4 * i + 2] = a[i] / b[i];
        out[4 * i + 3] = __hfma(a[i], b[i], c[i]);
    }
}
extern "C" __global__ void bf16_arith(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c,
                                      __nv_bfloat16* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[4 * i + 0] = a[i] + b[i];
        out[4 * i + 1] = a[i] * b[i];
        out[4 * i + 2] = a[i] / b[i];
        out[4 * i + 3] = __hfma(a[i], b[i], c[i]);
    }
}
