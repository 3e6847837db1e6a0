// race_runtime.cpp: a data-race detector for the CUDA-on-CPU runner (compute-sanitizer's
// racecheck, on the CPU).
//
// How it sees accesses: the kernel's unit is compiled with g++ -fsanitize=thread, which calls
// __tsan_read4(addr), __tsan_write8(addr), ... before every load and store; this file defines
// those functions instead of ThreadSanitizer's runtime. ThreadSanitizer itself would not do:
// its vector clocks know OS threads and fibers, not barrier intervals, warps or blocks that run
// one after another but are concurrent on the GPU.
//
// What it checks: the memory a CUDA kernel can share between threads, the block's shared memory
// (dynamic and static __shared__) and the launch's argument buffers (global memory, registered
// by the worker before the launch). Every byte has a shadow cell with its last write and up to two
// reads, each with the thread, the block, the barrier interval (the number of __syncthreads the
// block had passed), the thread's count of __syncwarp and the instruction address. Two accesses
// to one byte conflict when one writes, they come from different threads and nothing orders them:
//   * different blocks are never ordered (only atomics on both sides are allowed);
//   * in one block a __syncthreads between them orders them;
//   * in one warp a __syncwarp that both threads took part in, after the first access, does too.
// Warp shuffles and votes are not memory barriers (the CUDA programming guide gives that
// guarantee only to __syncwarp). Atomics (the shim's atomicAdd, ...) never conflict with each
// other. Fences and atomics used as flags between blocks are not modelled: such a kernel gets a
// report. A shadow cell keeps only a few accesses, so a race may be missed; what is reported is
// a real pair of accesses that none of the above orders.
//
// Reports are deduplicated by the pair of instructions and handed to the caller as text by
// fa_cpu_race_report; the parent symbolises the addresses (fa_verify/cuda_cpu/_race.py).
//
// Each pair also says whether it only ever stored the value the memory already held (every thread
// writing the same flag, or the same row maximum): undefined all the same, but no result depends on
// the order. A hook runs before its store, so the byte is kept at the conflict and compared at the
// thread's next hook, barrier or the block's end, when the store has happened. A read that
// follows an unordered write may have seen either value: such a pair never counts as same-value.

