// Decode attention straight from the paged KV cache: each cached K/V element is read once,
// with no gathered copy of a request's history.
//
// AVX-512 path (head_dim a multiple of 16, up to 128): one pass over the context in tiles of 16
// tokens with an online (flash-decoding) softmax, so K and V of a tile are used while they are
// still in L1 and there is no scores buffer or second pass. Work items are whole sequences, or
// chunks of one when there are fewer sequences than threads need, merged at the end.
// Elsewhere the portable path below (AVX2 or scalar inner loops) does the same job.
//
// The cache may be float32, bfloat16 or float16 (half the bytes a decode step reads from memory,
// about 1.6x faster); either way the arithmetic is fp32: 16-bit K/V values are widened as they
// are loaded (exactly).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cpu_math.h"

namespace {

// Whether paged_decode takes the int8 cache's VNNI kernel where it built (tests and benchmarks
// turn it off to run the dequantizing path).
bool i8_fast_path = true;

// bfloat16 cache elements are handled as their raw 16 bits: a bf16 value is the top half of the
// fp32 with the same sign, exponent and leading mantissa bits, so widening is exact.
using bf16_t = uint16_t;
using batchserve::fp16_t;  // IEEE half, widened by F16C (vcvtph2ps)

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return batchserve::bf16_to_float(x); }
inline float to_float(fp16_t x) { return batchserve::fp16_to_float(x); }

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

using batchserve::exp_nonpos;  // scores minus their max are <= 0

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

// One cached token's row of all kv heads as fp32: the row itself for a float cache, else widened
// into buf (once per row, not once per query head that reads it).
inline const float* row_f32(const float* r, float*, int64_t) { return r; }
template <typename T>
inline const float* row_f32(const T* r, float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  // 8 at a time where the CPU converts them (float16: vcvtph2ps; bf16: shifted into the top half),
  // the same values as one by one: element by element this widening was most of a decode step.
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i));
    _mm256_storeu_ps(buf + i, std::is_same<T, fp16_t>::value
                                  ? _mm256_cvtph_ps(h)
                                  : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) buf[i] = to_float(r[i]);
  return buf;
}

// Portable path: one work item per sequence, all heads at once; scores, softmax, then V.
template <typename T>
void decode_portable(const float* qp, const T* kp, const T* vp, const int64_t* bt, const int64_t* lens,
                     float* op, int64_t B, int64_t nh, int64_t hd, int64_t nkv, int64_t maxb, int64_t block_size,
                     float sc) {
  const int64_t g = nh / nkv;
  // Each block's K (then V), all kv heads, read once in block order.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(nh * hd);
    std::vector<float> rowbuf(std::is_same<T, float>::value ? 0 : hd);  // one kv head's row, widened
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lens[b];
      const float* qb = qp + b * nh * hd;  // [nh, hd]; heads h*g .. h*g+g-1 share kv head h
      const int64_t* table = bt + b * maxb;
      scores.resize(nh * n);
      for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const int64_t block = table[t0 / block_size], len = std::min(block_size, n - t0);
        for (int64_t h = 0; h < nkv; ++h)
          for (int64_t o = 0; o < len; ++o) {
            const float* kr = row_f32(kp + batchserve::kv_row(block, o, h, nkv, block_size) * hd, rowbuf.data(), hd);
            for (int64_t qh = h * g; qh < (h + 1) * g; ++qh)
              scores[qh * n + t0 + o] = dot(qb + qh * hd, kr, hd) * sc;
          }
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
        const int64_t block = table[t0 / block_size], len = std::min(block_size, n - t0);
        for (int64_t h = 0; h < nkv; ++h)
          for (int64_t o = 0; o < len; ++o) {
            const float* vr = row_f32(vp + batchserve::kv_row(block, o, h, nkv, block_size) * hd, rowbuf.data(), hd);
            for (int64_t qh = h * g; qh < (h + 1) * g; ++qh)
              axpy(acc.data() + qh * hd, scores[qh * n + t0 + o], vr, hd);
          }
      }
      std::copy(acc.begin(), acc.end(), op + b * nh * hd);
    }
  });
}

// The prefill kernels' driver: each span's queries cut into items of up to `qtile` consecutive
// queries and one kv head, the longest first, handed out one at a time so that the threads
// finish together. Each worker makes its buffers once (init) and runs item(bufs, span, kv head,
// first row, queries, position of the first).
template <typename Bufs, typename Init, typename Item>
void prefill_items(const int64_t* spans, int64_t S, int64_t nkv, int64_t qtile, Init init, Item item) {
  struct Work {
    int64_t span, kvh, q_off, nq, cost;
  };
  std::vector<Work> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = spans[s * 3 + 1], pos0 = spans[s * 3 + 2];
    for (int64_t off = 0; off < n; off += qtile)
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t nq = std::min(qtile, n - off);
        items.push_back({s, h, off, nq, pos0 + off + nq});
      }
  }
  std::sort(items.begin(), items.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t nitems = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    Bufs bufs;
    init(bufs);
    for (int64_t i = next.fetch_add(1); i < nitems; i = next.fetch_add(1)) {
      const Work& w = items[i];
      item(bufs, w.span, w.kvh, spans[w.span * 3] + w.q_off, w.nq, spans[w.span * 3 + 2] + w.q_off);
    }
  };
  const int64_t nworkers = std::min<int64_t>(at::get_num_threads(), nitems);
  if (nworkers > 1)
    at::parallel_for(0, nworkers, 1, worker);
  else if (nitems > 0)
    worker(0, 1);
}

#if defined(__AVX512F__)

constexpr int kTile = 16;  // tokens scored together: their 16 scores fill one zmm
// K/V rows are prefetched this many tokens ahead of the tile being computed: while kv head h of
// a tile is computed, kv head h's rows of the tile 16 tokens on. Measured on Zen 5 with the
// model's shapes when a block held the rows of all kv heads side by side: 8 to 32 tokens ahead
// all did about the same, a burst per kv head beat both one burst per tile and an even trickle,
// and T0 beat T1 by a few percent; with the head-major blocks, 16 and 32 tokens measured the same.
constexpr int64_t kPrefetchAhead = 16;

// Vector d (of NV) of one head's HD = 16 * NV elements as 16 fp32 lanes. float: elements
// 16d .. 16d+15. bf16: each 32 elements (64 bytes, vectors 2c and 2c+1) are loaded as 16 dwords
// and split without a shuffle: the even elements are each dword shifted left by 16, the odd ones
// its top half masked. Widening 16 bf16 in order takes a zero-extension across 128-bit lanes
// (vpmovzxwd), a shuffle per vector, redone for every query head that reads K from L1; the split
// measured 0-4% faster from DRAM (Zen 5, model shapes). The lanes are then in the order lane_of
// gives: the scaled q is stored in it and the output acc read back through it (a dot product or
// an axpy does not care which lane holds which element). A last unpaired vector (NV odd) is
// widened in order.
template <int NV>
inline __m512 load_vec(const float* r, int d) {
  return _mm512_loadu_ps(r + 16 * d);
}
template <int NV>
inline __m512 load_vec(const bf16_t* r, int d) {
  if (d % 2 == 1 || d + 1 < NV) {
    const __m512i w = _mm512_loadu_si512(r + 16 * (d & ~1));
    return _mm512_castsi512_ps(d % 2 == 0 ? _mm512_slli_epi32(w, 16)
                                          : _mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * d)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// float16: 16 halves widened in order by one vcvtph2ps.
template <int NV>
inline __m512 load_vec(const fp16_t* r, int d) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * d)));
}

// Where element i of a head's hd elements sits in the lanes load_vec fills (see above).
template <typename T>
inline int64_t lane_of(int64_t i, int64_t hd) {
  if (!std::is_same<T, bf16_t>::value || i >= hd / 32 * 32) return i;
  return i / 32 * 32 + (i % 2) * 16 + (i % 32) / 2;
}

using batchserve::exp_nonpos16;

// Lane i of the result is the sum of v[i]'s 16 lanes: 16 dot products finished together with
// 15 shuffle-pair-and-add steps (a transpose that adds as it goes) instead of 16 separate
// horizontal reductions of ~8 dependent steps each.
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lane: [a, b, a, b] partials of v[2i], v[2i+1]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane: [a, b, c, d] partials of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0,1: v[8i .. 8i+3]; lanes 2,3: v[8i+4 .. 8i+7]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// Running softmax state of one work item, per query head: max m, lane-wise sum of exp l
// (reduced once at the end, not per tile), and the unnormalised output acc.
struct State {
  std::vector<float> m, l, acc;
  void reset(int64_t nh, int64_t hd) {
    m.assign(nh, -INFINITY);
    l.assign(nh * kTile, 0.f);
    acc.assign(nh * hd, 0.f);
  }
};

