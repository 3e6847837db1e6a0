// fa_cuda_cpu_ptx.h: the PTX instructions that hand-written tensor-core kernels put in inline asm,
// as C++ functions. The builder (fa_verify/cuda_cpu/_ptx.py) rewrites each `asm(...)` statement
// into a call of one of these, with the operands read into temporaries first and the outputs
// written back afterwards (so an output that is also an input behaves as in a register).
//
// The warp-collective instructions (mma.sync, ldmatrix) exchange registers between lanes with the
// exact fragment layouts of the PTX ISA: each lane publishes its operand registers in a per-warp
// table, the warp meets (a __syncwarp of all 32 lanes), and each lane computes only the registers
// it owns from the others' entries. A kernel that fills a fragment in the wrong layout therefore
// gets wrong numbers here, as on a GPU.
//
// cp.async copies are queued per thread and performed (and shown to the race detector, as the
// issuing thread's accesses) at the cp.async.wait_group/wait_all that covers them, not before: a kernel that reads the destination without waiting reads what was
// there (NaN at block start), as a GPU may. Copies a thread never waits for are dropped when its
// block ends; no thread may read them on a GPU either.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <type_traits>
#include <vector>

#include "fa_cuda_cpu_round.h"
#include "fa_cuda_cpu_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

// ---- shared-memory addresses ----------------------------------------------------------------------

// A shared-window address is the 32-bit offset of a byte from the block's dynamic shared memory
// (static __shared__ variables lie at negative offsets in the same image); as on the GPU, kernels
// may add byte offsets to it in 32-bit arithmetic.
inline std::size_t __cvta_generic_to_shared(const void* p) {
    return static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(p) -
                                      reinterpret_cast<std::uintptr_t>(fa_cpu_dynamic_smem));
}
inline void* __cvta_shared_to_generic(std::size_t a) {
    return fa_cpu_dynamic_smem + static_cast<std::int32_t>(static_cast<std::uint32_t>(a));
}

