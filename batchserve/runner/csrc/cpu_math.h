// Scalar helpers shared by the C++ extensions (fused_ops.cpp, paged_attention.cpp). Written so
// that loops calling them vectorise under the flags in runner/kernels.py (-fno-trapping-math).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace batchserve {

// The paged KV cache's layout (runner/attention.py): one layer's K (or V) is [blocks, nkv,
// block_size, hd], each kv head's rows of a block together. The index, in rows of hd elements, of
// kv head h's row at offset `off` of block `block`; kv head h + 1's is block_size rows further.
inline int64_t kv_row(int64_t block, int64_t off, int64_t h, int64_t nkv, int64_t block_size) {
  return (block * nkv + h) * block_size + off;
}

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

// IEEE binary16 (float16) cache elements as raw bits, in a type of their own so that overloads
// tell them from bf16 (a bare uint16_t). Widening is exact. Narrowing rounds to nearest even and
// saturates at +-65504, the largest finite half: a K or V value past it is stored as the largest
// half, not as infinity (which would turn a whole attention row into NaN); NaN stays NaN.
struct fp16_t {
  uint16_t bits;
};
constexpr float kFp16Max = 65504.0f;

inline float fp16_to_float_portable(fp16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t e = (h.bits >> 10) & 0x1Fu, m = h.bits & 0x3FFu;
  uint32_t u;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    float f = static_cast<float>(m) * 5.9604644775390625e-08f;
    std::memcpy(&u, &f, sizeof(u));
    u |= sign;
  } else if (e == 31) {  // infinity or NaN
    u = sign | 0x7F800000u | (m << 13);
  } else {  // rebias the exponent (15 -> 127)
    u = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline fp16_t float_to_fp16_portable(float f) {
  f = std::min(std::max(f, -kFp16Max), kFp16Max);  // a NaN compares false both times and stays
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7E00u)};  // NaN
  if (a >= 0x38800000u) {  // |f| >= 2^-14: a normal half; drop 13 mantissa bits, ties to even
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u;  // and rebias 127 -> 15
    return {static_cast<uint16_t>(sign | (r >> 13))};
  }
  // Subnormal (or zero): adding 0.5, whose ulp is 2^-24, leaves round(|f| * 2^24) to nearest
  // even in the low mantissa bits; 1024 there is the smallest normal, also the right bits.
  float fa;
  std::memcpy(&fa, &a, sizeof(fa));
  fa += 0.5f;
  uint32_t r;
  std::memcpy(&r, &fa, sizeof(r));
  return {static_cast<uint16_t>(sign | (r - 0x3F000000u))};
}

inline float fp16_to_float(fp16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.bits);
#else
  return fp16_to_float_portable(h);
#endif
}

inline fp16_t float_to_fp16(float f) {
#if defined(__F16C__)
  f = std::min(std::max(f, -kFp16Max), kFp16Max);
  return {static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
  return float_to_fp16_portable(f);
#endif
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

// silu(g) * u, the sigmoid taken from exp(-|g|) so that nothing overflows on either side. The
// fused SiLU * up and the integer product that takes the gate and up halves (gemm_int, gated)
// both call this, so they give the same bits.
inline float silu_mul1(float g, float u) {
  const float e = exp_nonpos(-std::fabs(g));
  const float r = 1.f / (1.f + e);
  return g * ((g >= 0.f ? 1.f : e) * r) * u;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 on 16 lanes; the same polynomial as exp_nonpos, with k rounded to nearest and
// scalef doing the 2^k.
inline __m512 exp_nonpos16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0 on 8 lanes (AVX2): the same polynomial as exp_nonpos16 above, k rounded to
// nearest, 2^k built in the exponent bits (k >= -126 for x >= -87, a normal float).
inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860677e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// ---- int8 KV cache (--kv-cache-dtype int8) ----------------------------------------------------
// Per block and kv head a layer's cache holds a region of block_size rows: their int8 values
// (block_size * hd bytes), then their float32 scales (value = scale * q, q in [-127, 127], scale =
// the largest |value| it covers / 127). V: one scale per row, so V is uint8 [blocks, nkv,
// block_size, hd + 4]; its values in tiles of 16 tokens, [4][hd][4] (groups of 4 tokens, each
// element's 4 values together), so vpdpbusd against 4 tokens' broadcast weights adds them into
// 16 elements' lanes at once. K: one scale per 16 elements of a row (RoPE'd keys have a few
// large channels; a scale per row left the rest too coarse: 7 of 24 greedy continuations equal
// to float32's against 20 of 24 with these groups, BENCHMARKS.md), so K is [blocks, nkv,
// block_size, hd + hd / 4]. K is stored in tiles of 16 tokens, the values [hd / 4][16][4] as q +
// 128 (unsigned): four consecutive elements of 16 tokens fill one 64-byte vector, so vpdpbusd
// against four broadcast query elements scores 16 tokens at once, with no horizontal sums; the
// scales [hd / 16][16], one vector per group. block_size must be a multiple of 16, hd of 16.
constexpr int64_t kI8Tile = 16;   // tokens per K tile
constexpr int64_t kI8KGroup = 16;  // K elements per scale

inline int64_t i8_k_row(int64_t hd) { return hd + hd / kI8KGroup * 4; }  // bytes per K row
inline int64_t i8_v_row(int64_t hd) { return hd + 4; }

// Where kv head h's region of block `block` starts, in a cache of `row`-byte rows.
inline int64_t i8_region(int64_t block, int64_t h, int64_t nkv, int64_t bs, int64_t row) {
  return (block * nkv + h) * bs * row;
}

inline int64_t i8_k_index(int64_t off, int64_t d, int64_t hd) {
  return off / kI8Tile * kI8Tile * hd + (d / 4 * kI8Tile + off % kI8Tile) * 4 + d % 4;
}
inline int64_t i8_v_index(int64_t off, int64_t d, int64_t hd) {
  return off / kI8Tile * kI8Tile * hd + ((off % kI8Tile / 4) * hd + d) * 4 + off % 4;
}
inline int64_t i8_k_scale_index(int64_t off, int64_t group, int64_t hd) {
  return (off / kI8Tile * (hd / kI8KGroup) + group) * kI8Tile + off % kI8Tile;
}

template <typename P>
inline auto i8_scales(P* region, int64_t bs, int64_t hd) {
  using F = std::conditional_t<std::is_const<P>::value, const float, float>;
  return reinterpret_cast<F*>(region + bs * hd);
}

// q = round(x / scale), scale = max |x| / 127 (all zero: scale 0, q 0). With AVX-512 and n a
// multiple of 16, on 16 lanes with the same bits: a max is exact in any order, and roundscale
// rounds to nearest even as nearbyint does under the default mode.
inline float i8_quantize(const float* x, int64_t n, int8_t* q) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f), hi = _mm512_set1_ps(127.f);
    for (int64_t i = 0; i < n; i += 16) {
      __m512 y = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      y = _mm512_min_ps(hi, _mm512_max_ps(_mm512_set1_ps(-127.f), y));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y)));
    }
    return amax / 127.f;
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv))));
  return amax / 127.f;
}

