// Scalar helpers shared by the attention kernels (paged_attention.cpp, varlen_attention.cpp):
// fp32 reads and rounded writes of fp32 / bf16 elements, and softmax's row maximum and exp.
#pragma once

#include <c10/util/BFloat16.h>

#include "bf16_bits.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cenote_attention {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) { return cenote_bf16::bf16_to_float(x.x); }

inline void store(float* out, float x) { *out = x; }

inline void store(c10::BFloat16* out, float x) { *out = c10::BFloat16(x); }

// exp(x) for x <= 0 (a score minus the row's maximum), Cephes' single-precision polynomial,
// written so that the compiler vectorizes a loop of it (inlined by force: left to GCC, the fp32
// instantiation called it once per score).
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// max(x[0], ..., x[n - 1]) for n >= 1, in kWays independent chains (one chain is a maxss
// latency per score; GCC does not vectorize a float max).
inline float row_max(const float* x, int64_t n) {
  constexpr int64_t kWays = 8;
  float top[kWays];
  for (int64_t i = 0; i < kWays; ++i) top[i] = x[0];
  int64_t j = 0;
  for (; j + kWays <= n; j += kWays) {
    for (int64_t i = 0; i < kWays; ++i) top[i] = std::max(top[i], x[j + i]);
  }
  for (; j < n; ++j) top[0] = std::max(top[0], x[j]);
  return *std::max_element(top, top + kWays);
}

}  // namespace cenote_attention