namespace fa_cpu {
namespace ptx {

// Stops the launch with "<instruction> (<file:line>): <why>"; the builder passes the instruction
// as the kernel wrote it, with its place.
[[noreturn]] inline void fail(const char* instruction, const char* why) {
    char message[512];
    std::snprintf(message, sizeof message, "%s: %s", instruction, why);
    trap(message);
}

// In the AddressSanitizer build, an instruction's memory operand is checked where the kernel issues
// it: ASan itself would see cp.async's copy only at the wait that performs it, and ldmatrix's reads
// inside this header, and name those places instead of the kernel's line. The message gives the
// address; the parent says which argument it belongs to (fa_verify/cuda_cpu/_faults.py).
inline void check_access(const char* instruction, const char* verb, const void* p, std::size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
    const void* bad = bytes ? __asan_region_is_poisoned(const_cast<void*>(p), bytes) : nullptr;
    if (bad == nullptr) return;
    char why[256];
    const auto* byte = static_cast<const unsigned char*>(bad);
    if (byte >= fa_cpu_dynamic_smem && byte < fa_cpu_dynamic_smem + kDynamicSharedCapacity)
        std::snprintf(why, sizeof why, "%s %zu bytes at byte %td of the dynamic shared memory, past the launch's "
                      "shared_bytes", verb, bytes, byte - fa_cpu_dynamic_smem);
    else
        std::snprintf(why, sizeof why, "%s %zu bytes at address %p, memory it may not %s (AddressSanitizer)", verb,
                      bytes, bad, verb[0] == 'r' ? "read" : "write");
    fail(instruction, why);
#else
    (void)instruction, (void)verb, (void)p, (void)bytes;
#endif
}

// The byte an address operand names: `.shared` operands are shared-window offsets (integers) or,
// as some kernels pass them, generic pointers; other operands are generic pointers. An address
// outside shared memory is not detected here; the AddressSanitizer build reports the access.
template <bool Shared, class T>
inline unsigned char* address(const T& operand) {
    // Not std::is_pointer: it is false for a `__restrict__` pointer, which kernels pass often.
    if constexpr (std::is_convertible<T, const volatile void*>::value && !std::is_integral<T>::value) {
        return static_cast<unsigned char*>(const_cast<void*>(static_cast<const volatile void*>(operand)));
    } else {
        static_assert(std::is_integral<T>::value, "fa_verify CUDA-on-CPU: an address operand must be an integer or a pointer");
        if constexpr (Shared) {
            return static_cast<unsigned char*>(__cvta_shared_to_generic(static_cast<std::size_t>(operand)));
        } else {
            static_assert(sizeof(T) == 8, "fa_verify CUDA-on-CPU: a generic address operand must be 64 bits (\"l\")");
            return reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(operand));
        }
    }
}

// `[%N+imm]`: a byte offset, whatever the operand's type.
template <class T>
inline T byte_offset(const T& operand, long long bytes) {
    if constexpr (std::is_pointer<T>::value)
        return reinterpret_cast<T>(reinterpret_cast<std::uintptr_t>(operand) + static_cast<std::uintptr_t>(bytes));
    else
        return static_cast<T>(operand + bytes);
}

// The race detector (race builds) sees the kernel's own loads and stores; the copies below are
// memcpy calls it does not see, so they announce the bytes they read and write.
#if FA_CPU_RACECHECK
extern "C" FA_CPU_HIDDEN void __tsan_read_range(void* p, std::size_t n);
extern "C" FA_CPU_HIDDEN void __tsan_write_range(void* p, std::size_t n);
#endif
inline void race_read(const void* p, std::size_t n) {
#if FA_CPU_RACECHECK
    __tsan_read_range(const_cast<void*>(p), n);
#else
    (void)p, (void)n;
#endif
}
inline void race_write(void* p, std::size_t n) {
#if FA_CPU_RACECHECK
    __tsan_write_range(p, n);
#else
    (void)p, (void)n;
#endif
}

// ---- operands ---------------------------------------------------------------------------------------

template <class T>
inline std::uint32_t b32(const T& v) {
    static_assert(sizeof(T) == 4 && std::is_trivially_copyable<T>::value,
                  "fa_verify CUDA-on-CPU: a 32-bit register operand (\"r\") must be a 4-byte value");
    std::uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}
template <class T>
inline float f32(const T& v) {
    static_assert(std::is_arithmetic<T>::value, "fa_verify CUDA-on-CPU: an \"f\" operand must be a floating-point value");
    return static_cast<float>(v);
}
template <class T>
inline void set_b32(T& out, std::uint32_t bits) {
    static_assert(sizeof(T) == 4 && std::is_trivially_copyable<T>::value,
                  "fa_verify CUDA-on-CPU: a 32-bit register output (\"=r\") must be a 4-byte variable");
    std::memcpy(&out, &bits, 4);
}
template <class T>
inline void set_f32(T& out, float v) {
    static_assert(std::is_arithmetic<T>::value, "fa_verify CUDA-on-CPU: an \"=f\" output must be a floating-point variable");
    out = static_cast<T>(v);
}

// ---- warp rendezvous ------------------------------------------------------------------------------

enum Collective : int { kMmaF16 = 1, kMmaBf16, kLdmatrix };

struct LaneEntry {
    std::uint64_t block = 0;  // g_block_serial and ...
    unsigned int seq = 0;     // ... which collective of the lane's block this entry is for
    int op = 0;
    int shape = 0;
    std::uint32_t regs[6] = {};
    std::uint32_t acc[4] = {};  // mma: the lane's C registers, then its D registers
    bool met = false;           // the warp's first lane to resume from the meeting has checked it
    const unsigned char* row = nullptr;
};

// The warp's table for this lane's next collective instruction. Consecutive collectives alternate
// between two tables, so one meeting per instruction suffices: a lane can write a table again
// only after the next instruction's meeting, which every lane reaches after reading this one.
inline LaneEntry* next_table() {
    static LaneEntry tables[2][32][32];  // 1024 threads at most: 32 warps of 32 lanes
    static std::uint64_t block[1024];
    static unsigned int count[1024];
    const unsigned int thread = g_current->warp * 32 + g_current->lane;
    if (block[thread] != g_block_serial) {  // a new block: its warps start at table 0
        block[thread] = g_block_serial;
        count[thread] = 0;
    }
    LaneEntry* table = tables[count[thread] & 1u][g_current->warp];
    table[g_current->lane].block = g_block_serial;
    table[g_current->lane].seq = ++count[thread];
    table[g_current->lane].met = false;
    return table;
}

// All 32 lanes must take part in a .sync.aligned instruction: with a lane exited or the others at
// a different instruction the GPU's result is undefined, so the runner stops. The first lane to
// resume checks the whole warp's entries (the others find them checked) and gets true: it may do
// the warp's shared work before any other lane reads the table.
inline bool meet(LaneEntry* table, const char* instruction, int op, int shape) {
    static const char* const missing =
        "all 32 lanes of the warp must execute this .sync.aligned instruction, but some lanes have exited "
        "or do not exist (undefined behaviour on a GPU)";
    if (live_lanes() != 0xffffffffu) fail(instruction, missing);
    warp_op(kSyncWarp, 0xffffffffu, 0, 0, 0);
    if (table[g_current->lane].met) return false;
    const unsigned int seq = table[g_current->lane].seq;
    for (int l = 0; l < 32; ++l) {
        if (table[l].seq != seq || table[l].block != g_block_serial)
            fail(instruction, missing);  // a lane exited while the others waited
        if (table[l].op != op || table[l].shape != shape)
            fail(instruction, "the lanes of the warp met at different warp-collective instructions "
                              "(.aligned requires every lane to execute the same one)");
    }
    for (int l = 0; l < 32; ++l) table[l].met = true;
    return true;
}

inline float element(std::uint32_t reg, int half, bool bf16) {
    const auto bits = static_cast<std::uint16_t>(half ? reg >> 16 : reg & 0xffffu);
    return bf16 ? fp::bf16_to_float(bits) : fp::half_to_float(bits);
}

// ---- mma.sync.aligned.m16n8k{8,16}.row.col.f32.{f16,bf16}.{f16,bf16}.f32 -----------------------------
//
// Layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8" with 16-bit inputs), with
// g = lane / 4 and t = lane % 4; register r holds elements 2r (low half) and 2r+1 (high half):
//   A (16 x K, row-major): element i at row g + 8*((i/2)%2), column 2t + (i%2) + 8*(i/4);
//   B (K x 8):             element i at row 2t + (i%2) + 8*(i/2), column g;
//   C, D (16 x 8, f32):    element i at row g + 8*(i/2), column 2t + (i%2).
// Products of 16-bit values are exact in fp32; they are summed in fp32 with k ascending,
// starting from C, the model the runner's wmma uses too.
//
// The first lane to resume from the meeting computes the whole warp's D, decoding each A and B
// element once (not once per lane that reads it: 16x fewer conversions); the others find their
// registers done. Each D element is the same sum in the same order as its own lane would form.
template <int K>
inline void mma_warp(LaneEntry* table, bool bf16) {
    constexpr int kARegs = K / 4;
    float a[16][K], b[K][8];
    for (int row = 0; row < 16; ++row)
        for (int k = 0; k < K; ++k)  // A(row, k): lane 4*(row%8) + (k%8)/2, register (row/8) + 2*(k/8), half k%2
            a[row][k] = element(table[4 * (row % 8) + (k % 8) / 2].regs[row / 8 + 2 * (k / 8)], k % 2, bf16);
    for (int k = 0; k < K; ++k)
        for (int col = 0; col < 8; ++col)  // B(k, col): lane 4*col + (k%8)/2, register k/8, half k%2
            b[k][col] = element(table[4 * col + (k % 8) / 2].regs[kARegs + k / 8], k % 2, bf16);
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
            float acc = fp::bits_float(table[lane].acc[i]);
            for (int k = 0; k < K; ++k) acc += a[row][k] * b[k][col];
            table[lane].acc[i] = fp::float_bits(acc);
        }
    }
}