#include "race_runtime.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace fa_cpu {
namespace race {
namespace {

enum Kind : std::uint8_t { kNone = 0, kRead = 1, kWrite = 2, kAtomic = 3 };

// 16 bytes: the shadow is 48 bytes per byte of memory, and its cache misses are most of the cost.
struct Access {
    std::uint32_t pc;          // the instruction after the call to the hook, as an offset into the module
    std::uint32_t block;       // serial number of the block (unique in the process); 0: none
    std::uint32_t gen;         // __syncthreads the block had passed
    std::uint32_t wsync : 20;  // __syncwarp the thread had taken part in since that __syncthreads
    std::uint32_t tid : 10;    // linear thread index in the block
    std::uint32_t kind : 2;
};
static_assert(sizeof(Access) == 16, "Access is packed into 16 bytes");
constexpr std::uint32_t kMaxWsync = (1u << 20) - 1;

struct Cell {
    Access write;
    Access read[2];
};

// Where the shadow of a region of memory is. id: kDynamicShared, kStaticShared or the index of
// an argument buffer.
constexpr int kDynamicShared = -1, kStaticShared = -2;
struct Region {
    std::uintptr_t lo = 0, hi = 0;
    int id = 0;
    Cell* shadow = nullptr;
};

struct Race {
    Access first, second;
    int region;
    std::size_t offset;      // byte within the region
    std::uintptr_t address;  // as an offset into the module
    unsigned long count;
    bool same_value;  // every conflict of the pair was a write of the value already there
};

// A conflicting write's byte as it was before the store, to compare once the store happened.
struct Pending {
    const unsigned char* byte;
    unsigned char before;
    std::size_t race;
};
std::vector<Pending> g_pending;

constexpr std::size_t kMaxRaces = 32;

bool g_on = false;
int g_mode = kRaceNormal;
std::uint32_t g_serial = 0;        // the running block's serial number
std::uint32_t g_launch_first = 1;  // the first block serial of the running launch
std::uint32_t g_gen = 0;
unsigned int g_threads = 0;
std::uintptr_t g_base = 0;      // where the module is loaded: instructions are recorded relative to it
// Per thread: __syncwarp taken part in since the block's last __syncthreads (accesses of earlier
// barrier intervals are ordered anyway); at kMaxWsync, warp-level conflicts are no longer reported.
std::vector<std::uint32_t> g_wsync;
bool g_wsync_saturated = false;
// Per warp, per pair of lanes (x, y): y's __syncwarp count after the last one x and y shared.
std::vector<std::uint32_t> g_with;
std::vector<Region> g_regions;         // dynamic shared, static shared, then the arguments
std::vector<Cell> g_shared_shadow;     // reused by every block and launch (records carry the block)
// Static __shared__ variables as they registered, each with its own shadow (reused like the above).
struct StaticShared {
    std::uintptr_t lo;
    std::size_t size;
    std::unique_ptr<std::vector<Cell>> shadow;
};
std::vector<StaticShared> g_static_shared;
std::vector<std::uintptr_t> g_buffer_lo, g_buffer_size;  // registered by fa_cpu_race_buffers
std::vector<Race> g_races;
unsigned long g_race_total = 0;

inline bool current_block(const Access& a) { return a.block == g_serial; }

// Whether an earlier access `a` is unordered with the running thread's access now.
inline bool concurrent(const Access& a, unsigned int tid) {
    if (a.block != g_serial) return true;
    if (a.tid == tid || a.gen != g_gen) return false;
    const unsigned int warp = tid / 32;
    if (a.tid / 32 != warp) return true;
    return !g_wsync_saturated && g_with[(warp * 32 + tid % 32) * 32 + a.tid % 32] <= a.wsync;
}

// Compare the bytes of conflicting writes with what they held before: the stores have happened.
void settle() {
    for (const Pending& p : g_pending)
        if (*p.byte != p.before) g_races[p.race].same_value = false;
    g_pending.clear();
}

void note(const Access& first, const Access& second, const Region& r, std::uintptr_t address) {
    ++g_race_total;
    std::size_t i = 0;
    while (i < g_races.size() && !((g_races[i].first.pc == first.pc && g_races[i].second.pc == second.pc) ||
                                   (g_races[i].first.pc == second.pc && g_races[i].second.pc == first.pc)))
        ++i;
    if (i == g_races.size()) {
        if (i == kMaxRaces) return;
        g_races.push_back(Race{first, second, r.id, address - r.lo, address - g_base, 0, true});
    }
    Race& race = g_races[i];
    ++race.count;
    if (second.kind != kWrite) {
        race.same_value = false;
    } else if (race.same_value) {
        const auto* byte = reinterpret_cast<const unsigned char*>(address);
        g_pending.push_back(Pending{byte, *byte, i});
    }
}

// Whether `a` (valid for this region) conflicts with the running thread's access of kind `kind`.
inline bool conflicts(const Access& a, std::uint8_t kind, unsigned int tid, bool valid) {
    if (!valid || a.kind == kNone) return false;
    if (a.kind == kAtomic && kind == kAtomic) return false;
    if (a.kind == kRead && kind == kRead) return false;
    return concurrent(a, tid);
}

// A read may replace a slot whose access is the same thread's or ordered before every later
// access of the block (an earlier barrier interval); otherwise two unordered readers are kept.
inline bool replaceable(const Access& slot, const Access& now, bool valid) {
    return !valid || slot.kind == kNone ||
           (slot.block == now.block && (slot.tid == now.tid || slot.gen < now.gen));
}

void check(std::uintptr_t address, std::size_t size, std::uint8_t kind, std::uintptr_t pc) {
    if (!g_on || g_mode == kRaceIgnore || g_current == nullptr) return;
    if (!g_pending.empty()) settle();
    const Region* r = nullptr;
    for (const Region& candidate : g_regions)
        if (address - candidate.lo < candidate.hi - candidate.lo) {
            r = &candidate;
            break;
        }
    if (r == nullptr) return;
    if (g_mode == kRaceAtomic) kind = kAtomic;
    const unsigned int tid = g_current->warp * 32 + g_current->lane;
    const bool shared = r->id < 0;
    const Access now{static_cast<std::uint32_t>(pc - g_base), g_serial, g_gen, g_wsync[tid], tid, kind};
    const std::uintptr_t end = address + size < r->hi ? address + size : r->hi;
    for (std::uintptr_t a = address; a < end; ++a) {
        Cell& cell = r->shadow[a - r->lo];
        auto valid = [&](const Access& x) { return shared ? current_block(x) : x.block >= g_launch_first; };
        if (conflicts(cell.write, kind, tid, valid(cell.write))) note(cell.write, now, *r, a);
        if (kind == kRead) {
            if (replaceable(cell.read[0], now, valid(cell.read[0]))) cell.read[0] = now;
            else if (replaceable(cell.read[1], now, valid(cell.read[1]))) cell.read[1] = now;
            continue;
        }
        for (const Access& read : cell.read)
            if (conflicts(read, kind, tid, valid(read))) note(read, now, *r, a);
        cell.write = now;
    }
}

void add_region(std::uintptr_t lo, std::size_t size, int id, Cell* shadow) {
    if (size > 0 && shadow != nullptr) g_regions.push_back(Region{lo, lo + size, id, shadow});
}

// Shared memory's shadow is reused by every block and launch: its records carry their block.
Cell* shared_shadow(std::vector<Cell>& shadow, std::size_t size) {
    if (shadow.size() < size) shadow.resize(size);  // new cells are empty (kind kNone)
    return shadow.data();
}

// The arguments' shadows, calloc'd: pages of a large buffer that the kernel never touches stay unmapped.
struct FreeCells {
    void operator()(Cell* cells) const { std::free(cells); }
};
std::vector<std::unique_ptr<Cell[], FreeCells>> g_buffer_shadows;

const char* kind_name(std::uint8_t kind) {
    switch (kind) {
        case kRead: return "read";
        case kWrite: return "write";
        default: return "atomic";
    }
}

void coordinates(std::uint64_t linear, const dim3& dims, unsigned int out[3]) {
    out[0] = static_cast<unsigned int>(linear % dims.x);
    out[1] = static_cast<unsigned int>(linear / dims.x % dims.y);
    out[2] = static_cast<unsigned int>(linear / (static_cast<std::uint64_t>(dims.x) * dims.y));
}

int print_access(char* out, std::size_t size, const Access& a) {
    unsigned int b[3], t[3];
    coordinates(a.block - g_launch_first, g_grid_dim, b);
    coordinates(a.tid, g_block_dim, t);
    return std::snprintf(out, size, "\t%s\t%x\t%u,%u,%u\t%u,%u,%u\t%u", kind_name(a.kind), a.pc, b[0], b[1],
                         b[2], t[0], t[1], t[2], a.gen);
}

}  // namespace

void add_static_shared(void* address, std::size_t bytes) {
    g_static_shared.push_back(StaticShared{reinterpret_cast<std::uintptr_t>(address), bytes,
                                           std::make_unique<std::vector<Cell>>(bytes)});
    if (g_on) add_region(g_static_shared.back().lo, bytes, kStaticShared, g_static_shared.back().shadow->data());
}

void begin_launch(const LaunchConfig& cfg, unsigned char* dynamic_shared) {
    Dl_info info{};
    dladdr(reinterpret_cast<void*>(&begin_launch), &info);
    g_base = reinterpret_cast<std::uintptr_t>(info.dli_fbase);
    g_launch_first = g_serial + 1;
    g_regions.clear();
    g_races.clear();
    g_pending.clear();
    g_race_total = 0;
    const auto dynamic_bytes = static_cast<std::size_t>(cfg.shared_bytes);
    add_region(reinterpret_cast<std::uintptr_t>(dynamic_shared), dynamic_bytes, kDynamicShared,
               shared_shadow(g_shared_shadow, dynamic_bytes));
    for (const StaticShared& v : g_static_shared) add_region(v.lo, v.size, kStaticShared, v.shadow->data());
    g_buffer_shadows.clear();
    for (std::size_t i = 0; i < g_buffer_lo.size(); ++i) {
        g_buffer_shadows.emplace_back(static_cast<Cell*>(std::calloc(g_buffer_size[i], sizeof(Cell))));
        add_region(g_buffer_lo[i], g_buffer_size[i], static_cast<int>(i), g_buffer_shadows.back().get());
    }
    g_threads = static_cast<unsigned int>(cfg.block[0] * cfg.block[1] * cfg.block[2]);
    g_on = true;
}

void begin_block() {
    ++g_serial;
    g_gen = 0;
    g_mode = kRaceNormal;
    const std::size_t warps = (g_threads + 31) / 32;
    g_wsync.assign(warps * 32, 0);
    g_with.assign(warps * 32 * 32, 0);
    g_wsync_saturated = false;
}

void end_block() { settle(); }

void barrier() {
    settle();
    ++g_gen;
    std::fill(g_wsync.begin(), g_wsync.end(), 0);
    std::fill(g_with.begin(), g_with.end(), 0);
    g_wsync_saturated = false;
}

void syncwarp(unsigned int warp, unsigned int lanes) {
    std::uint32_t* count = &g_wsync[warp * 32];
    for (unsigned int l = 0; l < 32; ++l) {
        if (!((lanes >> l) & 1u)) continue;
        if (count[l] == kMaxWsync) g_wsync_saturated = true;
        else ++count[l];
    }
    std::uint32_t* with = &g_with[static_cast<std::size_t>(warp) * 32 * 32];
    for (unsigned int x = 0; x < 32; ++x)
        if ((lanes >> x) & 1u)
            for (unsigned int y = 0; y < 32; ++y)
                if ((lanes >> y) & 1u) with[x * 32 + y] = count[y];
}

void end_launch() {
    settle();
    g_on = false;
    g_buffer_lo.clear();
    g_buffer_size.clear();
    g_buffer_shadows.clear();
}

}  // namespace race

