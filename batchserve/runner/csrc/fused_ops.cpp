// The small per-layer operations around the matrix products, fused so that a layer is a handful
// of calls instead of forty: at decode batch 32 each PyTorch elementwise call costs 2-15 us, and
// a step makes about 45 of them per layer. Activations entering or leaving a matrix product may
// be float32 or bfloat16 (the bf16 matmul mode); the residual stream, norms, RoPE and attention
// stay float32, and the KV cache is stored as float32, bfloat16 or float16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"  // and immintrin.h where AVX-512 or F16C code is compiled

namespace {

using batchserve::bf16_to_float;
using batchserve::exp_nonpos;
using batchserve::float_to_bf16;
using batchserve::fp16_t;

// Rows per parallel task: below about 256k elements one thread is faster than waking two (and
// does not stall when the other core is busy).
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 262144 / std::max<int64_t>(1, row_elems)); }

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), name, ": expected a contiguous 2-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
              ": float32 or bfloat16 only");
}

}  // namespace

// x += delta (when given), in place; returns rms_norm(x) * w, as bfloat16 when out_bf16.
// x: [T, H] float32; delta: [T, H] float32 or bfloat16; w: [H] float32.
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps,
                           bool out_bf16) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "add_rms_norm: x must be float32");
  check_rows(x, "add_rms_norm x");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: w must be float32 [H]");
  const int64_t T = x.size(0), H = x.size(1);
  const bool has_d = delta.has_value() && delta->defined();
  if (has_d) {
    check_rows(*delta, "add_rms_norm delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "add_rms_norm: delta shape differs from x");
  }
  const bool d_bf = has_d && delta->scalar_type() == torch::kBFloat16;
  auto out = torch::empty({T, H}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
  float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const void* dp = has_d ? delta->data_ptr() : nullptr;
  void* op = out.data_ptr();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      float* xr = xp + t * H;
      if (d_bf) {
        const uint16_t* dr = static_cast<const uint16_t*>(dp) + t * H;
        for (int64_t i = 0; i < H; ++i) xr[i] += bf16_to_float(dr[i]);
      } else if (has_d) {
        const float* dr = static_cast<const float*>(dp) + t * H;
        for (int64_t i = 0; i < H; ++i) xr[i] += dr[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + e);
      if (out_bf16) {
        uint16_t* orow = static_cast<uint16_t*>(op) + t * H;
        for (int64_t i = 0; i < H; ++i) orow[i] = float_to_bf16(xr[i] * inv * wp[i]);
      } else {
        float* orow = static_cast<float*>(op) + t * H;
        for (int64_t i = 0; i < H; ++i) orow[i] = xr[i] * inv * wp[i];
      }
    }
  });
  return out;
}