template <int K>
inline void mma(bool bf16, std::uint32_t d[4], const std::uint32_t* a, const std::uint32_t* b, const std::uint32_t c[4],
                const char* instruction) {
    constexpr int kARegs = K / 4, kBRegs = K / 8;
    LaneEntry* table = next_table();
    LaneEntry& mine = table[g_current->lane];
    mine.op = bf16 ? kMmaBf16 : kMmaF16;
    mine.shape = K;
    for (int r = 0; r < kARegs; ++r) mine.regs[r] = a[r];
    for (int r = 0; r < kBRegs; ++r) mine.regs[kARegs + r] = b[r];
    for (int i = 0; i < 4; ++i) mine.acc[i] = c[i];
    // This table is written again two collectives on, after every lane has read D from it.
    if (meet(table, instruction, mine.op, K)) mma_warp<K>(table, bf16);
    for (int i = 0; i < 4; ++i) d[i] = mine.acc[i];
}

// ---- ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}{.shared}.b16 -------------------------------------
//
// Matrix j's eight rows (16 bytes each) are at the addresses lanes 8j..8j+7 give. Lane L receives
// in register j the elements (row L/4, columns 2*(L%4), 2*(L%4)+1) of matrix j; with .trans, the
// elements (rows 2*(L%4), 2*(L%4)+1, column L/4).
inline void ldmatrix(int matrices, bool trans, const unsigned char* row, std::uint32_t* out, const char* instruction) {
    // Lanes whose address the shape does not use may pass anything; the used ones are checked below.
    LaneEntry* table = next_table();
    const unsigned int lane = g_current->lane;
    table[lane].op = kLdmatrix;
    table[lane].shape = matrices * 2 + trans;
    table[lane].row = row;
    if (meet(table, instruction, kLdmatrix, matrices * 2 + trans)) {  // the rows are the warp's: checked once
        for (int l = 0; l < 8 * matrices; ++l)
            if (reinterpret_cast<std::uintptr_t>(table[l].row) % 16 != 0)
                fail(instruction, "a row address is not 16-byte aligned");
        for (int l = 0; l < 8 * matrices; ++l) check_access(instruction, "reads", table[l].row, 16);
    }
    for (int j = 0; j < matrices; ++j) {
        std::uint16_t e[2];
        for (int h = 0; h < 2; ++h) {
            const int r = trans ? 2 * static_cast<int>(lane % 4) + h : static_cast<int>(lane / 4);
            const int c = trans ? static_cast<int>(lane / 4) : 2 * static_cast<int>(lane % 4) + h;
            race_read(table[8 * j + r].row + 2 * c, 2);
            std::memcpy(&e[h], table[8 * j + r].row + 2 * c, 2);
        }
        out[j] = static_cast<std::uint32_t>(e[0]) | (static_cast<std::uint32_t>(e[1]) << 16);
    }
}

