// fa_cuda_cpu_runtime.h: the contract between the shim (compiled into the kernel's translation
// unit) and the fiber runtime (runtime/fiber_runtime.cpp). Both sides of one shared library.
//
// Everything here is hidden: every built kernel module carries its own copy of the runtime, and
// two modules loaded into one process must never resolve each other's scheduler state.
#pragma once

#include <cstddef>
#include <cstdint>

#define FA_CPU_HIDDEN __attribute__((visibility("hidden")))
#define FA_CPU_EXPORT extern "C" __attribute__((visibility("default")))

// CUDA's builtin index types live in the global namespace.
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

namespace fa_cpu {

// What a kernel may read about the emulated thread that is running now. The runtime's fiber
// record starts with this, so the shim reads it without knowing the rest.
struct ThreadHead {
    uint3 thread_idx;
    unsigned int lane;  // linear thread index % 32
    unsigned int warp;  // linear thread index / 32
};

extern FA_CPU_HIDDEN ThreadHead* g_current;
extern FA_CPU_HIDDEN uint3 g_block_idx;
extern FA_CPU_HIDDEN dim3 g_block_dim;
extern FA_CPU_HIDDEN dim3 g_grid_dim;
// Counts the blocks this module has run: per-thread state kept by the shim (cp.async queues)
// belongs to one block and is discarded when this changes.
extern FA_CPU_HIDDEN std::uint64_t g_block_serial;

// Warp operations. They all go through one rendezvous of the lanes named in the mask; `b` and
// `c` are PTX shfl's operands (source lane / delta / xor mask, and the clamp/segment word).
enum WarpOp : int { kShflIdx = 0, kShflUp = 1, kShflDown = 2, kShflBfly = 3, kBallot = 4, kSyncWarp = 5 };
// __syncthreads_count / _and / _or.
enum BlockReduce : int { kReduceNone = 0, kReduceCount = 1, kReduceAnd = 2, kReduceOr = 3 };

FA_CPU_HIDDEN int block_barrier(int reduce, int predicate);
// Records a static __shared__ variable (the builder's rewrite calls it where the declaration is
// first passed) and fills it with NaN now and at every block start. Returns true.
FA_CPU_HIDDEN bool register_shared(void* address, std::size_t bytes);
FA_CPU_HIDDEN std::uint64_t warp_op(int op, unsigned int mask, std::uint64_t bits, int b, int c);
FA_CPU_HIDDEN unsigned int live_lanes();
FA_CPU_HIDDEN void yield_now();
[[noreturn]] FA_CPU_HIDDEN void trap(const char* what);

// What the race detector (race builds, FA_CPU_RACECHECK) makes of the accesses that follow: as
// they are, as atomics (the shim's atomicAdd, ...), or not at all (a warp-collective operation that
// every emulated lane performs whole, such as wmma::store_matrix_sync, attributes each element
// to one lane). No-op in other builds.
enum RaceMode : int { kRaceNormal = 0, kRaceAtomic = 1, kRaceIgnore = 2 };
#if FA_CPU_RACECHECK
FA_CPU_HIDDEN void race_mode(int mode);
#else
inline void race_mode(int) {}
#endif

// How a launch is laid out; mirrors LaunchConfig in fa_verify/cuda_cpu/_exec.py.
struct LaunchConfig {
    std::int64_t grid[3];
    std::int64_t block[3];
    std::int64_t shared_bytes;
    std::int64_t order;       // 0 forward, 1 reverse, 2 seeded shuffle: the order fibers run in
    std::int64_t seed;
    std::int64_t stack_bytes; // per emulated thread
};

using KernelBody = void (*)(const std::uint64_t* slots);

// Status codes of a launch; _exec.py maps them to exceptions.
enum Status : int { kOk = 0, kBadLaunch = 2, kDeadlock = 3, kTrap = 4, kBadArgument = 5 };

}  // namespace fa_cpu

// The block's dynamic shared memory: every `extern __shared__` array is rewritten by the builder
// into a reference to this buffer (fa_verify/cuda_cpu/_rewrite.py).
extern "C" FA_CPU_HIDDEN unsigned char fa_cpu_dynamic_smem[];
// Its size: the most any architecture gives a block (H100's 227 KiB).
constexpr std::size_t kDynamicSharedCapacity = 227 * 1024;

// Runs the whole grid, block after block, one fiber per thread. Writes a message on failure.
extern "C" FA_CPU_HIDDEN int fa_cpu_run_grid(fa_cpu::KernelBody body, const std::uint64_t* slots,
                                             const fa_cpu::LaunchConfig* config, char* message,
                                             int message_size);
