// cuda_bf16.h for the CUDA-on-CPU runner: __nv_bfloat16 and __nv_bfloat162 with CUDA's
// conversions (bit-level round to nearest even, canonical NaN 0x7FFF) and arithmetic computed in
// float and rounded once. Mirrors the used part of CUDA's interface; see cuda_fp16.h.
#pragma once

#include "fa_cuda_cpu_half.h"

struct __nv_bfloat16_raw {
    unsigned short x;
};
struct __nv_bfloat162_raw {
    unsigned short x, y;
};

struct __attribute__((aligned(2))) __nv_bfloat16
    : ::fa_cpu::Float16<__nv_bfloat16, __nv_bfloat16_raw, ::fa_cpu::Bf16Format> {
    using Float16::Float16;
    using Float16::operator=;
};

struct __attribute__((aligned(4))) __nv_bfloat162 : ::fa_cpu::Pair16<__nv_bfloat16, __nv_bfloat162_raw> {
    using Pair16::Pair16;
};

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

FA_CPU_16BIT_CONVERSIONS(__nv_bfloat16, __nv_bfloat162, bfloat16)
FA_CPU_16BIT_ARITHMETIC(__nv_bfloat16, bfloat16, 0x7f80u)
FA_CPU_16BIT_PAIR_ARITHMETIC(__nv_bfloat162)
FA_CPU_16BIT_MATH(__nv_bfloat16, bfloat16)

#define CUDART_INF_BF16 __ushort_as_bfloat16((unsigned short)0x7F80U)
#define CUDART_NAN_BF16 __ushort_as_bfloat16((unsigned short)0x7FFFU)
#define CUDART_MIN_DENORM_BF16 __ushort_as_bfloat16((unsigned short)0x0001U)
#define CUDART_MAX_NORMAL_BF16 __ushort_as_bfloat16((unsigned short)0x7F7FU)
#define CUDART_NEG_ZERO_BF16 __ushort_as_bfloat16((unsigned short)0x8000U)
#define CUDART_ZERO_BF16 __ushort_as_bfloat16((unsigned short)0x0000U)
#define CUDART_ONE_BF16 __ushort_as_bfloat16((unsigned short)0x3F80U)
