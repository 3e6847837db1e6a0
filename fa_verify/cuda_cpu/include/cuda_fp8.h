// cuda_fp8.h for the CUDA-on-CPU runner: the e4m3 and e5m2 formats of CUDA 12/13 (storage types,
// __nv_cvt_* conversions, the __nv_fp8[x2|x4]_{e4m3,e5m2} classes) with CUDA's results bit for bit.
// Written from the formats' definitions and the documented semantics of NVIDIA's header:
//
// - rounding to nearest even, from the exact value (a double is rounded once; a float, __half or
//   __nv_bfloat16 is widened exactly first);
// - e4m3 has no infinity: its largest finite value is 448 (0x7E), 0x7F is NaN; e5m2's largest
//   finite value is 57344 (0x7B), 0x7C infinity, above it NaN;
// - out of range (a value that rounds past the largest finite one, or an infinity): __NV_SATFINITE
//   gives +-the largest finite value; __NV_NOSAT gives NaN for e4m3 and +-infinity for e5m2;
// - NaN stays NaN in both modes (e4m3 0x7F, e5m2 0x7E). A float, __half or bf16 NaN loses its
//   sign first (CUDA canonicalises it to 0x7FFFFFFF), a double NaN keeps it (0xFF / 0xFE);
// - magnitudes at or below half the smallest subnormal give a signed zero;
// - fp8 to __half is exact; a NaN gives __half's canonical NaN 0x7FFF, which widens to the float
//   0x7FFFFFFF (as cvt.f32.f16 does).
//
// Where this differs from ml_dtypes (tests/test_cuda_fp8.py asserts each): __NV_SATFINITE (ml_dtypes
// does not saturate) and the sign of a NaN from float (ml_dtypes keeps it).
// The classes' constructors saturate (__NV_SATFINITE), as CUDA's do; their conversions are explicit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;

typedef enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE } __nv_saturation_t;
typedef enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 } __nv_fp8_interpretation_t;

namespace fa_cpu {
namespace fp8 {

// One format's shape: explicit mantissa bits, exponent bias, and its special codes (magnitudes).
struct Format {
    int mantissa_bits, bias;
    std::uint8_t max_finite, nan, overflow_nosat;
};
inline Format format(__nv_fp8_interpretation_t f) {
    return f == __NV_E4M3 ? Format{3, 7, 0x7E, 0x7F, 0x7F} : Format{2, 15, 0x7B, 0x7E, 0x7C};
}

// The magnitude of code c (sign bit clear, not NaN or infinity), as a double (exact).
inline double magnitude(std::uint8_t c, const Format& f) {
    const int e = c >> f.mantissa_bits, m = c & ((1 << f.mantissa_bits) - 1);
    const int one = 1 << f.mantissa_bits;
    return e == 0 ? std::ldexp(static_cast<double>(m), 1 - f.bias - f.mantissa_bits)
                  : std::ldexp(static_cast<double>(one + m), e - f.bias - f.mantissa_bits);
}

// x rounded to the nearest code (ties to even), as CUDA's conversion of a double does.
inline __nv_fp8_storage_t from_double(double x, __nv_saturation_t sat, __nv_fp8_interpretation_t interp) {
    const Format f = format(interp);
    const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return static_cast<__nv_fp8_storage_t>(sign | f.nan);
    const double a = std::fabs(x);
    const double max = magnitude(f.max_finite, f);
    const std::uint8_t overflow = sat == __NV_SATFINITE ? f.max_finite : f.overflow_nosat;
    if (std::isinf(a)) return static_cast<__nv_fp8_storage_t>(sign | overflow);
    // The spacing of codes around a: 2^(e - mantissa_bits), e the exponent of a, at least the
    // smallest normal exponent (the subnormals share its spacing).
    const int min_exponent = 1 - f.bias;
    int e = a == 0.0 ? min_exponent : std::ilogb(a);
    if (e < min_exponent) e = min_exponent;
    const double units = std::nearbyint(std::ldexp(a, f.mantissa_bits - e));  // exact scaling; ties to even
    const double r = std::ldexp(units, e - f.mantissa_bits);
    if (r > max) return static_cast<__nv_fp8_storage_t>(sign | overflow);
    if (r == 0.0) return sign;
    const int re = std::ilogb(r);
    const int code = re < min_exponent ? static_cast<int>(units)  // a subnormal: its count of units
                                       : ((re + f.bias) << f.mantissa_bits) |
                                             (static_cast<int>(std::ldexp(r, f.mantissa_bits - re)) -
                                              (1 << f.mantissa_bits));
    return static_cast<__nv_fp8_storage_t>(sign | code);
}

// A float NaN is CUDA's canonical one (positive) before the exact widening to double.
inline __nv_fp8_storage_t from_float(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t interp) {
    return from_double(std::isnan(x) ? std::fabs(static_cast<double>(x)) : static_cast<double>(x), sat, interp);
}

inline unsigned short to_half_bits(__nv_fp8_storage_t c, __nv_fp8_interpretation_t interp) {
    const Format f = format(interp);
    const std::uint8_t a = c & 0x7F;
    const bool nan = interp == __NV_E4M3 ? a == f.nan : a > f.overflow_nosat;
    if (nan) return 0x7FFF;
    const unsigned short sign = (c & 0x80) ? 0x8000 : 0x0000;
    if (interp == __NV_E5M2 && a == f.overflow_nosat) return static_cast<unsigned short>(sign | 0x7C00);
    return static_cast<unsigned short>(sign | fp::float_to_half(static_cast<float>(magnitude(a, f))));
}

// __half bits widened to float; a NaN is 0x7FFFFFFF, as cvt.f32.f16 gives.
inline float half_bits_to_float(unsigned short h) {
    return (h & 0x7FFF) > 0x7C00 ? fp::bits_float(0x7FFFFFFFu) : fp::half_to_float(h);
}

inline unsigned short pack2(__nv_fp8_storage_t lo, __nv_fp8_storage_t hi) {
    return static_cast<unsigned short>(lo | (hi << 8));
}

}  // namespace fp8
}  // namespace fa_cpu

