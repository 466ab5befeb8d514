// Float vectors for the CPU ops (GCC vector extensions), shared by the step attention and the fused decoder layer.
// Two widths: 16 lanes (one AVX-512 register) and 8 lanes (one AVX2 register). Each op is compiled once per
// instruction set with the width that set holds in one register: GCC lowers a 16-lane vector on AVX2 through the
// stack (a scalar times such a vector became four stores and a reload per lane group), which made the step
// attention 5-10x slower on an AVX2-only CPU.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpu_vec {

typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

// The lanes of a float vector type, and the integer vector of the same shape.
template <typename V> struct Traits;
template <> struct Traits<v16sf> { static constexpr int lanes = 16; using Int = v16si; };
template <> struct Traits<v8sf> { static constexpr int lanes = 8; using Int = v8si; };

template <typename V>
__attribute__((always_inline)) inline V load(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename V>
__attribute__((always_inline)) inline void store(float* p, V x) { std::memcpy(p, &x, sizeof(x)); }

// Every lane s.
template <typename V>
__attribute__((always_inline)) inline V splat(float s) { return V{} + s; }

// exp(x) for x <= 0, Cephes' float polynomial on x - n ln2 (relative error ~1e-7); n rounded with the
// 1.5 * 2^23 trick, as vector types have no floor. Below -87 the result is clamped to exp(-87) (about 1.6e-38,
// where float turns denormal): a caller that needs an exact zero there sets it.
template <typename V>
__attribute__((always_inline)) inline V exp_nonpositive(V x) {
  using I = typename Traits<V>::Int;
  const V lo = V{} - 87.0f;
  x = x < lo ? lo : x;
  const V magic = V{} + 12582912.0f;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return y * reinterpret_cast<const V&>(bits);
}

}  // namespace cpu_vec
