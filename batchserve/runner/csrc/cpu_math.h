// Scalar helpers shared by the C++ extensions (fused_ops.cpp, paged_attention.cpp). Written so
// that loops calling them vectorise under the flags in runner/kernels.py (-fno-trapping-math).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace batchserve {

// bf16 <-> fp32 on the raw 16 bits: a bf16 value is the top half of the fp32 with the same sign,
// exponent and leading mantissa bits, so widening is exact; narrowing rounds to nearest even
// (NaN payloads are not preserved: activations here are finite).
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0: Cody-Waite range reduction to |r| < ln2/2, a degree-7 Taylor polynomial
// (relative error below 2e-7), and 2^k put straight into the exponent bits. std::exp does not
// vectorise without -ffast-math and neither does std::floor, so k comes from a truncating
// conversion (|x log2 e - k| < 1/2 for x <= 0).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float k = static_cast<float>(static_cast<int32_t>(x * 1.44269504f - 0.5f));
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace batchserve