namespace {

// One token's K or V row into the cache, as float32, bfloat16 or float16 (saturating, see
// cpu_math.h). `stream`: a float16 row of whole 64-byte lines goes out with non-temporal stores,
// which do not read the lines first: a decode step writes one row per request into lines nothing
// has touched for a long time (at batch 64 the step's 30 calls took 0.98 ms so, 1.34 with
// ordinary stores). Only for decode steps: a prompt chunk's rows are read back at once by its
// attention, and should stay in cache.
template <typename C>
inline void store_row(C* dst, const float* src, int64_t n, bool stream = false) {
  if constexpr (std::is_same<C, uint16_t>::value) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  } else if constexpr (std::is_same<C, fp16_t>::value) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_set1_ps(-batchserve::kFp16Max), hi = _mm512_set1_ps(batchserve::kFp16Max);
    // 16 floats -> 16 halves, saturated (max/min return their second operand for a NaN: it stays NaN)
    auto halves = [&](const float* p) {
      return _mm512_cvtps_ph(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_loadu_ps(p))),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    };
    if (stream && n % 32 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
      for (; i < n; i += 32)  // two conversions fill one line
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i),
                            _mm512_inserti64x4(_mm512_castsi256_si512(halves(src + i)), halves(src + i + 16), 1));
      return;
    }
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), halves(src + i));
#endif
    for (; i < n; ++i) dst[i] = batchserve::float_to_fp16(src[i]);
  } else {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

template <typename In, typename C>
void rope_store_rows(const In* qkv, const float* cos, const float* sin, const int64_t* slots, C* kc, C* vc,
                     float* out, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, bool stream) {
  const int64_t half = hd / 2, width = (nh + 2 * nkv) * hd, row = nkv * hd;
  auto load = [](In v) -> float {
    if constexpr (std::is_same<In, uint16_t>::value) return bf16_to_float(v); else return v;
  };
  at::parallel_for(0, T, grain(width), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const In* src = qkv + t * width;
      float* dst = out + t * width;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < nh + nkv; ++h) {  // q heads then k heads: rotate (first, second) halves
        const In* x = src + h * hd;
        float* y = dst + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(x[i]), x2 = load(x[i + half]);
          y[i] = x1 * c[i] - x2 * s[i];
          y[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
      const In* v = src + (nh + nkv) * hd;
      float* vo = dst + (nh + nkv) * hd;
      for (int64_t i = 0; i < row; ++i) vo[i] = load(v[i]);
      for (int64_t h = 0; h < nkv; ++h) {  // slot = block * bs + offset
        if constexpr (std::is_same<C, uint8_t>::value) {  // int8 cache (cpu_math.h)
          const int64_t blk = slots[t] / bs, off = slots[t] % bs;
          batchserve::i8_store_k(kc + batchserve::i8_region(blk, h, nkv, bs, batchserve::i8_k_row(hd)), off, bs, hd,
                                 dst + (nh + h) * hd);
          batchserve::i8_store_v(vc + batchserve::i8_region(blk, h, nkv, bs, batchserve::i8_v_row(hd)), off, bs, hd,
                                 vo + h * hd);
        } else {
          const int64_t at = batchserve::kv_row(slots[t] / bs, slots[t] % bs, h, nkv, bs) * hd;
          store_row(kc + at, dst + (nh + h) * hd, hd, stream);
          store_row(vc + at, vo + h * hd, hd, stream);
        }
      }
    }
#if defined(__AVX512F__)
    if (stream) _mm_sfence();  // the streamed rows are visible before attention reads them
#endif
  });
}

}  // namespace

// qkv: [T, (nh + 2 nkv) * hd] float32 or bfloat16, the fused QKV product; cos, sin: [T, hd/2]
// float32; slots: [T] int64. Applies RoPE to q and k, writes k and v into the caches ([blocks, nkv,
// block_size, hd], float32, bfloat16 or float16) at `slots` (block * block_size + offset), and returns
// q, k, v as one float32 tensor [T, nh + 2 nkv, hd].
// `stream` (a decode step): float16 rows go to the cache with non-temporal stores (store_row).
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor k_cache, torch::Tensor v_cache, int64_t nh, int64_t nkv, bool stream) {
  check_rows(qkv, "rope_store qkv");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(qkv.size(1) % (nh + 2 * nkv) == 0, "rope_store: qkv width is not (nh + 2 nkv) * hd");
  const int64_t hd = qkv.size(1) / (nh + 2 * nkv);
  TORCH_CHECK(hd % 2 == 0, "rope_store: head_dim must be even");
  const auto cdt = k_cache.scalar_type();
  const bool i8 = cdt == torch::kUInt8;  // int8 cache: rows of bytes and scales (cpu_math.h)
  TORCH_CHECK((cdt == torch::kFloat32 || cdt == torch::kBFloat16 || cdt == torch::kHalf || i8) &&
                  v_cache.scalar_type() == cdt && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && k_cache.size(1) == nkv && v_cache.dim() == 4 &&
                  v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) &&
                  k_cache.size(3) == (i8 ? batchserve::i8_k_row(hd) : hd) &&
                  v_cache.size(3) == (i8 ? batchserve::i8_v_row(hd) : hd),
              "rope_store: caches must be contiguous [blocks, nkv, block_size, hd], both float32, bfloat16 or float16 "
              "(int8: uint8, K [blocks, nkv, block_size, hd + hd / 4], V [blocks, nkv, block_size, hd + 4])");
  TORCH_CHECK(!i8 || (k_cache.size(2) % batchserve::kI8Tile == 0 && hd % batchserve::kI8KGroup == 0),
              "rope_store: an int8 cache needs block_size and head_dim multiples of 16");
  cos = cos.contiguous().to(torch::kFloat32);
  sin = sin.contiguous().to(torch::kFloat32);
  slots = slots.contiguous();
  TORCH_CHECK(cos.numel() == T * hd / 2 && sin.numel() == T * hd / 2, "rope_store: cos/sin must be [T, hd/2]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T, "rope_store: slots must be int64 [T]");
  const int64_t bs = k_cache.size(2), nslots = k_cache.size(0) * bs;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "rope_store: slot out of range");
  auto out = torch::empty({T, nh + 2 * nkv, hd}, qkv.options().dtype(torch::kFloat32));
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  auto with_cache = [&](const auto* in) {
    if (i8)
      rope_store_rows(in, c, s, sp, k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), o, T, nh, nkv, hd, bs,
                      stream);
    else if (cdt == torch::kBFloat16)
      rope_store_rows(in, c, s, sp, static_cast<uint16_t*>(k_cache.data_ptr()),
                      static_cast<uint16_t*>(v_cache.data_ptr()), o, T, nh, nkv, hd, bs, stream);
    else if (cdt == torch::kHalf)
      rope_store_rows(in, c, s, sp, static_cast<fp16_t*>(k_cache.data_ptr()), static_cast<fp16_t*>(v_cache.data_ptr()),
                      o, T, nh, nkv, hd, bs, stream);
    else
      rope_store_rows(in, c, s, sp, static_cast<float*>(k_cache.data_ptr()), static_cast<float*>(v_cache.data_ptr()),
                      o, T, nh, nkv, hd, bs, stream);
  };
  if (qkv.scalar_type() == torch::kBFloat16)
    with_cache(static_cast<const uint16_t*>(qkv.data_ptr()));
  else
    with_cache(static_cast<const float*>(qkv.data_ptr()));
  return out;
}

