// fiber_runtime.cpp: runs a CUDA grid on one CPU thread, one fiber per CUDA thread.
//
// Why fibers: a CUDA thread blocks at __syncthreads and at warp operations and must resume there
// with its locals intact, so each needs its own stack; but the threads of a block never run in
// parallel here, so cooperative switching (a few nanoseconds, no locks, no syscalls) replaces OS
// threads and makes every run deterministic. Blocks run one after another in blockIdx order.
//
// Barrier semantics follow the hardware since Volta: a thread that has exited no longer counts
// for __syncthreads, and a warp operation waits only for the live lanes its mask names. When no
// fiber can make progress any more, the launch stops with a deadlock report instead of hanging.

#include "fa_cuda_cpu_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#if FA_CPU_RACECHECK
#include "race_runtime.h"
#define FA_CPU_RACE(call) ::fa_cpu::race::call
#else
#define FA_CPU_RACE(call) ((void)0)
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FA_CPU_ASAN 1
#else
#define FA_CPU_ASAN 0
#endif

namespace fa_cpu {
ThreadHead* g_current = nullptr;
uint3 g_block_idx = {0, 0, 0};
dim3 g_block_dim;
dim3 g_grid_dim;
std::uint64_t g_block_serial = 0;
}  // namespace fa_cpu

// Every `extern __shared__` array of the kernel refers to this buffer, so all of them alias the
// block's dynamic shared memory, as on the GPU.
alignas(128) unsigned char fa_cpu_dynamic_smem[kDynamicSharedCapacity];

// Static __shared__ variables, as the kernel registers them (register_shared), so that each block
// can start with them filled with a NaN pattern: reading shared memory that the block has not
// written yet then shows in the output instead of silently reusing the previous block's data.
struct SharedVariable {
    void* address;
    std::size_t bytes;
};
static std::vector<SharedVariable>& shared_variables() {
    static std::vector<SharedVariable> registered;  // built on first use: no static-init order issue
    return registered;
}

// ---- context switch -----------------------------------------------------------------------------

// Saves the callee-saved registers on the current stack, stores the stack pointer in *save_sp,
// and resumes the context whose stack pointer is load_sp. glibc's swapcontext would also save the
// signal mask with a syscall per switch; nothing here changes signal masks or FP control words.
extern "C" void fa_cpu_swap(void** save_sp, void* load_sp);

#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .globl fa_cpu_swap
    .hidden fa_cpu_swap
    .type fa_cpu_swap, @function
fa_cpu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fa_cpu_swap, .-fa_cpu_swap
)");
#define FA_CPU_ASM_SWITCH 1
#else
#include <ucontext.h>
#define FA_CPU_ASM_SWITCH 0
#endif