// One tile for G query heads that share a kv head (their q, running max m, sum l and acc at
// qs, m, l, acc, in head order); token t's row of that kv head is at krow[t] + hoff (vrow for V).
// The G heads are done together so that each K and V row is loaded once for all of them and the
// V accumulation has G * NV independent FMA chains: with one head at a time (NV chains of 16 dependent FMAs) the kernel
// was bound by FMA latency, not by memory.
template <typename T, int NV, int G>
inline void tile_heads(const float* qs, const T* const* krow, const T* const* vrow, int64_t hoff,
                       __mmask16 valid, int nvalid, float* m, float* l, float* acc) {
  constexpr int HD = NV * 16;
  // Below 8 chains, even and odd tokens go to separate accumulators (added at the end).
  constexpr int S = G * NV < 8 ? 2 : 1;
  alignas(64) float pbuf[G][kTile];
  __m512 a[S][G][NV];
  // Each K row is loaded (and, for a 16-bit cache, widened) once for the G heads; their 16
  // partial dot products per token wait in memory for the reductions. Loading it per head
  // instead widened every K element G times: 7-12 % slower with the data in cache.
  alignas(64) __m512 parts[G][kTile];
  for (int t = 0; t < kTile; ++t) {
    const T* kr = krow[t] + hoff;
    __m512 kv[NV];
    for (int d = 0; d < NV; ++d) kv[d] = load_vec<NV>(kr, d);
    for (int j = 0; j < G; ++j) {
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qs + j * HD), kv[0]);
      for (int d = 1; d < NV; ++d) s = _mm512_fmadd_ps(_mm512_loadu_ps(qs + j * HD + 16 * d), kv[d], s);
      parts[j][t] = s;
    }
  }
  for (int j = 0; j < G; ++j) {
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, reduce16(parts[j]));
    const float tmax = _mm512_reduce_max_ps(s);
    for (int d = 0; d < NV; ++d) a[0][j][d] = _mm512_loadu_ps(acc + j * HD + 16 * d);
    __m512 lsum = _mm512_loadu_ps(l + j * kTile);
    // A new running max rescales what was summed so far (0 at the start). The branch is
    // rarely taken once the max settles, so the exp below need not wait for the max.
    if (tmax > m[j]) {
      const __m512 alpha = _mm512_set1_ps(exp_nonpos(m[j] - tmax));
      for (int d = 0; d < NV; ++d) a[0][j][d] = _mm512_mul_ps(a[0][j][d], alpha);
      lsum = _mm512_mul_ps(lsum, alpha);
      m[j] = tmax;
    }
    const __m512 pr = _mm512_maskz_mov_ps(valid, exp_nonpos16(_mm512_sub_ps(s, _mm512_set1_ps(m[j]))));
    _mm512_storeu_ps(l + j * kTile, _mm512_add_ps(lsum, pr));
    _mm512_store_ps(pbuf[j], pr);
    for (int e = 1; e < S; ++e)
      for (int d = 0; d < NV; ++d) a[e][j][d] = _mm512_setzero_ps();
  }
  int t = 0;
  for (; t + S <= nvalid; t += S)
    for (int e = 0; e < S; ++e) {
      const T* vr = vrow[t + e] + hoff;
      for (int d = 0; d < NV; ++d) {
        const __m512 vv = load_vec<NV>(vr, d);
        for (int j = 0; j < G; ++j) a[e][j][d] = _mm512_fmadd_ps(_mm512_set1_ps(pbuf[j][t + e]), vv, a[e][j][d]);
      }
    }
  for (; t < nvalid; ++t) {
    const T* vr = vrow[t] + hoff;
    for (int d = 0; d < NV; ++d) {
      const __m512 vv = load_vec<NV>(vr, d);
      for (int j = 0; j < G; ++j) a[0][j][d] = _mm512_fmadd_ps(_mm512_set1_ps(pbuf[j][t]), vv, a[0][j][d]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int d = 0; d < NV; ++d) {
      __m512 r = a[0][j][d];
      for (int e = 1; e < S; ++e) r = _mm512_add_ps(r, a[e][j][d]);
      _mm512_storeu_ps(acc + j * HD + 16 * d, r);
    }
}

// Attends positions [p0, p1) of one sequence. qs: [nh, hd], already multiplied by the scale.
// Tile by tile (16 tokens); inside a tile, kv head by kv head, its query heads in groups of up
// to 4 (tile_heads). A block holds each kv head's rows together ([nkv][bs][HD]), so one kv head of
// a tile is one contiguous run (2 KB for float16 at 16 tokens): with rows of all heads side by
// side instead, each head read every third pair of lines, and over a request's contiguous blocks
// decode attention ran at 24-32 GB/s from DRAM against 33-45 with this layout (Zen 5, the model's
// shapes). Over blocks scattered one by one this layout is ~1.5x slower (15 against 23-25 GB/s):
// a block is then read as three 2 KB pieces at different moments, and neither a whole-block
// prefetch nor one 16-32 tokens further ahead won that back. The KV manager keeps a request's
// blocks in one run. Without the prefetch the loads of a new block wait on DRAM with nothing else
// to do; with it they overlap with the arithmetic of the tiles before.
template <typename T, int NV>
void attend(const float* qs, const T* kc, const T* vc, const int64_t* table, int64_t bs, int64_t nkv,
            int64_t g, int64_t p0, int64_t p1, State& st) {
  constexpr int HD = NV * 16;
  const int64_t hstride = bs * HD;  // from one kv head's row to the next one's (kv_row)
  constexpr int64_t kHeadBytes = HD * static_cast<int64_t>(sizeof(T));
  const T* krow[kTile];  // token t's row of kv head 0 (kv head h: + h * hstride)
  const T* vrow[kTile];
  const T* next[kTile];  // the same for the tile kPrefetchAhead tokens on (offsets into both caches)
  int64_t blk = p0 / bs, off = p0 % bs;  // walks the block table without a division per token
  int64_t pf = p0, pfblk = blk, pfoff = off;  // the prefetch walker
  auto rows_from = [&](int64_t limit, const T** out) {  // the prefetch walker's rows up to limit
    int n = 0;
    for (limit = std::min(limit, p1); pf < limit; ++pf, ++n) {
      out[n] = kc + batchserve::kv_row(table[pfblk], pfoff, 0, nkv, bs) * HD;
      if (++pfoff == bs) pfoff = 0, ++pfblk;
    }
    return n;
  };
  auto prefetch_head = [&](const T* const* rows, int n, int64_t h) {
    for (int t = 0; t < n; ++t) {
      const char* kr = reinterpret_cast<const char*>(rows[t] + h * hstride);
      const char* vr = reinterpret_cast<const char*>(vc + (rows[t] - kc) + h * hstride);
      for (int64_t o = 0; o < kHeadBytes; o += 64) {  // one per cache line
        _mm_prefetch(kr + o, _MM_HINT_T0);
        _mm_prefetch(vr + o, _MM_HINT_T0);
      }
    }
  };
  {  // the item's first tokens, before the first tile needs them
    const T* first[kPrefetchAhead];
    const int n = rows_from(p0 + kPrefetchAhead, first);
    for (int64_t h = 0; h < nkv; ++h) prefetch_head(first, n, h);
  }
  for (int64_t p = p0; p < p1; p += kTile) {
    const int nvalid = static_cast<int>(std::min<int64_t>(kTile, p1 - p));
    const __mmask16 valid = static_cast<__mmask16>((1u << nvalid) - 1u);
    for (int t = 0; t < nvalid; ++t) {
      krow[t] = kc + batchserve::kv_row(table[blk], off, 0, nkv, bs) * HD;
      vrow[t] = vc + (krow[t] - kc);
      if (++off == bs) off = 0, ++blk;
    }
    for (int t = nvalid; t < kTile; ++t) krow[t] = krow[0], vrow[t] = vrow[0];  // scored, then masked
    const int nnext = rows_from(p + kPrefetchAhead + kTile, next);
    for (int64_t h = 0; h < nkv; ++h) {
      prefetch_head(next, nnext, h);  // kv head h of the tile kPrefetchAhead tokens on
      for (int64_t j = 0; j < g; j += 4) {
        const int64_t qh = h * g + j;
        const float* q = qs + qh * HD;
        float* m = st.m.data() + qh;
        float* l = st.l.data() + qh * kTile;
        float* acc = st.acc.data() + qh * HD;
        const int64_t hoff = h * hstride;
        switch (std::min<int64_t>(4, g - j)) {
          case 1: tile_heads<T, NV, 1>(q, krow, vrow, hoff, valid, nvalid, m, l, acc); break;
          case 2: tile_heads<T, NV, 2>(q, krow, vrow, hoff, valid, nvalid, m, l, acc); break;
          case 3: tile_heads<T, NV, 3>(q, krow, vrow, hoff, valid, nvalid, m, l, acc); break;
          default: tile_heads<T, NV, 4>(q, krow, vrow, hoff, valid, nvalid, m, l, acc); break;
        }
      }
    }
  }
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, State&);

template <typename T>
AttendFn<T> attend_for(int64_t hd) {
  switch (hd / 16) {
    case 1: return attend<T, 1>;
    case 2: return attend<T, 2>;
    case 3: return attend<T, 3>;
    case 4: return attend<T, 4>;
    case 5: return attend<T, 5>;
    case 6: return attend<T, 6>;
    case 7: return attend<T, 7>;
    case 8: return attend<T, 8>;
    default: return nullptr;
  }
}

// One piece of work: positions [p0, p1) of sequence b. part >= 0 indexes the partial-result
// slot of a sequence split into several chunks; -1 means the item is the whole sequence.
struct Item {
  int64_t b, p0, p1, part;
};

// The decode driver: cuts the batch into items (below), runs them on the threads, merges the
// parts of split sequences. Each worker builds its own Ctx from `args`; ctx.run(b, p0, p1, st)
// attends positions [p0, p1) of sequence b into st (acc in the lane order `lane` gives).
template <typename Ctx, typename Args>
void decode_items(const Args& args, const int64_t* lens, float* op, int64_t B, int64_t nh, int64_t hd,
                  const std::vector<int64_t>& lane) {
  // Chunk length: whole sequences when there are enough of them to keep every thread busy,
  // else long contexts are cut so each thread gets a few pieces (a multiple of the tile, and
  // not so short that the merge and thread wake-up cost more than they save).
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b];
  constexpr int64_t kMinChunk = 64;
  int64_t chunk = (total + 4 * nt - 1) / (4 * nt);
  chunk = std::max(kMinChunk, (chunk + kTile - 1) / kTile * kTile);
  std::vector<Item> items;
  std::vector<int64_t> first_part(B, -1), nparts(B, 1);
  int64_t nparts_total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b];
    if (n <= chunk) {
      items.push_back({b, 0, n, -1});
      continue;
    }
    first_part[b] = nparts_total;
    nparts[b] = (n + chunk - 1) / chunk;
    for (int64_t c = 0; c < nparts[b]; ++c)
      items.push_back({b, c * chunk, std::min(n, (c + 1) * chunk), nparts_total + c});
    nparts_total += nparts[b];
  }
  // Partial results of split sequences: per part and head, max, sum and unnormalised output.
  std::vector<float> pm(nparts_total * nh), pl(nparts_total * nh), pacc(nparts_total * nh * hd);

  // Items are handed out one at a time (dynamic), so sequences of different lengths balance.
  std::atomic<int64_t> next{0};
  const int64_t nitems = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    State st;
    Ctx ctx(args);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < nitems;) {
      const Item it = items[i];
      st.reset(nh, hd);
      ctx.run(it.b, it.p0, it.p1, st);
      for (int64_t qh = 0; qh < nh; ++qh) {
        const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(st.l.data() + qh * kTile));
        const float* a = st.acc.data() + qh * hd;
        if (it.part < 0) {  // whole sequence: normalise straight into the output (0 for no context)
          const float inv = l > 0.f ? 1.f / l : 0.f;
          float* o = op + (it.b * nh + qh) * hd;
          for (int64_t d = 0; d < hd; ++d) o[d] = a[lane[d]] * inv;
        } else {
          pm[it.part * nh + qh] = st.m[qh];
          pl[it.part * nh + qh] = l;
          float* pa = pacc.data() + (it.part * nh + qh) * hd;  // back in element order for the merge
          for (int64_t d = 0; d < hd; ++d) pa[d] = a[lane[d]];
        }
      }
    }
  };
  const int64_t nworkers = std::min(nt, nitems);
  if (nworkers > 1)
    at::parallel_for(0, nworkers, 1, worker);
  else
    worker(0, 1);

  // Merge the parts of split sequences: rescale each to the common max, then normalise.
  for (int64_t b = 0; b < B; ++b) {
    if (first_part[b] < 0) continue;
    for (int64_t qh = 0; qh < nh; ++qh) {
      float m = -INFINITY;
      for (int64_t c = 0; c < nparts[b]; ++c) m = std::max(m, pm[(first_part[b] + c) * nh + qh]);
      float* o = op + (b * nh + qh) * hd;
      std::fill(o, o + hd, 0.f);
      float l = 0.f;
      for (int64_t c = 0; c < nparts[b]; ++c) {
        const int64_t k = (first_part[b] + c) * nh + qh;
        const float w = exp_nonpos(pm[k] - m);
        l += w * pl[k];
        axpy(o, w, pacc.data() + k * hd, hd);
      }
      const float inv = 1.f / l;
      for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
    }
  }
}

