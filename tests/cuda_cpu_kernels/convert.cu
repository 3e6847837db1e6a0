// convert.cu: fp16 / bf16 conversions and arithmetic, element by element. One body per test, a
// template over the 16-bit type T; each extern "C" entry names the shim functions it tests.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>

// out[i] = the bits of in[i] rounded to T in `mode` 0..3: to nearest even (rn), toward zero (rz),
// down (rd), up (ru).
template <typename T>
__device__ void round_each(const float* in, uint16_t* out, int n, int mode, T (*rn)(float), T (*rz)(float),
                           T (*rd)(float), T (*ru)(float), unsigned short (*bits)(T)) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const T r = mode == 0 ? rn(in[i]) : mode == 1 ? rz(in[i]) : mode == 2 ? rd(in[i]) : ru(in[i]);
        out[i] = bits(r);
    }
}
extern "C" __global__ void float_to_half(const float* in, uint16_t* out, int n, int mode) {
    round_each(in, out, n, mode, __float2half_rn, __float2half_rz, __float2half_rd, __float2half_ru, __half_as_ushort);
}
extern "C" __global__ void float_to_bf16(const float* in, uint16_t* out, int n, int mode) {
    round_each(in, out, n, mode, __float2bfloat16_rn, __float2bfloat16_rz, __float2bfloat16_rd, __float2bfloat16_ru,
               __bfloat16_as_ushort);
}

extern "C" __global__ void half_to_float(const __half* in, float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __half2float(in[i]);
}
extern "C" __global__ void bf16_to_float(const __nv_bfloat16* in, float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __bfloat162float(in[i]);
}
extern "C" __global__ void double_to_half(const double* in, __half* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __double2half(in[i]);
}

// out = [a+b, a*b, a/b, fma(a,b,c)] per element, in T.
template <typename T>
__device__ void arith(const T* a, const T* b, const T* c, T* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[4 * i + 0] = a[i] + b[i];
        out[4 * i + 1] = a[i] * b[i];
        out[4 * i + 2] = a[i] / b[i];
        out[4 * i + 3] = __hfma(a[i], b[i], c[i]);
    }
}
extern "C" __global__ void half_arith(const __half* a, const __half* b, const __half* c, __half* out, int n) {
    arith(a, b, c, out, n);
}
extern "C" __global__ void bf16_arith(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c,
                                      __nv_bfloat16* out, int n) {
    arith(a, b, c, out, n);
}
