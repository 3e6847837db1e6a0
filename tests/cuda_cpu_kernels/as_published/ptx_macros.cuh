// PTX helpers as tensor-core kernels keep them: macros around asm statements and forceinline
// device functions, in a header of their own. Unused CUDA headers come along, as they do in
// published code.
#pragma once
#include <cuda_runtime_api.h>
#include <cuda_fp8.h>
#include <cooperative_groups/memcpy_async.h>
#include <cstdint>

#define DEVICE_INLINE __device__ __forceinline__

// 16 bytes from global to shared memory, zero-filled past `src_bytes`.
#define CP_ASYNC_CG(dst, src, src_bytes) \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes))
#define CP_ASYNC_COMMIT() \
    do {                  \
        asm volatile("cp.async.commit_group;\n" ::); \
    } while (0)

template <int N>
DEVICE_INLINE void cp_async_wait() {
    if constexpr (N == 0) __asm__ __volatile__("cp.async.wait_all;\n" ::);
    else asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

DEVICE_INLINE uint32_t smem_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four floats through the read-only path.
DEVICE_INLINE float4 load_nc_f4(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

DEVICE_INLINE float fast_exp2(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