// Token `off`'s row of one kv head into its region, and back to float32.
inline void i8_store_k(uint8_t* region, int64_t off, int64_t bs, int64_t hd, const float* x) {
  int8_t q[kI8KGroup];
  for (int64_t g = 0; g < hd / kI8KGroup; ++g) {
    i8_scales(region, bs, hd)[i8_k_scale_index(off, g, hd)] = i8_quantize(x + g * kI8KGroup, kI8KGroup, q);
    uint8_t* dst = region + i8_k_index(off, g * kI8KGroup, hd);  // elements 4j .. 4j + 3 at dst + 64 j
    for (int64_t i = 0; i < kI8KGroup; ++i) dst[i / 4 * kI8Tile * 4 + i % 4] = static_cast<uint8_t>(q[i] + 128);
  }
}
inline void i8_store_v(uint8_t* region, int64_t off, int64_t bs, int64_t hd, const float* x) {
  int8_t q[512];
  i8_scales(region, bs, hd)[off] = i8_quantize(x, hd, q);
  uint8_t* dst = region + i8_v_index(off, 0, hd);  // element d at dst + 4 d
  for (int64_t d = 0; d < hd; ++d) dst[4 * d] = static_cast<uint8_t>(q[d]);
}
inline void i8_load_k(const uint8_t* region, int64_t off, int64_t bs, int64_t hd, float* out) {
#if defined(__AVX512F__)
  for (int64_t g = 0; g < hd / kI8KGroup; ++g) {  // the group's 4 dwords (4 elements each), 64 bytes apart
    const uint8_t* src = region + i8_k_index(off, g * kI8KGroup, hd);
    alignas(16) uint8_t u[kI8KGroup];
    for (int j = 0; j < 4; ++j) std::memcpy(u + 4 * j, src + j * kI8Tile * 4, 4);
    const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(u))),
                                       _mm512_set1_epi32(128));
    _mm512_storeu_ps(out + g * kI8KGroup, _mm512_mul_ps(_mm512_set1_ps(i8_scales(region, bs, hd)[i8_k_scale_index(off, g, hd)]),
                                                        _mm512_cvtepi32_ps(q)));
  }
#else
  for (int64_t d = 0; d < hd; ++d)
    out[d] = i8_scales(region, bs, hd)[i8_k_scale_index(off, d / kI8KGroup, hd)] *
             static_cast<float>(static_cast<int>(region[i8_k_index(off, d, hd)]) - 128);
#endif
}
inline void i8_load_v(const uint8_t* region, int64_t off, int64_t bs, int64_t hd, float* out) {
  const float s = i8_scales(region, bs, hd)[off];
  const uint8_t* src = region + i8_v_index(off, 0, hd);  // element d at src + 4 d
#if defined(__AVX512F__)
  const int64_t lane = off % 4;  // this token's byte of each dword (the 4 tokens of a group share it)
  for (int64_t d = 0; d < hd; d += 16) {
    const __m512i w = _mm512_loadu_si512(src - lane + 4 * d);
    const __m512i q = _mm512_srai_epi32(_mm512_sllv_epi32(w, _mm512_set1_epi32(static_cast<int>(24 - 8 * lane))), 24);
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(q)));
  }
#else
  for (int64_t d = 0; d < hd; ++d) out[d] = s * static_cast<float>(static_cast<int8_t>(src[4 * d]));
#endif
}

}  // namespace batchserve
