// cuda_fp16.h for the CUDA-on-CPU runner: __half and __half2 with CUDA's conversions and
// arithmetic, bit-exact (see fa_cuda_cpu_round.h). It stands in for NVIDIA's header so that a
// machine with only g++ can build the kernels; the interface mirrors CUDA 12/13's, minus the
// rarely used corners (directed-rounding arithmetic, most __half2 math functions). A function
// missing here fails the build naming it.
#pragma once

#include "fa_cuda_cpu_half.h"

struct __half_raw {
    unsigned short x;
};
struct __half2_raw {
    unsigned short x, y;
};

// Storage and implicit conversions, as CUDA has them (round to nearest even; integers to zero).
struct __attribute__((aligned(2))) __half : ::fa_cpu::Float16<__half, __half_raw, ::fa_cpu::HalfFormat> {
    using Float16::Float16;
    using Float16::operator=;
};

struct __attribute__((aligned(4))) __half2 : ::fa_cpu::Pair16<__half, __half2_raw> {
    using Pair16::Pair16;
};

typedef __half half;
typedef __half2 half2;
typedef __half __nv_half;
typedef __half2 __nv_half2;

// ---- conversions ------------------------------------------------------------------------------------

FA_CPU_16BIT_CONVERSIONS(__half, __half2, half)
// fp16 only (cuda_bf16.h has no counterpart of these; CUDA has, and they can be added to the macro)
inline int __half2int_rd(__half h) { float f = __half2float(h); return f != f ? 0 : static_cast<int>(floorf(f)); }
inline int __half2int_ru(__half h) { float f = __half2float(h); return f != f ? 0 : static_cast<int>(ceilf(f)); }
inline unsigned int __half2uint_rz(__half h) { return static_cast<unsigned int>(h); }
inline short __half2short_rz(__half h) { return static_cast<short>(h); }
inline unsigned short __half2ushort_rz(__half h) { return static_cast<unsigned short>(h); }
inline long long __half2ll_rz(__half h) { return static_cast<long long>(h); }
inline __half __short2half_rn(short i) { return __half(i); }
inline __half __ushort2half_rn(unsigned short i) { return __half(i); }
inline __half __ll2half_rn(long long i) { return __half(i); }
inline __half __ull2half_rn(unsigned long long i) { return __half(i); }
inline __half2 __low2half2(__half2 h) { return __half2(h.x, h.x); }
inline __half2 __high2half2(__half2 h) { return __half2(h.y, h.y); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __lowhigh2highlow(__half2 h) { return __half2(h.y, h.x); }

// ---- arithmetic: computed in float, rounded once ------------------------------------------------------

FA_CPU_16BIT_ARITHMETIC(__half, half, 0x7c00u)
inline __half __hadd_sat(__half a, __half b) { return __half(__saturatef(__half2float(__hadd(a, b)))); }
inline __half __hsub_sat(__half a, __half b) { return __half(__saturatef(__half2float(__hsub(a, b)))); }
inline __half __hmul_sat(__half a, __half b) { return __half(__saturatef(__half2float(__hmul(a, b)))); }
inline __half __hfma_sat(__half a, __half b, __half c) { return __half(__saturatef(__half2float(__hfma(a, b, c)))); }
inline __half& operator++(__half& a) { return a = __hadd(a, __half(1.0f)); }
inline __half& operator--(__half& a) { return a = __hsub(a, __half(1.0f)); }
inline __half operator++(__half& a, int) { __half old = a; ++a; return old; }
inline __half operator--(__half& a, int) { __half old = a; --a; return old; }

// __half2: the same, lane by lane.
FA_CPU_16BIT_PAIR_ARITHMETIC(__half2)
FA_CPU_COMPOUND_OPERATORS(__half2, __hadd2, __hsub2, __hmul2, __h2div)
inline __half2 __hneg2(__half2 a) { return __half2(__hneg(a.x), __hneg(a.y)); }
inline __half2 __habs2(__half2 a) { return __half2(__habs(a.x), __habs(a.y)); }
inline __half2 operator-(const __half2& a) { return __hneg2(a); }

// ---- math functions: float libm, rounded once ---------------------------------------------------------

FA_CPU_16BIT_MATH(__half, half)
FA_CPU_16BIT_MATH_FUNCTION(__half, half, hexp10, powf(10.0f, x))
FA_CPU_16BIT_MATH_FUNCTION(__half, half, hlog10, log10f(x))
FA_CPU_16BIT_MATH_FUNCTION(__half, half, hsin, sinf(x))
FA_CPU_16BIT_MATH_FUNCTION(__half, half, hcos, cosf(x))
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
