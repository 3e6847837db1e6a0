// ptx_race.cu: warp 0 reads with ldmatrix what warp 1 copied into shared memory with cp.async;
// without the __syncthreads after warp 1's wait that is a race (the copy may land after the read).
#include <cstdint>

extern "C" __global__ void copy_then_ldmatrix(const uint16_t* src, uint32_t* out, int sync) {
    __shared__ __align__(16) uint16_t tile[8 * 8];
    const int t = threadIdx.x;
    if (t >= 32 && t < 40) {  // warp 1: one 16-byte row each
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&tile[(t - 32) * 8]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + (t - 32) * 8));
        asm volatile("cp.async.wait_all;\n" ::);
    }
    if (sync) __syncthreads();
    if (t < 32) {
        uint32_t r;
        const uint32_t row = static_cast<uint32_t>(__cvta_generic_to_shared(&tile[(t % 8) * 8]));
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r) : "r"(row));
        out[t] = r;
    }
}
