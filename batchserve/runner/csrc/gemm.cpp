// y = x W^T for the decoder's float32 matrix products, on weights packed once into panels.
//
// W [N, K] is stored as ceil(N/32) panels of [K][32]: for each k, the 32 output columns of the
// panel are contiguous, so a panel is one sequential 128-byte-per-k stream. A tile holds MR rows
// of x against one panel in registers (AVX-512: MR x 2 vectors, MR <= 14), walks k once
// broadcasting x[r][k] and multiplying it into the panel's 32 columns, then stores 32 finished
// outputs per row. Threads split the panels; within a panel the row blocks follow one another,
// so the first reads the panel from memory (prefetched ahead) and the others find it in L2.
// Each weight is read from memory once per step whatever the batch: at decode sizes (M of 1 to
// 64) this is 1.25-1.4x faster here than oneDNN on its own packed layout, 1.1x at 128 rows and
// on par at 512 (BENCHMARKS.md). A bf16 variant (AVX512-BF16) serves --matmul-dtype bfloat16.
//
// Prompt rows on CPUs with AMX have a path of their own (gemm_amx, below): bf16 tiles.
//
// Three code paths share the layout: AVX-512F, AVX2+FMA, and portable C++. The vector paths are
// compiled with function target attributes, so the module holds all three whatever -march says,
// and the one the CPU supports is picked at run time (a test can force the others).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr int NB = 32;       // panel width: output columns per panel
constexpr int64_t PF = 64;   // prefetch the panel this many k ahead (8 KiB)
constexpr int64_t MCHUNK = 512;  // rows of x per pass over the panels (keeps x in L2 for prefill)
constexpr int64_t MCHUNK_BF16 = 128;  // rows per pass for bf16: x stays in L2 (the rows are re-read for every panel)
constexpr int64_t KSLICE_BF16 = 128;  // k pairs per slice of a bf16 panel: 16 KiB, stays in L1 across row blocks

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// Lane masks of a panel's two 16-column halves when only `ncols` of its 32 columns exist.
__attribute__((target("avx512f"))) inline void tail_masks(int ncols, __mmask16& m0, __mmask16& m1) {
  m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  m1 = ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
}

// Stores MR rows of a tile's two 16-column sums, only the first `ncols` columns.
template <int MR>
__attribute__((target("avx512f"))) inline void store_rows(float* c, int64_t ldc, int ncols, const __m512* c0,
                                                          const __m512* c1) {
  __mmask16 m0, m1;
  tail_masks(ncols, m0, m1);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, c0[r]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, c1[r]);
  }
}

// ---- AVX-512 -------------------------------------------------------------------------------
constexpr int MR512 = 14;  // 28 accumulators + 2 weight vectors + 1 broadcast = 31 of 32 registers

template <int MR>
__attribute__((target("avx512f"))) void tile512(const float* __restrict a, int64_t lda,
                                                 const float* __restrict w, int64_t K, float* __restrict c,
                                                 int64_t ldc, int ncols) {
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    c0[r] = _mm512_setzero_ps();
    c1[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * NB;
    _mm_prefetch(reinterpret_cast<const char*>(wk + PF * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + PF * NB + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + k]);
      c0[r] = _mm512_fmadd_ps(av, w0, c0[r]);
      c1[r] = _mm512_fmadd_ps(av, w1, c1[r]);
    }
  }
  if (ncols == NB) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(c + r * ldc, c0[r]);
      _mm512_storeu_ps(c + r * ldc + 16, c1[r]);
    }
  } else {  // the last panel of an N that is not a multiple of 32
    __mmask16 m0, m1;
    tail_masks(ncols, m0, m1);
    for (int r = 0; r < MR; ++r) {
      _mm512_mask_storeu_ps(c + r * ldc, m0, c0[r]);
      _mm512_mask_storeu_ps(c + r * ldc + 16, m1, c1[r]);
    }
  }
}

// ---- AVX-512 BF16: bf16 weights and activations, fp32 accumulation --------------------------
// Panels hold k in pairs: [ceil(K/2)][32 columns][2], so one vdpbf16ps multiplies a broadcast
// pair (x[r][2kk], x[r][2kk+1]) into 16 columns' pairs and adds both products to fp32 lanes:
// twice the multiply-adds of an fp32 FMA per instruction, half the weight bytes.
template <int MR>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16(const uint16_t* __restrict a, int64_t lda,
                                                              const uint16_t* __restrict w, int64_t K2,
                                                              float* __restrict c, int64_t ldc, int ncols,
                                                              bool accumulate) {
  __m512 c0[MR], c1[MR];
  __mmask16 m0, m1;
  tail_masks(ncols, m0, m1);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    c0[r] = accumulate ? _mm512_maskz_loadu_ps(m0, c + r * ldc) : _mm512_setzero_ps();
    c1[r] = accumulate ? _mm512_maskz_loadu_ps(m1, c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* wk = w + kk * 2 * NB;
    _mm_prefetch(reinterpret_cast<const char*>(wk + PF * 2 * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + PF * 2 * NB + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * kk, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      c0[r] = _mm512_dpbf16_ps(c0[r], av, w0);
      c1[r] = _mm512_dpbf16_ps(c1[r], av, w1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, c0[r]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, c1[r]);
  }
}

// fn##_table[mr] is fn<mr>, for the row-block sizes 1..14 a call may need.
#define BATCHSERVE_TILES(Type, fn)                                                                    \
  static const Type fn##_table[] = {nullptr, fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>, fn<7>, fn<8>, \
                                    fn<9>, fn<10>, fn<11>, fn<12>, fn<13>, fn<14>}

using TileBf16Fn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int, bool);
BATCHSERVE_TILES(TileBf16Fn, tile_bf16);

// ---- AVX2 + FMA ----------------------------------------------------------------------------
constexpr int MR256 = 3;  // 12 accumulators + 3 broadcasts + 1 weight vector = 16 registers

template <int MR>
__attribute__((target("avx2,fma"))) void tile256(const float* __restrict a, int64_t lda,
                                                  const float* __restrict w, int64_t K, float* __restrict c,
                                                  int64_t ldc, int ncols) {
  __m256 acc[MR][4];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * NB;
    _mm_prefetch(reinterpret_cast<const char*>(wk + PF * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + PF * NB + 16), _MM_HINT_T0);
    __m256 av[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) av[r] = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_loadu_ps(wk + 8 * j);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(av[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (ncols == NB) {
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(c + r * ldc + 8 * j, acc[r][j]);
    } else {
      alignas(32) float tmp[NB];
      for (int j = 0; j < 4; ++j) _mm256_store_ps(tmp + 8 * j, acc[r][j]);
      std::copy(tmp, tmp + ncols, c + r * ldc);
    }
  }
}

// ---- portable ------------------------------------------------------------------------------
constexpr int MRP = 4;

template <int MR>
void tile_portable(const float* __restrict a, int64_t lda, const float* __restrict w, int64_t K,
                   float* __restrict c, int64_t ldc, int ncols) {
  float acc[MR][NB] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * NB;
    for (int r = 0; r < MR; ++r) {
      const float av = a[r * lda + k];
      for (int j = 0; j < NB; ++j) acc[r][j] += av * wk[j];
    }
  }
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + ncols, c + r * ldc);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int);

static_assert(MR512 <= 14 && MR256 <= 14 && MRP <= 14, "the tile tables stop at 14 rows");
BATCHSERVE_TILES(TileFn, tile512);
BATCHSERVE_TILES(TileFn, tile256);
BATCHSERVE_TILES(TileFn, tile_portable);

Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kPortable;
}

// n output columns fill `wp`'s panels, the last one at least in part.
void check_n(const torch::Tensor& wp, int64_t n, const char* what) {
  TORCH_CHECK(n > (wp.size(0) - 1) * NB && n <= wp.size(0) * NB, what, ": n=", n, " does not match ", wp.size(0),
              " panels of ", NB);
}

void check_packed(const torch::Tensor& wp, int64_t n) {
  TORCH_CHECK(wp.device().is_cpu() && wp.scalar_type() == torch::kFloat32 && wp.dim() == 3 && wp.size(2) == NB &&
                  wp.is_contiguous(),
              "gemm: packed weight must be a contiguous float32 CPU tensor [panels, K, 32]");
  check_n(wp, n, "gemm");
}

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

// Runs fn(p) for each panel p, the threads splitting the panels, and x's rows in passes of MCHUNK.
template <typename Fn>
void for_panels(int64_t M, int64_t NP, int64_t mchunk, Fn fn) {
  for (int64_t m_lo = 0; m_lo < M; m_lo += mchunk) {
    const int64_t rows = std::min(mchunk, M - m_lo);
    at::parallel_for(0, NP, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) fn(p, m_lo, rows);
    });
  }
}

// Calls fn(m0, mr) for row blocks of at most mr_max covering rows [m_lo, m_lo + rows), as even
// as possible (32 rows at 14: 10 + 11 + 11).
template <typename Fn>
void for_row_blocks(int64_t m_lo, int64_t rows, int64_t mr_max, Fn fn) {
  const int64_t nblocks = (rows + mr_max - 1) / mr_max;
  int64_t m0 = m_lo;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t mr = (m_lo + rows - m0) / (nblocks - b);
    fn(m0, mr);
    m0 += mr;
  }
}