// ---- cp.async ---------------------------------------------------------------------------------------

struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes, src_bytes;
};
struct AsyncQueue {
    std::uint64_t block = ~std::uint64_t{0};
    std::vector<AsyncCopy> open;                // issued, not yet committed
    std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
};

inline AsyncQueue& async_queue() {
    static AsyncQueue queues[1024];
    AsyncQueue& q = queues[g_current->warp * 32 + g_current->lane];
    if (q.block != g_block_serial) {  // a thread of an earlier block left copies behind
        q.open.clear();
        q.groups.clear();
        q.block = g_block_serial;
    }
    return q;
}

// Inlined into the kernel, so that the race detector names the kernel line of the wait.
__attribute__((always_inline)) inline void perform(const std::vector<AsyncCopy>& group) {
    for (const AsyncCopy& c : group) {
        race_read(c.src, static_cast<std::size_t>(c.src_bytes));
        race_write(c.dst, static_cast<std::size_t>(c.bytes));
        std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.src_bytes));
        std::memset(c.dst + c.src_bytes, 0, static_cast<std::size_t>(c.bytes - c.src_bytes));
    }
}

template <class D, class S>
inline void cp_async(bool cg, const D& dst_operand, const S& src_operand, long long bytes, long long src_bytes,
                     const char* instruction) {
    const bool size_ok = cg ? bytes == 16 : (bytes == 4 || bytes == 8 || bytes == 16);
    if (!size_ok || src_bytes < 0 || src_bytes > bytes)
        fail(instruction, "cp-size must be 4, 8 or 16 bytes (16 for .cg) and src-size at most cp-size");
    unsigned char* dst = address<true>(dst_operand);
    const unsigned char* src = address<false>(src_operand);
    if (reinterpret_cast<std::uintptr_t>(dst) % bytes != 0 || reinterpret_cast<std::uintptr_t>(src) % bytes != 0)
        fail(instruction, "source and destination must be aligned to cp-size");
    check_access(instruction, "reads", src, static_cast<std::size_t>(src_bytes));
    check_access(instruction, "writes", dst, static_cast<std::size_t>(bytes));
    async_queue().open.push_back(AsyncCopy{dst, src, static_cast<int>(bytes), static_cast<int>(src_bytes)});
}

