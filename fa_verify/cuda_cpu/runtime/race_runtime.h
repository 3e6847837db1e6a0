// race_runtime.h: what the fiber runtime tells the race detector (race builds only).
//
// The detector (race_runtime.cpp) sees every memory access of the kernel through the calls g++
// inserts with -fsanitize=thread (__tsan_read4, __tsan_write8, ...), and the synchronisation
// through these calls from the scheduler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fa_cuda_cpu_runtime.h"

namespace fa_cpu {
namespace race {

// A launch begins: every record of earlier launches becomes stale.
FA_CPU_HIDDEN void begin_launch(const LaunchConfig& cfg, unsigned char* dynamic_shared);
// A static __shared__ variable registered itself (fa_cpu::register_shared): from now on, and in
// every later launch, accesses to it are checked as shared memory.
FA_CPU_HIDDEN void add_static_shared(void* address, std::size_t bytes);
// A block begins (blocks run one after another): its shared memory starts with no history.
FA_CPU_HIDDEN void begin_block();
// The running block's threads have all finished (its shared memory still holds what they wrote).
FA_CPU_HIDDEN void end_block();
// A __syncthreads (or _count/_and/_or) of the running block completed.
FA_CPU_HIDDEN void barrier();
// A __syncwarp of these lanes of warp `warp` completed.
FA_CPU_HIDDEN void syncwarp(unsigned int warp, unsigned int lanes);
// The launch is over: no access is checked until the next one.
FA_CPU_HIDDEN void end_launch();

}  // namespace race
}  // namespace fa_cpu
