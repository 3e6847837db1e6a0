// fa_cuda_cpu_round.h: bit-level rounding into fp16 and bf16, shared by cuda_fp16.h and
// cuda_bf16.h.
//
// Why bit-level: g++ has _Float16 but no __bf16 here, and _Float16 keeps NaN payloads where CUDA
// returns the canonical NaN 0x7FFF. Doing both formats by hand gives CUDA's results bit for bit on
// every compiler, including the directed modes (_rz, _rd, _ru).
//
// Why every fp16/bf16 operation may go through float: for +, -, *, / and sqrt, rounding the exact
// result first to float (24 bits) and then to an 11- or 8-bit format gives the correctly rounded
// result, since 24 >= 2p + 2. An fma is not covered by that rule, so it goes through round-to-odd.
#pragma once

#include <cmath>
#include <cfloat>
#include <cstdint>
#include <cstring>

namespace fa_cpu {
namespace fp {

enum Rounding { kNearest, kTowardZero, kDown, kUp };

inline std::uint32_t float_bits(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float bits_float(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Whether dropping `rem` (of which `halfway` is one half unit of the kept last place) must
// increment the kept magnitude.
inline bool increments(std::uint32_t kept, std::uint32_t rem, std::uint32_t halfway, bool negative, Rounding mode) {
    if (rem == 0) return false;
    switch (mode) {
        case kNearest: return rem > halfway || (rem == halfway && (kept & 1u));
        case kTowardZero: return false;
        case kDown: return negative;
        default: return !negative;
    }
}

inline std::uint16_t float_to_half(float f, Rounding mode = kNearest) {
    const std::uint32_t x = float_bits(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t u = x & 0x7fffffffu;
    const bool negative = sign != 0;
    if (u > 0x7f800000u) return 0x7fffu;  // NaN: CUDA's canonical NaN
    if (u == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    std::uint32_t r;
    if (u >= 0x38800000u) {  // at least 2^-14: a normal half, or an overflow
        const std::uint32_t m = u - 0x38000000u;  // exponent rebiased from 127 to 15
        r = m >> 13;
        if (increments(r, m & 0x1fffu, 0x1000u, negative, mode)) ++r;
        if (r >= 0x7c00u) {
            const bool to_inf = mode == kNearest || (mode == kUp && !negative) || (mode == kDown && negative);
            r = to_inf ? 0x7c00u : 0x7bffu;
        }
    } else {  // a subnormal half: the value in units of 2^-24, rounded to an integer
        const std::uint32_t e = u >> 23;
        const std::uint32_t mant = e ? ((u & 0x7fffffu) | 0x800000u) : u;
        const int shift = 126 - static_cast<int>(e ? e : 1);
        if (shift >= 32) {
            r = increments(0, mant, 0xffffffffu, negative, mode) ? 1u : 0u;
        } else {
            r = mant >> shift;
            if (increments(r, mant & ((1u << shift) - 1u), 1u << (shift - 1), negative, mode)) ++r;
        }
    }
    return static_cast<std::uint16_t>(sign | r);
}

inline float half_to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t e = (h >> 10) & 0x1fu;
    const std::uint32_t m = h & 0x3ffu;
    if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

inline std::uint16_t float_to_bf16(float f, Rounding mode = kNearest) {
    const std::uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    std::uint32_t r = x >> 16;  // sign included: incrementing it grows the magnitude
    if (increments(r, x & 0xffffu, 0x8000u, (x >> 31) != 0, mode)) ++r;
    return static_cast<std::uint16_t>(r);
}

inline float bf16_to_float(std::uint16_t b) { return bits_float(static_cast<std::uint32_t>(b) << 16); }

// A double rounded to float with round-to-odd (truncate, then set the last bit if inexact):
// rounding that float once more to 11 or 8 bits gives the correctly rounded result.
inline float double_to_float_odd(double d) {
    if (std::isnan(d)) return NAN;
    if (std::isinf(d)) return static_cast<float>(d);
    if (std::fabs(d) > static_cast<double>(FLT_MAX)) return d > 0 ? FLT_MAX : -FLT_MAX;  // beyond fp16 and bf16 alike
    float t = static_cast<float>(d);
    if (static_cast<double>(t) == d) return t;
    if (std::fabs(static_cast<double>(t)) > std::fabs(d)) t = std::nextafter(t, 0.0f);
    return bits_float(float_bits(t) | 1u);
}

// p + c rounded to double with round-to-odd, from the exact error of the sum (TwoSum).
inline double sum_odd(double p, double c) {
    const double s = p + c;
    const double pp = s - c;
    const double e = (p - pp) + (c - (s - pp));
    if (e == 0.0) return s;
    double t = s;
    if ((e > 0) != (s > 0)) t = std::nextafter(s, 0.0);  // the exact value lies below |s|
    std::uint64_t bits;
    std::memcpy(&bits, &t, 8);
    bits |= 1u;
    std::memcpy(&t, &bits, 8);
    return t;
}

// a*b + c of three values with at most 11 significant bits, rounded once: a*b is exact in double.
inline float fma_odd(float a, float b, float c) {
    return double_to_float_odd(sum_odd(static_cast<double>(a) * static_cast<double>(b), static_cast<double>(c)));
}

}  // namespace fp
}  // namespace fa_cpu