// gu: [T, 2 I] (gate then up), float32 or bfloat16. Returns silu(gate) * up, [T, I], same dtype.
torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "silu_mul");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: width must be even");
  auto out = torch::empty({T, I}, gu.options());
  const bool bf = gu.scalar_type() == torch::kBFloat16;
  const void* ip = gu.data_ptr();
  void* op = out.data_ptr();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      if (bf) {
        const uint16_t* g = static_cast<const uint16_t*>(ip) + t * 2 * I;
        uint16_t* y = static_cast<uint16_t*>(op) + t * I;
        for (int64_t i = 0; i < I; ++i) y[i] = float_to_bf16(batchserve::silu_mul1(bf16_to_float(g[i]), bf16_to_float(g[i + I])));
      } else {
        const float* g = static_cast<const float*>(ip) + t * 2 * I;
        float* y = static_cast<float*>(op) + t * I;
        for (int64_t i = 0; i < I; ++i) y[i] = batchserve::silu_mul1(g[i], g[i + I]);
      }
    }
  });
  return out;
}

// ---- token sampling ---------------------------------------------------------------------------
// Each row in one thread, a few passes over the vocabulary, instead of PyTorch's per-row ops
// (softmax, a full sort for top-p, multinomial), which took 3-15 ms a row at 49,152 tokens here,
// so 0.3-1 s a step at batch 64 against a 36 ms forward pass.
namespace {

struct SampleBufs {
  std::vector<float> w, tmp;
  std::vector<int32_t> idx;
};

// The passes over a row, vectorised with AVX-512 where it is there.
// max(x) and whether x holds a NaN.
float row_max(const float* x, int64_t V, bool& nan) {
  float m = -INFINITY;
  int64_t j = 0;
  nan = false;
#if defined(__AVX512F__)
  // four independent maxima, so that the loop is not one chain of vmaxps latencies
  __m512 vm[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                  _mm512_set1_ps(-INFINITY)};
  __mmask16 un = 0;
  for (; j + 64 <= V; j += 64)
    for (int i = 0; i < 4; ++i) {
      const __m512 v = _mm512_loadu_ps(x + j + 16 * i);
      un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vm[i] = _mm512_max_ps(vm[i], v);
    }
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vm[0] = _mm512_max_ps(vm[0], v);
  }
  nan = un != 0;
  m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vm[0], vm[1]), _mm512_max_ps(vm[2], vm[3])));
#endif
  for (; j < V; ++j) {
    nan = nan || std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  return m;
}

// The first largest value, as torch.argmax; a NaN counts as the largest (its first index).
int64_t argmax_row(const float* x, int64_t V) {
  bool nan;
  const float m = row_max(x, V, nan);
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, mv, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < V; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == m) return j;
  return 0;  // all -inf
}

// How many x >= t.
int64_t count_ge(const float* x, int64_t V, float t) {
  int64_t n = 0, j = 0;
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(t);
  for (; j + 16 <= V; j += 16) n += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), tv, _CMP_GE_OQ));
