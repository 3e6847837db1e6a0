// mma.h for the CUDA-on-CPU runner: nvcuda::wmma with fp16/bf16 inputs and fp32 (or fp16)
// accumulators, and tf32 inputs (m16n16k8, float fragments) with fp32 accumulators.
//
// On the GPU a fragment is spread over the 32 lanes of a warp in an unspecified layout. Here every
// emulated thread holds the whole tile, row-major: load, mma and store need no exchange between
// lanes, and all lanes compute the same result (32 times the work, which a CPU run can afford).
// Kernels may therefore touch fragment elements only through `num_elements` and `x[i]` with the
// same operation on every element, which is also all that CUDA guarantees.
//
// tf32: fragments hold floats as loaded; wmma::__float_to_tf32 rounds one to tf32 (10-bit mantissa,
// round to nearest with ties away from zero, as cvt.rna.tf32.f32), and mma_sync reads only the 19
// high bits of each input (sign, exponent, 10 mantissa bits), so a kernel that skips the
// conversion multiplies truncated inputs, the model of what the tensor cores do with them.
//
// mma_sync multiplies exactly (an fp16, bf16 or tf32 product fits in fp32) and accumulates in fp32,
// k ascending, starting from C; the lanes after the first reuse its result (see MmaMemo). The GPU's requirements are checked, since violating them is
// undefined behaviour there: 256-bit aligned tile pointers and a leading dimension that is a
// multiple of 16 bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fa_cuda_cpu.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

namespace nvcuda {
namespace wmma {

struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32;
}
namespace experimental {
namespace precision {
struct u4;
struct s4;
struct b1;
}  // namespace precision
}  // namespace experimental

namespace detail {
template <class Use, int M, int N, int K> struct tile;
template <int M, int N, int K> struct tile<matrix_a, M, N, K> { static constexpr int rows = M, cols = K; };
template <int M, int N, int K> struct tile<matrix_b, M, N, K> { static constexpr int rows = K, cols = N; };
template <int M, int N, int K> struct tile<accumulator, M, N, K> { static constexpr int rows = M, cols = N; };

template <class T> struct is_input : std::integral_constant<bool, std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value || std::is_same<T, precision::tf32>::value> {};
// What a fragment stores for its element type: tf32 fragments hold floats.
template <class T> struct storage { using type = T; };
template <> struct storage<precision::tf32> { using type = float; };
template <class Use, int M, int N, int K, class T>
struct valid_shape : std::integral_constant<bool, (M == 16 && N == 16 && K == 8)
    ? (std::is_same<T, precision::tf32>::value || (std::is_same<Use, accumulator>::value && std::is_same<T, float>::value))
    : ((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16)) &&
          !std::is_same<T, precision::tf32>::value> {};
template <class T> struct is_accumulator : std::integral_constant<bool, std::is_same<T, float>::value || std::is_same<T, __half>::value> {};

inline float widen(float v) { return v; }
inline float widen(__half v) { return __half2float(v); }
inline float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
// A tf32 input as the tensor cores read it: the low 13 mantissa bits dropped (NaN kept NaN).
inline float tf32_input(float v) {
    if (v != v) return v;
    return ::fa_cpu::fp::bits_float(::fa_cpu::fp::float_bits(v) & 0xffffe000u);
}

template <class T>
inline void check_pointer(const T* p, unsigned ldm, const char* what) {
    if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0 || (static_cast<std::size_t>(ldm) * sizeof(T)) % 16 != 0)
        ::fa_cpu::trap(what);
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
    static_assert(detail::valid_shape<Use, M, N, K, T>::value,
                  "fa_verify CUDA-on-CPU: wmma shapes m16n16k16, m32n8k16 and m8n32k16 (fp16/bf16 inputs) and "
                  "m16n16k8 (tf32 inputs, float accumulator) only");
    static_assert(std::is_same<Use, accumulator>::value ? detail::is_accumulator<T>::value : detail::is_input<T>::value,
                  "fa_verify CUDA-on-CPU: wmma inputs must be __half, __nv_bfloat16 or precision::tf32 and "
                  "accumulators float or __half (integer and sub-byte wmma are not emulated)");

  public:
    using element_type = typename detail::storage<T>::type;
    using storage_element_type = element_type;
    static constexpr int num_rows = detail::tile<Use, M, N, K>::rows;
    static constexpr int num_cols = detail::tile<Use, M, N, K>::cols;
    static constexpr int num_elements = num_rows * num_cols;
    element_type x[num_elements];  // the whole tile, row-major
};

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f,
                          const typename fragment<Use, M, N, K, T, Layout>::element_type& v) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

namespace detail {
template <class Frag, class T>
inline void load(Frag& f, const T* p, unsigned ldm, bool row_major) {
    check_pointer(p, ldm,
                  "wmma::load_matrix_sync: the pointer must be 256-bit aligned and ldm a multiple of 16 bytes");
    for (int r = 0; r < Frag::num_rows; ++r)
        for (int c = 0; c < Frag::num_cols; ++c)
            f.x[r * Frag::num_cols + c] = row_major ? p[static_cast<std::size_t>(r) * ldm + c] : p[r + static_cast<std::size_t>(c) * ldm];
}
}  // namespace detail

// matrix_a / matrix_b with the layout in the type.
template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f,
                             const typename fragment<Use, M, N, K, T, Layout>::element_type* p, unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value && !std::is_void<Layout>::value,
                  "wmma::load_matrix_sync: an accumulator (or a fragment without layout) needs a layout_t argument");
    detail::load(f, p, ldm, std::is_same<Layout, row_major>::value);
}

