// Decode attention straight from the paged KV cache: each cached K/V element is read once,
// with no gathered copy of a request's history. One work item per (sequence, kv head); the
// g query heads sharing that kv head are handled together so K/V rows are loaded once for all.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  // Eight independent partial sums let the compiler vectorise without -ffast-math.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int u = 0; u < 8; ++u) s[u] += a[d + u] * b[d + u];
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; d < n; ++d) r += a[d] * b[d];
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
  at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(g * hd);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / nkv, h = w % nkv, n = lens[b];
      const float* qb = qp + (b * nh + h * g) * hd;
      const int64_t* table = bt + b * maxb;
      scores.resize(g * n);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* kt = kp + slot * row + h * hd;
        for (int64_t j = 0; j < g; ++j) scores[j * n + t] = dot(qb + j * hd, kt, hd) * sc;
      }
      for (int64_t j = 0; j < g; ++j) {
        float* s = scores.data() + j * n;
        const float m = *std::max_element(s, s + n);
        float total = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - m);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* vt = vp + slot * row + h * hd;
        for (int64_t j = 0; j < g; ++j) {
          const float p = scores[j * n + t];
          float* a = acc.data() + j * hd;
          for (int64_t d = 0; d < hd; ++d) a[d] += p * vt[d];
        }
      }
      for (int64_t j = 0; j < g; ++j)
        std::copy(acc.begin() + j * hd, acc.begin() + (j + 1) * hd, op + (b * nh + h * g + j) * hd);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache (fp32)");
}
