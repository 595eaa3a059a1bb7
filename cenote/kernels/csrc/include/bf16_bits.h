// bf16 as its 16 storage bits, in forms GCC vectorizes (-O3 -march=native): widening is a shift,
// rounding is to nearest even on the bits, exactly what c10::BFloat16's scalar conversions do
// (any NaN becomes 0x7FC0). Shared by the fused ops (cenote/kernels) and the attention kernels
// (cenote/models/layers); part of both extensions' build hash.
#pragma once

#include <cstdint>
#include <cstring>

namespace cenote_bf16 {

inline float bf16_to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}

}  // namespace cenote_bf16
