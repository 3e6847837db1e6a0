// cuda_bf16.h for the CUDA-on-CPU runner: __nv_bfloat16 and __nv_bfloat162 with CUDA's
// conversions (bit-level round to nearest even, canonical NaN 0x7FFF) and arithmetic computed in
// float and rounded once. Mirrors the used part of CUDA's interface; see cuda_fp16.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "fa_cuda_cpu.h"
#include "fa_cuda_cpu_round.h"

struct __nv_bfloat16_raw {
    unsigned short x;
};
struct __nv_bfloat162_raw {
    unsigned short x, y;
};

struct __attribute__((aligned(2))) __nv_bfloat16 {
  protected:
    unsigned short __x;

  public:
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) { __x = r.x; return *this; }
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }

    __nv_bfloat16(float f) : __x(::fa_cpu::fp::float_to_bf16(f)) {}
    __nv_bfloat16(double d) : __x(::fa_cpu::fp::float_to_bf16(::fa_cpu::fp::double_to_float_odd(d))) {}
    __nv_bfloat16(short v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(unsigned short v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(int v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(unsigned int v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(long v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(unsigned long v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(long long v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16(unsigned long long v) : __nv_bfloat16(static_cast<double>(v)) {}
    __nv_bfloat16& operator=(float f) { return *this = __nv_bfloat16(f); }
    __nv_bfloat16& operator=(double d) { return *this = __nv_bfloat16(d); }
    operator float() const { return ::fa_cpu::fp::bf16_to_float(__x); }
    operator short() const { return static_cast<short>(to_int()); }
    operator unsigned short() const { return static_cast<unsigned short>(to_int()); }
    operator int() const { return static_cast<int>(to_int()); }
    operator unsigned int() const { return static_cast<unsigned int>(to_int()); }
    operator long long() const { return to_int(); }
    operator unsigned long long() const { return static_cast<unsigned long long>(to_int()); }
    explicit operator bool() const { return (__x & 0x7fffu) != 0; }

  private:
    long long to_int() const {
        const float f = ::fa_cpu::fp::bf16_to_float(__x);
        if (f != f) return 0;
        if (f > 9.2e18f || f < -9.2e18f) return f > 0 ? LLONG_MAX : LLONG_MIN;
        return static_cast<long long>(f);
    }
};

struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    constexpr __nv_bfloat162(const __nv_bfloat16& a, const __nv_bfloat16& b) : x(a), y(b) {}
    __nv_bfloat162(const __nv_bfloat162_raw& r) : x(__nv_bfloat16_raw{r.x}), y(__nv_bfloat16_raw{r.y}) {}
    operator __nv_bfloat162_raw() const {
        return __nv_bfloat162_raw{static_cast<__nv_bfloat16_raw>(x).x, static_cast<__nv_bfloat16_raw>(y).x};
    }
};

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

namespace fa_cpu {
inline unsigned short bf16_bits(__nv_bfloat16 h) { return static_cast<__nv_bfloat16_raw>(h).x; }
inline __nv_bfloat16 bf16_from_bits(unsigned short b) { return __nv_bfloat16(__nv_bfloat16_raw{b}); }
inline __nv_bfloat16 bf16_round(float f, fp::Rounding mode) { return bf16_from_bits(fp::float_to_bf16(f, mode)); }
}  // namespace fa_cpu

// ---- conversions ------------------------------------------------------------------------------------

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return ::fa_cpu::bf16_round(f, ::fa_cpu::fp::kTowardZero); }
inline __nv_bfloat16 __float2bfloat16_rd(float f) { return ::fa_cpu::bf16_round(f, ::fa_cpu::fp::kDown); }
inline __nv_bfloat16 __float2bfloat16_ru(float f) { return ::fa_cpu::bf16_round(f, ::fa_cpu::fp::kUp); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __nv_bfloat162(__nv_bfloat16(f), __nv_bfloat16(f)); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(b)); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __nv_bfloat162(__nv_bfloat16(f.x), __nv_bfloat16(f.y)); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline int __bfloat162int_rz(__nv_bfloat16 h) { return static_cast<int>(h); }
inline int __bfloat162int_rn(__nv_bfloat16 h) { float f = __bfloat162float(h); return f != f ? 0 : static_cast<int>(nearbyintf(f)); }
inline __nv_bfloat16 __int2bfloat16_rn(int i) { return __nv_bfloat16(i); }
inline __nv_bfloat16 __uint2bfloat16_rn(unsigned int i) { return __nv_bfloat16(i); }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return static_cast<short>(::fa_cpu::bf16_bits(h)); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return ::fa_cpu::bf16_bits(h); }
inline __nv_bfloat16 __short_as_bfloat16(short i) { return ::fa_cpu::bf16_from_bits(static_cast<unsigned short>(i)); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short i) { return ::fa_cpu::bf16_from_bits(i); }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) { return __nv_bfloat162(x, y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) { return __nv_bfloat162(x, y); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 x) { return __nv_bfloat162(x, x); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }

// ---- arithmetic: computed in float, rounded once (same names as for __half, as in CUDA) ---------------

inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(__bfloat162float(a) + __bfloat162float(b)); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(__bfloat162float(a) - __bfloat162float(b)); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(__bfloat162float(a) * __bfloat162float(b)); }
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(__bfloat162float(a) / __bfloat162float(b)); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
    return __nv_bfloat16(::fa_cpu::fp::fma_odd(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return ::fa_cpu::bf16_from_bits(::fa_cpu::bf16_bits(a) ^ 0x8000u); }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return ::fa_cpu::bf16_from_bits(::fa_cpu::bf16_bits(a) & 0x7fffu); }
inline bool __hisnan(__nv_bfloat16 a) { return (::fa_cpu::bf16_bits(a) & 0x7fffu) > 0x7f80u; }
inline int __hisinf(__nv_bfloat16 a) {
    const unsigned short b = ::fa_cpu::bf16_bits(a);
    return b == 0x7f80u ? 1 : (b == 0xff80u ? -1 : 0);
}
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) {
    if (__hisnan(a)) return __hisnan(b) ? __ushort_as_bfloat16(0x7fffu) : b;
    if (__hisnan(b)) return a;
    return __bfloat162float(a) >= __bfloat162float(b) ? a : b;
}
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) {
    if (__hisnan(a)) return __hisnan(b) ? __ushort_as_bfloat16(0x7fffu) : b;
    if (__hisnan(b)) return a;
    return __bfloat162float(a) <= __bfloat162float(b) ? a : b;
}
inline __nv_bfloat16 __hmax_nan(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (__hisnan(a) || __hisnan(b)) ? __ushort_as_bfloat16(0x7fffu) : __hmax(a, b);
}
inline __nv_bfloat16 __hmin_nan(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (__hisnan(a) || __hisnan(b)) ? __ushort_as_bfloat16(0x7fffu) : __hmin(a, b);
}
inline bool __heq(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) == __bfloat162float(b); }
inline bool __hne(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) != __bfloat162float(b) && !__hisnan(a) && !__hisnan(b); }
inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) < __bfloat162float(b); }
inline bool __hle(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) <= __bfloat162float(b); }
inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) > __bfloat162float(b); }
inline bool __hge(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) >= __bfloat162float(b); }
inline bool __hneu(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) != __bfloat162float(b); }

inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hadd(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hsub(a, b); }
inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hmul(a, b); }
inline __nv_bfloat16 operator/(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hdiv(a, b); }
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hadd(a, b); }
inline __nv_bfloat16& operator-=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hsub(a, b); }
inline __nv_bfloat16& operator*=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hmul(a, b); }
inline __nv_bfloat16& operator/=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hdiv(a, b); }
inline __nv_bfloat16 operator+(const __nv_bfloat16& a) { return a; }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a) { return __hneg(a); }
inline bool operator==(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __heq(a, b); }
inline bool operator!=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hneu(a, b); }
inline bool operator<(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hlt(a, b); }
inline bool operator<=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hle(a, b); }
inline bool operator>(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hgt(a, b); }
inline bool operator>=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hge(a, b); }

inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hadd(a.x, b.x), __hadd(a.y, b.y)); }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hsub(a.x, b.x), __hsub(a.y, b.y)); }
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hmul(a.x, b.x), __hmul(a.y, b.y)); }
inline __nv_bfloat162 __h2div(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
    return __nv_bfloat162(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
inline __nv_bfloat162 __hmax2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hmax(a.x, b.x), __hmax(a.y, b.y)); }
inline __nv_bfloat162 __hmin2(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(__hmin(a.x, b.x), __hmin(a.y, b.y)); }
inline __nv_bfloat162 operator+(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hadd2(a, b); }
inline __nv_bfloat162 operator-(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hsub2(a, b); }
inline __nv_bfloat162 operator*(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hmul2(a, b); }
inline __nv_bfloat162 operator/(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __h2div(a, b); }

#define FA_CPU_BF16_MATH(NAME, EXPR) \
    inline __nv_bfloat16 NAME(__nv_bfloat16 h) { const float x = __bfloat162float(h); return __nv_bfloat16(EXPR); }
FA_CPU_BF16_MATH(hexp, expf(x))
FA_CPU_BF16_MATH(hexp2, exp2f(x))
FA_CPU_BF16_MATH(hlog, logf(x))
FA_CPU_BF16_MATH(hlog2, log2f(x))
FA_CPU_BF16_MATH(hsqrt, sqrtf(x))
FA_CPU_BF16_MATH(hrsqrt, 1.0f / sqrtf(x))
FA_CPU_BF16_MATH(hrcp, 1.0f / x)
FA_CPU_BF16_MATH(htanh, tanhf(x))
FA_CPU_BF16_MATH(hceil, ceilf(x))
FA_CPU_BF16_MATH(hfloor, floorf(x))
FA_CPU_BF16_MATH(htrunc, truncf(x))
FA_CPU_BF16_MATH(hrint, nearbyintf(x))
#undef FA_CPU_BF16_MATH

#define CUDART_INF_BF16 __ushort_as_bfloat16((unsigned short)0x7F80U)
#define CUDART_NAN_BF16 __ushort_as_bfloat16((unsigned short)0x7FFFU)
#define CUDART_MIN_DENORM_BF16 __ushort_as_bfloat16((unsigned short)0x0001U)
#define CUDART_MAX_NORMAL_BF16 __ushort_as_bfloat16((unsigned short)0x7F7FU)
#define CUDART_NEG_ZERO_BF16 __ushort_as_bfloat16((unsigned short)0x8000U)
#define CUDART_ZERO_BF16 __ushort_as_bfloat16((unsigned short)0x0000U)
#define CUDART_ONE_BF16 __ushort_as_bfloat16((unsigned short)0x3F80U)
