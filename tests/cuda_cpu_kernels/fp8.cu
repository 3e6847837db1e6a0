// fp8.cu: cuda_fp8.h's conversions, element by element (tests/test_cuda_fp8.py). `interp` is
// 0 for e4m3, 1 for e5m2; `sat` 0 for __NV_NOSAT, 1 for __NV_SATFINITE.
#include <cuda_fp8.h>
#include <cstdint>

__device__ __nv_fp8_interpretation_t format_of(int interp) { return interp ? __NV_E5M2 : __NV_E4M3; }
__device__ __nv_saturation_t saturation_of(int sat) { return sat ? __NV_SATFINITE : __NV_NOSAT; }

// Every code to __half bits (__nv_cvt_fp8_to_halfraw, and pairwise) and to float (the classes).
extern "C" __global__ void decode(const uint8_t* codes, uint16_t* halves, uint16_t* pair_halves, float* floats,
                                  int n, int interp) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        halves[i] = __nv_cvt_fp8_to_halfraw(codes[i], format_of(interp)).x;
        const __nv_fp8x2_storage_t two = static_cast<__nv_fp8x2_storage_t>(codes[i] | (codes[n - 1 - i] << 8));
        const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(two, format_of(interp));
        pair_halves[2 * i] = h2.x;
        pair_halves[2 * i + 1] = h2.y;
        if (interp) {
            __nv_fp8_e5m2 v;
            v.__x = codes[i];
            floats[i] = static_cast<float>(v);
        } else {
            __nv_fp8_e4m3 v;
            v.__x = codes[i];
            floats[i] = static_cast<float>(v);
        }
    }
}

// out[i] = in[i] rounded by the __nv_cvt_* function of the input's type.
extern "C" __global__ void from_float(const float* in, uint8_t* out, int n, int sat, int interp) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = __nv_cvt_float_to_fp8(in[i], saturation_of(sat), format_of(interp));
}
extern "C" __global__ void from_double(const double* in, uint8_t* out, int n, int sat, int interp) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = __nv_cvt_double_to_fp8(in[i], saturation_of(sat), format_of(interp));
}
extern "C" __global__ void from_half(const __half* in, uint8_t* out, int n, int sat, int interp) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = __nv_cvt_halfraw_to_fp8(static_cast<__half_raw>(in[i]), saturation_of(sat), format_of(interp));
}
extern "C" __global__ void from_bf16(const __nv_bfloat16* in, uint8_t* out, int n, int sat, int interp) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = __nv_cvt_bfloat16raw_to_fp8(static_cast<__nv_bfloat16_raw>(in[i]), saturation_of(sat),
                                             format_of(interp));
}

// The classes built from in[4i..4i+3] (n a multiple of 4), per class one row of out: the scalar
// classes from float, double, __half and __nv_bfloat16 (4 rows), __nv_fp8x2_* from float2 pairs and
// __nv_fp8x4_* from float4 (their storage's bytes), and the pair/quad cvt functions (float2, __half2).
template <class Scalar, class Pair, class Quad>
__device__ void construct(const float* in, uint8_t* out, int n, __nv_fp8_interpretation_t f) {
    for (int q = threadIdx.x; q < n / 4; q += blockDim.x) {
        for (int j = 0; j < 4; ++j) {
            const float v = in[4 * q + j];
            out[0 * n + 4 * q + j] = Scalar(v).__x;
            out[1 * n + 4 * q + j] = Scalar(static_cast<double>(v)).__x;
            out[2 * n + 4 * q + j] = Scalar(__float2half(v)).__x;
            out[3 * n + 4 * q + j] = Scalar(__float2bfloat16(v)).__x;
        }
        const float4 v4 = make_float4(in[4 * q], in[4 * q + 1], in[4 * q + 2], in[4 * q + 3]);
        const __nv_fp8x2_storage_t lo = Pair(make_float2(v4.x, v4.y)).__x, hi = Pair(make_float2(v4.z, v4.w)).__x;
        const __nv_fp8x4_storage_t quad = Quad(v4).__x;
        const __nv_fp8x2_storage_t cvt = __nv_cvt_float2_to_fp8x2(make_float2(v4.x, v4.y), __NV_SATFINITE, f);
        const __nv_fp8x2_storage_t halves = __nv_cvt_halfraw2_to_fp8x2(
            static_cast<__half2_raw>(__half2(__float2half(v4.z), __float2half(v4.w))), __NV_SATFINITE, f);
        for (int b = 0; b < 4; ++b) {
            out[4 * n + 4 * q + b] = static_cast<uint8_t>((b < 2 ? lo : hi) >> (8 * (b % 2)));
            out[5 * n + 4 * q + b] = static_cast<uint8_t>(quad >> (8 * b));
            out[6 * n + 4 * q + b] = static_cast<uint8_t>((b < 2 ? cvt : halves) >> (8 * (b % 2)));
        }
    }
}
extern "C" __global__ void classes(const float* in, uint8_t* out, int n, int interp) {
    if (interp) construct<__nv_fp8_e5m2, __nv_fp8x2_e5m2, __nv_fp8x4_e5m2>(in, out, n, __NV_E5M2);
    else construct<__nv_fp8_e4m3, __nv_fp8x2_e4m3, __nv_fp8x4_e4m3>(in, out, n, __NV_E4M3);
}

// The widening conversions of the pair and quad classes: codes[4i..4i+3] as one __nv_fp8x4_* and as
// two __nv_fp8x2_*, to float4 and float2 pairs (rows 0 and 1 of out) and __half2 bits.
template <class Pair, class Quad>
__device__ void widen(const uint8_t* codes, float* out, uint16_t* halves, int n) {
    for (int q = threadIdx.x; q < n / 4; q += blockDim.x) {
        Quad quad;
        quad.__x = codes[4 * q] | (codes[4 * q + 1] << 8) | (codes[4 * q + 2] << 16) |
                   (static_cast<uint32_t>(codes[4 * q + 3]) << 24);
        const float4 f4 = static_cast<float4>(quad);
        const float quad_values[4] = {f4.x, f4.y, f4.z, f4.w};
        for (int p = 0; p < 2; ++p) {
            Pair pair;
            pair.__x = static_cast<__nv_fp8x2_storage_t>(codes[4 * q + 2 * p] | (codes[4 * q + 2 * p + 1] << 8));
            const float2 f2 = static_cast<float2>(pair);
            out[n + 4 * q + 2 * p] = f2.x;
            out[n + 4 * q + 2 * p + 1] = f2.y;
            const __half2 h2 = static_cast<__half2>(pair);
            halves[4 * q + 2 * p] = __half_as_ushort(h2.x);
            halves[4 * q + 2 * p + 1] = __half_as_ushort(h2.y);
        }
        for (int b = 0; b < 4; ++b) out[4 * q + b] = quad_values[b];
    }
}
extern "C" __global__ void widen_vectors(const uint8_t* codes, float* out, uint16_t* halves, int n, int interp) {
    if (interp) widen<__nv_fp8x2_e5m2, __nv_fp8x4_e5m2>(codes, out, halves, n);
    else widen<__nv_fp8x2_e4m3, __nv_fp8x4_e4m3>(codes, out, halves, n);
}