// Accumulators (and matrix fragments declared without a layout) with the layout at run time.
template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f,
                             const typename fragment<Use, M, N, K, T, Layout>::element_type* p, unsigned ldm,
                             layout_t layout) {
    detail::load(f, p, ldm, layout == mem_row_major);
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    detail::check_pointer(p, ldm,
                          "wmma::store_matrix_sync: the pointer must be 256-bit aligned and ldm a multiple of 16 bytes");
    using Frag = fragment<accumulator, M, N, K, T>;
    const int lane = static_cast<int>(::fa_cpu::g_current->lane);
    for (int r = 0; r < Frag::num_rows; ++r)
        for (int c = 0; c < Frag::num_cols; ++c) {
            const std::size_t at = layout == mem_row_major ? static_cast<std::size_t>(r) * ldm + c
                                                           : r + static_cast<std::size_t>(c) * ldm;
            // Every lane stores the whole tile; on the GPU each element is one lane's: the race
            // detector sees element i stored by lane i % 32 only.
            ::fa_cpu::race_mode((r * Frag::num_cols + c) % 32 == lane ? ::fa_cpu::kRaceNormal : ::fa_cpu::kRaceIgnore);
            p[at] = f.x[r * Frag::num_cols + c];
        }
    ::fa_cpu::race_mode(::fa_cpu::kRaceNormal);
}

namespace detail {
// The 32 lanes of a warp call mma_sync with the same fragments one after another, so all but the
// first can reuse its result. mma_sync is a pure function of (a, b, c): a small table keyed by
// the operands' contents returns bit-identical results whatever the lanes do, and makes a
// tensor-core kernel ~10x faster on the CPU.
// A cheap fingerprint (16 words sampled across the operand) picks the table slot; the full
// operands are compared before a result is reused, so a collision only costs a recomputation.
inline std::uint64_t mix(const void* data, std::size_t bytes, std::uint64_t h) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    const std::size_t words = bytes / 8, stride = words > 16 ? words / 16 : 1;
    for (std::size_t i = 0; i < words; i += stride) {
        std::uint64_t w;
        std::memcpy(&w, p + 8 * i, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    return h;
}

template <class FA, class FB, class FC>
struct MmaMemo {
    struct Entry {
        std::uint64_t hash = 0;
        bool valid = false;
        FA a;
        FB b;
        FC c, d;
    };
    static Entry& slot(std::uint64_t hash) {
        static Entry table[64];
        return table[hash % 64];
    }
};

template <bool Tf32, class FA, class FB, class FC>
inline void multiply(FC& d, const FA& a, const FB& b, const FC& c) {
    constexpr int M = FA::num_rows, K = FA::num_cols, N = FB::num_cols;
    float fa[M * K], fb[K * N], acc[M * N];
    if constexpr (Tf32) {
        for (int i = 0; i < M * K; ++i) fa[i] = tf32_input(a.x[i]);
        for (int i = 0; i < K * N; ++i) fb[i] = tf32_input(b.x[i]);
    } else {
        for (int i = 0; i < M * K; ++i) fa[i] = widen(a.x[i]);
        for (int i = 0; i < K * N; ++i) fb[i] = widen(b.x[i]);
    }
    for (int i = 0; i < M * N; ++i) acc[i] = widen(c.x[i]);
    for (int i = 0; i < M; ++i)
        for (int k = 0; k < K; ++k) {
            const float aik = fa[i * K + k];
            for (int j = 0; j < N; ++j) acc[i * N + j] += aik * fb[k * N + j];  // exact product
        }
    for (int i = 0; i < M * N; ++i) d.x[i] = static_cast<typename FC::element_type>(acc[i]);
}
}  // namespace detail

template <int M, int N, int K, class Tab, class LayoutA, class LayoutB, class Tc>
inline void mma_sync(fragment<accumulator, M, N, K, Tc>& d, const fragment<matrix_a, M, N, K, Tab, LayoutA>& a,
                     const fragment<matrix_b, M, N, K, Tab, LayoutB>& b, const fragment<accumulator, M, N, K, Tc>& c) {
    using FA = fragment<matrix_a, M, N, K, Tab, LayoutA>;
    using FB = fragment<matrix_b, M, N, K, Tab, LayoutB>;
    using FC = fragment<accumulator, M, N, K, Tc>;
    const std::uint64_t hash = detail::mix(c.x, sizeof c.x, detail::mix(b.x, sizeof b.x, detail::mix(a.x, sizeof a.x, 1)));
    auto& entry = detail::MmaMemo<FA, FB, FC>::slot(hash);
    if (entry.valid && entry.hash == hash && std::memcmp(entry.a.x, a.x, sizeof a.x) == 0 &&
        std::memcmp(entry.b.x, b.x, sizeof b.x) == 0 && std::memcmp(entry.c.x, c.x, sizeof c.x) == 0) {
        d = entry.d;
        return;
    }
    entry.a = a;
    entry.b = b;
    entry.c = c;
    detail::multiply<std::is_same<Tab, precision::tf32>::value>(entry.d, a, b, c);
    entry.hash = hash;
    entry.valid = true;
    d = entry.d;
}

// cvt.rna.tf32.f32: round to the nearest tf32 (10-bit mantissa), ties away from zero; the result
// is a float whose low 13 bits are zero. Infinities and NaN pass unchanged.
inline float __float_to_tf32(float x) {
    if (!std::isfinite(x)) return x;
    return ::fa_cpu::fp::bits_float((::fa_cpu::fp::float_bits(x) + 0x1000u) & 0xffffe000u);
}

}  // namespace wmma
}  // namespace nvcuda
