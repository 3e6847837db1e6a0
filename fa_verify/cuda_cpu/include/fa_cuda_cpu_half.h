// fa_cuda_cpu_half.h: what cuda_fp16.h (__half, __half2) and cuda_bf16.h (__nv_bfloat16,
// __nv_bfloat162) share, written once. The two formats differ only in how a float rounds into
// their 16 bits and back (fa_cuda_cpu_round.h) and in where infinity lies; the storage, CUDA's
// implicit conversions and the lane pair are class templates both types derive from, and the
// functions CUDA gives both types are macros each header expands with its type's names (CUDA
// names them __float2half / __float2bfloat16, __half2float / __bfloat162float, ...: N below is
// `half` or `bfloat16`). Internal to the shim: a kernel includes cuda_fp16.h or cuda_bf16.h.
#pragma once

#include <climits>
#include <cstdint>

#include "fa_cuda_cpu.h"
#include "fa_cuda_cpu_round.h"

namespace fa_cpu {

// How a float rounds into the bits of a format (nearest even unless told; CUDA's canonical NaN
// 0x7FFF) and back.
struct HalfFormat {
    static std::uint16_t from_float(float f, fp::Rounding mode = fp::kNearest) { return fp::float_to_half(f, mode); }
    static float to_float(std::uint16_t b) { return fp::half_to_float(b); }
};
struct Bf16Format {
    static std::uint16_t from_float(float f, fp::Rounding mode = fp::kNearest) { return fp::float_to_bf16(f, mode); }
    static float to_float(std::uint16_t b) { return fp::bf16_to_float(b); }
};

// The storage and implicit conversions of a 16-bit float type Self (__half, __nv_bfloat16), as
// CUDA has them: to and from its raw struct Raw bit for bit; from floating types rounded to
// nearest even (a double through round-to-odd float, so that it rounds once) and from integers
// through double; to integers toward zero (NaN 0, +-inf saturating).
template <class Self, class Raw, class Format>
struct Float16 {
    using fa_cpu_raw = Raw;
    using fa_cpu_format = Format;

  protected:
    unsigned short __x;

  public:
    Float16() = default;
    constexpr Float16(const Raw& r) : __x(r.x) {}
    Self& operator=(const Raw& r) { __x = r.x; return self(); }
    operator Raw() const { return Raw{__x}; }

    Float16(float f) : __x(Format::from_float(f)) {}
    Float16(double d) : __x(Format::from_float(fp::double_to_float_odd(d))) {}
    Float16(short v) : Float16(static_cast<double>(v)) {}
    Float16(unsigned short v) : Float16(static_cast<double>(v)) {}
    Float16(int v) : Float16(static_cast<double>(v)) {}
    Float16(unsigned int v) : Float16(static_cast<double>(v)) {}
    Float16(long v) : Float16(static_cast<double>(v)) {}
    Float16(unsigned long v) : Float16(static_cast<double>(v)) {}
    Float16(long long v) : Float16(static_cast<double>(v)) {}
    Float16(unsigned long long v) : Float16(static_cast<double>(v)) {}
    Self& operator=(float f) { return self() = Self(f); }
    Self& operator=(double d) { return self() = Self(d); }
    operator float() const { return Format::to_float(__x); }
    operator short() const { return static_cast<short>(to_int()); }
    operator unsigned short() const { return static_cast<unsigned short>(to_int()); }
    operator int() const { return static_cast<int>(to_int()); }
    operator unsigned int() const { return static_cast<unsigned int>(to_int()); }
    operator long long() const { return to_int(); }
    operator unsigned long long() const { return static_cast<unsigned long long>(to_int()); }
    explicit operator bool() const { return (__x & 0x7fffu) != 0; }

  private:
    Self& self() { return static_cast<Self&>(*this); }
    long long to_int() const {
        const float f = Format::to_float(__x);
        if (f != f) return 0;
        if (f > 9.2e18f || f < -9.2e18f) return f > 0 ? LLONG_MAX : LLONG_MIN;  // +-inf saturate
        return static_cast<long long>(f);
    }
};

// The lane pair of Elem (__half2, __nv_bfloat162): .x and .y, to and from its raw struct Raw2.
template <class Elem, class Raw2>
struct Pair16 {
    Elem x, y;
    Pair16() = default;
    constexpr Pair16(const Elem& a, const Elem& b) : x(a), y(b) {}
    Pair16(const Raw2& r) : x(typename Elem::fa_cpu_raw{r.x}), y(typename Elem::fa_cpu_raw{r.y}) {}
    operator Raw2() const {
        using Raw = typename Elem::fa_cpu_raw;
        return Raw2{static_cast<Raw>(x).x, static_cast<Raw>(y).x};
    }
};

// A value's bits, a value from bits, and a float rounded in a given mode.
template <class T> inline unsigned short bits16(T h) { return static_cast<typename T::fa_cpu_raw>(h).x; }
template <class T> inline T from_bits16(unsigned short b) { return T(typename T::fa_cpu_raw{b}); }
template <class T> inline T round16(float f, fp::Rounding mode) {
    return from_bits16<T>(T::fa_cpu_format::from_float(f, mode));
}

}  // namespace fa_cpu

