// Float vectors for the CPU ops (GCC vector extensions), shared by the step attention and the fused decoder layer.
// Three widths: 16 lanes (one AVX-512 register), 8 lanes (one AVX2 register) and 4 (SSE, every x86-64's: the
// build for CPUs with neither). Each op is compiled once per instruction set with the width that set holds in one
// register: GCC lowers a 16-lane vector on AVX2 through the stack (a scalar times such a vector became four stores
// and a reload per lane group), which made the step attention 5-10x slower on an AVX2-only CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace cpu_vec {

typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));
typedef float v4sf __attribute__((vector_size(16)));
typedef int32_t v4si __attribute__((vector_size(16)));

// The lanes of a float vector type, and the integer vector of the same shape.
template <typename V> struct Traits;
template <> struct Traits<v16sf> { static constexpr int lanes = 16; using Int = v16si; };
template <> struct Traits<v8sf> { static constexpr int lanes = 8; using Int = v8si; };
template <> struct Traits<v4sf> { static constexpr int lanes = 4; using Int = v4si; };

template <typename V>
__attribute__((always_inline)) inline V load(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename V>
__attribute__((always_inline)) inline void store(float* p, V x) { std::memcpy(p, &x, sizeof(x)); }

// Every lane s, one specialisation per width, each the instruction set's own broadcast (an FMA's broadcast
// memory operand with AVX-512). GCC 12 compiles the generic `V{} + s` as a scalar add to zero (the sum differs from
// s for s = -0) and then a broadcast, and a uniform initialiser lane by lane: in the step attention's score and
// output loops that cost two extra instructions an FMA, 20-25% of a long prompt's attention. No result changes:
// each splat feeds FMA chains that start at +0 (they never hold -0, so a zero's sign cannot show) or a softmax's
// shift (x - 0 and x + 0 agree). Each width is compiled only in code for its instruction set (SSE is every
// x86-64's), so the specialisations inline there.
template <typename V>
V splat(float s);  // only the widths below

template <>
__attribute__((target("avx512f"))) inline v16sf splat<v16sf>(float s) {
  return reinterpret_cast<v16sf>(_mm512_set1_ps(s));
}
template <>
__attribute__((target("avx2"))) inline v8sf splat<v8sf>(float s) {
  return reinterpret_cast<v8sf>(_mm256_set1_ps(s));
}
template <>
inline v4sf splat<v4sf>(float s) {
  return reinterpret_cast<v4sf>(_mm_set1_ps(s));
}

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