#endif
  for (; j < V; ++j) n += x[j] >= t;
  return n;
}

// The sum of the w >= t, in double.
double sum_ge(const float* w, int64_t V, float t) {
  double total = 0.0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(t);
  __m512d a = _mm512_setzero_pd(), c = _mm512_setzero_pd();
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(w + j);
    const __m512 k = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, tv, _CMP_GE_OQ), v);
    a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm512_castps512_ps256(k)));
    c = _mm512_add_pd(c, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(k), 1))));
  }
  total = _mm512_reduce_add_pd(_mm512_add_pd(a, c));
#endif
  for (; j < V; ++j) total += w[j] >= t ? w[j] : 0.f;
  return total;
}

// One draw from softmax(x / t) restricted by top-k then top-p, with the caller's uniform u in (0, 1).
int64_t draw_row(const float* x, int64_t V, float t, int64_t k, float p, double u, SampleBufs& b) {
  bool nan;
  const float m = row_max(x, V, nan);
  const float inv_t = 1.f / t;
  // Nothing to draw from, or all the mass on the largest: a NaN (the first), all -inf, a +inf
  // logit, or a temperature so small that 1/t overflows. As greedy.
  if (nan || m == -INFINITY || m == INFINITY || !std::isfinite(inv_t)) return argmax_row(x, V);
  float thr = -INFINITY;  // top-k: the k-th largest logit; ties with it are kept
  if (k > 0 && k < V) {
    // Candidates first: the logits within d of the max for the smallest d (doubling) that
    // holds k of them, so the selection runs on a handful of values, not the vocabulary.
    float d = 1.f;
    while (count_ge(x, V, m - d) < k && d < 1e30f) d *= 2.f;
    const float lo = m - d;
    b.tmp.clear();
    for (int64_t j = 0; j < V; ++j)
      if (x[j] >= lo) b.tmp.push_back(x[j]);
    if (static_cast<int64_t>(b.tmp.size()) < k) b.tmp.assign(x, x + V);  // -inf logits: take all
    std::nth_element(b.tmp.begin(), b.tmp.begin() + (k - 1), b.tmp.end(), std::greater<float>());
    thr = b.tmp[k - 1];
  }
  b.w.resize(V);
  float* w = b.w.data();
  // The max gets 1; logits below the top-k, and those whose exp underflows float (an exponent
  // below -87, -inf among them), get 0.
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(thr), mv = _mm512_set1_ps(m), iv = _mm512_set1_ps(inv_t),
               lo = _mm512_set1_ps(-87.f);
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __m512 z = _mm512_mul_ps(_mm512_sub_ps(v, mv), iv);
    const __mmask16 ok = _mm512_cmp_ps_mask(v, tv, _CMP_GE_OQ) & _mm512_cmp_ps_mask(z, lo, _CMP_GE_OQ);
    _mm512_storeu_ps(w + j, _mm512_maskz_mov_ps(ok, batchserve::exp_nonpos16(z)));
  }
#endif
  for (; j < V; ++j) {
    const float z = (x[j] - m) * inv_t;
    w[j] = (x[j] >= thr && z >= -87.f) ? exp_nonpos(z) : 0.f;
  }
  double total = sum_ge(w, V, 0.f);
  float cut = 0.f;  // top-p: the smallest weight kept; ties with it are kept
  if (p < 1.f) {
    const double target = static_cast<double>(p) * total;
    // The kept tokens are a head of the weights in descending order whose mass first exceeds the
    // target, so they all lie among the w >= tau of any tau whose such mass exceeds it: find
    // one (tau = 2^-3, 2^-6, ...; the largest weight is 1) and sort only those.
    float tau = 0.125f;
    while (tau > 1e-30f && sum_ge(w, V, tau) <= target) tau *= 0.125f;
    if (tau <= 1e-30f) tau = 0.f;
    b.idx.clear();
    for (int64_t j = 0; j < V; ++j)
      if (w[j] > 0.f && w[j] >= tau) b.idx.push_back(static_cast<int32_t>(j));
    std::sort(b.idx.begin(), b.idx.end(), [w](int32_t a, int32_t c) { return w[a] > w[c] || (w[a] == w[c] && a < c); });
    double acc = 0.0;
    size_t kept = 0;
    while (kept < b.idx.size() && (acc <= target || kept == 0)) acc += w[b.idx[kept++]];  // at least one
    cut = w[b.idx[kept - 1]];
    total = sum_ge(w, V, cut);
  }
  // Inverse CDF in vocabulary order: block sums of 256 first, then the block's elements.
  constexpr int64_t BLK = 256;
  const int64_t nb = (V + BLK - 1) / BLK;
  const float keep = cut > 0.f ? cut : std::numeric_limits<float>::min();  // w > 0 and w >= cut
  const double target = u * total;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t j0 = blk * BLK, n = std::min(BLK, V - j0);
    const double bs = sum_ge(w + j0, n, keep);
    if (bs <= 0.0) continue;
    if (acc + bs > target) {
      for (int64_t j = j0; j < j0 + n; ++j) {
        if (!(w[j] >= keep)) continue;
        acc += w[j];
        last = j;
        if (acc > target) return j;
      }
    } else {
      acc += bs;
      for (int64_t j = j0 + n - 1; j >= j0; --j)
        if (w[j] >= keep) {
          last = j;
          break;
        }
    }
  }
  return last >= 0 ? last : argmax_row(x, V);  // u * total rounded up to the whole mass
}

}  // namespace

