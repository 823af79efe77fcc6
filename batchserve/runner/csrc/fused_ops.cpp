// The small per-layer operations around the matrix products, fused so that a layer is a handful
// of calls instead of forty: at decode batch 32 each PyTorch elementwise call costs 2-15 us, and
// a step makes about 45 of them per layer. Activations entering or leaving a matrix product may
// be float32 or bfloat16 (the bf16 matmul mode); the residual stream, norms, RoPE and attention
// stay float32, and the KV cache is stored as float32, bfloat16 or float16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_math.h"

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
// cpu_math.h).
template <typename C>
inline void store_row(C* dst, const float* src, int64_t n) {
  if constexpr (std::is_same<C, uint16_t>::value) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  } else if constexpr (std::is_same<C, fp16_t>::value) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_set1_ps(-batchserve::kFp16Max), hi = _mm512_set1_ps(batchserve::kFp16Max);
    for (; i + 16 <= n; i += 16) {  // max/min return their second operand for a NaN: it stays NaN
      const __m512 x = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_loadu_ps(src + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < n; ++i) dst[i] = batchserve::float_to_fp16(src[i]);
  } else {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

template <typename In, typename C>
void rope_store_rows(const In* qkv, const float* cos, const float* sin, const int64_t* slots, C* kc, C* vc,
                     float* out, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
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
      const int64_t slot = slots[t];
      store_row(kc + slot * row, dst + nh * hd, row);
      store_row(vc + slot * row, vo, row);
    }
  });
}

}  // namespace

// qkv: [T, (nh + 2 nkv) * hd] float32 or bfloat16, the fused QKV product; cos, sin: [T, hd/2]
// float32; slots: [T] int64. Applies RoPE to q and k, writes k and v into the caches ([slots, nkv,
// hd], float32, bfloat16 or float16) at `slots`, and returns q, k, v as one float32 tensor [T, nh + 2 nkv, hd].
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor k_cache, torch::Tensor v_cache, int64_t nh, int64_t nkv) {
  check_rows(qkv, "rope_store qkv");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(qkv.size(1) % (nh + 2 * nkv) == 0, "rope_store: qkv width is not (nh + 2 nkv) * hd");
  const int64_t hd = qkv.size(1) / (nh + 2 * nkv);
  TORCH_CHECK(hd % 2 == 0, "rope_store: head_dim must be even");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK((cdt == torch::kFloat32 || cdt == torch::kBFloat16 || cdt == torch::kHalf) && v_cache.scalar_type() == cdt &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 && k_cache.size(1) == nkv &&
                  k_cache.size(2) == hd && v_cache.sizes() == k_cache.sizes(),
              "rope_store: caches must be contiguous [slots, nkv, hd], both float32, bfloat16 or float16");
  cos = cos.contiguous().to(torch::kFloat32);
  sin = sin.contiguous().to(torch::kFloat32);
  slots = slots.contiguous();
  TORCH_CHECK(cos.numel() == T * hd / 2 && sin.numel() == T * hd / 2, "rope_store: cos/sin must be [T, hd/2]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T, "rope_store: slots must be int64 [T]");
  const int64_t nslots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "rope_store: slot out of range");
  auto out = torch::empty({T, nh + 2 * nkv, hd}, qkv.options().dtype(torch::kFloat32));
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  auto with_cache = [&](const auto* in) {
    if (cdt == torch::kBFloat16)
      rope_store_rows(in, c, s, sp, static_cast<uint16_t*>(k_cache.data_ptr()),
                      static_cast<uint16_t*>(v_cache.data_ptr()), o, T, nh, nkv, hd);
    else if (cdt == torch::kHalf)
      rope_store_rows(in, c, s, sp, static_cast<fp16_t*>(k_cache.data_ptr()), static_cast<fp16_t*>(v_cache.data_ptr()),
                      o, T, nh, nkv, hd);
    else
      rope_store_rows(in, c, s, sp, static_cast<float*>(k_cache.data_ptr()), static_cast<float*>(v_cache.data_ptr()),
                      o, T, nh, nkv, hd);
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
        for (int64_t i = 0; i < I; ++i) {
          const float a = bf16_to_float(g[i]);
          const float e = exp_nonpos(-std::fabs(a));  // sigmoid from exp(-|a|): no overflow either side
          const float r = 1.f / (1.f + e);
          const float sig = (a >= 0.f ? 1.f : e) * r;
          y[i] = float_to_bf16(a * sig * bf16_to_float(g[i + I]));
        }
      } else {
        const float* g = static_cast<const float*>(ip) + t * 2 * I;
        float* y = static_cast<float*>(op) + t * I;
        for (int64_t i = 0; i < I; ++i) {
          const float a = g[i];
          const float e = exp_nonpos(-std::fabs(a));
          const float r = 1.f / (1.f + e);
          const float sig = (a >= 0.f ? 1.f : e) * r;
          y[i] = a * sig * g[i + I];
        }
      }
    }
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
  m.def("rope_store", &rope_store, "RoPE on q, k; k, v into the paged cache; q, k, v as float32", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate/up product", nogil);
  m.def("fp16_from_float_portable", &fp16_from_float_portable, "float32 -> float16 bits, the portable path (tests)");
  m.def("fp16_to_float_portable", &fp16_to_float_portable, "float16 bits -> float32, the portable path (tests)");
}