// ---- GGUF block-quantized weights, multiplied without a float32 copy --------------------------
// The file's blocks are regrouped into the panel layout: for each panel and each block of 32 k,
// first the 32 columns' scales as float32 (Q4_1: then their minimums; Q8_16: then the scales of
// k 16-31), then per k the 32 columns' quants. Q4_1 (also holding Q4_0 and Q4_K): 16 bytes per k,
// byte j = column j (low nibble) | column j+16 (high nibble). Q8_0 and Q8_16 (Q6_K): 32 int8 per
// k. A weight is d*q + m (Q4_1) or d*q (Q8); with fp16-derived d and small q the value each FMA
// sees is bit for bit the float32 that gguf's dequantize gives (see pack_q), so the products
// equal the float32 panel GEMM's exactly.
enum QFmt : int64_t { kQ4_1 = 0, kQ8_0 = 1, kQ8_16 = 2 };  // kQ8_16: int8 quants, a scale per 16 k (Q6_K)
constexpr int QB = 32;  // k per block
constexpr int64_t Q4_BYTES = 2 * NB * 4 + QB * 16;  // 768 per panel block
constexpr int64_t Q8_BYTES = NB * 4 + QB * NB;      // 1152
constexpr int64_t Q8_16_BYTES = 2 * NB * 4 + QB * NB;  // 1280: scales for k 0-15, then for k 16-31
constexpr int MRQ = 12;   // rows per fused tile: 24 sums + scales, minimums, weights, broadcast
constexpr int64_t FUSED_ROWS = 36;  // up to this many rows fused tiles (measured faster to 32), then the scratch
constexpr int64_t PFQ = 4;  // prefetch this many panel blocks ahead

constexpr int64_t q_block_bytes(int64_t f) { return f == kQ4_1 ? Q4_BYTES : f == kQ8_0 ? Q8_BYTES : Q8_16_BYTES; }
// Where a panel block's quants start: after one (Q8_0) or two (Q4_1: scales, minimums; Q8_16:
// two halves' scales) vectors of 32 floats.
constexpr int64_t q_offset(int64_t f) { return (f == kQ8_0 ? 1 : 2) * NB * 4; }

// One panel block's expansion: its scales (and minimums) in registers, then, k by k, the 32
// weights of that k as two vectors. Used by the fused tile and by the AVX-512 scratch.
template <int F>
struct QBlock512 {
  const float* sc;
  const uint8_t* q;
  __m512 d0, d1, m0, m1;

  __attribute__((target("avx512f"))) explicit QBlock512(const uint8_t* blk)
      : sc(reinterpret_cast<const float*>(blk)), q(blk + q_offset(F)),
        d0(_mm512_loadu_ps(sc)), d1(_mm512_loadu_ps(sc + 16)),
        m0(F == kQ4_1 ? _mm512_loadu_ps(sc + 32) : _mm512_setzero_ps()),
        m1(F == kQ4_1 ? _mm512_loadu_ps(sc + 48) : _mm512_setzero_ps()) {}

  __attribute__((target("avx512f"))) inline void weights(int k, __m512& w0, __m512& w1) {
    if (F == kQ8_16 && k == QB / 2) {  // the second half of the block has its own scales
      d0 = _mm512_loadu_ps(sc + 32);
      d1 = _mm512_loadu_ps(sc + 48);
    }
    if (F == kQ4_1) {
      const __m512i qi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16)));
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(qi, _mm512_set1_epi32(0xF))), d0, m0);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(qi, 4)), d1, m1);
    } else {
      const __m128i* qk = reinterpret_cast<const __m128i*>(q + k * NB);
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk))), d0);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk + 1))), d1);
    }
  }
};

// The fused tile: each k's 32 weights are expanded from the quants in registers, then multiplied
// into MR rows, so the weights cross the memory bus at 0.75 (Q4_1) or 1.125 (Q8_0) bytes each.
template <int MR, int F>
__attribute__((target("avx512f"))) void tile_q512(const float* __restrict a, int64_t lda,
                                                   const uint8_t* __restrict wq, int64_t KB,
                                                   float* __restrict c, int64_t ldc, int ncols) {
  constexpr int64_t BYTES = q_block_bytes(F);
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    c0[r] = _mm512_setzero_ps();
    c1[r] = _mm512_setzero_ps();
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = wq + kb * BYTES;
    QBlock512<F> qb(blk);
    const char* ahead = reinterpret_cast<const char*>(blk + PFQ * BYTES);
    const float* ak = a + kb * QB;
#pragma GCC unroll 2
    for (int k = 0; k < QB; ++k) {
      if (k * 64 < BYTES / 2) {  // the block PFQ ahead, two lines per k until it is covered
        _mm_prefetch(ahead + k * 128, _MM_HINT_T0);
        _mm_prefetch(ahead + k * 128 + 64, _MM_HINT_T0);
      }
      __m512 w0, w1;
      qb.weights(k, w0, w1);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512 av = _mm512_set1_ps(ak[r * lda + k]);
        c0[r] = _mm512_fmadd_ps(av, w0, c0[r]);
        c1[r] = _mm512_fmadd_ps(av, w1, c1[r]);
      }
    }
  }
  store_rows<MR>(c, ldc, ncols, c0, c1);
}

template <int MR> void tile_q4_512(const float* a, int64_t lda, const uint8_t* w, int64_t KB, float* c, int64_t ldc,
                                   int nc) { tile_q512<MR, kQ4_1>(a, lda, w, KB, c, ldc, nc); }
template <int MR> void tile_q8_512(const float* a, int64_t lda, const uint8_t* w, int64_t KB, float* c, int64_t ldc,
                                   int nc) { tile_q512<MR, kQ8_0>(a, lda, w, KB, c, ldc, nc); }
template <int MR> void tile_q8s_512(const float* a, int64_t lda, const uint8_t* w, int64_t KB, float* c, int64_t ldc,
                                    int nc) { tile_q512<MR, kQ8_16>(a, lda, w, KB, c, ldc, nc); }
using TileQFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int);
static_assert(MRQ <= 14, "the tile tables stop at 14 rows");
BATCHSERVE_TILES(TileQFn, tile_q4_512);
BATCHSERVE_TILES(TileQFn, tile_q8_512);
BATCHSERVE_TILES(TileQFn, tile_q8s_512);

// One panel's weights as float32 [K][32] (for more rows than one fused tile, and for the AVX2
// and portable paths, which then run their float32 tiles on it from cache).
void dequant_panel(QFmt f, const uint8_t* wq, int64_t KB, float* out) {
  const int64_t bytes = q_block_bytes(f);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = wq + kb * bytes;
    float d[NB], m[NB] = {}, d2[NB];
    std::memcpy(d, blk, sizeof(d));
    if (f == kQ4_1) std::memcpy(m, blk + sizeof(d), sizeof(m));
    std::memcpy(d2, f == kQ8_16 ? blk + sizeof(d) : blk, sizeof(d2));  // scales of k 16-31
    const uint8_t* q = blk + q_offset(f);
    float* o = out + kb * QB * NB;
    for (int k = 0; k < QB; ++k)
      for (int j = 0; j < NB; ++j) {
        if (f == kQ4_1) {
          const int v = j < 16 ? q[k * 16 + j] & 0xF : q[k * 16 + j - 16] >> 4;
          o[k * NB + j] = std::fma(static_cast<float>(v), d[j], m[j]);
        } else {
          o[k * NB + j] = static_cast<float>(static_cast<int8_t>(q[k * NB + j])) * (k < QB / 2 ? d[j] : d2[j]);
        }
      }
  }
}

// The same expansion with AVX-512, the quants turned into 32 float32 per k as in tile_q512.
template <int F>
__attribute__((target("avx512f"))) void dequant_panel512(const uint8_t* __restrict wq, int64_t KB,
                                                          float* __restrict out) {
  constexpr int64_t BYTES = q_block_bytes(F);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = wq + kb * BYTES;
    QBlock512<F> qb(blk);
    const char* ahead = reinterpret_cast<const char*>(blk + PFQ * BYTES);
    for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    float* o = out + kb * QB * NB;
#pragma GCC unroll 4
    for (int k = 0; k < QB; ++k) {
      __m512 w0, w1;
      qb.weights(k, w0, w1);
      _mm512_storeu_ps(o + k * NB, w0);
      _mm512_storeu_ps(o + k * NB + 16, w1);
    }
  }
}

inline float half_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

void check_q(const torch::Tensor& wq, int64_t n, QFmt f, const char* what) {
  TORCH_CHECK(f >= kQ4_1 && f <= kQ8_16, what, ": format must be 0 (Q4_1), 1 (Q8_0) or 2 (Q8 with a scale per 16 k), got ",
              static_cast<int64_t>(f));
  TORCH_CHECK(wq.device().is_cpu() && wq.scalar_type() == torch::kUInt8 && wq.dim() == 3 &&
                  wq.size(2) == q_block_bytes(f) && wq.is_contiguous(),
              what, ": packed weight must be a contiguous uint8 CPU tensor [panels, K/32, ", q_block_bytes(f), "]");
  check_n(wq, n, what);
}


// The GGUF block types pack_q reads. Q6_K becomes int8 panels with a scale per 16 k (its (d*sc)
// is exact in fp32, and the one rounding of (d*sc)*q is gguf's). Q4_0 and Q4_K become Q4_1 panels: a Q4_0 weight
// d*(q-8) is d*q + (-8d), and a Q4_K weight (d*sc)*q - dmin*m has a per-32 scale d*sc and
// minimum -(dmin*m); with fp16 d, dmin and 6-bit sc, m all of these products are exact in fp32,
// so the panels hold the same floats as gguf's dequantization and the FMA rounds as its
// subtraction does.
enum SrcFmt : int64_t { kSrcQ4_1 = 0, kSrcQ8_0 = 1, kSrcQ4_0 = 2, kSrcQ4_K = 3, kSrcQ6_K = 4 };

// Bytes per block of the source type, and how many k one block covers.
inline void src_layout(SrcFmt s, int64_t& bytes, int64_t& k) {
  switch (s) {
    case kSrcQ4_1: bytes = 20, k = 32; return;
    case kSrcQ8_0: bytes = 34, k = 32; return;
    case kSrcQ4_0: bytes = 18, k = 32; return;
    case kSrcQ4_K: bytes = 144, k = 256; return;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales, 128 of quants
    default: bytes = 210, k = 256; return;  // Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, fp16 d
  }
}