// The float / bfloat16 / float16 caches: q scaled and stored in the lane order of the cache loads.
template <typename T>
struct DecodeArgs {
  AttendFn<T> attend_fn;
  const float* qp;
  const T *kp, *vp;
  const int64_t* bt;
  int64_t nh, hd, nkv, maxb, block_size;
  float sc;
  const std::vector<int64_t>* lane;
};

template <typename T>
struct DecodeCtx {
  const DecodeArgs<T>& a;
  std::vector<float> qs;
  explicit DecodeCtx(const DecodeArgs<T>& args) : a(args), qs(args.nh * args.hd) {}
  void run(int64_t b, int64_t p0, int64_t p1, State& st) {
    const float* qb = a.qp + b * a.nh * a.hd;
    const std::vector<int64_t>& lane = *a.lane;
    for (int64_t qh = 0; qh < a.nh; ++qh)
      for (int64_t d = 0; d < a.hd; ++d) qs[qh * a.hd + lane[d]] = qb[qh * a.hd + d] * a.sc;
    a.attend_fn(qs.data(), a.kp, a.vp, a.bt + b * a.maxb, a.block_size, a.nkv, a.nh / a.nkv, p0, p1, st);
  }
};

template <typename T>
void decode_avx512(AttendFn<T> attend_fn, const float* qp, const T* kp, const T* vp, const int64_t* bt,
                   const int64_t* lens, float* op, int64_t B, int64_t nh, int64_t hd, int64_t nkv, int64_t maxb,
                   int64_t block_size, float sc) {
  std::vector<int64_t> lane(hd);
  for (int64_t d = 0; d < hd; ++d) lane[d] = lane_of<T>(d, hd);
  const DecodeArgs<T> args{attend_fn, qp, kp, vp, bt, nh, hd, nkv, maxb, block_size, sc, &lane};
  decode_items<DecodeCtx<T>>(args, lens, op, B, nh, hd, lane);
}

#if defined(__AVX512VNNI__)
// ---- int8 cache (layout in cpu_math.h) --------------------------------------------------------
// Scores: each query head's scaled q is quantized to int8 twice over, q ~ s * (hi + lo / 254)
// (hi = round(q / s), lo = the rounding left, x 254), so the scores keep ~15 bits of q and only
// K's own rounding is lost. vpdpbusd multiplies 4 bytes of 16 tokens' K (stored + 128, unsigned)
// by 4 broadcast bytes of hi (then lo) and adds into the 16 tokens' lanes: a tile's 16 scores of
// a head come out of hd / 4 x 2 instructions, with no widening and no horizontal sums. Each K
// group's sums lose the + 128 (128 x the group's sum of q) and take the 16 tokens' scales of that
// group. V rows are widened to fp32 (exactly) and accumulated as in the 16-bit kernel, each
// token's weight times its V scale.
constexpr float kLoScale = 254.f;

