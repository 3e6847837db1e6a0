// cuda_fp8.h for the CUDA-on-CPU runner: fp8 is not emulated. Published kernels often include the
// header without using it, so the include is accepted; the types are declared incomplete, so a
// kernel that does use them stops at that line (a pointer to them alone is harmless).
#pragma once
#include <cstdint>

struct fa_cpu_fp8_is_not_emulated_by_the_cuda_on_cpu_runner;
typedef fa_cpu_fp8_is_not_emulated_by_the_cuda_on_cpu_runner __nv_fp8_e4m3, __nv_fp8_e5m2, __nv_fp8x2_e4m3,
    __nv_fp8x2_e5m2, __nv_fp8x4_e4m3, __nv_fp8x4_e5m2;
typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;