// Scale, minimum and the 32 quants of 32-k block kb of one row in the source format; d2 is the
// scale of the block's second 16 k (Q6_K has one per 16; the others repeat d).
void read_block(SrcFmt s, const uint8_t* row, int64_t kb, float& d, float& d2, float& m, int q[QB]) {
  int64_t bytes, k;
  src_layout(s, bytes, k);
  if (s == kSrcQ6_K) {  // w = (d * scale[e / 16]) * (q - 32), q of 6 bits: 4 from ql, 2 from qh
    const uint8_t* sb = row + (kb / 8) * bytes;
    const uint8_t *ql = sb, *qh = sb + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(sb + 192);
    const float dd = half_bits_to_float(sb + 208);
    const int64_t e0 = (kb % 8) * QB;  // first element of this block in the super-block
    d = dd * static_cast<float>(scales[e0 / 16]);
    d2 = dd * static_cast<float>(scales[e0 / 16 + 1]);
    m = 0.f;
    for (int i = 0; i < QB; ++i) {
      const int64_t e = e0 + i, h = e / 128;
      const int lo = (ql[h * 64 + e % 64] >> (4 * ((e / 64) % 2))) & 0xF;
      const int hi = (qh[h * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 0x3;
      q[i] = (lo | (hi << 4)) - 32;
    }
    return;
  }
  if (s == kSrcQ4_K) {
    const uint8_t* sb = row + (kb / 8) * bytes;
    const int j = static_cast<int>(kb % 8);  // sub-block
    const uint8_t* sc = sb + 4;
    int scale, mn;
    if (j < 4) {
      scale = sc[j] & 0x3F;
      mn = sc[4 + j] & 0x3F;
    } else {
      scale = (sc[8 + j - 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
      mn = (sc[8 + j - 4] >> 4) | ((sc[4 + j - 4] >> 2) & 0x30);
    }
    d = d2 = half_bits_to_float(sb) * static_cast<float>(scale);
    m = -(half_bits_to_float(sb + 2) * static_cast<float>(mn));
    const uint8_t* qs = sb + 16 + (j / 2) * 32;
    for (int e = 0; e < QB; ++e) q[e] = (j % 2 == 0) ? qs[e] & 0xF : qs[e] >> 4;
    return;
  }
  const uint8_t* b = row + kb * bytes;
  d = d2 = half_bits_to_float(b);
  if (s == kSrcQ8_0) {
    m = 0.f;
    for (int e = 0; e < QB; ++e) q[e] = static_cast<int8_t>(b[2 + e]);
    return;
  }
  const uint8_t* qs = b + (s == kSrcQ4_1 ? 4 : 2);
  m = s == kSrcQ4_1 ? half_bits_to_float(b + 2) : -8.f * d;
  for (int e = 0; e < QB; ++e) q[e] = e < 16 ? qs[e] & 0xF : qs[e - 16] >> 4;
}

// GGUF blocks (raw [N, row bytes] of source format sf, one row of W per row, as the file stores
// them) regrouped into panels of `bytes` per block of 32 k: put(blk, j, d, d2, m, q) is called for
// each panel block and each of its columns j with the column's scale (d2: of k 16-31), minimum and
// 32 quants as read_block gives them, and writes them into the zeroed block.
template <typename Put>
torch::Tensor regroup_blocks(torch::Tensor raw, SrcFmt sf, int64_t bytes, const char* what, Put put) {
  int64_t src_bytes, src_k;
  src_layout(sf, src_bytes, src_k);
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 &&
                  raw.size(1) % src_bytes == 0 && raw.size(1) > 0,
              what, ": raw blocks must be a uint8 CPU matrix [N, K/", src_k, " * ", src_bytes, "]");
  raw = raw.contiguous();
  const int64_t N = raw.size(0), KB = raw.size(1) / src_bytes * (src_k / QB), NP = (N + NB - 1) / NB;
  const int64_t row_bytes = raw.size(1);
  auto out = torch::zeros({NP, KB, bytes}, raw.options());
  const uint8_t* srcp = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, NP, 1, [&](int64_t lo, int64_t hi) {
    int q[QB];
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int j = 0; j < NB && p * NB + j < N; ++j) {
          float scale, scale2, mn;
          read_block(sf, srcp + (p * NB + j) * row_bytes, kb, scale, scale2, mn, q);
          put(dst + (p * KB + kb) * bytes, j, scale, scale2, mn, q);
        }
  });
  return out;
}

}  // namespace

// GGUF blocks -> panels. raw: uint8 [N, K / block_k * block_bytes], one row of W per row, as the
// file stores it; src: 0 Q4_1, 1 Q8_0, 2 Q4_0, 3 Q4_K, 4 Q6_K. Q8_0 gives Q8_0 panels (gemm_q
// fmt 1), Q6_K int8 panels with a scale per 16 k (fmt 2), the others Q4_1 panels (fmt 0).
torch::Tensor pack_q(torch::Tensor raw, int64_t src) {
  const SrcFmt sf = static_cast<SrcFmt>(src);
  TORCH_CHECK(src >= 0 && src <= 4, "pack_q: format must be 0 (Q4_1), 1 (Q8_0), 2 (Q4_0), 3 (Q4_K) or 4 (Q6_K), got ", src);
  const QFmt f = sf == kSrcQ8_0 ? kQ8_0 : sf == kSrcQ6_K ? kQ8_16 : kQ4_1;
  return regroup_blocks(raw, sf, q_block_bytes(f), "pack_q",
                        [f](uint8_t* blk, int j, float d, float d2, float m, const int* q) {
                          float* sc = reinterpret_cast<float*>(blk);
                          uint8_t* qd = blk + q_offset(f);
                          sc[j] = d;
                          if (f == kQ8_16) sc[NB + j] = d2;
                          if (f == kQ4_1) {
                            sc[NB + j] = m;
                            for (int e = 0; e < QB; ++e) qd[e * 16 + j % 16] |= static_cast<uint8_t>(q[e] << (j < 16 ? 0 : 4));
                          } else {
                            for (int e = 0; e < QB; ++e) qd[e * NB + j] = static_cast<uint8_t>(static_cast<int8_t>(q[e]));
                          }
                        });
}

// The dense float32 W [n, K] the panels hold (tests, and anything that wants the matrix back).
torch::Tensor unpack_q(torch::Tensor wq, int64_t n, int64_t fmt) {
  const QFmt f = static_cast<QFmt>(fmt);
  check_q(wq, n, f, "unpack_q");
  const int64_t NP = wq.size(0), KB = wq.size(1), K = KB * QB;
  auto out = torch::empty({n, K}, torch::kFloat32);
  std::vector<float> buf(K * NB);
  float* o = out.data_ptr<float>();
  for (int64_t p = 0; p < NP; ++p) {
    dequant_panel(f, wq.data_ptr<uint8_t>() + p * KB * wq.size(2), KB, buf.data());
    for (int64_t j = 0; j < NB && p * NB + j < n; ++j)
      for (int64_t k = 0; k < K; ++k) o[(p * NB + j) * K + k] = buf[k * NB + j];
  }
  return out;
}

// x [M, K] float32 (contiguous) times the block-quantized W^T -> float32 [M, n]. Up to MRQ rows
// the AVX-512 tile expands the quants in registers; with more rows each panel is expanded once
// into a float32 scratch that the float32 tiles then read from cache for every row block.
// `isa_override` as for gemm.
torch::Tensor gemm_q(torch::Tensor x, torch::Tensor wq, int64_t n, int64_t fmt, int64_t isa_override,
                     int64_t fused_rows) {
  const QFmt f = static_cast<QFmt>(fmt);
  check_q(wq, n, f, "gemm_q");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "gemm_q: x must be a contiguous float32 CPU matrix [M, K]");
  const int64_t M = x.size(0), K = x.size(1), NP = wq.size(0), KB = wq.size(1), bytes = wq.size(2);
  TORCH_CHECK(KB * QB == K, "gemm_q: x has K=", K, " but the packed weight has K=", KB * QB);
  static const Isa native = best_isa();
  const Isa use = isa_override < 0 ? native : static_cast<Isa>(isa_override);
  TORCH_CHECK(use >= kPortable && use <= native, "gemm_q: code path ", isa_override, " is not supported by this CPU");
  const TileFn* table = use == kAvx512 ? tile512_table : use == kAvx2 ? tile256_table : tile_portable_table;
  const int64_t mr_max = use == kAvx512 ? MR512 : use == kAvx2 ? MR256 : MRP;
  const TileQFn* qtable = f == kQ4_1 ? tile_q4_512_table : f == kQ8_0 ? tile_q8_512_table : tile_q8s_512_table;

  auto y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const float* a = x.data_ptr<float>();
  const uint8_t* w = wq.data_ptr<uint8_t>();
  float* c = y.data_ptr<float>();
  const int64_t max_fused = fused_rows < 0 ? FUSED_ROWS : fused_rows;
  for_panels(M, NP, MCHUNK, [&](int64_t p, int64_t m_lo, int64_t rows) {
    const int ncols = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    const uint8_t* wp = w + p * KB * bytes;
    if (use == kAvx512 && rows <= max_fused) {
      for_row_blocks(m_lo, rows, MRQ, [&](int64_t m0, int64_t mr) {
        qtable[mr](a + m0 * K, K, wp, KB, c + m0 * n + p * NB, n, ncols);
      });
      return;
    }
    thread_local std::vector<float> scratch;  // one panel as float32, kept by the thread between calls
    scratch.resize(K * NB);
    if (use == kAvx512)
      (f == kQ4_1 ? dequant_panel512<kQ4_1> : f == kQ8_0 ? dequant_panel512<kQ8_0> : dequant_panel512<kQ8_16>)(
          wp, KB, scratch.data());
    else
      dequant_panel(f, wp, KB, scratch.data());
    for_row_blocks(m_lo, rows, mr_max, [&](int64_t m0, int64_t mr) {
      table[mr](a + m0 * K, K, scratch.data(), K, c + m0 * n + p * NB, n, ncols);
    });
  });
  return y;
}