inline void cp_async_commit_group() {
    AsyncQueue& q = async_queue();
    q.groups.push_back(std::move(q.open));
    q.open.clear();
}

// Waits until at most `pending` of the most recent committed groups are outstanding.
__attribute__((always_inline)) inline void cp_async_wait_group(long long pending) {
    AsyncQueue& q = async_queue();
    while (q.groups.size() > static_cast<std::size_t>(pending < 0 ? 0 : pending)) {
        perform(q.groups.front());
        q.groups.pop_front();
    }
}

__attribute__((always_inline)) inline void cp_async_wait_all() {
    cp_async_commit_group();
    cp_async_wait_group(0);
}

// ---- ld.global{.v2,.v4}.{b32,u32,s32,f32} ------------------------------------------------------------

// `count` 32-bit elements from global memory; the address must be aligned to the whole access.
inline void ld_global(int count, const unsigned char* p, std::uint32_t* out, const char* instruction) {
    const std::size_t bytes = 4 * static_cast<std::size_t>(count);
    if (reinterpret_cast<std::uintptr_t>(p) % bytes != 0) fail(instruction, "the address is not aligned to the access");
    check_access(instruction, "reads", p, bytes);
    race_read(p, bytes);
    std::memcpy(out, p, bytes);
}

// ---- ex2.approx.f32 -----------------------------------------------------------------------------------

// The GPU's ex2.approx is within 2 ulp of 2^x; exp2f is the model (as for __expf). .ftz flushes
// subnormal inputs and results to zero of the same sign.
inline float ex2(float x, bool ftz) {
    if (ftz && std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
    float y = exp2f(x);
    if (ftz && std::fpclassify(y) == FP_SUBNORMAL) y = std::copysign(0.0f, y);
    return y;
}

// ---- tanh.approx.f32 ----------------------------------------------------------------------------------

// The GPU's tanh.approx.f32 errs by up to 2^-10.987 relative (PTX ISA). The emulation errs nearly
// that much, so that a kernel using it is judged on an error of the documented size, not on the
// hardware's luck (measured ~2^-16.5 on sm_75+): tanhf, then the significand cut toward zero to 12
// bits (relative error below 2^-11 + tanhf's ulp). Subnormal results (tanh(x) = x), ±0, NaN pass.
inline float tanh_approx(float x) {
    const float y = std::tanh(x);
    if (!std::isnormal(y)) return y;
    return fp::bits_float(fp::float_bits(y) & ~0xfffu);
}

// ---- cvt.rn.{f16x2,bf16x2}.f32 d, a, b ------------------------------------------------------------------

// a rounded (to nearest even) into the upper half of d, b into the lower half.
inline std::uint32_t cvt_pack(bool bf16, float a, float b) {
    const auto round = [bf16](float x) -> std::uint32_t { return bf16 ? fp::float_to_bf16(x) : fp::float_to_half(x); };
    return (round(a) << 16) | round(b);
}

// ---- shfl.sync ----------------------------------------------------------------------------------------

inline std::uint32_t shfl(int mode, std::uint32_t value, std::uint32_t b, std::uint32_t c, std::uint32_t mask) {
    return static_cast<std::uint32_t>(warp_op(mode, mask, value, static_cast<int>(b), static_cast<int>(c)));
}

}  // namespace ptx
}  // namespace fa_cpu