struct QI8 {
  std::vector<int32_t> hi, lo;  // [nh][hd / 4], 4 int8 packed per word
  std::vector<float> scale, corr;  // per head: s; per head and K group: 128 * (sum(hi) + sum(lo) / 254)
  // One sequence's heads, 16 elements (one K group) per vector: a scalar loop here cost ~5 us a
  // sequence, as much as attending 64 tokens.
  void set(const float* qb, int64_t nh, int64_t hd, float sc) {
    static_assert(batchserve::kI8KGroup == 16, "a K group is one vector");
    const int64_t nv = hd / 16;
    hi.resize(nh * hd / 4);
    lo.resize(nh * hd / 4);
    scale.resize(nh);
    corr.resize(nh * nv);
    const __m512 lim = _mm512_set1_ps(127.f), abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t h = 0; h < nh; ++h) {
      const float* x = qb + h * hd;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t v = 0; v < nv; ++v) amax = _mm512_max_ps(amax, _mm512_and_ps(_mm512_loadu_ps(x + 16 * v), abs_mask));
      const float m = _mm512_reduce_max_ps(amax) * sc;
      const float s = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
      const __m512 f = _mm512_set1_ps(sc * inv);
      int8_t* ph = reinterpret_cast<int8_t*>(hi.data() + h * hd / 4);
      int8_t* pl = reinterpret_cast<int8_t*>(lo.data() + h * hd / 4);
      for (int64_t v = 0; v < nv; ++v) {
        const __m512 y = _mm512_min_ps(lim, _mm512_max_ps(-lim, _mm512_mul_ps(_mm512_loadu_ps(x + 16 * v), f)));
        const __m512i qh = _mm512_cvtps_epi32(y);  // to nearest, ties to even
        const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(qh)),
                                                            _mm512_set1_ps(kLoScale)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ph + 16 * v), _mm512_cvtepi32_epi8(qh));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pl + 16 * v), _mm512_cvtepi32_epi8(ql));
        corr[h * nv + v] = 128.f * (static_cast<float>(_mm512_reduce_add_epi32(qh)) +
                                    static_cast<float>(_mm512_reduce_add_epi32(ql)) / kLoScale);
      }
      scale[h] = s;
    }
  }
};

// One 16-token tile of one kv head for G query heads sharing it (their quantized q at qhi/qlo,
// qscale per head and corr per head and K group, running max m, sums l and acc as in tile_heads).
// kt, vt: the tile's K and V values; ks: its K scales, a vector of 16 tokens per group; vs: its
// 16 V scales. Lanes past `valid` hold whatever the block held: masked out of the scores and
// weighted 0.
template <int NV, int G>
inline void tile_i8(const int32_t* qhi, const int32_t* qlo, const float* qscale, const float* corr,
                    const uint8_t* kt, const float* ks, const int8_t* vt, const float* vs, __mmask16 valid,
                    float* m, float* l, float* acc) {
  constexpr int HD = NV * 16, C = HD / 4, NG = HD / batchserve::kI8KGroup, CG = batchserve::kI8KGroup / 4;
  __m512 x[G];  // the 16 tokens' scores of each head, summed group by group
  for (int j = 0; j < G; ++j) x[j] = _mm512_setzero_ps();
  for (int g = 0; g < NG; ++g) {
    __m512i ah[G], al[G];
    for (int j = 0; j < G; ++j) ah[j] = al[j] = _mm512_setzero_si512();
    for (int c = g * CG; c < (g + 1) * CG; ++c) {
      const __m512i kv = _mm512_loadu_si512(kt + 64 * c);
      for (int j = 0; j < G; ++j) {
        ah[j] = _mm512_dpbusd_epi32(ah[j], kv, _mm512_set1_epi32(qhi[j * C + c]));
        al[j] = _mm512_dpbusd_epi32(al[j], kv, _mm512_set1_epi32(qlo[j * C + c]));
      }
    }
    const __m512 kscale = _mm512_loadu_ps(ks + g * kTile);
    for (int j = 0; j < G; ++j) {
      const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[j]), _mm512_set1_ps(1.f / kLoScale),
                                       _mm512_cvtepi32_ps(ah[j]));
      x[j] = _mm512_fmadd_ps(_mm512_sub_ps(y, _mm512_set1_ps(corr[j * NG + g])), kscale, x[j]);
    }
  }
  // Softmax weights, times the V scales, as two bytes each against the tile's largest (w ~ wmax /
  // 255 * (hi + lo / 255), ~16 bits), so P x V is integer dot products too: vpdpbusd multiplies 4
  // tokens' weight bytes (broadcast) by their 4 values of 16 elements and adds into those lanes.
  const __m512 vscale = _mm512_loadu_ps(vs);
  alignas(16) uint32_t whi[G][4], wlo[G][4];
  float wstep[G], alpha[G];
  for (int j = 0; j < G; ++j) {
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                        _mm512_mul_ps(x[j], _mm512_set1_ps(qscale[j])));  // lanes past the end: garbage
    const float tmax = _mm512_reduce_max_ps(s);
    __m512 lsum = _mm512_loadu_ps(l + j * kTile);
    alpha[j] = 1.f;
    if (tmax > m[j]) {  // a new running max rescales what was summed so far
      alpha[j] = exp_nonpos(m[j] - tmax);
      lsum = _mm512_mul_ps(lsum, _mm512_set1_ps(alpha[j]));
      m[j] = tmax;
    }
    const __m512 pr = _mm512_maskz_mov_ps(valid, exp_nonpos16(_mm512_sub_ps(s, _mm512_set1_ps(m[j]))));
    _mm512_storeu_ps(l + j * kTile, _mm512_add_ps(lsum, pr));
    const __m512 w = _mm512_maskz_mul_ps(valid, pr, vscale);
    const float wmax = _mm512_reduce_max_ps(w);
    wstep[j] = wmax / 255.f;
    const __m512 y = _mm512_mul_ps(w, _mm512_set1_ps(wmax > 0.f ? 255.f / wmax : 0.f));  // [0, 255]
    const __m512i h = _mm512_min_epi32(_mm512_cvttps_epi32(y), _mm512_set1_epi32(255));
    const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(h)), _mm512_set1_ps(255.f)));
    _mm_store_si128(reinterpret_cast<__m128i*>(whi[j]), _mm512_cvtepi32_epi8(h));
    _mm_store_si128(reinterpret_cast<__m128i*>(wlo[j]), _mm512_cvtepi32_epi8(_mm512_min_epi32(lo, _mm512_set1_epi32(255))));
  }
  for (int dv = 0; dv < NV; ++dv) {
    __m512i ah[G], al[G];
    for (int j = 0; j < G; ++j) ah[j] = al[j] = _mm512_setzero_si512();
    for (int grp = 0; grp < 4; ++grp) {
      const __m512i vv = _mm512_loadu_si512(vt + (grp * HD + 16 * dv) * 4);
      for (int j = 0; j < G; ++j) {
        ah[j] = _mm512_dpbusd_epi32(ah[j], _mm512_set1_epi32(static_cast<int>(whi[j][grp])), vv);
        al[j] = _mm512_dpbusd_epi32(al[j], _mm512_set1_epi32(static_cast<int>(wlo[j][grp])), vv);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m512 pv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[j]), _mm512_set1_ps(1.f / 255.f), _mm512_cvtepi32_ps(ah[j]));
      float* o = acc + j * HD + 16 * dv;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(pv, _mm512_set1_ps(wstep[j]),
                                          _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha[j]))));
    }
  }
}

struct DecodeI8Args {
  const float* qp;
  const uint8_t *kp, *vp;
  const int64_t* bt;
  int64_t nh, hd, nkv, maxb, bs;
  float sc;
};

// Positions [p0, p1) (p0 a multiple of 16, so each tile lies in one block) of one sequence.
template <int NV>
void attend_i8(const QI8& q, const DecodeI8Args& a, const int64_t* table, int64_t p0, int64_t p1, State& st) {
  constexpr int HD = NV * 16, C = HD / 4, NG = HD / batchserve::kI8KGroup;
  const int64_t bs = a.bs, nkv = a.nkv, g = a.nh / a.nkv;
  const int64_t kreg = bs * batchserve::i8_k_row(HD), vreg = bs * batchserve::i8_v_row(HD);  // bytes per region
  auto prefetch_tile = [&](int64_t p, int64_t h) {  // tile at position p, kv head h: values and scales
    const int64_t blk = table[p / bs], off = p % bs;
    const char* k = reinterpret_cast<const char*>(a.kp + (blk * nkv + h) * kreg);
    const char* v = reinterpret_cast<const char*>(a.vp + (blk * nkv + h) * vreg);
    for (int64_t o = 0; o < kTile * HD; o += 64) {
      _mm_prefetch(k + off * HD + o, _MM_HINT_T0);
      _mm_prefetch(v + off * HD + o, _MM_HINT_T0);
    }
    for (int64_t o = 0; o < kTile * NG * 4; o += 64) _mm_prefetch(k + bs * HD + off * NG * 4 + o, _MM_HINT_T0);
    _mm_prefetch(v + bs * HD + off * 4, _MM_HINT_T0);
  };
  for (int64_t p = p0; p < p1; p += kTile) {
    const int nvalid = static_cast<int>(std::min<int64_t>(kTile, p1 - p));
    const __mmask16 valid = static_cast<__mmask16>((1u << nvalid) - 1u);
    const int64_t blk = table[p / bs], off = p % bs;
    for (int64_t h = 0; h < nkv; ++h) {
      if (p + kTile < p1) prefetch_tile(p + kTile, h);
      const uint8_t* kr = a.kp + (blk * nkv + h) * kreg;
      const uint8_t* vr = a.vp + (blk * nkv + h) * vreg;
      const uint8_t* kt = kr + off * HD;
      const float* ks = batchserve::i8_scales(kr, bs, HD) + batchserve::i8_k_scale_index(off, 0, HD);
      const int8_t* vt = reinterpret_cast<const int8_t*>(vr + off * HD);
      const float* vs = batchserve::i8_scales(vr, bs, HD) + off;
      for (int64_t j = 0; j < g; j += 4) {
        const int64_t qh = h * g + j;
        const int32_t* qhi = q.hi.data() + qh * C;
        const int32_t* qlo = q.lo.data() + qh * C;
        float* m = st.m.data() + qh;
        float* l = st.l.data() + qh * kTile;
        float* acc = st.acc.data() + qh * HD;
        const float* qs = q.scale.data() + qh;
        const float* qc = q.corr.data() + qh * NG;
        switch (std::min<int64_t>(4, g - j)) {
          case 1: tile_i8<NV, 1>(qhi, qlo, qs, qc, kt, ks, vt, vs, valid, m, l, acc); break;
          case 2: tile_i8<NV, 2>(qhi, qlo, qs, qc, kt, ks, vt, vs, valid, m, l, acc); break;
          case 3: tile_i8<NV, 3>(qhi, qlo, qs, qc, kt, ks, vt, vs, valid, m, l, acc); break;
          default: tile_i8<NV, 4>(qhi, qlo, qs, qc, kt, ks, vt, vs, valid, m, l, acc); break;
        }
      }
    }
  }
}