namespace {

// ---- integer dot products: the blocks' quants times activations quantized to int8 or int16 -----
// (--matmul-dtype int8 / int16.) Each row of x is quantized per block of 32 k to BITS-bit
// integers with a scale da = max|x| / (2^(BITS-1) - 1) (round half to even), and the block's
// quant sum s is kept as sa = da * s. A weight of the block is d*u + m with u an unsigned quant
// (Q4_1/Q4_0/Q4_K: 0..15; Q8_0: q+128 with m = -128 d), so a block contributes
//     sum_k x[k] w[k] ~ (d * da) * sum_k u[k] a[k]  +  m * sa,
// the integer sum exact in int32. AVX512-VNNI does it: int8 with vpdpbusd (64 byte products per
// instruction, four times an fp32 FMA's), int16 with vpdpwssd (32 word products, twice). AVX2
// (no VNNI: AMD Zen 2/3, Intel before Ice Lake) does it with vpmaddubsw / vpmaddwd (tile_int256),
// and portable C++ without either. All three give the same bits: the integer sums are exact and
// each block is folded into the float sums in the same order with the same roundings. Only x's
// rounding differs from the float32 path: int8 is llama.cpp's CPU scheme (its Q8_1
// activations); int16 rounds 256 times finer, close to float32's output.
//
// Panel block layout: float d[32], then (Q4) float m[32]; then the quants as the instruction
// reads them, per 16-column half (h):
//   int8:  per group of 4 k, 64 bytes = 16 columns x 4 k; Q4 keeps k-groups 2g and 2g+1 in the
//          low and high nibbles of one 64-byte vector (512 bytes in all), Q8 one byte each (1024).
//   int16: per pair of k, 16 columns x 2 k, widened to words on load; Q4 keeps k-pairs 2p and
//          2p+1 in the low and high nibbles of 32 bytes (512 in all), Q8 one byte each (1024).
enum IFmt : int64_t { kIQ4 = 0, kIQ8 = 1 };
constexpr int64_t IQ4_BYTES = 2 * NB * 4 + QB * NB / 2;  // 768 per panel block
constexpr int64_t IQ8_BYTES = NB * 4 + QB * NB;          // 1152
constexpr int MRI = 6;                                    // rows per tile (12 int32 + 12 fp32 sums)
// Up to MRI_SMALL rows per tile when x has at most mri_small_upto<BITS>() rows (decode batches):
// the tile's fp32 sums then no longer fit in registers and the compiler keeps some on the stack,
// but each panel block's quants are widened for more rows and x needs fewer tiles. The model's
// 121 products, 6 and 12 alternating call by call in one process: int16 8 rows 1.035x, 13 rows
// 1.06x, 20 and 32 rows 1.025x, 4 and 48 rows the same (512 rows 1.08x and 2,048 1.13x slower, in
// runs alternating by size); int8 8 rows 1.10x, 13 1.06x, 20 1.03x, 24 1.01x, 28 0.98x, 32 0.98x,
// 48 0.96x.
constexpr int MRI_SMALL = 12;
template <int BITS>
constexpr int64_t mri_small_upto() { return BITS == 8 ? 24 : 48; }

constexpr int64_t int_block_bytes(int64_t f) { return f == kIQ4 ? IQ4_BYTES : IQ8_BYTES; }
constexpr int64_t int_offset(int64_t f) { return (f == kIQ4 ? 2 : 1) * NB * 4; }

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// The AVX2 integer tiles also fold their sums with FMA (as AVX2 CPUs all have).
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// The fastest integer path this CPU has: kAvx512 (VNNI), kAvx2 or kPortable.
Isa best_int_isa() { return cpu_has_vnni() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kPortable; }

// Where quant (k e of the block, column j) lives in a panel block's quant bytes, and its shift.
inline void int_pos(IFmt f, int bits, int e, int j, int64_t& byte, int& shift) {
  const int h = j / 16, jj = j % 16;
  if (bits == 8) {
    const int g = e / 4, within = jj * 4 + e % 4;
    byte = f == kIQ8 ? (g * 2 + h) * 64 + within : ((g / 2) * 2 + h) * 64 + within;
    shift = f == kIQ8 ? 0 : 4 * (g % 2);
  } else {
    const int pair = e / 2, within = jj * 2 + e % 2;
    byte = f == kIQ8 ? (pair * 2 + h) * 32 + within : ((pair / 2) * 2 + h) * 32 + within;
    shift = f == kIQ8 ? 0 : 4 * (pair % 2);
  }
}

template <int BITS>
using act_t = std::conditional_t<BITS == 8, int8_t, int16_t>;
// Broadcast steps per block of 32 k: each takes one 32-bit word of a row's quants (4 int8 or 2 int16).
template <int BITS>
constexpr int act_steps() { return QB * (BITS / 8) / 4; }
template <int BITS>
constexpr float act_max() { return BITS == 8 ? 127.f : 32767.f; }

// A block's scale from its largest |x|: amax / act_max, and the factor that maps x to quants. A
// block holding NaN or infinity gets a NaN scale and zero quants, so its row's outputs come out
// NaN as the float32 path's would; a block too small for act_max / amax to be finite (|x| below
// ~1e-34) contributes 0.
template <int BITS>
inline bool block_scale(float amax, float& inv, float& da, float& sa) {
  if (!std::isfinite(amax)) {
    inv = 0.f, da = sa = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  inv = amax > 0.f ? act_max<BITS>() / amax : 0.f;
  if (!std::isfinite(inv)) inv = 0.f;
  da = inv > 0.f ? amax / act_max<BITS>() : 0.f;
  return true;
}

// One block of 32 of x's row -> BITS-bit quants, its scale da and sa = da * (sum of the quants).
template <int BITS>
void quantize_row_block(const float* v, act_t<BITS>* q, float& da, float& sa) {
  float amax = 0.f;
  for (int i = 0; i < QB; ++i) amax = std::isnan(v[i]) ? v[i] : std::max(amax, std::fabs(v[i]));
  float inv;
  const bool ok = block_scale<BITS>(amax, inv, da, sa);
  int sum = 0;
  for (int i = 0; i < QB; ++i) {
    const int t = ok ? static_cast<int>(std::nearbyint(v[i] * inv)) : 0;
    q[i] = static_cast<act_t<BITS>>(t);
    sum += t;
  }
  if (ok) sa = da * static_cast<float>(sum);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw"))) void quantize_row_block512(const float* v, act_t<BITS>* q, float& da,
                                                                       float& sa) {
  const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
  const bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
  const float amax = nan ? std::numeric_limits<float>::quiet_NaN()
                         : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  float f;
  const bool ok = block_scale<BITS>(amax, f, da, sa);
  const __m512 inv = _mm512_set1_ps(f);
  const __m512i q0 = ok ? _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)) : _mm512_setzero_si512();
  const __m512i q1 = ok ? _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)) : _mm512_setzero_si512();
  if constexpr (BITS == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(q1));
  }
  if (ok) sa = da * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
}

// The same quantization with AVX2: the same max, product and round-to-nearest-even conversion as
// the two above, so the same quants and scales.
template <int BITS>
__attribute__((target("avx2,fma"))) void quantize_row_block256(const float* v, act_t<BITS>* q, float& da,
                                                                float& sa) {
  __m256 x[4];
  __m256 unord = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(x[i], x[i], _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, _mm256_and_ps(x[i], abs_mask));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm256_movemask_ps(unord) ? std::numeric_limits<float>::quiet_NaN() : _mm_cvtss_f32(m4);
  float f;
  const bool ok = block_scale<BITS>(amax, f, da, sa);
  const __m256 inv = _mm256_set1_ps(f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = ok ? _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv)) : _mm256_setzero_si256();
  // |quant| <= act_max, so the saturating packs keep every value; they interleave the 128-bit
  // lanes, which the permutes put back in order.
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
  if constexpr (BITS == 8) {
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(p01, 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm256_permute4x64_epi64(p23, 0xD8));
  }
  if (ok) {
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    sa = da * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// x's rows quantized per block of 32 k. The portable tiles read them row by row. The vector tiles
// read each row group (a tile's rows m0 .. m0+mr-1, grp0 / grpn giving every row's m0 and mr)
// interleaved: the group's quants start at xq + m0 * K, where 32-bit word (kb * STEPS + s) * mr + j
// holds row j's quants of step s of block kb (2 int16 or 4 int8, the ones one broadcast takes),
// and its scales start at m0 * KB, row j's of block kb at kb * mr + j. Every broadcast of a tile
// is then one base register plus a constant offset; with rows K apart the compiler kept a
// pointer per row and step on the stack and reloaded it for every broadcast (2-7 % slower).
// `gated`: x's rows are [gate | up], 2K wide, and the rows quantized are silu(gate) * up.
template <int BITS>
void quantize_rows(const float* x, int64_t M, int64_t K, bool gated, Isa isa, const int64_t* grp0,
                   const int64_t* grpn, act_t<BITS>* xq, float* da, float* sa) {
  const int64_t KB = K / QB, stride = gated ? 2 * K : K;
  constexpr int64_t STEPS = act_steps<BITS>();
  at::parallel_for(0, M * KB, 256, [&](int64_t lo, int64_t hi) {
    alignas(64) act_t<BITS> qb[QB];
    alignas(64) float gv[QB];
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = i / KB, kb = i % KB;
      const float* src = x + r * stride + kb * QB;
      if (gated) {
        for (int e = 0; e < QB; ++e) gv[e] = batchserve::silu_mul1(src[e], src[e + K]);
        src = gv;
      }
      if (isa == kPortable) {
        quantize_row_block<BITS>(src, xq + r * K + kb * QB, da[i], sa[i]);
        continue;
      }
      const int64_t m0 = grp0[r], mr = grpn[r], j = r - m0;
      float d, s;
      if (isa == kAvx512)
        quantize_row_block512<BITS>(src, qb, d, s);
      else
        quantize_row_block256<BITS>(src, qb, d, s);
      da[m0 * KB + kb * mr + j] = d;
      sa[m0 * KB + kb * mr + j] = s;
      int32_t* dst = reinterpret_cast<int32_t*>(xq + m0 * K) + kb * STEPS * mr + j;
      const int32_t* words = reinterpret_cast<const int32_t*>(qb);
      for (int64_t t = 0; t < STEPS; ++t) dst[t * mr] = words[t];
    }
  });
}