// ---- conversions ------------------------------------------------------------------------------------

inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t sat, __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::from_double(x, sat, f);
}
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::from_float(x, sat, f);
}
inline __nv_fp8_storage_t __nv_cvt_halfraw_to_fp8(__half_raw x, __nv_saturation_t sat, __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::from_float(::fa_cpu::fp::half_to_float(x.x), sat, f);
}
inline __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw x, __nv_saturation_t sat,
                                                      __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::from_float(::fa_cpu::fp::bf16_to_float(x.x), sat, f);
}
inline __nv_fp8x2_storage_t __nv_cvt_double2_to_fp8x2(double2 x, __nv_saturation_t sat, __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::pack2(__nv_cvt_double_to_fp8(x.x, sat, f), __nv_cvt_double_to_fp8(x.y, sat, f));
}
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t sat, __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::pack2(__nv_cvt_float_to_fp8(x.x, sat, f), __nv_cvt_float_to_fp8(x.y, sat, f));
}
inline __nv_fp8x2_storage_t __nv_cvt_halfraw2_to_fp8x2(__half2_raw x, __nv_saturation_t sat,
                                                       __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::pack2(__nv_cvt_halfraw_to_fp8(__half_raw{x.x}, sat, f),
                                __nv_cvt_halfraw_to_fp8(__half_raw{x.y}, sat, f));
}
inline __nv_fp8x2_storage_t __nv_cvt_bfloat16raw2_to_fp8x2(__nv_bfloat162_raw x, __nv_saturation_t sat,
                                                           __nv_fp8_interpretation_t f) {
    return ::fa_cpu::fp8::pack2(__nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw{x.x}, sat, f),
                                __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw{x.y}, sat, f));
}
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t f) {
    return __half_raw{::fa_cpu::fp8::to_half_bits(x, f)};
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t f) {
    return __half2_raw{::fa_cpu::fp8::to_half_bits(static_cast<__nv_fp8_storage_t>(x & 0xFF), f),
                       ::fa_cpu::fp8::to_half_bits(static_cast<__nv_fp8_storage_t>(x >> 8), f)};
}

// ---- the classes ------------------------------------------------------------------------------------

namespace fa_cpu {
namespace fp8 {

// One fp8 value of format F: the storage __x and CUDA's (explicit) conversions, saturating.
template <__nv_fp8_interpretation_t F>
struct Scalar {
    __nv_fp8_storage_t __x;

    Scalar() = default;
    explicit Scalar(__half h) : __x(__nv_cvt_halfraw_to_fp8(static_cast<__half_raw>(h), __NV_SATFINITE, F)) {}
    explicit Scalar(__nv_bfloat16 h)
        : __x(__nv_cvt_bfloat16raw_to_fp8(static_cast<__nv_bfloat16_raw>(h), __NV_SATFINITE, F)) {}
    explicit Scalar(float v) : __x(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, F)) {}
    explicit Scalar(double v) : __x(__nv_cvt_double_to_fp8(v, __NV_SATFINITE, F)) {}
    // from short, int, long, long long and their unsigned kinds, through float, as CUDA does
    template <class I, class = typename std::enable_if<std::is_integral<I>::value>::type>
    explicit Scalar(I v) : Scalar(static_cast<float>(v)) {}