void race_mode(int mode) { race::g_mode = mode; }

}  // namespace fa_cpu

using fa_cpu::race::check;
using fa_cpu::race::kAtomic;
using fa_cpu::race::kRead;
using fa_cpu::race::kWrite;

// The argument buffers of the next launch (global memory): address and size of each.
FA_CPU_EXPORT void fa_cpu_race_buffers(const std::uint64_t* address, const std::uint64_t* size, int count) {
    fa_cpu::race::g_buffer_lo.assign(address, address + count);
    fa_cpu::race::g_buffer_size.assign(size, size + count);
}

// The races of the last launch, one per line: region, byte offset in it, address relative to
// the module's base, then per access (first, second): kind, instruction offset, block, thread,
// barrier interval; then whether the threads share a warp, how often the pair was seen and whether
// it only ever wrote the value already there.
// Returns the number of races (all, not only those listed).
FA_CPU_EXPORT long fa_cpu_race_report(char* out, int size) {
    using namespace fa_cpu::race;
    std::size_t used = 0;
    if (size > 0) out[0] = '\0';
    for (const Race& r : g_races) {
        char line[512];
        int n = std::snprintf(line, sizeof line, "%d\t%zu\t%lx", r.region, r.offset,
                              static_cast<unsigned long>(r.address));
        n += print_access(line + n, sizeof line - n, r.first);
        n += print_access(line + n, sizeof line - n, r.second);
        n += std::snprintf(line + n, sizeof line - n, "\t%d\t%lu\t%d\n", r.first.tid / 32 == r.second.tid / 32 &&
                           r.first.block == r.second.block, r.count, r.same_value);
        if (used + n + 1 > static_cast<std::size_t>(size)) break;
        std::memcpy(out + used, line, static_cast<std::size_t>(n) + 1);
        used += n;
    }
    return static_cast<long>(g_race_total);
}