// MR rows of quantized x against one panel: int32 sums per block, folded into fp32 sums with the
// block's scales; each quant vector is loaded (and widened) once per block for all MR rows.
template <int MR, int F, int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_int(const act_t<BITS>* __restrict xq, int64_t K,
                                                                     const float* __restrict da,
                                                                     const float* __restrict sa,
                                                                     const uint8_t* __restrict wq, float* __restrict c,
                                                                     int64_t ldc, int ncols) {
  constexpr int64_t BYTES = int_block_bytes(F);
  const int64_t KB = K / QB;
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  const __m512i low4 = BITS == 8 ? _mm512_set1_epi8(0x0F) : _mm512_set1_epi16(0x0F);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = wq + kb * BYTES;
    const uint8_t* q = blk + int_offset(F);
    const char* ahead = reinterpret_cast<const char*>(blk + PFQ * BYTES);
#pragma GCC unroll 4
    for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    constexpr int STEPS = act_steps<BITS>();  // k-groups of 4 (int8) or pairs (int16)
    // x's quants in the row group's layout: word (step, row) at step * MR + row
    const int32_t* xk = reinterpret_cast<const int32_t*>(xq) + kb * STEPS * MR;
    __m512i s0[MR], s1[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int g = 0; g < STEPS; ++g) {
      __m512i w0, w1;
      if (BITS == 8) {
        if (F == kIQ4) {
          const __m512i v0 = _mm512_loadu_si512(q + (g / 2) * 128), v1 = _mm512_loadu_si512(q + (g / 2) * 128 + 64);
          w0 = g % 2 == 0 ? _mm512_and_si512(v0, low4) : _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
          w1 = g % 2 == 0 ? _mm512_and_si512(v1, low4) : _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
        } else {
          w0 = _mm512_loadu_si512(q + g * 128);
          w1 = _mm512_loadu_si512(q + g * 128 + 64);
        }
      } else {
        const int64_t at = F == kIQ4 ? (g / 2) * 64 : g * 64;
        const __m512i v0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + at)));
        const __m512i v1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + at + 32)));
        if (F == kIQ4) {
          w0 = g % 2 == 0 ? _mm512_and_si512(v0, low4) : _mm512_srli_epi16(v0, 4);
          w1 = g % 2 == 0 ? _mm512_and_si512(v1, low4) : _mm512_srli_epi16(v1, 4);
        } else {
          w0 = v0, w1 = v1;
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512i av = _mm512_set1_epi32(xk[g * MR + r]);  // 4 int8 or 2 int16 quants of x
        if constexpr (BITS == 8) {
          s0[r] = _mm512_dpbusd_epi32(s0[r], w0, av);
          s1[r] = _mm512_dpbusd_epi32(s1[r], w1, av);
        } else {
          s0[r] = _mm512_dpwssd_epi32(s0[r], w0, av);
          s1[r] = _mm512_dpwssd_epi32(s1[r], w1, av);
        }
      }
    }
    const float* sc = reinterpret_cast<const float*>(blk);
    const __m512 d0 = _mm512_loadu_ps(sc), d1 = _mm512_loadu_ps(sc + 16);
    const __m512 m0 = F == kIQ4 ? _mm512_loadu_ps(sc + 32) : d0, m1 = F == kIQ4 ? _mm512_loadu_ps(sc + 48) : d1;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 dr = _mm512_set1_ps(da[kb * MR + r]);
      // Q8: m = -128 d, and m * sa = d * (-128 sa) exactly (a power of two)
      const __m512 sr = _mm512_set1_ps(F == kIQ4 ? sa[kb * MR + r] : -128.f * sa[kb * MR + r]);
      c0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), _mm512_mul_ps(d0, dr), c0[r]);
      c1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(d1, dr), c1[r]);
      c0[r] = _mm512_fmadd_ps(m0, sr, c0[r]);
      c1[r] = _mm512_fmadd_ps(m1, sr, c1[r]);
    }
  }
  store_rows<MR>(c, ldc, ncols, c0, c1);
}

// The same sums in plain C++, in the same order, so the results match the AVX-512 tile's bit for
// bit (the integer sums are exact; each fold is the same two roundings).
template <int MR, int F, int BITS>
void tile_int_portable(const act_t<BITS>* xq, int64_t K, const float* da, const float* sa, const uint8_t* wq,
                       float* c, int64_t ldc, int ncols) {
  constexpr int64_t BYTES = int_block_bytes(F);
  const int64_t KB = K / QB;
  float acc[MR][NB] = {};
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = wq + kb * BYTES;
    const float* sc = reinterpret_cast<const float*>(blk);
    for (int j = 0; j < ncols; ++j) {
      int u[QB];
      for (int e = 0; e < QB; ++e) {
        int64_t byte;
        int shift;
        int_pos(static_cast<IFmt>(F), BITS, e, j, byte, shift);
        u[e] = (blk[int_offset(F) + byte] >> shift) & (F == kIQ4 ? 0xF : 0xFF);
      }
      for (int r = 0; r < MR; ++r) {
        int32_t s = 0;
        for (int e = 0; e < QB; ++e) s += u[e] * xq[r * K + kb * QB + e];
        const float sr = F == kIQ4 ? sa[r * KB + kb] : -128.f * sa[r * KB + kb];
        const float m = F == kIQ4 ? sc[NB + j] : sc[j];
        acc[r][j] = std::fma(static_cast<float>(s), sc[j] * da[r * KB + kb], acc[r][j]);
        acc[r][j] = std::fma(m, sr, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + ncols, c + r * ldc);
}

// ---- the integer tile on AVX2 ------------------------------------------------------------------
// A 256-bit vector holds a quarter of the panel (8 columns), so the tile walks each block's four
// quarters in turn, and its float sums live in `acc` (L1) between blocks; the quants and x's
// words are the ones tile_int reads, a quarter's 32 (int8) or 16 (int16) bytes at a time.
//
// int8: vpmaddubsw multiplies unsigned weight bytes by signed activation bytes and adds each pair
// into an int16 lane, saturating; vpmaddwd by ones then adds the lane pairs into int32. Neither
// saturation nor int16 wrap-around can happen, as every int16 value stays within +-30,480:
//   - activations: |a| <= 127 (quantize_row_block: |x * (127 / amax)| <= 127 up to a rounding
//     far below 0.5, and NaN / infinite blocks give zero quants);
//   - weights enter as 4-bit values w in 0..15: Q4_1 / Q4_0 / Q4_K quants are such nibbles, and a
//     Q8_0 byte u = q + 128 (0..255) is taken as its two nibbles, u = 16 * hi + lo, each summed on
//     its own (a whole byte would not do: 2 * 255 * 127 = 64,770 > 32,767);
//   - one vpmaddubsw lane is w0 a0 + w1 a1, |.| <= 2 * 15 * 127 = 3,810, and a block's 8 groups
//     of 4 k are summed per lane with plain int16 adds, |.| <= 8 * 3,810 = 30,480 <= 32,767.
// vpmaddwd by 1 (lo) and by 16 (hi) then gives the exact int32 sum of u * a over the block.
// int16: weights widened to words 0..255 (vpmovzxbw), vpmaddwd with the activation words
// (|a| <= 32,767, never -32,768, so vpmaddwd's one overflow case cannot occur); a block's sum is
// at most 32 * 255 * 32,767 < 2^31 in int32.
// The fold of each block's sums is tile_int's and tile_int_portable's (d * da, then two FMAs),
// so the output is theirs bit for bit.
// Rows per AVX2 tile: each row holds one vector of sums (two for Q8_0 int8: the low and the high
// nibbles') in the 16 registers beside the weights, the broadcast and the product.
constexpr int64_t mri256(IFmt f, int bits) { return bits == 8 && f == kIQ8 ? 4 : 6; }

template <int MR, int F, int BITS>
__attribute__((target("avx2,fma"))) void tile_int256(const act_t<BITS>* __restrict xq, int64_t K,
                                                      const float* __restrict da, const float* __restrict sa,
                                                      const uint8_t* __restrict wq, float* __restrict c,
                                                      int64_t ldc, int ncols) {
  constexpr int64_t BYTES = int_block_bytes(F);
  constexpr int STEPS = act_steps<BITS>();  // k-groups of 4 (int8) or pairs (int16)
  const int64_t KB = K / QB;
  alignas(32) float acc[MR][NB] = {};
  const __m256i low4 = BITS == 8 ? _mm256_set1_epi8(0x0F) : _mm256_set1_epi16(0x0F);
  const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = wq + kb * BYTES;
    const uint8_t* q = blk + int_offset(F);
    const char* ahead = reinterpret_cast<const char*>(blk + PFQ * BYTES);
#pragma GCC unroll 4
    for (int64_t i = 0; i < BYTES; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    const int32_t* xk = reinterpret_cast<const int32_t*>(xq) + kb * STEPS * MR;  // word (step, row)
    const float* sc = reinterpret_cast<const float*>(blk);
#pragma GCC unroll 4
    for (int qt = 0; qt < 4; ++qt) {  // columns 8 qt .. 8 qt + 7
      __m256i s[MR], h[MR];  // int8: int16 sums of the low (s) and high (h, Q8_0) nibbles; int16: int32 sums
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) s[r] = h[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
      for (int g = 0; g < STEPS; ++g) {
        if constexpr (BITS == 8) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (F == kIQ4 ? g / 2 : g) * 128 + qt * 32));
          const __m256i lo = (F == kIQ4 && g % 2) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)
                                                  : _mm256_and_si256(v, low4);
          const __m256i hi = F == kIQ8 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : lo;
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            const __m256i av = _mm256_set1_epi32(xk[g * MR + r]);  // 4 int8 quants of x
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, av));
            if (F == kIQ8) h[r] = _mm256_add_epi16(h[r], _mm256_maddubs_epi16(hi, av));
          }
        } else {
          const __m256i v = _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (F == kIQ4 ? g / 2 : g) * 64 + qt * 16)));
          const __m256i w = F == kIQ4 ? (g % 2 ? _mm256_srli_epi16(v, 4) : _mm256_and_si256(v, low4)) : v;
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r)
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(w, _mm256_set1_epi32(xk[g * MR + r])));
        }
      }
      const __m256 d = _mm256_loadu_ps(sc + qt * 8);
      const __m256 m = F == kIQ4 ? _mm256_loadu_ps(sc + NB + qt * 8) : d;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        __m256i s32 = s[r];
        if constexpr (BITS == 8) {
          s32 = _mm256_madd_epi16(s[r], ones);
          if (F == kIQ8) s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(h[r], sixteens));
        }
        const __m256 dr = _mm256_set1_ps(da[kb * MR + r]);
        const __m256 sr = _mm256_set1_ps(F == kIQ4 ? sa[kb * MR + r] : -128.f * sa[kb * MR + r]);
        __m256 a = _mm256_load_ps(acc[r] + qt * 8);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(d, dr), a);
        a = _mm256_fmadd_ps(m, sr, a);
        _mm256_store_ps(acc[r] + qt * 8, a);
      }
    }
  }
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + ncols, c + r * ldc);
}