using AttendI8Fn = void (*)(const QI8&, const DecodeI8Args&, const int64_t*, int64_t, int64_t, State&);

AttendI8Fn attend_i8_for(int64_t hd) {
  switch (hd / 16) {
    case 1: return attend_i8<1>;
    case 2: return attend_i8<2>;
    case 3: return attend_i8<3>;
    case 4: return attend_i8<4>;
    case 5: return attend_i8<5>;
    case 6: return attend_i8<6>;
    case 7: return attend_i8<7>;
    case 8: return attend_i8<8>;
    default: return nullptr;
  }
}

struct DecodeI8Ctx {
  const DecodeI8Args& a;
  AttendI8Fn fn;
  QI8 q;
  int64_t last_b = -1;
  explicit DecodeI8Ctx(const DecodeI8Args& args) : a(args), fn(attend_i8_for(args.hd)) {}
  void run(int64_t b, int64_t p0, int64_t p1, State& st) {
    if (b != last_b) q.set(a.qp + b * a.nh * a.hd, a.nh, a.hd, a.sc), last_b = b;  // parts of one sequence share it
    fn(q, a, a.bt + b * a.maxb, p0, p1, st);
  }
};
#endif  // __AVX512VNNI__


// ---- prefill: many queries per sequence ----------------------------------------------------
// A work item is up to 16 consecutive queries (one per vector lane) of one prompt chunk and one
// kv head, with the G query heads sharing it. Keys are visited 16 at a time, only the tiles some
// query may see under the causal mask, each K/V row read once from the paged cache for all G x
// 16 rows. Scores come out transposed, s[j] = 16 queries' scores for key j (q stored transposed,
// K rows broadcast), so the online softmax is all vertical: the row max is 15 vmaxps, no
// horizontal reductions. P x V then runs with the head dimension in the lanes, 4 (HD 64) or 2
// (HD 128) query rows at a time, each V vector loaded once for them.
constexpr int64_t kQTile = 16;

struct PrefillBufs {
  std::vector<float> qt, o, m, l, p, alpha, kf, vf;
  std::vector<__m512> s;  // one tile's scores, [G][16 keys] vectors of 16 queries
  void init(int64_t G, int64_t hd) {
    s.resize(G * kTile);
    qt.resize(G * hd * kQTile);
    o.resize(G * kQTile * hd);
    m.resize(G * kQTile);
    l.resize(G * kQTile);
    p.resize(kTile * G * kQTile);
    alpha.resize(G * kQTile);
    kf.resize(kTile * hd);
    vf.resize(kTile * hd);
  }
};

inline void row_to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void row_to_float(const bf16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
}
inline void row_to_float(const fp16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
}

// s[g * 16 + j] = the 16 queries' scores (lanes) for key j, query head g of the item. Three
// heads at a time and 8 keys at a time, so each broadcast K element feeds three FMAs (one per
// head) and each q vector eight: with one head and 16 keys per pass, every FMA needed a
// broadcast load of its own.
template <int HD>
inline void qk_scores(const float* qt, const float* kf, int64_t G, __m512* s) {
  int64_t g0 = 0;
  for (; g0 + 3 <= G; g0 += 3)
    for (int j0 = 0; j0 < kTile; j0 += 8) {
      __m512 a[3][8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) a[0][j] = a[1][j] = a[2][j] = _mm512_setzero_ps();
      const float* q0 = qt + g0 * HD * kQTile;
      for (int d = 0; d < HD; ++d) {
        const __m512 qa = _mm512_loadu_ps(q0 + d * kQTile), qb = _mm512_loadu_ps(q0 + (HD + d) * kQTile),
                     qc = _mm512_loadu_ps(q0 + (2 * HD + d) * kQTile);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512 k = _mm512_set1_ps(kf[(j0 + j) * HD + d]);
          a[0][j] = _mm512_fmadd_ps(qa, k, a[0][j]);
          a[1][j] = _mm512_fmadd_ps(qb, k, a[1][j]);
          a[2][j] = _mm512_fmadd_ps(qc, k, a[2][j]);
        }
      }
      for (int e = 0; e < 3; ++e)
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) s[(g0 + e) * kTile + j0 + j] = a[e][j];
    }
  for (; g0 < G; ++g0) {  // heads left over (G not a multiple of 3): one at a time, 16 keys
    __m512 a[kTile];
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j) a[j] = _mm512_setzero_ps();
    const float* qg = qt + g0 * HD * kQTile;
    for (int d = 0; d < HD; ++d) {
      const __m512 qv = _mm512_loadu_ps(qg + d * kQTile);
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[j * HD + d]), a[j]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < kTile; ++j) s[g0 * kTile + j] = a[j];
  }
}