    explicit operator __half_raw() const { return __nv_cvt_fp8_to_halfraw(__x, F); }
    explicit operator __half() const { return __half(__nv_cvt_fp8_to_halfraw(__x, F)); }
    explicit operator float() const { return half_bits_to_float(__nv_cvt_fp8_to_halfraw(__x, F).x); }
    explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }
    explicit operator __nv_bfloat16() const { return __nv_bfloat16(static_cast<float>(*this)); }  // exact
    explicit operator bool() const { return (__x & 0x7F) != 0; }
};

// Two values: x in the low byte, y in the high byte.
template <__nv_fp8_interpretation_t F>
struct Pair {
    __nv_fp8x2_storage_t __x;

    Pair() = default;
    explicit Pair(__half2 h) : __x(__nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(h), __NV_SATFINITE, F)) {}
    explicit Pair(__nv_bfloat162 h)
        : __x(__nv_cvt_bfloat16raw2_to_fp8x2(static_cast<__nv_bfloat162_raw>(h), __NV_SATFINITE, F)) {}
    explicit Pair(float2 v) : __x(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, F)) {}
    explicit Pair(double2 v) : __x(__nv_cvt_double2_to_fp8x2(v, __NV_SATFINITE, F)) {}

    explicit operator __half2_raw() const { return __nv_cvt_fp8x2_to_halfraw2(__x, F); }
    explicit operator __half2() const { return __half2(__nv_cvt_fp8x2_to_halfraw2(__x, F)); }
    explicit operator float2() const {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__x, F);
        return float2{half_bits_to_float(h.x), half_bits_to_float(h.y)};
    }
};

// Four values, x in the lowest byte to w in the highest.
template <__nv_fp8_interpretation_t F>
struct Quad {
    __nv_fp8x4_storage_t __x;

    Quad() = default;
    explicit Quad(__half2 lo, __half2 hi) : __x(join(Pair<F>(lo).__x, Pair<F>(hi).__x)) {}
    explicit Quad(__nv_bfloat162 lo, __nv_bfloat162 hi) : __x(join(Pair<F>(lo).__x, Pair<F>(hi).__x)) {}
    explicit Quad(float4 v) : __x(join(Pair<F>(float2{v.x, v.y}).__x, Pair<F>(float2{v.z, v.w}).__x)) {}
    explicit Quad(double4 v) : __x(join(Pair<F>(double2{v.x, v.y}).__x, Pair<F>(double2{v.z, v.w}).__x)) {}

    explicit operator float4() const {
        const float2 lo = static_cast<float2>(pair(0)), hi = static_cast<float2>(pair(1));
        return float4{lo.x, lo.y, hi.x, hi.y};
    }

  private:
    static __nv_fp8x4_storage_t join(__nv_fp8x2_storage_t lo, __nv_fp8x2_storage_t hi) {
        return static_cast<__nv_fp8x4_storage_t>(lo) | (static_cast<__nv_fp8x4_storage_t>(hi) << 16);
    }
    Pair<F> pair(int i) const {
        Pair<F> p;
        p.__x = static_cast<__nv_fp8x2_storage_t>(__x >> (16 * i));
        return p;
    }
};

}  // namespace fp8
}  // namespace fa_cpu

#define FA_CPU_FP8_CLASS(NAME, BASE, F, ALIGN) \
    struct __attribute__((aligned(ALIGN))) NAME : ::fa_cpu::fp8::BASE<F> { using BASE::BASE; };
FA_CPU_FP8_CLASS(__nv_fp8_e4m3, Scalar, __NV_E4M3, 1)
FA_CPU_FP8_CLASS(__nv_fp8_e5m2, Scalar, __NV_E5M2, 1)
FA_CPU_FP8_CLASS(__nv_fp8x2_e4m3, Pair, __NV_E4M3, 2)
FA_CPU_FP8_CLASS(__nv_fp8x2_e5m2, Pair, __NV_E5M2, 2)
FA_CPU_FP8_CLASS(__nv_fp8x4_e4m3, Quad, __NV_E4M3, 4)
FA_CPU_FP8_CLASS(__nv_fp8x4_e5m2, Quad, __NV_E5M2, 4)
#undef FA_CPU_FP8_CLASS
