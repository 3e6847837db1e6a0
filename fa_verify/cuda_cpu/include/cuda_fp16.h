// cuda_fp16.h for the CUDA-on-CPU runner: __half and __half2 with CUDA's conversions and
// arithmetic, bit-exact (see fa_cuda_cpu_round.h). It stands in for NVIDIA's header so that a
// machine with only g++ can build the kernels; the interface mirrors CUDA 12/13's, minus the
// rarely used corners (directed-rounding arithmetic, most __half2 math functions). A function
// missing here fails the build naming it.
#pragma once

#include <cstdint>
#include <cstring>

#include "fa_cuda_cpu.h"
#include "fa_cuda_cpu_round.h"

struct __half_raw {
    unsigned short x;
};
struct __half2_raw {
    unsigned short x, y;
};

struct __attribute__((aligned(2))) __half {
  protected:
    unsigned short __x;

  public:
    __half() = default;
    constexpr __half(const __half_raw& r) : __x(r.x) {}
    __half& operator=(const __half_raw& r) { __x = r.x; return *this; }
    operator __half_raw() const { return __half_raw{__x}; }

    // Implicit conversions, as CUDA has them (round to nearest even; integers to zero).
    __half(float f) : __x(::fa_cpu::fp::float_to_half(f)) {}
    __half(double d) : __x(::fa_cpu::fp::float_to_half(::fa_cpu::fp::double_to_float_odd(d))) {}
    __half(short v) : __half(static_cast<double>(v)) {}
    __half(unsigned short v) : __half(static_cast<double>(v)) {}
    __half(int v) : __half(static_cast<double>(v)) {}
    __half(unsigned int v) : __half(static_cast<double>(v)) {}
    __half(long v) : __half(static_cast<double>(v)) {}
    __half(unsigned long v) : __half(static_cast<double>(v)) {}
    __half(long long v) : __half(static_cast<double>(v)) {}
    __half(unsigned long long v) : __half(static_cast<double>(v)) {}
    __half& operator=(float f) { return *this = __half(f); }
    __half& operator=(double d) { return *this = __half(d); }
    operator float() const { return ::fa_cpu::fp::half_to_float(__x); }
    operator short() const { return static_cast<short>(to_int()); }
    operator unsigned short() const { return static_cast<unsigned short>(to_int()); }
    operator int() const { return static_cast<int>(to_int()); }
    operator unsigned int() const { return static_cast<unsigned int>(to_int()); }
    operator long long() const { return to_int(); }
    operator unsigned long long() const { return static_cast<unsigned long long>(to_int()); }
    explicit operator bool() const { return (__x & 0x7fffu) != 0; }

  private:
    long long to_int() const {
        const float f = ::fa_cpu::fp::half_to_float(__x);
        if (f != f) return 0;
        if (f > 9.2e18f || f < -9.2e18f) return f > 0 ? LLONG_MAX : LLONG_MIN;  // +-inf saturate
        return static_cast<long long>(f);
    }
};

struct __attribute__((aligned(4))) __half2 {
    __half x, y;
    __half2() = default;
    constexpr __half2(const __half& a, const __half& b) : x(a), y(b) {}
    __half2(const __half2_raw& r) : x(__half_raw{r.x}), y(__half_raw{r.y}) {}
    operator __half2_raw() const {
        return __half2_raw{static_cast<__half_raw>(x).x, static_cast<__half_raw>(y).x};
    }
};

typedef __half half;
typedef __half2 half2;
typedef __half __nv_half;
typedef __half2 __nv_half2;

namespace fa_cpu {
inline unsigned short half_bits(__half h) { return static_cast<__half_raw>(h).x; }
inline __half half_from_bits(unsigned short b) { return __half(__half_raw{b}); }
inline __half half_round(float f, fp::Rounding mode) { return half_from_bits(fp::float_to_half(f, mode)); }
}  // namespace fa_cpu