// ---- conversions ------------------------------------------------------------------------------------

#define FA_CPU_16BIT_CONVERSIONS(T, T2, N)                                                                     \
    inline T __float2##N(float f) { return T(f); }                                                             \
    inline T __float2##N##_rn(float f) { return T(f); }                                                        \
    inline T __float2##N##_rz(float f) { return ::fa_cpu::round16<T>(f, ::fa_cpu::fp::kTowardZero); }        \
    inline T __float2##N##_rd(float f) { return ::fa_cpu::round16<T>(f, ::fa_cpu::fp::kDown); }              \
    inline T __float2##N##_ru(float f) { return ::fa_cpu::round16<T>(f, ::fa_cpu::fp::kUp); }                \
    inline T __double2##N(double d) { return T(d); }                                                           \
    inline float __##N##2float(T h) { return static_cast<float>(h); }                                          \
    inline T2 __float2##N##2_rn(float f) { return T2(T(f), T(f)); }                                            \
    inline T2 __floats2##N##2_rn(float a, float b) { return T2(T(a), T(b)); }                                  \
    inline T2 __float22##N##2_rn(float2 f) { return T2(T(f.x), T(f.y)); }                                      \
    inline float2 __##N##22float2(T2 h) { return float2{__##N##2float(h.x), __##N##2float(h.y)}; }             \
    inline float __low2float(T2 h) { return __##N##2float(h.x); }                                              \
    inline float __high2float(T2 h) { return __##N##2float(h.y); }                                             \
    inline int __##N##2int_rz(T h) { return static_cast<int>(h); }                                             \
    inline int __##N##2int_rn(T h) { float f = __##N##2float(h); return f != f ? 0 : static_cast<int>(nearbyintf(f)); } \
    inline T __int2##N##_rn(int i) { return T(i); }                                                            \
    inline T __uint2##N##_rn(unsigned int i) { return T(i); }                                                  \
    inline short __##N##_as_short(T h) { return static_cast<short>(::fa_cpu::bits16(h)); }                     \
    inline unsigned short __##N##_as_ushort(T h) { return ::fa_cpu::bits16(h); }                               \
    inline T __short_as_##N(short i) { return ::fa_cpu::from_bits16<T>(static_cast<unsigned short>(i)); }     \
    inline T __ushort_as_##N(unsigned short i) { return ::fa_cpu::from_bits16<T>(i); }                         \
    inline T2 make_##N##2(T x, T y) { return T2(x, y); }                                                       \
    inline T2 __halves2##N##2(T x, T y) { return T2(x, y); }                                                   \
    inline T2 __##N##2##N##2(T x) { return T2(x, x); }                                                         \
    inline T __low2##N(T2 h) { return h.x; }                                                                   \
    inline T __high2##N(T2 h) { return h.y; }

// ---- arithmetic: computed in float, rounded once (the same names for both types, as in CUDA) ----------
//
// INF: the bits of +infinity (negative: | 0x8000); a NaN is any larger magnitude.

#define FA_CPU_16BIT_ARITHMETIC(T, N, INF)                                                                     \
    inline T __hadd(T a, T b) { return T(__##N##2float(a) + __##N##2float(b)); }                               \
    inline T __hsub(T a, T b) { return T(__##N##2float(a) - __##N##2float(b)); }                               \
    inline T __hmul(T a, T b) { return T(__##N##2float(a) * __##N##2float(b)); }                               \
    inline T __hdiv(T a, T b) { return T(__##N##2float(a) / __##N##2float(b)); }                               \
    inline T __hfma(T a, T b, T c) {                                                                           \
        return T(::fa_cpu::fp::fma_odd(__##N##2float(a), __##N##2float(b), __##N##2float(c)));                \
    }                                                                                                          \
    inline T __hneg(T a) { return ::fa_cpu::from_bits16<T>(::fa_cpu::bits16(a) ^ 0x8000u); }                  \
    inline T __habs(T a) { return ::fa_cpu::from_bits16<T>(::fa_cpu::bits16(a) & 0x7fffu); }                  \
    inline bool __hisnan(T a) { return (::fa_cpu::bits16(a) & 0x7fffu) > (INF); }                             \
    inline int __hisinf(T a) {                                                                                 \
        const unsigned short b = ::fa_cpu::bits16(a);                                                          \
        return b == (INF) ? 1 : (b == ((INF) | 0x8000u) ? -1 : 0);                                             \
    }                                                                                                          \
    inline T __hmax(T a, T b) { /* a NaN operand yields the other one */                                       \
        if (__hisnan(a)) return __hisnan(b) ? __ushort_as_##N(0x7fffu) : b;                                    \
        if (__hisnan(b)) return a;                                                                             \
        return __##N##2float(a) >= __##N##2float(b) ? a : b;                                                   \
    }                                                                                                          \
    inline T __hmin(T a, T b) {                                                                                \
        if (__hisnan(a)) return __hisnan(b) ? __ushort_as_##N(0x7fffu) : b;                                    \
        if (__hisnan(b)) return a;                                                                             \
        return __##N##2float(a) <= __##N##2float(b) ? a : b;                                                   \
    }                                                                                                          \
    inline T __hmax_nan(T a, T b) { return (__hisnan(a) || __hisnan(b)) ? __ushort_as_##N(0x7fffu) : __hmax(a, b); } \
    inline T __hmin_nan(T a, T b) { return (__hisnan(a) || __hisnan(b)) ? __ushort_as_##N(0x7fffu) : __hmin(a, b); } \
    inline bool __heq(T a, T b) { return __##N##2float(a) == __##N##2float(b); }                               \
    inline bool __hne(T a, T b) { return __##N##2float(a) != __##N##2float(b) && !__hisnan(a) && !__hisnan(b); } \
    inline bool __hlt(T a, T b) { return __##N##2float(a) < __##N##2float(b); }                                \
    inline bool __hle(T a, T b) { return __##N##2float(a) <= __##N##2float(b); }                               \
    inline bool __hgt(T a, T b) { return __##N##2float(a) > __##N##2float(b); }                                \
    inline bool __hge(T a, T b) { return __##N##2float(a) >= __##N##2float(b); }                               \
    inline bool __hneu(T a, T b) { return __##N##2float(a) != __##N##2float(b); }                              \
    FA_CPU_BINARY_OPERATORS(T, __hadd, __hsub, __hmul, __hdiv)                                                 \
    FA_CPU_COMPOUND_OPERATORS(T, __hadd, __hsub, __hmul, __hdiv)                                               \
    inline T operator+(const T& a) { return a; }                                                               \
    inline T operator-(const T& a) { return __hneg(a); }                                                       \
    inline bool operator==(const T& a, const T& b) { return __heq(a, b); }                                     \
    inline bool operator!=(const T& a, const T& b) { return __hneu(a, b); }                                    \
    inline bool operator<(const T& a, const T& b) { return __hlt(a, b); }                                      \
    inline bool operator<=(const T& a, const T& b) { return __hle(a, b); }                                     \
    inline bool operator>(const T& a, const T& b) { return __hgt(a, b); }                                      \
    inline bool operator>=(const T& a, const T& b) { return __hge(a, b); }

// The pair type: lane by lane.
#define FA_CPU_16BIT_PAIR_ARITHMETIC(T2)                                                                       \
    inline T2 __hadd2(T2 a, T2 b) { return T2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }                           \
    inline T2 __hsub2(T2 a, T2 b) { return T2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }                           \
    inline T2 __hmul2(T2 a, T2 b) { return T2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }                           \
    inline T2 __h2div(T2 a, T2 b) { return T2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }                           \
    inline T2 __hfma2(T2 a, T2 b, T2 c) { return T2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }           \
    inline T2 __hmax2(T2 a, T2 b) { return T2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }                           \
    inline T2 __hmin2(T2 a, T2 b) { return T2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }                           \
    FA_CPU_BINARY_OPERATORS(T2, __hadd2, __hsub2, __hmul2, __h2div)

#define FA_CPU_BINARY_OPERATORS(T, ADD, SUB, MUL, DIV)                                                         \
    inline T operator+(const T& a, const T& b) { return ADD(a, b); }                                           \
    inline T operator-(const T& a, const T& b) { return SUB(a, b); }                                           \
    inline T operator*(const T& a, const T& b) { return MUL(a, b); }                                           \
    inline T operator/(const T& a, const T& b) { return DIV(a, b); }

#define FA_CPU_COMPOUND_OPERATORS(T, ADD, SUB, MUL, DIV)                                                       \
    inline T& operator+=(T& a, const T& b) { return a = ADD(a, b); }                                           \
    inline T& operator-=(T& a, const T& b) { return a = SUB(a, b); }                                           \
    inline T& operator*=(T& a, const T& b) { return a = MUL(a, b); }                                           \
    inline T& operator/=(T& a, const T& b) { return a = DIV(a, b); }

// ---- math functions: float libm, rounded once ---------------------------------------------------------

#define FA_CPU_16BIT_MATH_FUNCTION(T, N, NAME, EXPR) \
    inline T NAME(T h) { const float x = __##N##2float(h); return T(EXPR); }

#define FA_CPU_16BIT_MATH(T, N)                                    \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hexp, expf(x))                \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hexp2, exp2f(x))              \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hlog, logf(x))                \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hlog2, log2f(x))              \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hsqrt, sqrtf(x))              \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hrsqrt, 1.0f / sqrtf(x))      \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hrcp, 1.0f / x)               \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, htanh, tanhf(x))              \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hceil, ceilf(x))              \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hfloor, floorf(x))            \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, htrunc, truncf(x))            \
    FA_CPU_16BIT_MATH_FUNCTION(T, N, hrint, nearbyintf(x))
