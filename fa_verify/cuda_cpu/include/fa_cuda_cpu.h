// fa_cuda_cpu.h: the CUDA-on-CPU shim, force-included (g++ -include) before every kernel source.
//
// It lets an unmodified CUDA C kernel compile as C++17 and run on fa_verify's fiber runtime:
// the execution-space keywords vanish, the builtin index variables read the running fiber, and
// the synchronising intrinsics call the scheduler. What CUDA computes, this header computes the
// same way where that is cheap to do exactly (conversions, shuffles); fast-math intrinsics are
// modelled by the formula the GPU evaluates (e.g. __expf(x) = exp2(x * log2 e) with the product
// rounded to float), so a kernel that relies on them sees errors of the GPU's kind.
//
// Not here on purpose: `__shared__` is rewritten by the builder after preprocessing (a macro
// cannot give `__shared__ float a[8];` static storage and keep `extern __shared__ T s[];` valid),
// and inline assembly is rewritten by the builder into calls of fa_cuda_cpu_ptx.h (the PTX
// instructions it emulates) or rejected with a message naming the instruction and the line.
#pragma once

#include <math.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cassert>
#include <tuple>
#include <type_traits>
#include <utility>

#include "fa_cuda_cpu_runtime.h"

// ---- execution spaces and declaration attributes ------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __constant__
#define __grid_constant__
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __attribute__((aligned(n)))
#define __cudart_builtin__
#define __device_builtin__
// __restrict__ is already a g++ keyword.

// ---- builtin variables ----------------------------------------------------------------------------

namespace fa_cpu {
inline const uint3& thread_idx() { return g_current->thread_idx; }
inline const uint3& block_idx() { return g_block_idx; }
inline const dim3& block_dim() { return g_block_dim; }
inline const dim3& grid_dim() { return g_grid_dim; }
}  // namespace fa_cpu

#define threadIdx (::fa_cpu::thread_idx())
#define blockIdx (::fa_cpu::block_idx())
#define blockDim (::fa_cpu::block_dim())
#define gridDim (::fa_cpu::grid_dim())
static constexpr int warpSize = 32;

// ---- vector types -----------------------------------------------------------------------------------

#define FA_CPU_VEC1(T, N, A) struct __attribute__((aligned(A))) N##1 { T x; };
#define FA_CPU_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; };
#define FA_CPU_VEC3(T, N) struct N##3 { T x, y, z; };
#define FA_CPU_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };
#define FA_CPU_MAKE1(T, N) inline N##1 make_##N##1(T x) { return N##1{x}; }
#define FA_CPU_MAKE2(T, N) inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define FA_CPU_MAKE3(T, N) inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define FA_CPU_MAKE4(T, N) inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
#define FA_CPU_VECTORS(T, N, A1, A2, A4) \
    FA_CPU_VEC1(T, N, A1) FA_CPU_VEC2(T, N, A2) FA_CPU_VEC4(T, N, A4) \
    FA_CPU_MAKE1(T, N) FA_CPU_MAKE2(T, N) FA_CPU_MAKE3(T, N) FA_CPU_MAKE4(T, N)

FA_CPU_VEC3(signed char, char) FA_CPU_VEC3(unsigned char, uchar) FA_CPU_VEC3(short, short)
FA_CPU_VEC3(unsigned short, ushort) FA_CPU_VEC3(int, int) FA_CPU_VEC3(long, long)
FA_CPU_VEC3(unsigned long, ulong) FA_CPU_VEC3(long long, longlong) FA_CPU_VEC3(unsigned long long, ulonglong)
FA_CPU_VEC3(float, float) FA_CPU_VEC3(double, double)  // uint3 comes from the runtime header
FA_CPU_VECTORS(signed char, char, 1, 2, 4)
FA_CPU_VECTORS(unsigned char, uchar, 1, 2, 4)
FA_CPU_VECTORS(short, short, 2, 4, 8)
FA_CPU_VECTORS(unsigned short, ushort, 2, 4, 8)
FA_CPU_VECTORS(int, int, 4, 8, 16)
FA_CPU_VECTORS(unsigned int, uint, 4, 8, 16)
FA_CPU_VECTORS(long, long, 8, 16, 16)
FA_CPU_VECTORS(unsigned long, ulong, 8, 16, 16)
FA_CPU_VECTORS(long long, longlong, 8, 16, 16)
FA_CPU_VECTORS(unsigned long long, ulonglong, 8, 16, 16)
FA_CPU_VECTORS(float, float, 4, 8, 16)
FA_CPU_VECTORS(double, double, 8, 16, 16)