// logits [S, V] float32; temperature, top_p [S] float32; top_k [S] int64 (0: off); u [S] float64
// uniforms in (0, 1). Row r: temperature 0 -> argmax; else a draw from softmax(logits / t) over the
// top_k largest logits, then over the smallest set of most likely tokens whose mass reaches top_p
// (the one that crosses it kept): the first token, in vocabulary order, whose running kept mass
// exceeds u * the kept total. Returns [S] int64.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "sample_rows: logits must be a float32 CPU matrix [S, V]");
  logits = logits.contiguous();
  const int64_t S = logits.size(0), V = logits.size(1);
  temperature = temperature.contiguous().to(torch::kFloat32);
  top_p = top_p.contiguous().to(torch::kFloat32);
  u = u.contiguous().to(torch::kFloat64);
  top_k = top_k.contiguous().to(torch::kInt64);
  TORCH_CHECK(temperature.numel() == S && top_p.numel() == S && u.numel() == S && top_k.numel() == S,
              "sample_rows: one temperature, top_k, top_p and u per row");
  TORCH_CHECK(V > 0, "sample_rows: empty vocabulary");
  auto out = torch::empty({S}, logits.options().dtype(torch::kInt64));
  const float *x = logits.data_ptr<float>(), *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t lo, int64_t hi) {
    SampleBufs bufs;
    for (int64_t r = lo; r < hi; ++r)
      o[r] = tp[r] == 0.f ? argmax_row(x + r * V, V) : draw_row(x + r * V, V, tp[r], kp[r], pp[r], up[r], bufs);
  });
  return out;
}

// The portable float16 conversions (cpu_math.h), which run where F16C is missing, on whole
// tensors, so that tests can check them here against torch's: float32 -> float16 bits (int16)
// and back.
torch::Tensor fp16_from_float_portable(torch::Tensor x) {
  x = x.contiguous().to(torch::kFloat32);
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kInt16));
  const float* src = x.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = batchserve::float_to_fp16_portable(src[i]).bits;
  return out;
}

torch::Tensor fp16_to_float_portable(torch::Tensor bits) {
  TORCH_CHECK(bits.scalar_type() == torch::kInt16, "fp16_to_float_portable: int16 bits expected");
  bits = bits.contiguous();
  auto out = torch::empty(bits.sizes(), bits.options().dtype(torch::kFloat32));
  const auto* src = reinterpret_cast<const uint16_t*>(bits.data_ptr<int16_t>());
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < bits.numel(); ++i) dst[i] = batchserve::fp16_to_float_portable({src[i]});
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL (ATen needs none), like torch's own ops: the server's
  // event loop thread keeps answering while the engine thread is inside them.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place; rms_norm(x) * w (float32 or bfloat16 out)", nogil);
  m.def("rope_store", &rope_store, "RoPE on q, k; k, v into the paged cache; q, k, v as float32", nogil,
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("nh"), py::arg("nkv"), py::arg("stream") = false);
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate/up product", nogil);
  m.def("sample_rows", &sample_rows, "greedy or top-k / top-p draws per row, with the caller's uniforms", nogil);
  m.def("fp16_from_float_portable", &fp16_from_float_portable, "float32 -> float16 bits, the portable path (tests)");
  m.def("fp16_to_float_portable", &fp16_to_float_portable, "float16 bits -> float32, the portable path (tests)");
}