// ---- conversions ------------------------------------------------------------------------------------

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half_rz(float f) { return ::fa_cpu::half_round(f, ::fa_cpu::fp::kTowardZero); }
inline __half __float2half_rd(float f) { return ::fa_cpu::half_round(f, ::fa_cpu::fp::kDown); }
inline __half __float2half_ru(float f) { return ::fa_cpu::half_round(f, ::fa_cpu::fp::kUp); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half2 __float2half2_rn(float f) { return __half2(__half(f), __half(f)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__half(a), __half(b)); }
inline __half2 __float22half2_rn(float2 f) { return __half2(__half(f.x), __half(f.y)); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline int __half2int_rz(__half h) { return static_cast<int>(h); }
inline int __half2int_rn(__half h) { float f = __half2float(h); return f != f ? 0 : static_cast<int>(nearbyintf(f)); }
inline int __half2int_rd(__half h) { float f = __half2float(h); return f != f ? 0 : static_cast<int>(floorf(f)); }
inline int __half2int_ru(__half h) { float f = __half2float(h); return f != f ? 0 : static_cast<int>(ceilf(f)); }
inline unsigned int __half2uint_rz(__half h) { return static_cast<unsigned int>(h); }
inline short __half2short_rz(__half h) { return static_cast<short>(h); }
inline unsigned short __half2ushort_rz(__half h) { return static_cast<unsigned short>(h); }
inline long long __half2ll_rz(__half h) { return static_cast<long long>(h); }
inline __half __int2half_rn(int i) { return __half(i); }
inline __half __uint2half_rn(unsigned int i) { return __half(i); }
inline __half __short2half_rn(short i) { return __half(i); }
inline __half __ushort2half_rn(unsigned short i) { return __half(i); }
inline __half __ll2half_rn(long long i) { return __half(i); }
inline __half __ull2half_rn(unsigned long long i) { return __half(i); }
inline short __half_as_short(__half h) { return static_cast<short>(::fa_cpu::half_bits(h)); }
inline unsigned short __half_as_ushort(__half h) { return ::fa_cpu::half_bits(h); }
inline __half __short_as_half(short i) { return ::fa_cpu::half_from_bits(static_cast<unsigned short>(i)); }
inline __half __ushort_as_half(unsigned short i) { return ::fa_cpu::half_from_bits(i); }
inline __half2 make_half2(__half x, __half y) { return __half2(x, y); }
inline __half2 __halves2half2(__half x, __half y) { return __half2(x, y); }
inline __half2 __half2half2(__half x) { return __half2(x, x); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __low2half2(__half2 h) { return __half2(h.x, h.x); }
inline __half2 __high2half2(__half2 h) { return __half2(h.y, h.y); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __lowhigh2highlow(__half2 h) { return __half2(h.y, h.x); }

// ---- arithmetic: computed in float, rounded once ------------------------------------------------------

inline __half __hadd(__half a, __half b) { return __half(__half2float(a) + __half2float(b)); }
inline __half __hsub(__half a, __half b) { return __half(__half2float(a) - __half2float(b)); }
inline __half __hmul(__half a, __half b) { return __half(__half2float(a) * __half2float(b)); }
inline __half __hdiv(__half a, __half b) { return __half(__half2float(a) / __half2float(b)); }
inline __half __hfma(__half a, __half b, __half c) {
    return __half(::fa_cpu::fp::fma_odd(__half2float(a), __half2float(b), __half2float(c)));
}
inline __half __hneg(__half a) { return ::fa_cpu::half_from_bits(::fa_cpu::half_bits(a) ^ 0x8000u); }
inline __half __habs(__half a) { return ::fa_cpu::half_from_bits(::fa_cpu::half_bits(a) & 0x7fffu); }
inline __half __hadd_sat(__half a, __half b) { return __half(__saturatef(__half2float(__hadd(a, b)))); }
inline __half __hsub_sat(__half a, __half b) { return __half(__saturatef(__half2float(__hsub(a, b)))); }
inline __half __hmul_sat(__half a, __half b) { return __half(__saturatef(__half2float(__hmul(a, b)))); }
inline __half __hfma_sat(__half a, __half b, __half c) { return __half(__saturatef(__half2float(__hfma(a, b, c)))); }
inline bool __hisnan(__half a) { return (::fa_cpu::half_bits(a) & 0x7fffu) > 0x7c00u; }
inline int __hisinf(__half a) {
    const unsigned short b = ::fa_cpu::half_bits(a);
    return b == 0x7c00u ? 1 : (b == 0xfc00u ? -1 : 0);
}
inline __half __hmax(__half a, __half b) {  // a NaN operand yields the other one
    if (__hisnan(a)) return __hisnan(b) ? __ushort_as_half(0x7fffu) : b;
    if (__hisnan(b)) return a;
    return __half2float(a) >= __half2float(b) ? a : b;
}
inline __half __hmin(__half a, __half b) {
    if (__hisnan(a)) return __hisnan(b) ? __ushort_as_half(0x7fffu) : b;
    if (__hisnan(b)) return a;
    return __half2float(a) <= __half2float(b) ? a : b;
}
inline __half __hmax_nan(__half a, __half b) { return (__hisnan(a) || __hisnan(b)) ? __ushort_as_half(0x7fffu) : __hmax(a, b); }
inline __half __hmin_nan(__half a, __half b) { return (__hisnan(a) || __hisnan(b)) ? __ushort_as_half(0x7fffu) : __hmin(a, b); }
inline bool __heq(__half a, __half b) { return __half2float(a) == __half2float(b); }
inline bool __hne(__half a, __half b) { return __half2float(a) != __half2float(b) && !__hisnan(a) && !__hisnan(b); }
inline bool __hlt(__half a, __half b) { return __half2float(a) < __half2float(b); }
inline bool __hle(__half a, __half b) { return __half2float(a) <= __half2float(b); }
inline bool __hgt(__half a, __half b) { return __half2float(a) > __half2float(b); }
inline bool __hge(__half a, __half b) { return __half2float(a) >= __half2float(b); }
inline bool __hneu(__half a, __half b) { return __half2float(a) != __half2float(b); }

inline __half operator+(const __half& a, const __half& b) { return __hadd(a, b); }
inline __half operator-(const __half& a, const __half& b) { return __hsub(a, b); }
inline __half operator*(const __half& a, const __half& b) { return __hmul(a, b); }
inline __half operator/(const __half& a, const __half& b) { return __hdiv(a, b); }
inline __half& operator+=(__half& a, const __half& b) { return a = __hadd(a, b); }
inline __half& operator-=(__half& a, const __half& b) { return a = __hsub(a, b); }
inline __half& operator*=(__half& a, const __half& b) { return a = __hmul(a, b); }
inline __half& operator/=(__half& a, const __half& b) { return a = __hdiv(a, b); }
inline __half operator+(const __half& a) { return a; }
inline __half operator-(const __half& a) { return __hneg(a); }
inline __half& operator++(__half& a) { return a = __hadd(a, __half(1.0f)); }
inline __half& operator--(__half& a) { return a = __hsub(a, __half(1.0f)); }
inline __half operator++(__half& a, int) { __half old = a; ++a; return old; }
inline __half operator--(__half& a, int) { __half old = a; --a; return old; }
inline bool operator==(const __half& a, const __half& b) { return __heq(a, b); }
inline bool operator!=(const __half& a, const __half& b) { return __hneu(a, b); }
inline bool operator<(const __half& a, const __half& b) { return __hlt(a, b); }
inline bool operator<=(const __half& a, const __half& b) { return __hle(a, b); }
inline bool operator>(const __half& a, const __half& b) { return __hgt(a, b); }
inline bool operator>=(const __half& a, const __half& b) { return __hge(a, b); }

// __half2: the same, lane by lane.
inline __half2 __hadd2(__half2 a, __half2 b) { return __half2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }
inline __half2 __hsub2(__half2 a, __half2 b) { return __half2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }
inline __half2 __hmul2(__half2 a, __half2 b) { return __half2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }
inline __half2 __h2div(__half2 a, __half2 b) { return __half2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
inline __half2 __hneg2(__half2 a) { return __half2(__hneg(a.x), __hneg(a.y)); }
inline __half2 __habs2(__half2 a) { return __half2(__habs(a.x), __habs(a.y)); }
inline __half2 __hmax2(__half2 a, __half2 b) { return __half2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }
inline __half2 __hmin2(__half2 a, __half2 b) { return __half2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }
inline __half2 operator+(const __half2& a, const __half2& b) { return __hadd2(a, b); }
inline __half2 operator-(const __half2& a, const __half2& b) { return __hsub2(a, b); }
inline __half2 operator*(const __half2& a, const __half2& b) { return __hmul2(a, b); }
inline __half2 operator/(const __half2& a, const __half2& b) { return __h2div(a, b); }
inline __half2& operator+=(__half2& a, const __half2& b) { return a = __hadd2(a, b); }
inline __half2& operator-=(__half2& a, const __half2& b) { return a = __hsub2(a, b); }
inline __half2& operator*=(__half2& a, const __half2& b) { return a = __hmul2(a, b); }
inline __half2& operator/=(__half2& a, const __half2& b) { return a = __h2div(a, b); }
inline __half2 operator-(const __half2& a) { return __hneg2(a); }

// ---- math functions: float libm, rounded once ---------------------------------------------------------

#define FA_CPU_HALF_MATH(NAME, EXPR) \
    inline __half NAME(__half h) { const float x = __half2float(h); return __half(EXPR); }
FA_CPU_HALF_MATH(hexp, expf(x))
FA_CPU_HALF_MATH(hexp2, exp2f(x))
FA_CPU_HALF_MATH(hexp10, powf(10.0f, x))
FA_CPU_HALF_MATH(hlog, logf(x))
FA_CPU_HALF_MATH(hlog2, log2f(x))
FA_CPU_HALF_MATH(hlog10, log10f(x))
FA_CPU_HALF_MATH(hsqrt, sqrtf(x))
FA_CPU_HALF_MATH(hrsqrt, 1.0f / sqrtf(x))
FA_CPU_HALF_MATH(hrcp, 1.0f / x)
FA_CPU_HALF_MATH(hsin, sinf(x))
FA_CPU_HALF_MATH(hcos, cosf(x))
FA_CPU_HALF_MATH(htanh, tanhf(x))
FA_CPU_HALF_MATH(hceil, ceilf(x))
FA_CPU_HALF_MATH(hfloor, floorf(x))
FA_CPU_HALF_MATH(htrunc, truncf(x))
FA_CPU_HALF_MATH(hrint, nearbyintf(x))
#undef FA_CPU_HALF_MATH
inline __half2 h2exp(__half2 h) { return __half2(hexp(h.x), hexp(h.y)); }
inline __half2 h2exp2(__half2 h) { return __half2(hexp2(h.x), hexp2(h.y)); }
inline __half2 h2log(__half2 h) { return __half2(hlog(h.x), hlog(h.y)); }
inline __half2 h2sqrt(__half2 h) { return __half2(hsqrt(h.x), hsqrt(h.y)); }
inline __half2 h2rcp(__half2 h) { return __half2(hrcp(h.x), hrcp(h.y)); }

#define CUDART_INF_FP16 __ushort_as_half((unsigned short)0x7C00U)
#define CUDART_NAN_FP16 __ushort_as_half((unsigned short)0x7FFFU)
#define CUDART_MIN_DENORM_FP16 __ushort_as_half((unsigned short)0x0001U)
#define CUDART_MAX_NORMAL_FP16 __ushort_as_half((unsigned short)0x7BFFU)
#define CUDART_NEG_ZERO_FP16 __ushort_as_half((unsigned short)0x8000U)
#define CUDART_ZERO_FP16 __ushort_as_half((unsigned short)0x0000U)
#define CUDART_ONE_FP16 __ushort_as_half((unsigned short)0x3C00U)