template <int BITS>
using TileIntFn = void (*)(const act_t<BITS>*, int64_t, const float*, const float*, const uint8_t*, float*, int64_t,
                           int);
#define BATCHSERVE_INT_TILE(name, impl, F, BITS)                                                          \
  template <int MR>                                                                                       \
  void name(const act_t<BITS>* x, int64_t K, const float* d, const float* s, const uint8_t* w, float* c, \
            int64_t ldc, int nc) {                                                                        \
    impl<MR, F, BITS>(x, K, d, s, w, c, ldc, nc);                                                         \
  }                                                                                                       \
  BATCHSERVE_TILES(TileIntFn<BITS>, name)
BATCHSERVE_INT_TILE(tile_i8_q4, tile_int, kIQ4, 8);
BATCHSERVE_INT_TILE(tile_i8_q8, tile_int, kIQ8, 8);
BATCHSERVE_INT_TILE(tile_i16_q4, tile_int, kIQ4, 16);
BATCHSERVE_INT_TILE(tile_i16_q8, tile_int, kIQ8, 16);
BATCHSERVE_INT_TILE(tile_i8a_q4, tile_int256, kIQ4, 8);
BATCHSERVE_INT_TILE(tile_i8a_q8, tile_int256, kIQ8, 8);
BATCHSERVE_INT_TILE(tile_i16a_q4, tile_int256, kIQ4, 16);
BATCHSERVE_INT_TILE(tile_i16a_q8, tile_int256, kIQ8, 16);
BATCHSERVE_INT_TILE(tile_i8p_q4, tile_int_portable, kIQ4, 8);
BATCHSERVE_INT_TILE(tile_i8p_q8, tile_int_portable, kIQ8, 8);
BATCHSERVE_INT_TILE(tile_i16p_q4, tile_int_portable, kIQ4, 16);
BATCHSERVE_INT_TILE(tile_i16p_q8, tile_int_portable, kIQ8, 16);

void check_int(const torch::Tensor& wq, int64_t n, IFmt f, int64_t bits, const char* what) {
  TORCH_CHECK(bits == 8 || bits == 16, what, ": activation bits must be 8 or 16, got ", bits);
  TORCH_CHECK(f == kIQ4 || f == kIQ8, what, ": format must be 0 (4-bit quants) or 1 (Q8_0), got ",
              static_cast<int64_t>(f));
  TORCH_CHECK(wq.device().is_cpu() && wq.scalar_type() == torch::kUInt8 && wq.dim() == 3 &&
                  wq.size(2) == int_block_bytes(f) && wq.is_contiguous(),
              what, ": packed weight must be a contiguous uint8 CPU tensor [panels, K/32, ", int_block_bytes(f), "]");
  check_n(wq, n, what);
}

template <int BITS>
void run_int(const torch::Tensor& x, bool gated, const uint8_t* w, int64_t n, IFmt f, Isa isa, float* c,
             int64_t NP, int64_t KB) {
  const int64_t M = x.size(0), K = KB * QB, bytes = int_block_bytes(f);
  const bool q4 = f == kIQ4;
  const TileIntFn<BITS>* table;
  if constexpr (BITS == 8)
    table = isa == kAvx512 ? (q4 ? tile_i8_q4_table : tile_i8_q8_table)
            : isa == kAvx2 ? (q4 ? tile_i8a_q4_table : tile_i8a_q8_table)
                           : (q4 ? tile_i8p_q4_table : tile_i8p_q8_table);
  else
    table = isa == kAvx512 ? (q4 ? tile_i16_q4_table : tile_i16_q8_table)
            : isa == kAvx2 ? (q4 ? tile_i16a_q4_table : tile_i16a_q8_table)
                           : (q4 ? tile_i16p_q4_table : tile_i16p_q8_table);
  // x's quants and block scales, kept by the calling thread between calls (no allocation per product)
  thread_local std::vector<act_t<BITS>> xq;
  thread_local std::vector<float> da, sa;
  xq.resize(M * K), da.resize(M * KB), sa.resize(M * KB);
  // plain pointers for the worker threads (inside them the thread_local names are their own copies)
  act_t<BITS>* xqp = xq.data();
  float *dap = da.data(), *sap = sa.data();
  const int64_t mr_max = isa == kPortable ? 4
                         : isa == kAvx2    ? mri256(f, BITS)
                         : M <= mri_small_upto<BITS>() ? MRI_SMALL : MRI;
  thread_local std::vector<int64_t> g0, gn;  // each row's group (first row, rows), as the tiles take them
  g0.resize(M), gn.resize(M);
  for (int64_t m_lo = 0; m_lo < M; m_lo += MCHUNK)
    for_row_blocks(m_lo, std::min(MCHUNK, M - m_lo), mr_max, [&](int64_t m0, int64_t mr) {
      for (int64_t r = m0; r < m0 + mr; ++r) g0[r] = m0, gn[r] = mr;
    });
  quantize_rows<BITS>(x.data_ptr<float>(), M, K, gated, isa, g0.data(), gn.data(), xqp, dap, sap);
  for_panels(M, NP, MCHUNK, [&](int64_t p, int64_t m_lo, int64_t rows) {
    const int ncols = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    for_row_blocks(m_lo, rows, mr_max, [&](int64_t m0, int64_t mr) {
      table[mr](xqp + m0 * K, K, dap + m0 * KB, sap + m0 * KB, w + p * KB * bytes,
                c + m0 * n + p * NB, n, ncols);
    });
  });
}

}  // namespace

// Whether this CPU has the AVX512-VNNI integer dot-product path (gemm_int's fastest).
bool has_vnni() { return cpu_has_vnni(); }

// The integer path gemm_int runs here by default: "avx512" (VNNI), "avx2" or "portable" (plain
// C++, correct and slow). A CPU with AVX-512 but no VNNI gets "avx2" here and "avx512" from isa().
std::string int_isa() {
  switch (best_int_isa()) {
    case kAvx512: return "avx512";
    case kAvx2: return "avx2";
    default: return "portable";
  }
}

// GGUF blocks -> integer dot-product panels for activations of `bits` (8 or 16). src: 0 Q4_1,
// 1 Q8_0, 2 Q4_0, 3 Q4_K (Q6_K has a scale per 16 k and is not taken). Q8_0 gives fmt 1, the
// others fmt 0.
torch::Tensor pack_int(torch::Tensor raw, int64_t src, int64_t bits) {
  const SrcFmt sf = static_cast<SrcFmt>(src);
  TORCH_CHECK(src >= 0 && src <= 3, "pack_int: format must be 0 (Q4_1), 1 (Q8_0), 2 (Q4_0) or 3 (Q4_K), got ", src);
  TORCH_CHECK(bits == 8 || bits == 16, "pack_int: activation bits must be 8 or 16, got ", bits);
  const IFmt f = sf == kSrcQ8_0 ? kIQ8 : kIQ4;
  return regroup_blocks(raw, sf, int_block_bytes(f), "pack_int",
                        [f, bits](uint8_t* blk, int j, float d, float, float m, const int* q) {
                          float* sc = reinterpret_cast<float*>(blk);
                          sc[j] = d;
                          if (f == kIQ4) sc[NB + j] = m;
                          for (int e = 0; e < QB; ++e) {
                            int64_t byte;
                            int shift;
                            int_pos(f, static_cast<int>(bits), e, j, byte, shift);
                            blk[int_offset(f) + byte] |= static_cast<uint8_t>((f == kIQ8 ? q[e] + 128 : q[e]) << shift);
                          }
                        });
}

// The dense float32 W [n, K] = d*u + m that integer panels hold.
torch::Tensor unpack_int(torch::Tensor wq, int64_t n, int64_t fmt, int64_t bits) {
  const IFmt f = static_cast<IFmt>(fmt);
  check_int(wq, n, f, bits, "unpack_int");
  const int64_t KB = wq.size(1), K = KB * QB, bytes = wq.size(2);
  auto out = torch::empty({n, K}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const uint8_t* w = wq.data_ptr<uint8_t>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t p = col / NB;
    const int j = static_cast<int>(col % NB);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* blk = w + (p * KB + kb) * bytes;
      const float* sc = reinterpret_cast<const float*>(blk);
      for (int e = 0; e < QB; ++e) {
        int64_t byte;
        int shift;
        int_pos(f, static_cast<int>(bits), e, j, byte, shift);
        const int u = (blk[int_offset(f) + byte] >> shift) & (f == kIQ4 ? 0xF : 0xFF);
        o[col * K + kb * QB + e] = f == kIQ4 ? std::fma(static_cast<float>(u), sc[j], sc[NB + j])
                                             : static_cast<float>(u - 128) * sc[j];
      }
    }
  }
  return out;
}