// ---- the calls g++ -fsanitize=thread inserts --------------------------------------------------------

#define FA_CPU_PC reinterpret_cast<std::uintptr_t>(__builtin_return_address(0))
#define FA_CPU_HOOKS(N)                                                                                       \
    extern "C" FA_CPU_HIDDEN void __tsan_read##N(void* p) { check(reinterpret_cast<std::uintptr_t>(p), N, kRead, FA_CPU_PC); } \
    extern "C" FA_CPU_HIDDEN void __tsan_write##N(void* p) { check(reinterpret_cast<std::uintptr_t>(p), N, kWrite, FA_CPU_PC); } \
    extern "C" FA_CPU_HIDDEN void __tsan_unaligned_read##N(void* p) { check(reinterpret_cast<std::uintptr_t>(p), N, kRead, FA_CPU_PC); } \
    extern "C" FA_CPU_HIDDEN void __tsan_unaligned_write##N(void* p) { check(reinterpret_cast<std::uintptr_t>(p), N, kWrite, FA_CPU_PC); }
FA_CPU_HOOKS(1)
FA_CPU_HOOKS(2)
FA_CPU_HOOKS(4)
FA_CPU_HOOKS(8)
FA_CPU_HOOKS(16)

extern "C" FA_CPU_HIDDEN void __tsan_read_range(void* p, std::size_t n) {
    check(reinterpret_cast<std::uintptr_t>(p), n, kRead, FA_CPU_PC);
}
extern "C" FA_CPU_HIDDEN void __tsan_write_range(void* p, std::size_t n) {
    check(reinterpret_cast<std::uintptr_t>(p), n, kWrite, FA_CPU_PC);
}
extern "C" FA_CPU_HIDDEN void __tsan_vptr_read(void** p) {
    check(reinterpret_cast<std::uintptr_t>(p), sizeof(void*), kRead, FA_CPU_PC);
}
extern "C" FA_CPU_HIDDEN void __tsan_vptr_update(void** p, void*) {
    check(reinterpret_cast<std::uintptr_t>(p), sizeof(void*), kWrite, FA_CPU_PC);
}
extern "C" FA_CPU_HIDDEN void __tsan_func_entry(void*) {}
extern "C" FA_CPU_HIDDEN void __tsan_func_exit() {}
extern "C" FA_CPU_HIDDEN void __tsan_init() {}
extern "C" FA_CPU_HIDDEN void __tsan_atomic_thread_fence(int) {}
extern "C" FA_CPU_HIDDEN void __tsan_atomic_signal_fence(int) {}