namespace fa_cpu {
namespace {

struct Context {
    void* sp = nullptr;
#if !FA_CPU_ASM_SWITCH
    ucontext_t uc;
#endif
    const void* stack_lo = nullptr;  // for the sanitizer's stack bookkeeping
    std::size_t stack_size = 0;
    void* fake_stack = nullptr;
};

enum State : int { kRunnable = 0, kWaitBlock = 1, kWaitWarp = 2, kDone = 3 };

struct Fiber : ThreadHead {
    Context ctx;
    Fiber* next = nullptr;  // ring of fibers that have not exited, in schedule order
    Fiber* prev = nullptr;
    int state = kRunnable;
    // The warp operation this fiber waits in.
    int w_op = 0;
    unsigned int w_mask = 0;
    std::uint64_t w_bits = 0;
    int w_b = 0, w_c = 0;
    std::uint64_t w_result = 0;
    bool w_released = false;
};

struct Warp {
    unsigned int live = 0;     // lanes that exist and have not exited
    unsigned int waiting = 0;  // lanes waiting in a warp operation
    Fiber* lanes[32] = {};
};

struct Block {
    int live = 0;       // threads that have not exited
    int arrived = 0;    // threads waiting at the current barrier generation
    unsigned int generation = 0;
    int count[2] = {0, 0};  // __syncthreads_count accumulators, by generation parity
    int result_count[2] = {0, 0};
    int result_total[2] = {0, 0};
    int idle = 0;  // consecutive resumptions of fibers that were still blocked
    std::vector<Warp> warps;
};

struct Stack {
    char* mapping = nullptr;
    std::size_t mapping_size = 0;
    char* lo = nullptr;  // usable stack, above the guard page
    std::size_t size = 0;
};

std::mutex g_launch_mutex;  // one launch at a time per module: the scheduler state is global
Context g_main;
std::vector<Fiber> g_fibers;
std::vector<Stack> g_stacks;
std::size_t g_stack_bytes = 0;
Block g_block;
KernelBody g_body = nullptr;
const std::uint64_t* g_slots = nullptr;
int g_status = kOk;
char g_message[2048];
bool g_learn_main_stack = false;

Fiber* current() { return static_cast<Fiber*>(g_current); }

void set_message(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void set_message(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(g_message, sizeof g_message, fmt, ap);
    va_end(ap);
}

// Switches from `from` to `to`. A dying context passes no fake-stack slot, which tells the
// sanitizer to drop that stack's bookkeeping.
inline void switch_context(Context* from, Context* to, Fiber* to_fiber, bool from_dies) {
    g_current = to_fiber;
#if FA_CPU_ASAN
    __sanitizer_start_switch_fiber(from_dies ? nullptr : &from->fake_stack, to->stack_lo, to->stack_size);
#else
    (void)from_dies;
#endif
#if FA_CPU_ASM_SWITCH
    fa_cpu_swap(&from->sp, to->sp);
#else
    swapcontext(&from->uc, &to->uc);
#endif
#if FA_CPU_ASAN
    __sanitizer_finish_switch_fiber(from->fake_stack, nullptr, nullptr);
#endif
}

// Leaves the fiber for good and returns to the launch with an error status.
[[noreturn]] void abort_launch(int status) {
    g_status = status;
    Fiber* f = current();
    switch_context(&f->ctx, &g_main, nullptr, true);
    __builtin_unreachable();
}

const char* describe_state(const Fiber* f, char* buffer, std::size_t size) {
    switch (f->state) {
        case kWaitBlock: return "wait at __syncthreads";
        case kWaitWarp:
            std::snprintf(buffer, size, "wait at a warp operation (__shfl*_sync/__syncwarp/__ballot_sync) with mask 0x%08x",
                          f->w_mask);
            return buffer;
        default: return "are runnable";
    }
}

[[noreturn]] void report_deadlock() {
    // One line per run of consecutive threads in the same state.
    std::size_t used = std::snprintf(g_message, sizeof g_message,
                                     "kernel deadlocked in block (%u,%u,%u): no thread can proceed;",
                                     g_block_idx.x, g_block_idx.y, g_block_idx.z);
    const std::size_t n = g_fibers.size();
    std::size_t i = 0;
    while (i < n && used + 1 < sizeof g_message) {
        if (g_fibers[i].state == kDone) { ++i; continue; }
        std::size_t j = i;
        while (j + 1 < n && g_fibers[j + 1].state == g_fibers[i].state && g_fibers[j + 1].w_mask == g_fibers[i].w_mask)
            ++j;
        char what[160];
        used += std::snprintf(g_message + used, sizeof g_message - used, " threads %zu-%zu %s;", i, j,
                              describe_state(&g_fibers[i], what, sizeof what));
        i = j + 1;
    }
    abort_launch(kDeadlock);
}

// Lets the other fibers run until this one is released. Every event that can release a fiber
// (an arrival, an exit) resets g_block.idle; once every live fiber has been resumed and found
// itself still blocked, nothing can change any more: that is a deadlock.
template <class Released>
void wait_until(Fiber* f, Released released) {
    while (!released()) {
        if (++g_block.idle > g_block.live + 1) report_deadlock();
        switch_context(&f->ctx, &f->next->ctx, f->next, false);
    }
}

// ---- __syncthreads --------------------------------------------------------------------------------

void release_block_barrier() {
    Block& b = g_block;
    const unsigned int parity = b.generation & 1u;
    b.result_count[parity] = b.count[parity];
    b.result_total[parity] = b.arrived;
    b.count[parity ^ 1u] = 0;
    b.arrived = 0;
    ++b.generation;
    FA_CPU_RACE(barrier());
}

// ---- warp operations ----------------------------------------------------------------------------

std::uint64_t shuffle_source(const Warp& w, unsigned int participants, unsigned int lane, const Fiber* t) {
    // PTX shfl.sync: b selects the source, c packs the segment mask (bits 8-12) and the clamp.
    const unsigned int bval = static_cast<unsigned int>(t->w_b) & 31u;
    const unsigned int cval = static_cast<unsigned int>(t->w_c) & 31u;
    const unsigned int segmask = (static_cast<unsigned int>(t->w_c) >> 8) & 31u;
    const int max_lane = static_cast<int>((lane & segmask) | (cval & ~segmask));
    const int min_lane = static_cast<int>(lane & segmask);
    int j = static_cast<int>(lane);
    bool in_range = false;
    switch (t->w_op) {
        case kShflUp: j = static_cast<int>(lane) - static_cast<int>(bval); in_range = j >= max_lane; break;
        case kShflDown: j = static_cast<int>(lane + bval); in_range = j <= max_lane; break;
        case kShflBfly: j = static_cast<int>(lane ^ bval); in_range = j <= max_lane; break;
        default: j = min_lane | static_cast<int>(bval & ~segmask); in_range = j <= max_lane; break;
    }
    if (!in_range) j = static_cast<int>(lane);
    // Reading a lane that does not take part is undefined on the GPU; an all-ones pattern (NaN
    // for every float type) makes such a read visible in the results.
    if (!((participants >> j) & 1u)) return ~std::uint64_t{0};
    return w.lanes[j]->w_bits;
}

// Completes the rendezvous of `mask` if every live lane it names is waiting with that mask.
bool try_complete(Warp& w, unsigned int mask) {
    const unsigned int participants = mask & w.live;
    if (participants == 0 || (w.waiting & participants) != participants) return false;
    for (unsigned int l = 0; l < 32; ++l)
        if (((participants >> l) & 1u) && w.lanes[l]->w_mask != mask) return false;
    unsigned int ballot = 0;
    for (unsigned int l = 0; l < 32; ++l)
        if (((participants >> l) & 1u) && w.lanes[l]->w_bits != 0) ballot |= 1u << l;
#if FA_CPU_RACECHECK
    const Fiber* first = w.lanes[__builtin_ctz(participants)];
    if (first->w_op == kSyncWarp) race::syncwarp(first->warp, participants);
#endif
    for (unsigned int l = 0; l < 32; ++l) {
        if (!((participants >> l) & 1u)) continue;
        Fiber* t = w.lanes[l];
        if (t->w_op == kBallot) t->w_result = ballot;
        else if (t->w_op == kSyncWarp) t->w_result = 0;
        else t->w_result = shuffle_source(w, participants, l, t);
        t->w_released = true;
    }
    w.waiting &= ~participants;
    return true;
}

// After a lane exits, rendezvous that were waiting for it may complete without it.
void settle_warp(Warp& w) {
    for (unsigned int l = 0; l < 32; ++l)
        if ((w.waiting >> l) & 1u) try_complete(w, w.lanes[l]->w_mask);
}

// ---- fibers -----------------------------------------------------------------------------------------

[[noreturn]] void fiber_exit(Fiber* f) {
    Block& b = g_block;
    f->state = kDone;
    --b.live;
    b.idle = 0;
    Warp& w = b.warps[f->warp];
    w.live &= ~(1u << f->lane);
    if (b.arrived > 0 && b.arrived >= b.live) release_block_barrier();
    settle_warp(w);
    f->prev->next = f->next;
    f->next->prev = f->prev;
    if (b.live > 0) switch_context(&f->ctx, &f->next->ctx, f->next, true);
    else switch_context(&f->ctx, &g_main, nullptr, true);
    __builtin_unreachable();
}

[[noreturn]] void fiber_main() {
#if FA_CPU_ASAN
    const void* from_lo = nullptr;
    std::size_t from_size = 0;
    __sanitizer_finish_switch_fiber(nullptr, &from_lo, &from_size);
    if (g_learn_main_stack) {  // the first fiber of a launch is entered from the caller's stack
        g_main.stack_lo = from_lo;
        g_main.stack_size = from_size;
        g_learn_main_stack = false;
    }
#endif
    g_body(g_slots);
    fiber_exit(current());
}

#if !FA_CPU_ASM_SWITCH
void fiber_main_uc() { fiber_main(); }
#endif

bool ensure_stacks(std::size_t count, std::size_t bytes) {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    bytes = (bytes + page - 1) / page * page;
    if (bytes != g_stack_bytes) {
        for (Stack& s : g_stacks) munmap(s.mapping, s.mapping_size);
        g_stacks.clear();
        g_stack_bytes = bytes;
    }
    while (g_stacks.size() < count) {
        // Reserved lazily by the kernel; the guard page turns a stack overflow into SIGSEGV.
        Stack s;
        s.mapping_size = bytes + page;
        void* m = mmap(nullptr, s.mapping_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return false;
        s.mapping = static_cast<char*>(m);
        mprotect(s.mapping, page, PROT_NONE);
        s.lo = s.mapping + page;
        s.size = bytes;
        g_stacks.push_back(s);
    }
    return true;
}

void prepare_fiber(Fiber& f, const Stack& s) {
    f.ctx = Context{};
    f.ctx.stack_lo = s.lo;
    f.ctx.stack_size = s.size;
#if FA_CPU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(s.lo, s.size);  // frames of the previous block's fibers
#endif
#if FA_CPU_ASM_SWITCH
    // The frame fa_cpu_swap pops: six callee-saved registers, then fiber_main as the return
    // address, above it a null "return address" so fiber_main starts with rsp = 8 (mod 16).
    auto* top = reinterpret_cast<std::uint64_t*>(reinterpret_cast<std::uintptr_t>(s.lo + s.size) & ~std::uintptr_t{15});
    *--top = 0;
    *--top = reinterpret_cast<std::uint64_t>(&fiber_main);
    for (int i = 0; i < 6; ++i) *--top = 0;
    f.ctx.sp = top;
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = s.lo;
    f.ctx.uc.uc_stack.ss_size = s.size;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, fiber_main_uc, 0);
#endif
}

std::uint64_t splitmix64(std::uint64_t& state) {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void run_block(const LaunchConfig& cfg, std::uint64_t block_linear) {
    const unsigned int bx = static_cast<unsigned int>(cfg.block[0]);
    const unsigned int by = static_cast<unsigned int>(cfg.block[1]);
    const unsigned int n = static_cast<unsigned int>(cfg.block[0] * cfg.block[1] * cfg.block[2]);

    Block& b = g_block;
    ++g_block_serial;
    b.live = static_cast<int>(n);
    b.arrived = 0;
    b.generation = 0;
    b.count[0] = b.count[1] = 0;
    b.idle = 0;
    b.warps.assign((n + 31) / 32, Warp{});

    // Shared memory starts with garbage on the GPU; here with a NaN pattern.
    std::memset(fa_cpu_dynamic_smem, 0xFF, static_cast<std::size_t>(cfg.shared_bytes));
    for (const SharedVariable& v : shared_variables()) std::memset(v.address, 0xFF, v.bytes);

    FA_CPU_RACE(begin_block());

    g_fibers.resize(n);
    for (unsigned int i = 0; i < n; ++i) {
        Fiber& f = g_fibers[i];
        f = Fiber{};
        f.thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        f.lane = i % 32;
        f.warp = i / 32;
        b.warps[f.warp].live |= 1u << f.lane;
        b.warps[f.warp].lanes[f.lane] = &f;
        prepare_fiber(f, g_stacks[i]);
    }

    // The order fibers run in between two synchronisation points. Forward is the natural one;
    // the others let a test expose races that one order hides (a missing __syncthreads).
    std::vector<unsigned int> order(n);
    for (unsigned int i = 0; i < n; ++i) order[i] = cfg.order == 1 ? n - 1 - i : i;
    if (cfg.order == 2) {
        std::uint64_t state = static_cast<std::uint64_t>(cfg.seed) * 0x100000001B3ull ^ block_linear;
        for (unsigned int i = n - 1; i > 0; --i) {
            unsigned int j = static_cast<unsigned int>(splitmix64(state) % (i + 1));
            unsigned int t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
    }
    for (unsigned int i = 0; i < n; ++i) {
        Fiber& f = g_fibers[order[i]];
        f.next = &g_fibers[order[(i + 1) % n]];
        f.prev = &g_fibers[order[(i + n - 1) % n]];
    }

    Fiber* first = &g_fibers[order[0]];
    switch_context(&g_main, &first->ctx, first, false);
    FA_CPU_RACE(end_block());
}

}  // namespace

// ---- the kernel-facing calls ------------------------------------------------------------------------

int block_barrier(int reduce, int predicate) {
    Fiber* f = current();
    Block& b = g_block;
    const unsigned int parity = b.generation & 1u;
    b.count[parity] += predicate != 0;
    ++b.arrived;
    b.idle = 0;
    if (b.arrived >= b.live) {
        release_block_barrier();
    } else {
        const unsigned int generation = b.generation;
        f->state = kWaitBlock;
        wait_until(f, [&] { return b.generation != generation; });
        f->state = kRunnable;
    }
    switch (reduce) {
        case kReduceCount: return b.result_count[parity];
        case kReduceAnd: return b.result_count[parity] == b.result_total[parity];
        case kReduceOr: return b.result_count[parity] > 0;
        default: return 0;
    }
}

std::uint64_t warp_op(int op, unsigned int mask, std::uint64_t bits, int bval, int cval) {
    Fiber* f = current();
    if (!((mask >> f->lane) & 1u)) {
        set_message("a warp operation was called by lane %u of warp %u with mask 0x%08x, which does not name "
                    "that lane (undefined behaviour in CUDA); block (%u,%u,%u), thread (%u,%u,%u)",
                    f->lane, f->warp, mask, g_block_idx.x, g_block_idx.y, g_block_idx.z, f->thread_idx.x,
                    f->thread_idx.y, f->thread_idx.z);
        abort_launch(kTrap);
    }
    Warp& w = g_block.warps[f->warp];
    f->w_op = op;
    f->w_mask = mask;
    f->w_bits = bits;
    f->w_b = bval;
    f->w_c = cval;
    f->w_released = false;
    w.waiting |= 1u << f->lane;
    g_block.idle = 0;
    try_complete(w, mask);
    if (!f->w_released) {
        f->state = kWaitWarp;
        wait_until(f, [f] { return f->w_released; });
        f->state = kRunnable;
    }
    return f->w_result;
}

bool register_shared(void* address, std::size_t bytes) {
    std::memset(address, 0xFF, bytes);
    shared_variables().push_back(SharedVariable{address, bytes});
    FA_CPU_RACE(add_static_shared(address, bytes));
    return true;
}

unsigned int live_lanes() { return g_block.warps[current()->warp].live; }

void yield_now() {
    Fiber* f = current();
    if (f->next != f) switch_context(&f->ctx, &f->next->ctx, f->next, false);
}

void trap(const char* what) {
    Fiber* f = current();
    set_message("%s in block (%u,%u,%u), thread (%u,%u,%u)", what, g_block_idx.x, g_block_idx.y, g_block_idx.z,
                f->thread_idx.x, f->thread_idx.y, f->thread_idx.z);
    abort_launch(kTrap);
}

}  // namespace fa_cpu

using namespace fa_cpu;

extern "C" int fa_cpu_run_grid(KernelBody body, const std::uint64_t* slots, const LaunchConfig* cfg, char* message,
                               int message_size) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    g_status = kOk;
    g_message[0] = '\0';
    const std::int64_t* gr = cfg->grid;
    const std::int64_t* bl = cfg->block;
    const std::int64_t threads = bl[0] * bl[1] * bl[2];
    if (bl[0] < 1 || bl[1] < 1 || bl[2] < 1 || bl[0] > 1024 || bl[1] > 1024 || bl[2] > 64 || threads > 1024) {
        g_status = kBadLaunch;
        set_message("invalid block (%lld,%lld,%lld): each dimension >= 1, x,y <= 1024, z <= 64, at most 1024 threads",
                    (long long)bl[0], (long long)bl[1], (long long)bl[2]);
    } else if (gr[0] < 1 || gr[1] < 1 || gr[2] < 1 || gr[0] > 2147483647LL || gr[1] > 65535 || gr[2] > 65535) {
        g_status = kBadLaunch;
        set_message("invalid grid (%lld,%lld,%lld): each dimension >= 1, x <= 2^31-1, y,z <= 65535", (long long)gr[0],
                    (long long)gr[1], (long long)gr[2]);
    } else if (cfg->shared_bytes < 0 || static_cast<std::size_t>(cfg->shared_bytes) > kDynamicSharedCapacity) {
        g_status = kBadLaunch;
        set_message("invalid dynamic shared memory size %lld bytes: at most %zu", (long long)cfg->shared_bytes,
                    kDynamicSharedCapacity);
    } else if (cfg->stack_bytes < 16384) {
        g_status = kBadLaunch;
        set_message("stack of %lld bytes per thread is too small (at least 16 KiB)", (long long)cfg->stack_bytes);
    } else if (!ensure_stacks(static_cast<std::size_t>(threads), static_cast<std::size_t>(cfg->stack_bytes))) {
        g_status = kBadLaunch;
        set_message("cannot map %lld fiber stacks of %lld bytes: %s", (long long)threads, (long long)cfg->stack_bytes,
                    std::strerror(errno));
    }
    if (g_status == kOk) {
        g_body = body;
        g_slots = slots;
        g_grid_dim = dim3(static_cast<unsigned int>(gr[0]), static_cast<unsigned int>(gr[1]), static_cast<unsigned int>(gr[2]));
        g_block_dim = dim3(static_cast<unsigned int>(bl[0]), static_cast<unsigned int>(bl[1]), static_cast<unsigned int>(bl[2]));
#if FA_CPU_ASAN
        // Exactly shared_bytes of dynamic shared memory are addressable during this launch.
        ASAN_UNPOISON_MEMORY_REGION(fa_cpu_dynamic_smem, static_cast<std::size_t>(cfg->shared_bytes));
        ASAN_POISON_MEMORY_REGION(fa_cpu_dynamic_smem + cfg->shared_bytes,
                                  kDynamicSharedCapacity - static_cast<std::size_t>(cfg->shared_bytes));
        g_learn_main_stack = true;
#endif
        FA_CPU_RACE(begin_launch(*cfg, fa_cpu_dynamic_smem));
        std::uint64_t linear = 0;
        for (std::int64_t z = 0; z < gr[2] && g_status == kOk; ++z)
            for (std::int64_t y = 0; y < gr[1] && g_status == kOk; ++y)
                for (std::int64_t x = 0; x < gr[0] && g_status == kOk; ++x, ++linear) {
                    g_block_idx = uint3{static_cast<unsigned int>(x), static_cast<unsigned int>(y), static_cast<unsigned int>(z)};
                    run_block(*cfg, linear);
                }
        g_current = nullptr;
        FA_CPU_RACE(end_launch());
    }
    std::fflush(stdout);  // device printf
    if (message && message_size > 0) std::snprintf(message, static_cast<std::size_t>(message_size), "%s", g_message);
    return g_status;
}

// ---- the address of a fatal memory access -----------------------------------------------------------
//
// A kernel that dereferences a null or wild pointer kills the worker with SIGSEGV, and the parent
// learns only the signal. Before dying, the process writes the faulting address to stderr
// ("fa_cpu: SIGSEGV at address 0x10"), so that the parent can say which argument the address
// belongs to (or that it is a null pointer's). The handler that was there before (Python's
// faulthandler, in a process that loads a module itself) is put back and runs next: returning
// re-executes the faulting access. ASan builds report the address themselves.
#if !FA_CPU_ASAN
#include <csignal>

namespace {

alignas(16) char g_fault_stack[64 * 1024];  // a fiber's stack may be the one that overflowed
struct sigaction g_previous_segv, g_previous_bus;

// Whether the fault is the running emulated thread's stack overflow: the address is in the guard
// page below its stack, or its stack pointer went below the stack (a frame larger than the guard
// page skips it, and its access faults anywhere).
bool stack_overflow(std::uintptr_t address, const void* context) {
    if (fa_cpu::g_current == nullptr) return false;  // not in a kernel's thread
    const auto& ctx = static_cast<const fa_cpu::Fiber*>(fa_cpu::g_current)->ctx;
    const auto lo = reinterpret_cast<std::uintptr_t>(ctx.stack_lo);
    const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    std::uintptr_t sp = lo;
#if defined(__x86_64__)
    sp = static_cast<std::uintptr_t>(static_cast<const ucontext_t*>(context)->uc_mcontext.gregs[REG_RSP]);
#elif defined(__aarch64__)
    sp = static_cast<std::uintptr_t>(static_cast<const ucontext_t*>(context)->uc_mcontext.sp);
#endif
    constexpr std::uintptr_t kReach = std::uintptr_t{1} << 26;  // the largest frame believed to be one
    return (address < lo && address + page >= lo) || (sp < lo && lo - sp < kReach);
}

void write_fault(int signal, siginfo_t* info, void* context) {
    const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    const char* head = stack_overflow(address, context) ? "fa_cpu: stack overflow at address 0x"
                       : signal == SIGBUS      ? "fa_cpu: SIGBUS at address 0x"
                                               : "fa_cpu: SIGSEGV at address 0x";
    char line[64];
    std::size_t n = std::strlen(head);
    std::memcpy(line, head, n);
    bool leading = true;
    for (int shift = 60; shift >= 0; shift -= 4) {  // async-signal-safe: no printf
        const unsigned digit = (address >> shift) & 0xF;
        leading = leading && digit == 0 && shift > 0;
        if (!leading) line[n++] = "0123456789abcdef"[digit];
    }
    line[n++] = '\n';
    if (::write(2, line, n) < 0) {
        // nothing left to do: the previous handler or the default action ends the process
    }
    sigaction(signal, signal == SIGBUS ? &g_previous_bus : &g_previous_segv, nullptr);
}

__attribute__((constructor)) void report_faults() {
    stack_t stack{};
    stack.ss_sp = g_fault_stack;
    stack.ss_size = sizeof g_fault_stack;
    sigaltstack(&stack, nullptr);
    struct sigaction action {};
    action.sa_sigaction = write_fault;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &action, &g_previous_segv);
    sigaction(SIGBUS, &action, &g_previous_bus);
}

}  // namespace
#endif