// x [M, K] float32 times the integer panels' W^T -> float32 [M, n], x quantized to `bits`-bit
// integers per block of 32 k first. `isa_override`: -1 the best this CPU has (int_isa), 0
// portable, 1 AVX2, 2 AVX-512 VNNI; all give the same bits.
// `gated`: x is [M, 2K], a gate and an up projection side by side (the MLP's fused gate/up
// product), and the product is silu(gate) * up times W^T, the SiLU taken as the activations are
// quantized: the same bits as silu_mul followed by this product, without writing its [M, K]
// result and reading it back.
torch::Tensor gemm_int(torch::Tensor x, torch::Tensor wq, int64_t n, int64_t fmt, int64_t bits,
                       int64_t isa_override, bool gated) {
  const IFmt f = static_cast<IFmt>(fmt);
  check_int(wq, n, f, bits, "gemm_int");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "gemm_int: x must be a contiguous float32 CPU matrix [M, K]");
  const int64_t M = x.size(0), K = x.size(1) / (gated ? 2 : 1), NP = wq.size(0), KB = wq.size(1);
  if (gated)
    TORCH_CHECK(x.size(1) == 2 * KB * QB, "gemm_int: gated x has ", x.size(1), " columns (gate and up) but the ",
                "packed weight has K=", KB * QB, ", so it needs ", 2 * KB * QB);
  TORCH_CHECK(KB * QB == K, "gemm_int: x has K=", K, " but the packed weight has K=", KB * QB);
  static const bool vnni = cpu_has_vnni(), avx2 = cpu_has_avx2();
  TORCH_CHECK(isa_override == -1 || isa_override == kPortable || (isa_override == kAvx2 && avx2) ||
                  (isa_override == kAvx512 && vnni),
              "gemm_int: code path ", isa_override, " is not supported by this CPU");
  static const Isa best = best_int_isa();
  const Isa use = isa_override == -1 ? best : static_cast<Isa>(isa_override);
  auto y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  (bits == 8 ? run_int<8> : run_int<16>)(x, gated, wq.data_ptr<uint8_t>(), n, f, use, y.data_ptr<float>(), NP, KB);
  return y;
}

// Whether this CPU has the bf16 path (AVX512-BF16's vdpbf16ps).
bool has_bf16() { return cpu_has_bf16(); }

// w [N, K] (float32 or bfloat16) -> bf16 panels [ceil(N/32), ceil(K/2), 64]: for each k pair,
// 32 columns' (w[j][2kk], w[j][2kk+1]); zero past N and past K.
torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "pack_bf16: expected a float32 or bfloat16 CPU matrix [N, K]");
  w = w.to(torch::kBFloat16).contiguous();
  const int64_t N = w.size(0), K = w.size(1), NP = (N + NB - 1) / NB, K2 = (K + 1) / 2;
  auto out = torch::zeros({NP, K2, 2 * NB}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NP, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t j = 0; j < NB && p * NB + j < N; ++j) {
        const uint16_t* row = src + (p * NB + j) * K;
        uint16_t* col = dst + p * K2 * 2 * NB + 2 * j;
        for (int64_t k = 0; k < K; ++k) col[(k / 2) * 2 * NB + k % 2] = row[k];
      }
  });
  return out;
}

// x [M, K] (float32 or bfloat16) times the bf16 panels -> float32 [M, n]. x is rounded to bf16
// (into a scratch copy when it is float32 or K is odd); the sums are fp32.
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor wp, int64_t n) {
  TORCH_CHECK(cpu_has_bf16(), "gemm_bf16: this CPU has no AVX512-BF16");
  TORCH_CHECK(wp.device().is_cpu() && wp.scalar_type() == torch::kBFloat16 && wp.dim() == 3 &&
                  wp.size(2) == 2 * NB && wp.is_contiguous(),
              "gemm_bf16: packed weight must be a contiguous bfloat16 CPU tensor [panels, K/2, 64]");
  check_n(wp, n, "gemm_bf16");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "gemm_bf16: x must be a float32 or bfloat16 CPU matrix [M, K]");
  const int64_t M = x.size(0), K = x.size(1), NP = wp.size(0), K2 = wp.size(1);
  TORCH_CHECK((K + 1) / 2 == K2, "gemm_bf16: x has K=", K, " but the packed weight has K=", 2 * K2, " (or one less)");
  auto y = torch::empty({M, n}, x.options().dtype(torch::kFloat32));
  if (M == 0 || n == 0) return y;
  // x as bf16 rows of 2*K2 elements
  torch::Tensor xb;
  if (x.scalar_type() == torch::kBFloat16 && K % 2 == 0) {
    xb = x.contiguous();
  } else {
    xb = torch::zeros({M, 2 * K2}, x.options().dtype(torch::kBFloat16));
    xb.narrow(1, 0, K).copy_(x);
  }
  const uint16_t* a = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  float* c = y.data_ptr<float>();
  const int64_t lda = 2 * K2;
  for_panels(M, NP, MCHUNK_BF16, [&](int64_t p, int64_t m_lo, int64_t rows) {
    const int ncols = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    // With more than one row block, k is taken in slices whose panel part stays in L1 for all
    // the row blocks (the sums go through y between slices).
    const int64_t kslice = rows > MR512 ? KSLICE_BF16 : K2;
    for (int64_t k0 = 0; k0 < K2; k0 += kslice) {
      const int64_t kn = std::min(kslice, K2 - k0);
      for_row_blocks(m_lo, rows, MR512, [&](int64_t m0, int64_t mr) {
        tile_bf16_table[mr](a + m0 * lda + 2 * k0, lda, w + (p * K2 + k0) * 2 * NB, kn, c + m0 * n + p * NB, n, ncols,
                            k0 > 0);
      });
    }
  });
  return y;
}

// ---- AMX: bf16 tiles for prompt rows ---------------------------------------------------------
// Intel AMX (Sapphire Rapids and later) multiplies 16 x 32 bf16 tiles by 32 x 16 ones into 16 x 16
// fp32 sums in one instruction (tdpbf16ps), an order of magnitude more multiply-adds per cycle
// than AVX-512. It reads bf16 weights, 2 bytes each against a Q4_1 block's ~0.6, so it pays
// where many rows share each weight (a prompt), not at decode sizes.
// Weights: W [N, K] rounded to bf16 (nearest even), stored as [N/16][K/32] tiles of 1 KiB, each
// 16 rows (pairs of k) x 16 columns x 2: the layout tdpbf16ps takes its second operand in.
// A tile step: 32 rows of x (two A tiles) against 32 columns (two B tiles) into four C tiles;
// k runs in order through K/32 steps, and a row's sums depend on that row and W only: the same
// bits whatever other rows share the call (a request's tokens do not depend on its batch).
// Blocking: a thread takes AMX_NBLOCK column blocks of 32 at a time (their tiles, ~1 MB at the
// model's K, stay in L2 while every row passes), and 32 rows by k slices of at most AMX_KSLICE
// steps (those rows' x over a slice, 18 KB, stay in L1 while the blocks pass). Between slices a
// block's sums wait in a float32 buffer; stored and reloaded exactly, so the k order and the bits
// are those of one pass. Walking every row past all of W for each 64 rows instead re-read W
// from L3 each time, and x from L2.
// Linux hands out the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
constexpr int64_t AMX_NBLOCK = 28;
constexpr int64_t AMX_KSLICE = 9;

bool cpu_has_amx() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return false;  // AMX-BF16, -TILE
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Rows [m0, m1) (a multiple of 32 apart) of c = a W^T, column blocks [lo, hi) of 32. With `h`
// (swiglu), each block's two halves are a gate and an up block (W packed from pairs of 16 rows,
// gate then up): h [., N/2] gets bf16(silu(gate) * up), and c is not written.
__attribute__((target("amx-tile,amx-bf16"))) void amx_rows(const uint16_t* a, const uint16_t* w, float* c,
                                                            int64_t m0, int64_t m1, int64_t lo, int64_t hi, int64_t N,
                                                            int64_t K, at::BFloat16* h = nullptr) {
  const int64_t KB = K / 32, slices = (KB + AMX_KSLICE - 1) / AMX_KSLICE, ks = (KB + slices - 1) / slices;
  std::vector<float> part(slices > 1 ? AMX_NBLOCK * 1024 : 0);  // a 32 x 32 block's sums per column block
  AmxConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // every tile 16 x 64 bytes
  _tile_loadconfig(&cfg);
  for (int64_t n0 = lo; n0 < hi; n0 += AMX_NBLOCK)
  for (int64_t m = m0; m < m1; m += 32)
  for (int64_t k0 = 0; k0 < KB; k0 += ks) {
    const int64_t k1 = std::min(KB, k0 + ks);
    const uint16_t* ar = a + m * K;
    for (int64_t nb = n0; nb < std::min(hi, n0 + AMX_NBLOCK); ++nb) {
      const uint16_t* w0 = w + 2 * nb * KB * 512;
      const uint16_t* w1 = w0 + KB * 512;
      float* p = part.data() + (nb - n0) * 1024;
      if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, p, 128);
        _tile_loadd(1, p + 16, 128);
        _tile_loadd(2, p + 512, 128);
        _tile_loadd(3, p + 528, 128);
      }
      for (int64_t kb = k0; kb < k1; ++kb) {
        _tile_loadd(4, ar + kb * 32, K * 2);
        _tile_loadd(5, ar + 16 * K + kb * 32, K * 2);
        _tile_loadd(6, w0 + kb * 512, 64);
        _tile_loadd(7, w1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if (k1 < KB) {
        _tile_stored(0, p, 128);
        _tile_stored(1, p + 16, 128);
        _tile_stored(2, p + 512, 128);
        _tile_stored(3, p + 528, 128);
        continue;
      }
      if (h != nullptr) {
        alignas(64) float t[4][16][16];  // rows 0-15 gate, up; rows 16-31 gate, up
        _tile_stored(0, t[0], 64);
        _tile_stored(1, t[1], 64);
        _tile_stored(2, t[2], 64);
        _tile_stored(3, t[3], 64);
        for (int r = 0; r < 32; ++r) {
          const float *g = t[r / 16 * 2][r % 16], *u = t[r / 16 * 2 + 1][r % 16];
          at::BFloat16* hr = h + (m + r) * (N / 2) + nb * 16;
          for (int j = 0; j < 16; ++j) hr[j] = batchserve::silu_mul1(g[j], u[j]);
        }
        continue;
      }
      float* cr = c + m * N + nb * 32;
      _tile_stored(0, cr, N * 4);
      _tile_stored(1, cr + 16, N * 4);
      _tile_stored(2, cr + 16 * N, N * 4);
      _tile_stored(3, cr + 16 * N + 16, N * 4);
    }
  }
  _tile_release();
}