// ---- synchronisation and warp intrinsics ------------------------------------------------------------

inline void __syncthreads() { ::fa_cpu::block_barrier(::fa_cpu::kReduceNone, 0); }
inline int __syncthreads_count(int p) { return ::fa_cpu::block_barrier(::fa_cpu::kReduceCount, p); }
inline int __syncthreads_and(int p) { return ::fa_cpu::block_barrier(::fa_cpu::kReduceAnd, p); }
inline int __syncthreads_or(int p) { return ::fa_cpu::block_barrier(::fa_cpu::kReduceOr, p); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) { ::fa_cpu::warp_op(::fa_cpu::kSyncWarp, mask, 0, 0, 0); }
inline unsigned int __activemask() { return ::fa_cpu::live_lanes(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned int) { ::fa_cpu::yield_now(); }  // lets a spin-wait make progress
[[noreturn]] inline void __trap() { ::fa_cpu::trap("__trap() called"); }
[[noreturn]] inline void __brkpt() { ::fa_cpu::trap("__brkpt() called"); }

namespace fa_cpu {
template <class T>
inline T warp_exchange(int op, unsigned int mask, T var, int b, int c) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "fa_verify CUDA-on-CPU: warp shuffles take values of at most 8 bytes");
    std::uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = warp_op(op, mask, bits, b, c);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace fa_cpu

// The clamp words are those CUDA's headers pass to PTX shfl.sync.
template <class T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = warpSize) {
    return ::fa_cpu::warp_exchange(::fa_cpu::kShflIdx, mask, var, src_lane, ((warpSize - width) << 8) | 0x1f);
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
    return ::fa_cpu::warp_exchange(::fa_cpu::kShflUp, mask, var, static_cast<int>(delta), (warpSize - width) << 8);
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
    return ::fa_cpu::warp_exchange(::fa_cpu::kShflDown, mask, var, static_cast<int>(delta), ((warpSize - width) << 8) | 0x1f);
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize) {
    return ::fa_cpu::warp_exchange(::fa_cpu::kShflBfly, mask, var, lane_mask, ((warpSize - width) << 8) | 0x1f);
}
inline unsigned int __ballot_sync(unsigned int mask, int predicate) {
    return static_cast<unsigned int>(::fa_cpu::warp_op(::fa_cpu::kBallot, mask, predicate != 0, 0, 0));
}
inline int __any_sync(unsigned int mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned int mask, int predicate) {
    return __ballot_sync(mask, predicate) == (mask & ::fa_cpu::live_lanes());
}

// Inline PTX, rewritten by the builder into calls of this header's functions.
#include "fa_cuda_cpu_ptx.h"

// ---- bit casts and integer intrinsics ------------------------------------------------------------------

namespace fa_cpu {
template <class To, class From>
inline To bit_cast(const From& from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
    To to;
    std::memcpy(&to, &from, sizeof(To));
    return to;
}
}  // namespace fa_cpu

inline int __float_as_int(float x) { return ::fa_cpu::bit_cast<int>(x); }
inline unsigned int __float_as_uint(float x) { return ::fa_cpu::bit_cast<unsigned int>(x); }
inline float __int_as_float(int x) { return ::fa_cpu::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return ::fa_cpu::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return ::fa_cpu::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return ::fa_cpu::bit_cast<double>(x); }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    return __builtin_bswap32(x);
}
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned int __umul24(unsigned int a, unsigned int b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}

// ---- min / max as CUDA overloads them in the global namespace ----------------------------------------

inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned int>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned int>(b)); }
inline long min(long a, long b) { return a < b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned int>(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned int>(b)); }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline unsigned int umin(unsigned int a, unsigned int b) { return min(a, b); }
inline unsigned int umax(unsigned int a, unsigned int b) { return max(a, b); }
inline long long llmin(long long a, long long b) { return min(a, b); }
inline long long llmax(long long a, long long b) { return max(a, b); }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return min(a, b); }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return max(a, b); }

// ---- float math: the accurate functions come from libm; the intrinsics as the GPU computes them ----

// ex2.approx / lg2.approx of a product rounded to float: the rounding of x*log2(e) is the error
// term that grows with |x|, and it is reproduced exactly here.
inline float __expf(float x) { return exp2f(x * 1.44269504088896340736f); }
inline float __exp10f(float x) { return exp2f(x * 3.32192809488736234787f); }
inline float __logf(float x) { return log2f(x) * 0.693147180559945309417f; }
inline float __log10f(float x) { return log2f(x) * 0.301029995663981195214f; }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return exp2f(y * log2f(x)); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float a, float b) { return a * (1.0f / b); }  // a * rcp.approx(b)
inline float fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned int __float2uint_rn(float x) { return static_cast<unsigned int>(nearbyintf(x)); }
inline unsigned int __float2uint_rz(float x) { return static_cast<unsigned int>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned int x) { return static_cast<float>(x); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }

// ---- loads and stores with cache hints: plain memory here ---------------------------------------------

template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- atomics: fibers never interleave inside one call, so a plain read-modify-write is atomic ----------

namespace fa_cpu {
template <class T> struct unsupported_atomic : std::false_type {};
template <class T, class F>
inline T atomic_update(T* address, F f) {
    race_mode(kRaceAtomic);
    T old = *address;
    *address = f(old);
    race_mode(kRaceNormal);
    return old;
}
}  // namespace fa_cpu

// The overloads CUDA declares; any other type (e.g. atomicAdd on __half) meets the template below.
#define FA_CPU_ATOMIC(NAME, T, EXPR) \
    inline T NAME(T* a, T v) { return ::fa_cpu::atomic_update(a, [v](T o) { return static_cast<T>(EXPR); }); }
#define FA_CPU_ATOMIC_INTS(NAME, EXPR) \
    FA_CPU_ATOMIC(NAME, int, EXPR) FA_CPU_ATOMIC(NAME, unsigned int, EXPR) FA_CPU_ATOMIC(NAME, unsigned long long, EXPR)
FA_CPU_ATOMIC_INTS(atomicAdd, o + v)
FA_CPU_ATOMIC(atomicAdd, float, o + v)
FA_CPU_ATOMIC(atomicAdd, double, o + v)
FA_CPU_ATOMIC(atomicSub, int, o - v)
FA_CPU_ATOMIC(atomicSub, unsigned int, o - v)
FA_CPU_ATOMIC_INTS(atomicExch, ((void)o, v))
FA_CPU_ATOMIC(atomicExch, float, ((void)o, v))
FA_CPU_ATOMIC_INTS(atomicMin, v < o ? v : o)
FA_CPU_ATOMIC(atomicMin, long long, v < o ? v : o)
FA_CPU_ATOMIC_INTS(atomicMax, v > o ? v : o)
FA_CPU_ATOMIC(atomicMax, long long, v > o ? v : o)
FA_CPU_ATOMIC_INTS(atomicAnd, o & v)
FA_CPU_ATOMIC_INTS(atomicOr, o | v)
FA_CPU_ATOMIC_INTS(atomicXor, o ^ v)
FA_CPU_ATOMIC(atomicInc, unsigned int, o >= v ? 0u : o + 1u)
FA_CPU_ATOMIC(atomicDec, unsigned int, (o == 0u || o > v) ? v : o - 1u)
#define FA_CPU_ATOMIC_CAS(T) \
    inline T atomicCAS(T* a, T compare, T v) { \
        return ::fa_cpu::atomic_update(a, [compare, v](T o) { return o == compare ? v : o; }); \
    }