template <typename T, int HD>
void prefill_item(const float* q, int64_t q_tok_stride, const T* kc, const T* vc, int64_t nkv,
                  const int64_t* table, int64_t block_size, int64_t kvh, int64_t G, int64_t row0, int64_t nq,
                  int64_t pos0, float scale, float* out, int64_t out_tok_stride, PrefillBufs& b) {
  constexpr int NV = HD / 16;
  constexpr int RG = NV <= 4 ? 4 : 2;  // query rows per P x V block
  const int64_t R = G * kQTile;        // row r = g * 16 + query; queries past nq are zeros, never written
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < kQTile; ++i) {
      const float* src = q + (row0 + i) * q_tok_stride + (kvh * G + g) * HD;
      for (int d = 0; d < HD; ++d) b.qt[(g * HD + d) * kQTile + i] = i < nq ? src[d] * scale : 0.f;
    }
  std::fill(b.o.begin(), b.o.begin() + R * HD, 0.f);
  std::fill(b.m.begin(), b.m.begin() + R, -INFINITY);
  std::fill(b.l.begin(), b.l.begin() + R, 0.f);
  const int64_t last = pos0 + nq - 1;  // the last query's position: keys 0 .. last are needed
  for (int64_t base = 0; base <= last; base += kTile) {
    const int64_t nk = std::min<int64_t>(kTile, last + 1 - base);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = base + j;
      const int64_t at = batchserve::kv_row(table[pos / block_size], pos % block_size, kvh, nkv, block_size) * HD;
      row_to_float(kc + at, b.kf.data() + j * HD, HD);
      row_to_float(vc + at, b.vf.data() + j * HD, HD);
    }
    // Key j is visible to query i when base + j <= pos0 + i: lanes i >= base + j - pos0.
    __mmask16 vis[kTile];
    for (int64_t j = 0; j < kTile; ++j) {
      const int64_t first = base + j - pos0;
      vis[j] = j >= nk ? 0 : first <= 0 ? 0xFFFF : first >= kQTile ? 0 : static_cast<__mmask16>(0xFFFFu << first);
    }
    qk_scores<HD>(b.qt.data(), b.kf.data(), G, b.s.data());
    for (int64_t g = 0; g < G; ++g) {
      const __m512* s = b.s.data() + g * kTile;
      __m512 mx = _mm512_loadu_ps(b.m.data() + g * kQTile);
      const __m512 mold = mx;
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) mx = _mm512_mask_max_ps(mx, vis[j], mx, s[j]);
      // Every query sees key 0, so after the first tile no lane's max is -inf.
      const __m512 alpha = exp_nonpos16(_mm512_sub_ps(mold, mx));
      __m512 lsum = _mm512_mul_ps(_mm512_loadu_ps(b.l.data() + g * kQTile), alpha);
      float* pg = b.p.data() + g * kQTile;
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) {
        const __m512 p = _mm512_maskz_mov_ps(vis[j], exp_nonpos16(_mm512_sub_ps(s[j], mx)));
        lsum = _mm512_add_ps(lsum, p);
        _mm512_storeu_ps(pg + j * R, p);  // p[j][row]
      }
      _mm512_storeu_ps(b.m.data() + g * kQTile, mx);
      _mm512_storeu_ps(b.l.data() + g * kQTile, lsum);
      _mm512_storeu_ps(b.alpha.data() + g * kQTile, alpha);
    }
    // O = alpha * O + P V for the rows of real queries, RG at a time.
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i0 = 0; i0 < nq; i0 += RG) {
        const int rc = static_cast<int>(std::min<int64_t>(RG, nq - i0));
        const int64_t r0 = g * kQTile + i0;
        __m512 o[RG][NV];
        for (int r = 0; r < RG; ++r) {
          const __m512 a = _mm512_set1_ps(r < rc ? b.alpha[r0 + r] : 0.f);
          for (int c = 0; c < NV; ++c)
            o[r][c] = r < rc ? _mm512_mul_ps(a, _mm512_loadu_ps(b.o.data() + (r0 + r) * HD + 16 * c)) : _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < nk; ++j) {
          __m512 v[NV];
          for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(b.vf.data() + j * HD + 16 * c);
          const float* pj = b.p.data() + j * R + r0;
#pragma GCC unroll 4
          for (int r = 0; r < RG; ++r) {
            const __m512 pv = _mm512_set1_ps(pj[r]);  // rows past rc hold p of padding lanes: unused
            for (int c = 0; c < NV; ++c) o[r][c] = _mm512_fmadd_ps(pv, v[c], o[r][c]);
          }
        }
        for (int r = 0; r < rc; ++r)
          for (int c = 0; c < NV; ++c) _mm512_storeu_ps(b.o.data() + (r0 + r) * HD + 16 * c, o[r][c]);
      }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = g * kQTile + i;
      const float inv = 1.f / b.l[r];  // every query sees at least key 0
      float* dst = out + (row0 + i) * out_tok_stride + (kvh * G + g) * HD;
      for (int d = 0; d < HD; ++d) dst[d] = b.o[r * HD + d] * inv;
    }
}

template <typename T, int HD>
void prefill_avx512(const float* q, int64_t q_tok_stride, const T* kc, const T* vc, int64_t nh, int64_t nkv,
                    const int64_t* tables, int64_t maxb, const int64_t* spans, int64_t S, int64_t block_size,
                    float scale, float* out, int64_t out_tok_stride) {
  const int64_t G = nh / nkv;
  prefill_items<PrefillBufs>(spans, S, nkv, kQTile, [&](PrefillBufs& b) { b.init(G, HD); },
                             [&](PrefillBufs& b, int64_t span, int64_t kvh, int64_t row0, int64_t nq, int64_t pos0) {
                               prefill_item<T, HD>(q, q_tok_stride, kc, vc, nkv, tables + span * maxb, block_size,
                                                   kvh, G, row0, nq, pos0, scale, out, out_tok_stride, b);
                             });
}

#endif  // __AVX512F__

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// ---- prefill on AVX2: the AVX-512 kernel's scheme on 8 lanes --------------------------------
// A work item is up to 8 consecutive queries (one per lane) of one prompt chunk and one kv head,
// with its G query heads; keys 8 at a time, each K/V row read once for all G x 8 rows; scores
// transposed (s[j] = the 8 queries' scores for key j), so the online softmax is vertical. Each
// query's arithmetic is its own lane's, in key order: its result does not depend on which
// queries share its item or its chunk, so a prompt gives the same output however it is cut.
constexpr int64_t kQTile8 = 8;  // queries per item
constexpr int kKTile8 = 8;      // keys per tile
using batchserve::exp_nonpos8;

inline void row_to_float8(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
template <typename T>
inline void row_to_float8(const T* src, float* dst, int64_t n) { row_f32(src, dst, n); }  // 16-bit: widened into dst

struct PrefillBufs8 {
  std::vector<float> qt, o, m, l, p, alpha, kf, vf;
  std::vector<__m256> s;  // one tile's scores, [G][8 keys] vectors of 8 queries
  void init(int64_t G, int64_t hd) {
    s.resize(G * kKTile8);
    qt.resize(G * hd * kQTile8);
    o.resize(G * kQTile8 * hd);
    m.resize(G * kQTile8);
    l.resize(G * kQTile8);
    p.resize(kKTile8 * G * kQTile8);
    alpha.resize(G * kQTile8);
    kf.resize(kKTile8 * hd);
    vf.resize(kKTile8 * hd);
  }
};

template <typename T, int HD>
void prefill_item8(const float* q, int64_t q_tok_stride, const T* kc, const T* vc, int64_t nkv,
                   const int64_t* table, int64_t block_size, int64_t kvh, int64_t G, int64_t row0, int64_t nq,
                   int64_t pos0, float scale, float* out, int64_t out_tok_stride, PrefillBufs8& b) {
  constexpr int NV = HD / 8;  // 8-float vectors per head row
  constexpr int CV = 4;       // of them accumulated at once in P x V
  constexpr int RG = 2;       // query rows per P x V block
  const int64_t R = G * kQTile8;  // row r = g * 8 + query; queries past nq are zeros, never written
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < kQTile8; ++i) {
      const float* src = q + (row0 + i) * q_tok_stride + (kvh * G + g) * HD;
      for (int d = 0; d < HD; ++d) b.qt[(g * HD + d) * kQTile8 + i] = i < nq ? src[d] * scale : 0.f;
    }
  std::fill(b.o.begin(), b.o.begin() + R * HD, 0.f);
  std::fill(b.m.begin(), b.m.begin() + R, -INFINITY);
  std::fill(b.l.begin(), b.l.begin() + R, 0.f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t last = pos0 + nq - 1;  // the last query's position: keys 0 .. last are needed
  for (int64_t base = 0; base <= last; base += kKTile8) {
    const int64_t nk = std::min<int64_t>(kKTile8, last + 1 - base);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = base + j;
      const int64_t at = batchserve::kv_row(table[pos / block_size], pos % block_size, kvh, nkv, block_size) * HD;
      row_to_float8(kc + at, b.kf.data() + j * HD, HD);
      row_to_float8(vc + at, b.vf.data() + j * HD, HD);
    }
    for (int64_t j = nk; j < kKTile8; ++j) {  // keys past the last: zeros, masked out below
      std::fill(b.kf.begin() + j * HD, b.kf.begin() + (j + 1) * HD, 0.f);
      std::fill(b.vf.begin() + j * HD, b.vf.begin() + (j + 1) * HD, 0.f);
    }
    // Key j is visible to query i when base + j <= pos0 + i: lanes i >= base + j - pos0.
    __m256 vis[kKTile8];
    for (int j = 0; j < kKTile8; ++j) {
      const int64_t first = j >= nk ? kQTile8 : std::max<int64_t>(0, std::min<int64_t>(kQTile8, base + j - pos0));
      vis[j] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(first) - 1)));
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 s[kKTile8];
#pragma GCC unroll 8
      for (int j = 0; j < kKTile8; ++j) s[j] = _mm256_setzero_ps();
      const float* qg = b.qt.data() + g * HD * kQTile8;
      for (int d = 0; d < HD; ++d) {
        const __m256 qv = _mm256_loadu_ps(qg + d * kQTile8);
#pragma GCC unroll 8
        for (int j = 0; j < kKTile8; ++j) s[j] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(b.kf.data() + j * HD + d), s[j]);
      }
      __m256 mx = _mm256_loadu_ps(b.m.data() + g * kQTile8);
      const __m256 mold = mx;
#pragma GCC unroll 8
      for (int j = 0; j < kKTile8; ++j) mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, s[j]), vis[j]);
      // Every query sees key 0, so after the first tile no lane's max is -inf.
      const __m256 alpha = exp_nonpos8(_mm256_sub_ps(mold, mx));
      __m256 lsum = _mm256_mul_ps(_mm256_loadu_ps(b.l.data() + g * kQTile8), alpha);
      float* pg = b.p.data() + g * kQTile8;