bool has_amx() { return cpu_has_amx(); }

// w [N, K] float32 (N and K multiples of 32) -> bf16 tiles [N/16, K/32, 512] (as int16 bits).
torch::Tensor pack_amx(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 2,
              "pack_amx: expected a float32 CPU matrix [N, K]");
  const int64_t N = w.size(0), K = w.size(1), KB = K / 32;
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "pack_amx: N and K must be multiples of 32, got ", N, " x ", K);
  const auto wb = w.to(torch::kBFloat16).contiguous();
  auto out = torch::empty({N / 16, KB, 512}, w.options().dtype(torch::kInt16));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
  at::parallel_for(0, N / 16, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t nb = lo; nb < hi; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int kp = 0; kp < 16; ++kp)
          for (int j = 0; j < 16; ++j)
            for (int e = 0; e < 2; ++e)
              dst[((nb * KB + kb) * 16 + kp) * 32 + j * 2 + e] = src[(nb * 16 + j) * K + kb * 32 + 2 * kp + e];
  });
  return out;
}

// x [M, K] float32, rounded to bf16 (or bf16 as it is), times the AMX tiles -> float32 [M, n]
// (fp32 sums). `swiglu`: W was packed from gate and up rows in pairs of 16 (gate rows 16c..,
// then up rows 16c..) and the result is bf16 [M, n/2], silu(gate) * up of the products
// (silu_mul1, the fused ops' bits) rounded once: what the down product takes, without the
// float32 [M, n] in between.
torch::Tensor gemm_amx(torch::Tensor x, torch::Tensor wp, int64_t n, bool swiglu) {
  TORCH_CHECK(cpu_has_amx(), "gemm_amx: this CPU (or its OS) gives no AMX tiles");
  TORCH_CHECK(wp.device().is_cpu() && wp.scalar_type() == torch::kInt16 && wp.dim() == 3 && wp.size(2) == 512 &&
                  wp.is_contiguous() && wp.size(0) * 16 == n && n % 32 == 0,
              "gemm_amx: packed weight must be pack_amx's [n/16, K/32, 512] for n = ", n);
  const int64_t K = wp.size(1) * 32;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                  x.dim() == 2 && x.size(1) == K,
              "gemm_amx: x must be a float32 or bfloat16 CPU matrix [M, ", K, "]");
  const int64_t M = x.size(0), Mpad = (M + 31) / 32 * 32;
  auto y = swiglu ? torch::empty({Mpad, n / 2}, x.options().dtype(torch::kBFloat16))
                  : torch::empty({Mpad, n}, x.options().dtype(torch::kFloat32));
  if (M == 0) return y.narrow(0, 0, 0);
  auto xb = torch::empty({Mpad, K}, x.options().dtype(torch::kBFloat16));  // rows past M: zeros
  xb.narrow(0, 0, M).copy_(x);
  if (Mpad > M) xb.narrow(0, M, Mpad - M).zero_();
  const uint16_t* a = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr<int16_t>());
  float* c = swiglu ? nullptr : y.data_ptr<float>();
  at::BFloat16* hb = swiglu ? y.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, n / 32, 1, [&](int64_t lo, int64_t hi) { amx_rows(a, w, c, 0, Mpad, lo, hi, n, K, hb); });
  return y.narrow(0, 0, M);  // rows of a contiguous [Mpad, .]: contiguous
}

// The code path this CPU runs: "avx512", "avx2" or "portable".
std::string isa() {
  switch (best_isa()) {
    case kAvx512: return "avx512";
    case kAvx2: return "avx2";
    default: return "portable";
  }
}

// w [N, K] float32 -> panels [ceil(N/32), K, 32], zero-padded past N.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 2,
              "pack: expected a float32 CPU matrix [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NP = (N + NB - 1) / NB;
  auto out = torch::zeros({NP, K, NB}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, NP, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t j = 0; j < NB && p * NB + j < N; ++j) {
        const float* row = src + (p * NB + j) * K;
        float* col = dst + p * K * NB + j;
        for (int64_t k = 0; k < K; ++k) col[k * NB] = row[k];
      }
  });
  return out;
}

// x [M, K] float32 (contiguous) times the packed W^T -> [M, n]. `isa_override`: -1 for the
// best path on this CPU, else 0 portable, 1 AVX2, 2 AVX-512 (tests; must be supported).
torch::Tensor gemm(torch::Tensor x, torch::Tensor wp, int64_t n, int64_t isa_override) {
  check_packed(wp, n);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "gemm: x must be a contiguous float32 CPU matrix [M, K]");
  const int64_t M = x.size(0), K = x.size(1), NP = wp.size(0);
  TORCH_CHECK(wp.size(1) == K, "gemm: x has K=", K, " but the packed weight has K=", wp.size(1));
  static const Isa native = best_isa();
  const Isa use = isa_override < 0 ? native : static_cast<Isa>(isa_override);
  TORCH_CHECK(use >= kPortable && use <= native, "gemm: code path ", isa_override, " is not supported by this CPU");
  const TileFn* table = use == kAvx512 ? tile512_table : use == kAvx2 ? tile256_table : tile_portable_table;
  const int64_t mr_max = use == kAvx512 ? MR512 : use == kAvx2 ? MR256 : MRP;

  auto y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const float* a = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* c = y.data_ptr<float>();
  for_panels(M, NP, MCHUNK, [&](int64_t p, int64_t m_lo, int64_t rows) {
    const int ncols = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    for_row_blocks(m_lo, rows, mr_max, [&](int64_t m0, int64_t mr) {
      table[mr](a + m0 * K, K, w + p * K * NB, K, c + m0 * n + p * NB, n, ncols);
    });
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL (ATen needs none), like torch's own ops: the server's
  // event loop thread keeps answering while the engine thread is inside them.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa", &isa, "the code path this CPU runs: avx512, avx2 or portable");
  m.def("pack", &pack, "w [N, K] float32 -> panels [ceil(N/32), K, 32]", nogil);
  m.def("has_bf16", &has_bf16, "whether this CPU has the bf16 path (AVX512-BF16)");
  m.def("pack_bf16", &pack_bf16, "w [N, K] -> bf16 panels [ceil(N/32), ceil(K/2), 64]", nogil);
  m.def("gemm_bf16", &gemm_bf16, "x [M, K] (fp32 or bf16) @ W^T from the bf16 panels -> fp32 [M, n]", nogil);
  m.def("gemm", &gemm, "x [M, K] @ W^T from the packed panels -> [M, n]", nogil, py::arg("x"), py::arg("wp"), py::arg("n"),
        py::arg("isa_override") = -1);
  m.def("pack_q", &pack_q, "GGUF blocks (0 Q4_1, 1 Q8_0, 2 Q4_0, 3 Q4_K, 4 Q6_K) [N, row bytes] -> panels", nogil);
  m.def("unpack_q", &unpack_q, "block-quantized panels -> float32 [n, K]", nogil);
  m.def("has_amx", &has_amx, "whether this CPU and OS give AMX bf16 tiles (gemm_amx)");
  m.def("pack_amx", &pack_amx, "w [N, K] float32 -> bf16 AMX tiles [N/16, K/32, 512]", nogil);
  m.def("gemm_amx", &gemm_amx, "x [M, K] @ W^T on AMX bf16 tiles -> float32 [M, n] (swiglu: bf16 [M, n/2])", nogil,
        py::arg("x"), py::arg("wp"), py::arg("n"), py::arg("swiglu") = false);
  m.def("has_vnni", &has_vnni, "whether this CPU has the integer dot-product path (AVX512-VNNI)");
  m.def("int_isa", &int_isa, "the integer path gemm_int runs here by default: avx512 (VNNI), avx2 or portable");
  m.def("pack_int", &pack_int, "GGUF blocks (0 Q4_1, 1 Q8_0, 2 Q4_0, 3 Q4_K) [N, row bytes] -> integer panels "
        "for 8- or 16-bit activations", nogil, py::arg("raw"), py::arg("src"), py::arg("bits") = 8);
  m.def("unpack_int", &unpack_int, "integer panels -> float32 [n, K]", nogil, py::arg("wq"), py::arg("n"),
        py::arg("fmt"), py::arg("bits") = 8);
  m.def("gemm_int", &gemm_int, "x [M, K] quantized to int8/int16 per 32 k @ W^T from integer panels -> float32 [M, n]",
        nogil, py::arg("x"), py::arg("wq"), py::arg("n"), py::arg("fmt"), py::arg("bits") = 8,
        py::arg("isa_override") = -1, py::arg("gated") = false);
  m.def("gemm_q", &gemm_q, "x [M, K] @ W^T from block-quantized panels -> [M, n]", nogil, py::arg("x"), py::arg("wq"),
        py::arg("n"), py::arg("fmt"), py::arg("isa_override") = -1, py::arg("fused_rows") = -1);
}
