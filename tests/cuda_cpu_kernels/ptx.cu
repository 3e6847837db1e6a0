// ptx.cu: inline PTX instructions, each exercised through raw per-lane registers, so that the test
// (tests/test_cuda_cpu_ptx.py) checks the fragment layouts against the PTX ISA's tables in Python
// rather than against a kernel that uses them.
#include <cstdint>

// One warp. regs_in holds, per lane, the 32-bit registers A (K/4), B (K/8) and C (4, as float
// bits), in that order; d_out receives each lane's 4 D registers.
template <bool BF16, int K>
__device__ void mma_lanes(const uint32_t* regs_in, uint32_t* d_out) {
    constexpr int n = K / 4 + K / 8 + 4;
    const uint32_t* r = regs_in + threadIdx.x * n;
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) c[i] = __uint_as_float(r[K / 4 + K / 8 + i]);
    if constexpr (K == 16 && !BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%10,%11,%12,%13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else if constexpr (K == 16) {
        // The accumulators in place ("+f"), as most kernels write it.
        for (int i = 0; i < 4; ++i) d[i] = c[i];
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]));
    } else if constexpr (!BF16) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                     "{%7,%8,%9,%10};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(r[0]), "r"(r[1]), "r"(r[2]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(r[0]), "r"(r[1]), "r"(r[2]));
        for (int i = 0; i < 4; ++i) d[i] = c[i];
    }
    for (int i = 0; i < 4; ++i) d_out[threadIdx.x * 4 + i] = __float_as_uint(d[i]);
}

extern "C" __global__ void mma_f16_k16(const uint32_t* in, uint32_t* out) { mma_lanes<false, 16>(in, out); }
extern "C" __global__ void mma_bf16_k16(const uint32_t* in, uint32_t* out) { mma_lanes<true, 16>(in, out); }
extern "C" __global__ void mma_f16_k8(const uint32_t* in, uint32_t* out) { mma_lanes<false, 8>(in, out); }
extern "C" __global__ void mma_bf16_k8(const uint32_t* in, uint32_t* out) { mma_lanes<true, 8>(in, out); }

// 32 rows of 8 b16 elements in shared memory; lane L gives the address of row rows[L].
template <int N, bool TRANS>
__device__ void ldmatrix_lanes(const uint16_t* table, const int* rows, uint32_t* out) {
    __shared__ __align__(16) uint16_t smem[32 * 8];
    for (int i = threadIdx.x; i < 32 * 8; i += 32) smem[i] = table[i];
    __syncwarp();
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(&smem[rows[threadIdx.x] * 8]));
    uint32_t r[4] = {0, 0, 0, 0};
    if constexpr (N == 1 && !TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(addr));
    if constexpr (N == 1 && TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(addr));
    if constexpr (N == 2 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
    if constexpr (N == 2 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
    if constexpr (N == 4 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    if constexpr (N == 4 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared::cta.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    for (int j = 0; j < 4; ++j) out[threadIdx.x * 4 + j] = r[j];
}

#define LDMATRIX_ENTRY(NAME, N, TRANS) \
    extern "C" __global__ void NAME(const uint16_t* t, const int* rows, uint32_t* out) { ldmatrix_lanes<N, TRANS>(t, rows, out); }
LDMATRIX_ENTRY(ldmatrix_x1, 1, false)
LDMATRIX_ENTRY(ldmatrix_x1_trans, 1, true)
LDMATRIX_ENTRY(ldmatrix_x2, 2, false)
LDMATRIX_ENTRY(ldmatrix_x2_trans, 2, true)
LDMATRIX_ENTRY(ldmatrix_x4, 4, false)
LDMATRIX_ENTRY(ldmatrix_x4_trans, 4, true)

// Each thread copies 16 bytes of src into shared memory in two groups (two 8-byte copies; the
// second with src-size 4, so its upper half is zero-filled) and records what its destination
// holds before any wait, after wait_group 1 (the first group only) and after wait_all.
extern "C" __global__ void cp_async_groups(const uint32_t* src, uint32_t* before, uint32_t* middle, uint32_t* after) {
    __shared__ __align__(16) uint32_t smem[4 * 64];
    uint32_t* mine = smem + 4 * threadIdx.x;
    const uint32_t* from = src + 4 * threadIdx.x;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(from));
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.ca.shared.global.L2::128B [%0+8], [%1], %2, %3;\n" ::"r"(dst), "l"(from + 2), "n"(8), "r"(4));
    asm volatile("cp.async.commit_group;\n" ::);
    for (int i = 0; i < 4; ++i) before[4 * threadIdx.x + i] = mine[i];
    asm volatile("cp.async.wait_group %0;\n" ::"n"(1));
    for (int i = 0; i < 4; ++i) middle[4 * threadIdx.x + i] = mine[i];
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    for (int i = 0; i < 4; ++i) after[4 * threadIdx.x + i] = mine[i];
}

// ex2.approx with and without .ftz, and the four shfl.sync modes with PTX's operands.
extern "C" __global__ void ex2_and_shfl(const float* x, float* ex2, float* ex2_ftz, uint32_t* shuffled) {
    const int lane = threadIdx.x;
    float y, z;
    if (lane % 2)  // an asm statement is one statement: if/else around it still parses
        asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x[lane]));
    else
        __asm__ __volatile__("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x[lane]));
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(z) : "f"(x[lane]));
    ex2[lane] = y;
    ex2_ftz[lane] = z;
    const uint32_t v = 100u + lane;
    uint32_t s[4];
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(s[0]) : "r"(v), "r"(3));
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, %3, %4;" : "=r"(s[1]) : "r"(v), "r"(lane / 8), "r"(0x181f), "r"(0xffffffffu));
    asm volatile("shfl.sync.up.b32 %0, %1, 2, 0x0, 0xffffffff;" : "=r"(s[2]) : "r"(v));
    asm volatile("shfl.sync.down.b32 %0, %1, 5, 0x1f, -1;" : "=r"(s[3]) : "r"(v));
    for (int i = 0; i < 4; ++i) shuffled[4 * lane + i] = s[i];
}

// tanh.approx.f32 of n inputs, one per thread of a grid-stride loop.
extern "C" __global__ void tanh_approx(const float* x, float* y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float r;
        asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x[i]));
        y[i] = r;
    }
}

// An mma with lanes 16-31 gone: undefined on a GPU, a trap here.
extern "C" __global__ void mma_half_warp(uint32_t* out) {
    if (threadIdx.x >= 16) return;
    float d0, d1, d2, d3;
    const uint32_t z = 0;
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%4}, {%4}, {%5,%5,%5,%5};"
                 : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3) : "r"(z), "f"(0.0f));
    out[threadIdx.x] = __float_as_uint(d0 + d1 + d2 + d3);
}

// cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 d, a, b: a into the upper half, b into the lower.
extern "C" __global__ void cvt_pairs(const float* x, uint32_t* f16, uint32_t* bf16) {
    const int i = threadIdx.x;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(f16[i]) : "f"(x[2 * i]), "f"(x[2 * i + 1]));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(bf16[i]) : "f"(x[2 * i]), "f"(x[2 * i + 1]));
}