#pragma GCC unroll 8
      for (int j = 0; j < kKTile8; ++j) {
        const __m256 p = _mm256_and_ps(vis[j], exp_nonpos8(_mm256_sub_ps(s[j], mx)));
        lsum = _mm256_add_ps(lsum, p);
        _mm256_storeu_ps(pg + j * R, p);  // p[j][row]
      }
      _mm256_storeu_ps(b.m.data() + g * kQTile8, mx);
      _mm256_storeu_ps(b.l.data() + g * kQTile8, lsum);
      _mm256_storeu_ps(b.alpha.data() + g * kQTile8, alpha);
    }
    // O = alpha * O + P V for the rows of real queries, RG rows and CV vectors at a time.
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i0 = 0; i0 < nq; i0 += RG) {
        const int rc = static_cast<int>(std::min<int64_t>(RG, nq - i0));
        const int64_t r0 = g * kQTile8 + i0;
        for (int c0 = 0; c0 < NV; c0 += CV) {
          __m256 o[RG][CV];
#pragma GCC unroll 2
          for (int r = 0; r < RG; ++r) {
            const __m256 a = _mm256_set1_ps(r < rc ? b.alpha[r0 + r] : 0.f);
#pragma GCC unroll 4
            for (int c = 0; c < CV; ++c)
              o[r][c] = r < rc ? _mm256_mul_ps(a, _mm256_loadu_ps(b.o.data() + (r0 + r) * HD + 8 * (c0 + c)))
                               : _mm256_setzero_ps();
          }
          for (int64_t j = 0; j < nk; ++j) {
            __m256 v[CV];
#pragma GCC unroll 4
            for (int c = 0; c < CV; ++c) v[c] = _mm256_loadu_ps(b.vf.data() + j * HD + 8 * (c0 + c));
            const float* pj = b.p.data() + j * R + r0;
#pragma GCC unroll 2
            for (int r = 0; r < RG; ++r) {
              const __m256 pv = _mm256_set1_ps(pj[r]);  // a row past rc holds a padding lane's p: unused
#pragma GCC unroll 4
              for (int c = 0; c < CV; ++c) o[r][c] = _mm256_fmadd_ps(pv, v[c], o[r][c]);
            }
          }
          for (int r = 0; r < rc; ++r)
            for (int c = 0; c < CV; ++c) _mm256_storeu_ps(b.o.data() + (r0 + r) * HD + 8 * (c0 + c), o[r][c]);
        }
      }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = g * kQTile8 + i;
      const float inv = 1.f / b.l[r];  // every query sees at least key 0
      float* dst = out + (row0 + i) * out_tok_stride + (kvh * G + g) * HD;
      for (int d = 0; d < HD; ++d) dst[d] = b.o[r * HD + d] * inv;
    }
}

template <typename T, int HD>
void prefill_avx2(const float* q, int64_t q_tok_stride, const T* kc, const T* vc, int64_t nh, int64_t nkv,
                  const int64_t* tables, int64_t maxb, const int64_t* spans, int64_t S, int64_t block_size,
                  float scale, float* out, int64_t out_tok_stride) {
  const int64_t G = nh / nkv;
  prefill_items<PrefillBufs8>(spans, S, nkv, kQTile8, [&](PrefillBufs8& b) { b.init(G, HD); },
                              [&](PrefillBufs8& b, int64_t span, int64_t kvh, int64_t row0, int64_t nq, int64_t pos0) {
                                prefill_item8<T, HD>(q, q_tok_stride, kc, vc, nkv, tables + span * maxb, block_size,
                                                     kvh, G, row0, nq, pos0, scale, out, out_tok_stride, b);
                              });
}
#endif  // AVX2 without AVX-512

// Blocks of an int8 cache as float32 [n, nkv, bs, hd] (K and V).
void i8_dequantize(const uint8_t* kc, const uint8_t* vc, const int64_t* blocks, int64_t n, int64_t nkv, int64_t bs,
                   int64_t hd, float* ko, float* vo) {
  at::parallel_for(0, n * nkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* k = kc + batchserve::i8_region(blocks[i / nkv], i % nkv, nkv, bs, batchserve::i8_k_row(hd));
      const uint8_t* v = vc + batchserve::i8_region(blocks[i / nkv], i % nkv, nkv, bs, batchserve::i8_v_row(hd));
      for (int64_t off = 0; off < bs; ++off) {
        batchserve::i8_load_k(k, off, bs, hd, ko + (i * bs + off) * hd);
        batchserve::i8_load_v(v, off, bs, hd, vo + (i * bs + off) * hd);
      }
    }
  });
}

// The blocks that `tables` ([S, maxb]) reference within each row's first used[s] positions,
// dequantized into float32 caches, and the tables renumbered to them: the float32 kernels then
// run unchanged (prompt chunks, and decode where the int8 kernel does not build).
struct Dequantized {
  torch::Tensor k, v, tables;
};

Dequantized dequantize_tables(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& tables,
                              const std::vector<int64_t>& used, int64_t hd) {
  const int64_t S = tables.size(0), maxb = tables.size(1), nkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t nblocks = k_cache.size(0);
  const int64_t* tb = tables.data_ptr<int64_t>();
  auto remapped = torch::zeros_like(tables);
  int64_t* rt = remapped.data_ptr<int64_t>();
  std::unordered_map<int64_t, int64_t> index;
  std::vector<int64_t> blocks;
  for (int64_t r = 0; r < S; ++r)
    for (int64_t j = 0; j < std::min(maxb, (used[r] + bs - 1) / bs); ++j) {
      const int64_t b = tb[r * maxb + j];
      TORCH_CHECK(b >= 0 && b < nblocks, "int8 KV cache: block ", b, " out of range");
      auto [it, fresh] = index.emplace(b, static_cast<int64_t>(blocks.size()));
      if (fresh) blocks.push_back(b);
      rt[r * maxb + j] = it->second;
    }
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(blocks.size()));
  if (blocks.empty()) blocks.push_back(0);
  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  auto k = torch::empty({n, nkv, bs, hd}, opts), v = torch::empty({n, nkv, bs, hd}, opts);
  i8_dequantize(k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), blocks.data(), n, nkv, bs, hd,
                k.data_ptr<float>(), v.data_ptr<float>());
  return {k, v, remapped};
}

void check_i8_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t hd, const char* fn) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(3) == batchserve::i8_k_row(hd) &&
                  v_cache.size(3) == batchserve::i8_v_row(hd) && v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == torch::kUInt8,
              fn, ": an int8 cache must be contiguous uint8, K [blocks, n_kv, block_size, head_dim + head_dim / 4] "
              "and V [blocks, n_kv, block_size, head_dim + 4]; got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(2) % batchserve::kI8Tile == 0 && hd % batchserve::kI8KGroup == 0, fn,
              ": an int8 cache needs block_size and head_dim multiples of 16");
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size, double scale);

// paged_decode on an int8 cache: the VNNI kernel where it built (AVX512-VNNI, head_dim a
// multiple of 16 up to 128), else the referenced blocks dequantized for the float32 kernel.
torch::Tensor paged_decode_i8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor ctx_lens, int64_t block_size, double scale) {
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  check_i8_cache(k_cache, v_cache, hd, "paged_decode");
  TORCH_CHECK(k_cache.size(2) == block_size, "paged_decode: block_size ", block_size, " does not match the cache's ",
              k_cache.size(2));
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "paged_decode: query heads not a multiple of kv heads");
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
#if defined(__AVX512VNNI__)
  if (i8_fast_path && hd % 16 == 0 && attend_i8_for(hd) != nullptr) {
    auto out = torch::empty_like(q);
    const DecodeI8Args args{q.data_ptr<float>(), k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(),
                            block_tables.data_ptr<int64_t>(), nh, hd, nkv, block_tables.size(1), block_size,
                            static_cast<float>(scale)};
    std::vector<int64_t> lane(hd);
    for (int64_t d = 0; d < hd; ++d) lane[d] = d;
    decode_items<DecodeI8Ctx>(args, lens, out.data_ptr<float>(), B, nh, hd, lane);
    return out;
  }
#endif
  const Dequantized dq = dequantize_tables(k_cache, v_cache, block_tables, std::vector<int64_t>(lens, lens + B), hd);
  return paged_decode(q, dq.k, dq.v, dq.tables, ctx_lens, block_size, scale);
}