FA_CPU_ATOMIC_CAS(int)
FA_CPU_ATOMIC_CAS(unsigned int)
FA_CPU_ATOMIC_CAS(unsigned long long)
FA_CPU_ATOMIC_CAS(unsigned short)
#define FA_CPU_ATOMIC_UNSUPPORTED(NAME) \
    template <class T> inline T NAME(T*, T) { \
        static_assert(::fa_cpu::unsupported_atomic<T>::value, \
                      "fa_verify CUDA-on-CPU: " #NAME " is not emulated for this type (int, unsigned, " \
                      "unsigned long long, float, double only)"); \
        return T(); \
    }
FA_CPU_ATOMIC_UNSUPPORTED(atomicAdd)
FA_CPU_ATOMIC_UNSUPPORTED(atomicSub)
FA_CPU_ATOMIC_UNSUPPORTED(atomicExch)
FA_CPU_ATOMIC_UNSUPPORTED(atomicMin)
FA_CPU_ATOMIC_UNSUPPORTED(atomicMax)

// ---- clocks: a counter, so timing code runs but measures nothing ---------------------------

inline long long clock64() {
    static long long ticks = 0;
    return ticks += 1000;
}

// ---- launch trampolines (the builder generates one per entry point) ------------------------------------

namespace fa_cpu {
template <class F> struct signature;
template <class... P> struct signature<void (*)(P...)> {
    static constexpr std::size_t arity = sizeof...(P);
    using params = std::tuple<typename std::decay<P>::type...>;
};

// 'p' pointer, 'i' integer, 'f' floating (or a type made from a float, such as __half), '?' other.
template <class F, std::size_t I>
constexpr char param_kind() {
    if constexpr (I >= signature<F>::arity) {
        return '-';
    } else {
        using P = typename std::tuple_element<I, typename signature<F>::params>::type;
        if constexpr (std::is_pointer<P>::value) return 'p';
        else if constexpr (std::is_integral<P>::value || std::is_enum<P>::value) return 'i';
        else if constexpr (std::is_floating_point<P>::value || std::is_constructible<P, float>::value) return 'f';
        else return '?';
    }
}

// Each argument travels as 64 bits: a pointer, an int64, or a double.
template <class P>
inline P unpack(std::uint64_t slot) {
    if constexpr (std::is_pointer<P>::value) return reinterpret_cast<P>(static_cast<std::uintptr_t>(slot));
    else if constexpr (std::is_integral<P>::value || std::is_enum<P>::value) return static_cast<P>(static_cast<std::int64_t>(slot));
    else if constexpr (std::is_floating_point<P>::value) return static_cast<P>(bit_cast<double>(slot));
    else return P(static_cast<float>(bit_cast<double>(slot)));
}

// Checked once per launch: element sizes and alignment of the arrays, ranges of the integers.
template <class P>
inline bool check_one(std::size_t index, std::uint64_t slot, std::int64_t itemsize, char* message, int size) {
    if constexpr (std::is_pointer<P>::value) {
        using E = typename std::remove_cv<typename std::remove_pointer<P>::type>::type;
        if constexpr (!std::is_void<E>::value && sizeof(E) > 1) {
            if (itemsize > 0 && static_cast<std::size_t>(itemsize) != sizeof(E)) {
                std::snprintf(message, static_cast<std::size_t>(size),
                              "argument %zu: the kernel reads %zu-byte elements, the array has %lld-byte elements",
                              index, sizeof(E), static_cast<long long>(itemsize));
                return false;
            }
            if (slot % alignof(E) != 0) {
                std::snprintf(message, static_cast<std::size_t>(size),
                              "argument %zu: the array is not aligned to %zu bytes", index, alignof(E));
                return false;
            }
        }
    } else if constexpr (std::is_integral<P>::value) {
        const auto value = static_cast<std::int64_t>(slot);
        if (static_cast<std::int64_t>(static_cast<P>(value)) != value) {
            std::snprintf(message, static_cast<std::size_t>(size),
                          "argument %zu: %lld does not fit the kernel's %zu-byte integer parameter", index,
                          static_cast<long long>(value), sizeof(P));
            return false;
        }
    }
    return true;
}
}  // namespace fa_cpu
