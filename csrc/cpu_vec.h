// Sixteen-lane float vectors for the CPU ops (GCC vector extensions: AVX-512 registers in a function compiled for
// it, two AVX2 registers or scalar code elsewhere), shared by the step attention and the fused decoder layer.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpu_vec {

typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));

__attribute__((always_inline)) inline v16sf load16(const float* p) {
  v16sf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

__attribute__((always_inline)) inline void store16(float* p, v16sf x) { std::memcpy(p, &x, sizeof(x)); }

// exp(x) for x <= 0, Cephes' float polynomial on x - n ln2 (relative error ~1e-7); n rounded with the
// 1.5 * 2^23 trick, as vector types have no floor. Below -87 the result is clamped to exp(-87) (about 1.6e-38,
// where float turns denormal): a caller that needs an exact zero there sets it.
__attribute__((always_inline)) inline v16sf exp_nonpositive(v16sf x) {
  const v16sf lo = v16sf{} - 87.0f;
  x = x < lo ? lo : x;
  const v16sf magic = v16sf{} + 12582912.0f;
  const v16sf n = (x * 1.44269504088896341f + magic) - magic;
  v16sf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v16sf y = v16sf{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const v16si bits = (__builtin_convertvector(n, v16si) + 127) << 23;
  return y * reinterpret_cast<const v16sf&>(bits);
}

}  // namespace cpu_vec