// q: [B, n_h, hd]; k_cache, v_cache: [blocks, n_kv, block_size, hd] (slot s = block * block_size +
// offset; kv head h's rows of a block together); block_tables: [B, max_blocks] int64;
// ctx_lens: [B] int64 (tokens to attend, including the current one). Returns [B, n_h, hd].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode: q must be float32, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: k_cache and v_cache must have the same dtype, got ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  if (k_cache.scalar_type() == torch::kUInt8) return paged_decode_i8(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale);
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16 ||
                  k_cache.scalar_type() == torch::kHalf,
              "paged_decode: KV cache must be float32, bfloat16 or float16, got ", k_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: cache not contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == block_size && k_cache.size(3) == hd &&
                  v_cache.sizes() == k_cache.sizes(),
              "paged_decode: caches must be [blocks, n_kv, block_size, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "paged_decode: query heads not a multiple of kv heads");
  const int64_t maxb = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  auto run = [&](const auto* kp, const auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
#if defined(__AVX512F__)
    if (hd % 16 == 0) {
      if (AttendFn<T> fn = attend_for<T>(hd)) {
        decode_avx512<T>(fn, qp, kp, vp, bt, lens, op, B, nh, hd, nkv, maxb, block_size, sc);
        return;
      }
    }
#endif
    decode_portable<T>(qp, kp, vp, bt, lens, op, B, nh, hd, nkv, maxb, block_size, sc);
  };
  if (k_cache.scalar_type() == torch::kFloat32)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == torch::kHalf)  // at::Half and at::BFloat16 hold exactly their 16 bits
    run(reinterpret_cast<const fp16_t*>(k_cache.data_ptr<at::Half>()),
        reinterpret_cast<const fp16_t*>(v_cache.data_ptr<at::Half>()));
  else
    run(reinterpret_cast<const bf16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const bf16_t*>(v_cache.data_ptr<at::BFloat16>()));
  return out;
}

// Whether paged_prefill runs for this head size here (AVX-512, or AVX2 with FMA; head_dim 64 or
// 128); when not, the caller uses its PyTorch path.
bool prefill_supported(int64_t hd) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return hd == 64 || hd == 128;
#else
  (void)hd;
  return false;
#endif
}

// Causal attention for prompt chunks, straight from the paged cache (their own K/V already
// written there). q: [T, n_h, hd] float32 (token rows may be strided, heads contiguous);
// block_tables: [S, max_blocks] int64; spans: [S, 3] int64 rows of (first flat row, tokens,
// position of the first token); out: [T, n_h, hd] float32, the spans' rows written.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor spans, int64_t block_size, double scale, torch::Tensor out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  TORCH_CHECK(prefill_supported(hd), "paged_prefill: head_dim ", hd, " is not supported here");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_prefill: q and out must be float32");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == hd && out.stride(2) == 1 && out.stride(1) == hd,
              "paged_prefill: q and out need contiguous heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill: k_cache and v_cache must be contiguous and of one dtype");
  block_tables = block_tables.contiguous();
  spans = spans.contiguous();
  if (k_cache.scalar_type() == torch::kUInt8) {  // int8: the chunks' blocks dequantized, then the float32 kernel
    check_i8_cache(k_cache, v_cache, hd, "paged_prefill");
    TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.size(0) == block_tables.size(0),
                "paged_prefill: spans must be [S, 3], one row per block table");
    std::vector<int64_t> used(spans.size(0));
    const int64_t* sp = spans.data_ptr<int64_t>();
    for (int64_t r = 0; r < spans.size(0); ++r) used[r] = sp[r * 3 + 2] + sp[r * 3 + 1];
    const Dequantized dq = dequantize_tables(k_cache, v_cache, block_tables, used, hd);
    paged_prefill(q, dq.k, dq.v, dq.tables, spans, block_size, scale, out);
    return;
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == block_size && k_cache.size(3) == hd &&
                  v_cache.sizes() == k_cache.sizes(),
              "paged_prefill: caches must be [blocks, n_kv, block_size, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "paged_prefill: query heads not a multiple of kv heads");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.size(0) == block_tables.size(0),
              "paged_prefill: spans must be [S, 3], one row per block table");
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const float sc = static_cast<float>(scale);
  auto run = [&](const auto* kp, const auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
#if defined(__AVX512F__)
    auto fn = hd == 64 ? prefill_avx512<T, 64> : prefill_avx512<T, 128>;
#else
    auto fn = hd == 64 ? prefill_avx2<T, 64> : prefill_avx2<T, 128>;
#endif
    fn(q.data_ptr<float>(), q.stride(0), kp, vp, nh, nkv, block_tables.data_ptr<int64_t>(), block_tables.size(1),
       spans.data_ptr<int64_t>(), spans.size(0), block_size, sc, out.data_ptr<float>(), out.stride(0));
  };
  if (k_cache.scalar_type() == torch::kFloat32)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == torch::kBFloat16)
    run(reinterpret_cast<const bf16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const bf16_t*>(v_cache.data_ptr<at::BFloat16>()));
  else if (k_cache.scalar_type() == torch::kHalf)
    run(reinterpret_cast<const fp16_t*>(k_cache.data_ptr<at::Half>()),
        reinterpret_cast<const fp16_t*>(v_cache.data_ptr<at::Half>()));
  else
    TORCH_CHECK(false, "paged_prefill: KV cache must be float32, bfloat16 or float16, got ", k_cache.scalar_type());
#endif
}

// k, v: [T, n_kv, hd] float32 rows, written into an int8 cache (layout in cpu_math.h) at slots [T]
// (block * block_size + offset).
void kv_int8_store(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kUInt8, "kv_int8_store: not an int8 (uint8) cache");
  k = k.contiguous().to(torch::kFloat32);
  v = v.contiguous().to(torch::kFloat32);
  slots = slots.contiguous();
  const int64_t T = k.size(0), nkv = k_cache.size(1), bs = k_cache.size(2), hd = v_cache.size(3) - 4;
  check_i8_cache(k_cache, v_cache, hd, "kv_int8_store");
  TORCH_CHECK(k.dim() == 3 && k.size(1) == nkv && k.size(2) == hd && v.sizes() == k.sizes(),
              "kv_int8_store: k and v must be [T, n_kv, head_dim] matching the cache, got ", k.sizes());
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T, "kv_int8_store: slots must be int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_cache.size(0) * bs, "kv_int8_store: slot out of range");
  uint8_t* kc = k_cache.data_ptr<uint8_t>();
  uint8_t* vc = v_cache.data_ptr<uint8_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t blk = sp[t] / bs, off = sp[t] % bs;
        batchserve::i8_store_k(kc + batchserve::i8_region(blk, h, nkv, bs, batchserve::i8_k_row(hd)), off, bs, hd,
                               kp + (t * nkv + h) * hd);
        batchserve::i8_store_v(vc + batchserve::i8_region(blk, h, nkv, bs, batchserve::i8_v_row(hd)), off, bs, hd,
                               vp + (t * nkv + h) * hd);
      }
  });
}

std::vector<torch::Tensor> kv_int8_load(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kUInt8, "kv_int8_load: not an int8 (uint8) cache");
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2), hd = v_cache.size(3) - 4;
  check_i8_cache(k_cache, v_cache, hd, "kv_int8_load");
  blocks = blocks.contiguous();
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64 && blocks.dim() == 1, "kv_int8_load: blocks must be int64 [n]");
  const int64_t n = blocks.numel();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(bp[i] >= 0 && bp[i] < k_cache.size(0), "kv_int8_load: block out of range");
  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  auto ko = torch::empty({n, nkv, bs, hd}, opts), vo = torch::empty({n, nkv, bs, hd}, opts);
  i8_dequantize(k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), bp, n, nkv, bs, hd, ko.data_ptr<float>(),
                vo.data_ptr<float>());
  return {ko, vo};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL (ATen needs none), like torch's own ops: the server's
  // event loop thread keeps answering while the engine thread is inside them.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache (fp32 math; fp32, bf16 or fp16 cache)", nogil);
  m.def("prefill_supported", &prefill_supported, "whether paged_prefill runs for this head_dim here");
  m.def("paged_prefill", &paged_prefill, "causal attention of prompt chunks over the paged KV cache, into out", nogil);
  m.def("kv_int8_store", &kv_int8_store, "write K/V rows [T, n_kv, hd] (float32) into an int8 cache at slots", nogil);
  m.def("kv_int8_load", &kv_int8_load, "the blocks of an int8 cache as float32 (K, V), each [n, n_kv, block_size, hd]",
        nogil);
  m.def("set_int8_fast_path", [](bool on) { i8_fast_path = on; },
        "use the int8 cache's VNNI decode kernel where it built (else dequantize for the float32 kernel)");
  m.def("int8_fast_path", []() {
#if defined(__AVX512VNNI__)
    return i8_fast_path;
#else
    return false;
#endif
  }, "whether paged_decode runs the int8 cache's VNNI kernel here");
}
