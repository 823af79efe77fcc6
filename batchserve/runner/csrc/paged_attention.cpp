// Decode attention straight from the paged KV cache: each cached K/V element is read once,
// with no gathered copy of a request's history. One work item per sequence, all heads at once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// The compiler does not vectorise a float reduction without -ffast-math, so the two inner
// loops are written with intrinsics where the machine has them, with a portable fallback.
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    x = _mm_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_hadd_ps(x, x));
  }
#endif
  float r = 0.f;
  for (int64_t d = 0; d < n; ++d) r += a[d] * b[d];
  return r;
}

// acc += p * v over n floats.
inline void axpy(float* acc, float p, const float* v, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pp = _mm512_set1_ps(p);
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 pp = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < n; ++d) acc[d] += p * v[d];
}

// exp for x <= 0 (scores minus their max), written so the compiler vectorises the loop that
// calls it: Cody-Waite range reduction to r in [-ln2/2, ln2/2], a degree-7 Taylor polynomial
// (error below 2e-7 relative), and 2^k put straight into the exponent bits.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float k = std::floor(x * 1.44269504f + 0.5f);
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

inline float max_of(const float* s, int64_t n) {
  float m[8];
  for (int u = 0; u < 8; ++u) m[u] = -INFINITY;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8)
    for (int u = 0; u < 8; ++u) m[u] = s[t + u] > m[u] ? s[t + u] : m[u];
  float r = -INFINITY;
  for (int u = 0; u < 8; ++u) r = m[u] > r ? m[u] : r;
  for (; t < n; ++t) r = s[t] > r ? s[t] : r;
  return r;
}

}  // namespace

// q: [B, n_h, hd]; k_cache, v_cache: [slots, n_kv, hd]; block_tables: [B, max_blocks] int64;
// ctx_lens: [B] int64 (tokens to attend, including the current one). Returns [B, n_h, hd].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: cache not contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  const int64_t g = nh / nkv, maxb = block_tables.size(1), row = nkv * hd;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // One work item per sequence, all heads together: a cached token's K (then V) row of every
  // kv head is one contiguous run of memory, read once, in block order. Splitting the work by
  // head instead made each row come from DRAM several times.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(nh * hd);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lens[b];
      const float* qb = qp + b * nh * hd;  // [nh, hd]; heads h*g .. h*g+g-1 share kv head h
      const int64_t* table = bt + b * maxb;
      scores.resize(nh * n);
      for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const float* kb = kp + table[t0 / block_size] * block_size * row;
        const int64_t len = std::min(block_size, n - t0);
        for (int64_t o = 0; o < len; ++o)
          for (int64_t qh = 0; qh < nh; ++qh)
            scores[qh * n + t0 + o] = dot(qb + qh * hd, kb + o * row + (qh / g) * hd, hd) * sc;
      }
      for (int64_t qh = 0; qh < nh; ++qh) {
        float* s = scores.data() + qh * n;
        const float m = max_of(s, n);
        for (int64_t t = 0; t < n; ++t) s[t] = exp_nonpos(s[t] - m);
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t t = 0;
        for (; t + 8 <= n; t += 8)
          for (int u = 0; u < 8; ++u) part[u] += s[t + u];
        float total = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        for (; t < n; ++t) total += s[t];
        const float inv = 1.f / total;
        for (int64_t t2 = 0; t2 < n; ++t2) s[t2] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const float* vb = vp + table[t0 / block_size] * block_size * row;
        const int64_t len = std::min(block_size, n - t0);
        for (int64_t o = 0; o < len; ++o)
          for (int64_t qh = 0; qh < nh; ++qh)
            axpy(acc.data() + qh * hd, scores[qh * n + t0 + o], vb + o * row + (qh / g) * hd, hd);
      }
      std::copy(acc.begin(), acc.end(), op + b * nh * hd);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache (fp32)");
}
