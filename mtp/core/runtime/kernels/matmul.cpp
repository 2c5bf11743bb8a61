// Small-row CPU matmul kernels, batch-invariant by construction (see mtp/core/runtime/kernels/__init__.py).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]      x: [M, K] float32, W: [N, K] in float32 / Q8_0 / Q4_0 / Q4_1
//
// This file: the float32-activation ops (linear_f32 / _q8_0 / _q4_0 / _q4_1, dequantize_*); the
// int8-activation ops (linear_*_i8) are in matmul_i8.h, with their own fixed order.
//
// The one reduction order of the float32-activation ops (every ISA, every M, every tile shape, every
// thread split):
//   * 16 lanes; lane j accumulates the products of the elements k = 16*i + j in increasing i, each with
//     one fused multiply-add (acc = fma(x, w, acc)), starting from +0. Elements past K (float32 weights
//     whose K is not a multiple of 16) count as x = w = 0.
//   * the 16 lanes are then summed in one fixed tree: s8[i] = a[i] + a[i+8], s4[i] = s8[i] + s8[i+4],
//     s2[i] = s4[i] + s4[i+2], y = s2[0] + s2[1].
// So a row's output bits depend on that row and the weights alone: not on M, on the row's position or on
// the other rows, not on the thread count, and not on the ISA (the scalar, AVX2 and AVX-512 paths give the
// same bits). Threads split the output columns N, never K.
//
// Weights are dequantised exactly as the `gguf` Python package does (what mtp's loader uses), one float32
// rounding per operation, never fused (the file is compiled with -ffp-contract=off):
//   Q8_0 (34 bytes / 32 values): fp16 d, int8 q[32]            value = float(q) * d
//   Q4_0 (18 bytes / 32 values): fp16 d, 16 bytes of nibbles    value = float(q - 8) * d
//   Q4_1 (20 bytes / 32 values): fp16 d, fp16 m, 16 nibbles     value = float(q) * d + m
// with ggml's nibble order: byte i's low nibble is element i, its high nibble element i + 16.
// A weight block is dequantised once per pass of the tile over the rows and applied to every row of the
// tile (rows 1..MT in registers); with more rows than a register tile, a tile of weight rows is
// dequantised once into a float32 panel that every row tile then reads.
//
// The ISA-specific code lives in `#pragma GCC target` regions so one build serves every x86-64 CPU; the
// path is chosen at run time (`__builtin_cpu_supports`), or forced by the `isa` argument of each op.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "isa.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mtp_kernels {

enum Fmt : int { F32 = 0, Q8_0 = 1, Q4_0 = 2, Q4_1 = 3 };
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

// bytes of one 32-value block (float32: bytes of one value)
constexpr int64_t block_bytes(int f) {
  return f == Q8_0 ? 34 : f == Q4_0 ? 18 : f == Q4_1 ? 20 : 4;
}

static inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IEEE half -> float, exact (portable; the SIMD paths use F16C, which is exact too)
static inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    float f = float(mant) * 5.9604644775390625e-08f;  // mant * 2^-24: exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

using mtp_isa::tree16;  // the fixed 16-lane tree (isa.h)

// The arguments of one pass. w: the weight rows (row n at w + n * w_stride bytes).
// software prefetch distance along each weight row (bytes): with several rows streamed at once the
// hardware prefetcher alone left Q8_0 at M = 1 memory-stalled (Zen 4: 5.4 ms -> 2.4 ms for the 576x49152 head)
constexpr int64_t PREFETCH = 256;

struct Pass {
  int fmt;
  const uint8_t* w;
  int64_t w_stride;
  const float* x;  // [M, K], rows x_stride floats apart
  int64_t x_stride;
  float* y;  // [M, N]
  int64_t M, N, K;
};

// ---------------------------------------------------------------------------------------------- scalar
// chunk h (16 values, zero past K) of a weight row, dequantised
static void chunk_scalar(int fmt, const uint8_t* row, int64_t K, int64_t h, float* out) {
  if (fmt == F32) {
    const float* r = reinterpret_cast<const float*>(row);
    for (int j = 0; j < 16; j++) out[j] = 16 * h + j < K ? r[16 * h + j] : 0.0f;
    return;
  }
  const int64_t b = h >> 1, half = h & 1;
  const uint8_t* blk = row + b * block_bytes(fmt);
  const float d = half_to_float(load_u16(blk));
  if (fmt == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2) + 16 * half;
    for (int j = 0; j < 16; j++) out[j] = float(q[j]) * d;
  } else if (fmt == Q4_0) {
    for (int j = 0; j < 16; j++) out[j] = float(int((blk[2 + j] >> (4 * half)) & 0xF) - 8) * d;
  } else {  // Q4_1
    const float m = half_to_float(load_u16(blk + 2));
    for (int j = 0; j < 16; j++) {
      float p = float((blk[4 + j] >> (4 * half)) & 0xF) * d;
      out[j] = p + m;
    }
  }
}

static void run_scalar(const Pass& p, int64_t n0, int64_t n1) {
  const int64_t nch = (p.K + 15) / 16;
  std::vector<float> wrow(nch * 16), xpad(16);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = p.w + n * p.w_stride;
    for (int64_t h = 0; h < nch; h++) chunk_scalar(p.fmt, row, p.K, h, &wrow[16 * h]);
    for (int64_t m = 0; m < p.M; m++) {
      const float* xr = p.x + m * p.x_stride;
      float acc[16] = {0};
      for (int64_t h = 0; h < nch; h++) {
        for (int j = 0; j < 16; j++) {
          const float xv = 16 * h + j < p.K ? xr[16 * h + j] : 0.0f;
          acc[j] = std::fma(xv, wrow[16 * h + j], acc[j]);
        }
      }
      p.y[m * p.N + n] = tree16(acc);
    }
  }
}

static void dequant_scalar(int fmt, const uint8_t* row, int64_t K, float* out) {
  float buf[16];
  for (int64_t h = 0; h < K / 16; h++) {
    chunk_scalar(fmt, row, K, h, buf);
    std::memcpy(out + 16 * h, buf, sizeof buf);
  }
}

}  // namespace mtp_kernels

// ---------------------------------------------------------------------------------------------- AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace mtp_kernels {
namespace avx2 {

static inline float tree(__m256 lo, __m256 hi) {
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// elements 32 b + 16 HALF + 8 PART .. + 8 of a weight row, dequantised
template <int F, int HALF, int PART>
static inline __m256 part(const uint8_t* row, int64_t b) {
  if constexpr (F == F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 32 * b + 16 * HALF + 8 * PART);
  } else {
    const uint8_t* blk = row + b * block_bytes(F);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
    if constexpr (F == Q8_0) {
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 16 * HALF + 8 * PART));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    } else {
      const int off = F == Q4_0 ? 2 : 4;
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + off + 8 * PART));
      if (HALF) q = _mm_srli_epi16(q, 4);
      __m256i v = _mm256_cvtepu8_epi32(_mm_and_si128(q, _mm_set1_epi8(0x0F)));
      if constexpr (F == Q4_0) {
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))), d);
      } else {
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2)));
        return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), d), m);
      }
    }
  }
}

static inline __m256i tail_mask(int64_t valid) {  // lanes < valid set
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::max<int64_t>(0, std::min<int64_t>(valid, 8)))), idx);
}

// one 8-lane part of a 16-chunk for all MT x NT accumulators (lanes 8 PART .. 8 PART + 7)
template <int F, int MT, int NT, int HALF, int PART>
static inline void step(__m256 (&acc)[MT][NT][2], const uint8_t* w, int64_t ws, const float* x, int64_t xs,
                        int64_t b) {
  __m256 wv[NT];
  for (int n = 0; n < NT; n++) wv[n] = part<F, HALF, PART>(w + n * ws, b);
  for (int m = 0; m < MT; m++) {
    __m256 xv = _mm256_loadu_ps(x + m * xs + 32 * b + 16 * HALF + 8 * PART);
    if constexpr (NT > 1) asm("" : "+x"(xv));  // one load, kept in a register for the NT multiply-adds
    for (int n = 0; n < NT; n++) acc[m][n][PART] = _mm256_fmadd_ps(xv, wv[n], acc[m][n][PART]);
  }
}

// MT rows x NT weight rows, the whole of K; weights in format F (float32 panels pass F32)
template <int F, int MT, int NT>
static void tile(const uint8_t* w, int64_t ws, const float* x, int64_t xs, int64_t K, float* y, int64_t ys) {
  __m256 acc[MT][NT][2];
  for (int m = 0; m < MT; m++)
    for (int n = 0; n < NT; n++) acc[m][n][0] = acc[m][n][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; b++) {
    for (int n = 0; n < NT; n++)
      _mm_prefetch(reinterpret_cast<const char*>(w + n * ws + b * block_bytes(F) * (F == F32 ? 32 : 1) + PREFETCH),
                   _MM_HINT_T0);
    step<F, MT, NT, 0, 0>(acc, w, ws, x, xs, b);
    step<F, MT, NT, 0, 1>(acc, w, ws, x, xs, b);
    step<F, MT, NT, 1, 0>(acc, w, ws, x, xs, b);
    step<F, MT, NT, 1, 1>(acc, w, ws, x, xs, b);
  }
  if constexpr (F == F32) {  // the rest of K: whole or partial 16-chunks, zero past K
    for (int64_t k = 32 * nb; k < K; k += 16) {
      const __m256i m0 = tail_mask(K - k), m1 = tail_mask(K - k - 8);
      for (int m = 0; m < MT; m++) {
        const __m256 x0 = _mm256_maskload_ps(x + m * xs + k, m0), x1 = _mm256_maskload_ps(x + m * xs + k + 8, m1);
        for (int n = 0; n < NT; n++) {
          const float* r = reinterpret_cast<const float*>(w + n * ws) + k;
          acc[m][n][0] = _mm256_fmadd_ps(x0, _mm256_maskload_ps(r, m0), acc[m][n][0]);
          acc[m][n][1] = _mm256_fmadd_ps(x1, _mm256_maskload_ps(r + 8, m1), acc[m][n][1]);
        }
      }
    }
  }
  for (int m = 0; m < MT; m++)
    for (int n = 0; n < NT; n++) y[m * ys + n] = tree(acc[m][n][0], acc[m][n][1]);
}

template <int F>
static void dequant_rows(const uint8_t* w, int64_t ws, int64_t rows, int64_t K, float* out, int64_t os) {
  for (int64_t n = 0; n < rows; n++)
    for (int64_t b = 0; b < K / 32; b++) {
      const uint8_t* r = w + n * ws;
      float* o = out + n * os + 32 * b;
      _mm256_storeu_ps(o, part<F, 0, 0>(r, b));
      _mm256_storeu_ps(o + 8, part<F, 0, 1>(r, b));
      _mm256_storeu_ps(o + 16, part<F, 1, 0>(r, b));
      _mm256_storeu_ps(o + 24, part<F, 1, 1>(r, b));
    }
}

constexpr int NT = 2, MT = 3;

// 4 or 5 rows against a 2-column tile in one pass, one column at a time (at most 10 accumulators): each
// weight block is dequantised once and no float32 panel is written (at 6 rows the panel was as fast)
template <int F, int M>
static void columns(const uint8_t* w, int64_t ws, const Pass& p, float* y) {
  for (int h = 0; h < NT; h++) tile<F, M, 1>(w + h * ws, ws, p.x, p.x_stride, p.K, y + h, p.N);
}

// rows in tiles of MT (remainder: a smaller tile) for NTC weight rows
template <int F, int NTC>
static void rows(const uint8_t* w, int64_t ws, const Pass& p, int64_t n) {
  int64_t m = 0;
  const float* x = p.x;
  float* y = p.y + n;
  if constexpr (NTC == NT) {
    switch (p.M) {
      case 4: return columns<F, 4>(w, ws, p, y);
      case 5: return columns<F, 5>(w, ws, p, y);
      default: break;
    }
  }
  const int64_t tiles = (p.M + MT - 1) / MT;
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t mt = std::min<int64_t>(MT, p.M - m);
    switch (mt) {
      case 3: tile<F, 3, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
      case 2: tile<F, 2, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
      default: tile<F, 1, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
    }
    m += mt;
  }
}

constexpr int64_t PANEL_ABOVE_M = 5;  // 4 or 5 rows: one pass (`columns`) beats the panel
#include "matmul_driver.h"

}  // namespace avx2
}  // namespace mtp_kernels
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace mtp_kernels {
namespace avx512 {

static inline float tree(__m512 a) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

template <int F, int HALF>
static inline __m512 chunk(const uint8_t* row, int64_t b) {
  if constexpr (F == F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 32 * b + 16 * HALF);
  } else {
    const uint8_t* blk = row + b * block_bytes(F);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(blk)));
    if constexpr (F == Q8_0) {
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * HALF));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    } else {
      // the 16 values a nibble can stand for, computed as the scalar path does (Q4_0: float(i - 8) * d;
      // Q4_1: float(i) * d + m), then looked up: vpermps reads the low 4 bits of each index lane
      const int off = F == Q4_0 ? 2 : 4;
      __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off)));
      if (HALF) v = _mm512_srli_epi32(v, 4);
      __m512 table;
      if constexpr (F == Q4_0) {
        table = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), d);
      } else {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(blk + 2)));
        table = _mm512_add_ps(_mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d), m);
      }
      return _mm512_permutexvar_ps(v, table);
    }
  }
}

template <int F, int MT, int NT>
static void tile(const uint8_t* w, int64_t ws, const float* x, int64_t xs, int64_t K, float* y, int64_t ys) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; m++)
    for (int n = 0; n < NT; n++) acc[m][n] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; b++) {
    __m512 wv[NT];
    for (int n = 0; n < NT; n++)
      _mm_prefetch(reinterpret_cast<const char*>(w + n * ws + b * block_bytes(F) * (F == F32 ? 32 : 1) + PREFETCH),
                   _MM_HINT_T0);
    for (int n = 0; n < NT; n++) wv[n] = chunk<F, 0>(w + n * ws, b);
    for (int m = 0; m < MT; m++) {
      const __m512 xv = _mm512_loadu_ps(x + m * xs + 32 * b);
      for (int n = 0; n < NT; n++) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
    for (int n = 0; n < NT; n++) wv[n] = chunk<F, 1>(w + n * ws, b);
    for (int m = 0; m < MT; m++) {
      const __m512 xv = _mm512_loadu_ps(x + m * xs + 32 * b + 16);
      for (int n = 0; n < NT; n++) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  if constexpr (F == F32) {
    for (int64_t k = 32 * nb; k < K; k += 16) {
      const int64_t valid = std::min<int64_t>(16, K - k);
      const __mmask16 mk = __mmask16((1u << valid) - 1u);
      for (int m = 0; m < MT; m++) {
        const __m512 xv = _mm512_maskz_loadu_ps(mk, x + m * xs + k);
        for (int n = 0; n < NT; n++)
          acc[m][n] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(mk, reinterpret_cast<const float*>(w + n * ws) + k),
                                      acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; m++)
    for (int n = 0; n < NT; n++) y[m * ys + n] = tree(acc[m][n]);
}

template <int F>
static void dequant_rows(const uint8_t* w, int64_t ws, int64_t rows, int64_t K, float* out, int64_t os) {
  for (int64_t n = 0; n < rows; n++)
    for (int64_t b = 0; b < K / 32; b++) {
      float* o = out + n * os + 32 * b;
      // both halves before either store: the block's scale and table are then worked out once (a store through
      // float* may alias the weight bytes, so the compiler would read and compute them again after it)
      const __m512 lo = chunk<F, 0>(w + n * ws, b), hi = chunk<F, 1>(w + n * ws, b);
      _mm512_storeu_ps(o, lo);
      _mm512_storeu_ps(o + 16, hi);
    }
}

constexpr int NT = 4, MT = 4;

// 5..8 rows against a 4-column tile in one pass, as two 2-column halves of all the rows (at most 16
// accumulators): each weight block is dequantised once, not once per row tile of 4. (One column of 9..16
// rows was tried: slower than the panel at 16 rows, register pressure.)
template <int F, int M>
static void halves(const uint8_t* w, int64_t ws, const Pass& p, float* y) {
  for (int h = 0; h < NT; h += 2) tile<F, M, 2>(w + h * ws, ws, p.x, p.x_stride, p.K, y + h, p.N);
}

template <int F, int NTC>
static void rows(const uint8_t* w, int64_t ws, const Pass& p, int64_t n) {
  int64_t m = 0;
  const float* x = p.x;
  float* y = p.y + n;
  if constexpr (NTC == NT) {
    switch (p.M) {
      case 5: return halves<F, 5>(w, ws, p, y);
      case 6: return halves<F, 6>(w, ws, p, y);
      case 7: return halves<F, 7>(w, ws, p, y);
      case 8: return halves<F, 8>(w, ws, p, y);
      default: break;
    }
  }
  const int64_t tiles = (p.M + MT - 1) / MT;
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t mt = std::min<int64_t>(MT, p.M - m);
    switch (mt) {
      case 4: tile<F, 4, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
      case 3: tile<F, 3, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
      case 2: tile<F, 2, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
      default: tile<F, 1, NTC>(w, ws, x + m * p.x_stride, p.x_stride, p.K, y + m * p.N, p.N); break;
    }
    m += mt;
  }
}

constexpr int64_t PANEL_ABOVE_M = 2 * MT;  // up to 8 rows one pass (`halves`) beats the panel
#include "matmul_driver.h"

}  // namespace avx512
}  // namespace mtp_kernels
#pragma GCC pop_options

#include "matmul_i8.h"

// ---------------------------------------------------------------------------------------------- dispatch
namespace mtp_kernels {

using mtp_isa::best_isa;  // isa.h: shared with the layer ops
using mtp_isa::pick_isa;

int64_t cpu_isa() { return best_isa(); }

// the int8-activation ops' AVX-512 path needs VNNI too
static int best_isa_i8() {
  const int best = best_isa();
  __builtin_cpu_init();
  return best == AVX512 && !__builtin_cpu_supports("avx512vnni") ? AVX2 : best;
}

int64_t cpu_isa_i8() { return best_isa_i8(); }

static const char* fmt_name(int fmt) {
  return fmt == F32 ? "float32" : fmt == Q8_0 ? "q8_0" : fmt == Q4_0 ? "q4_0" : "q4_1";
}

// the weight's K from its bytes per row, checked
static int64_t weight_k(int fmt, const at::Tensor& w) {
  if (fmt == F32) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
                "mtp kernels: float32 weight must be a contiguous float32 [N, K] tensor");
    return w.size(1);
  }
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "mtp kernels: ", fmt_name(fmt),
              " weight must be a contiguous uint8 [N, bytes per row] tensor of blocks");
  TORCH_CHECK(w.size(1) % block_bytes(fmt) == 0, "mtp kernels: ", fmt_name(fmt), " rows of ", w.size(1),
              " bytes are not whole ", block_bytes(fmt), "-byte blocks");
  return w.size(1) / block_bytes(fmt) * 32;
}

static at::Tensor linear_impl(int fmt, const at::Tensor& x, const at::Tensor& w, int64_t isa_arg) {
  const int isa = pick_isa(isa_arg);
  const int64_t K = weight_k(fmt, w), N = w.size(0);
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "mtp kernels: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "mtp kernels: x must be a float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "mtp kernels: x has ", x.size(1), " columns, the weight ", K);
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  Pass p{fmt, static_cast<const uint8_t*>(w.data_ptr()),
         fmt == F32 ? K * 4 : w.size(1), xc.data_ptr<float>(), K, y.data_ptr<float>(), M, N, K};
  const int nt = isa == AVX512 ? avx512::NT : isa == AVX2 ? avx2::NT : 1;
  const int64_t tiles = (N + nt - 1) / nt;
  // enough work per task that a thread pays (~128k multiply-adds); the split never changes the bits
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, nt * K * M));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    if (isa == AVX512) avx512::run(p, t0, t1);
    else if (isa == AVX2) avx2::run(p, t0, t1);
    else run_scalar(p, t0 * nt, std::min(N, t1 * nt));
  });
  return y;
}

static at::Tensor dequant_impl(int fmt, const at::Tensor& w, int64_t isa_arg) {
  const int isa = pick_isa(isa_arg);
  const int64_t K = weight_k(fmt, w), N = w.size(0);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  if (N == 0 || K == 0) return out;
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t ws = w.size(1);
  at::parallel_for(0, N, std::max<int64_t>(1, (int64_t(1) << 16) / K), [&](int64_t n0, int64_t n1) {
    if (isa == AVX512) avx512::dequant(fmt, src + n0 * ws, ws, n1 - n0, K, dst + n0 * K);
    else if (isa == AVX2) avx2::dequant(fmt, src + n0 * ws, ws, n1 - n0, K, dst + n0 * K);
    else
      for (int64_t n = n0; n < n1; n++) dequant_scalar(fmt, src + n * ws, K, dst + n * K);
  });
  return out;
}

static at::Tensor linear_i8_impl(int fmt, const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t isa_arg) {
  const int best = best_isa_i8();
  TORCH_CHECK(isa_arg <= AVX512, "mtp kernels: unknown isa ", isa_arg, " (0 scalar, 1 avx2, 2 avx512, -1 best)");
  TORCH_CHECK(isa_arg <= best, "mtp kernels: isa ", isa_arg, " is not supported by this CPU for int8 activations (best: ",
              best, ")");
  const int isa = isa_arg < 0 ? best : int(isa_arg);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == rec_bytes(fmt) &&
                  N >= 0 && w.size(0) == (N + TILE_I8 - 1) / TILE_I8,
              "mtp kernels: ", fmt_name(fmt), " int8 weights must be the i8 packing: uint8 [ceil(N/16), K/32, ",
              rec_bytes(fmt), "] (qlinear.pack_int8)");
  const int64_t K = w.size(1) * 32;
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "mtp kernels: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "mtp kernels: x must be a float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "mtp kernels: x has ", x.size(1), " columns, the weight ", K);
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  QAct a;
  quantize_rows(xc.data_ptr<float>(), K, M, K, a);
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t tiles = w.size(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 19) / std::max<int64_t>(1, TILE_I8 * K * M));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    if (isa == AVX512) avx512::run_i8(fmt, wp, a, yp, N, t0, t1);
    else if (isa == AVX2) avx2::run_i8(fmt, wp, a, yp, N, t0, t1);
    else run_i8_scalar(fmt, wp, a, yp, N, t0, t1);
  });
  return y;
}

at::Tensor linear_q8_0_i8(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t isa) {
  return linear_i8_impl(Q8_0, x, w, n, isa);
}
at::Tensor linear_q4_0_i8(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t isa) {
  return linear_i8_impl(Q4_0, x, w, n, isa);
}
at::Tensor linear_q4_1_i8(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t isa) {
  return linear_i8_impl(Q4_1, x, w, n, isa);
}

at::Tensor linear_any(int64_t fmt, bool int8, const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t isa) {
  TORCH_CHECK(fmt >= F32 && fmt <= Q4_1 && !(int8 && fmt == F32), "mtp kernels: unknown weight format ", fmt);
  return int8 ? linear_i8_impl(int(fmt), x, w, n, isa) : linear_impl(int(fmt), x, w, isa);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int64_t isa) { return linear_impl(F32, x, w, isa); }
at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& w, int64_t isa) { return linear_impl(Q8_0, x, w, isa); }
at::Tensor linear_q4_0(const at::Tensor& x, const at::Tensor& w, int64_t isa) { return linear_impl(Q4_0, x, w, isa); }
at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& w, int64_t isa) { return linear_impl(Q4_1, x, w, isa); }
at::Tensor dequantize_q8_0(const at::Tensor& w, int64_t isa) { return dequant_impl(Q8_0, w, isa); }
at::Tensor dequantize_q4_0(const at::Tensor& w, int64_t isa) { return dequant_impl(Q4_0, w, isa); }
at::Tensor dequantize_q4_1(const at::Tensor& w, int64_t isa) { return dequant_impl(Q4_1, w, isa); }

}  // namespace mtp_kernels

TORCH_LIBRARY(mtp, m) {
  m.def("cpu_isa() -> int", &mtp_kernels::cpu_isa);
  m.def("cpu_isa_i8() -> int", &mtp_kernels::cpu_isa_i8);
  m.def("linear_q8_0_i8(Tensor x, Tensor packed, int n, int isa=-1) -> Tensor");
  m.def("linear_q4_0_i8(Tensor x, Tensor packed, int n, int isa=-1) -> Tensor");
  m.def("linear_q4_1_i8(Tensor x, Tensor packed, int n, int isa=-1) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor weight, int isa=-1) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor blocks, int isa=-1) -> Tensor");
  m.def("linear_q4_0(Tensor x, Tensor blocks, int isa=-1) -> Tensor");
  m.def("linear_q4_1(Tensor x, Tensor blocks, int isa=-1) -> Tensor");
  m.def("dequantize_q8_0(Tensor blocks, int isa=-1) -> Tensor");
  m.def("dequantize_q4_0(Tensor blocks, int isa=-1) -> Tensor");
  m.def("dequantize_q4_1(Tensor blocks, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp, CPU, m) {
  m.impl("linear_f32", &mtp_kernels::linear_f32);
  m.impl("linear_q8_0", &mtp_kernels::linear_q8_0);
  m.impl("linear_q4_0", &mtp_kernels::linear_q4_0);
  m.impl("linear_q4_1", &mtp_kernels::linear_q4_1);
  m.impl("linear_q8_0_i8", &mtp_kernels::linear_q8_0_i8);
  m.impl("linear_q4_0_i8", &mtp_kernels::linear_q4_0_i8);
  m.impl("linear_q4_1_i8", &mtp_kernels::linear_q4_1_i8);
  m.impl("dequantize_q8_0", &mtp_kernels::dequantize_q8_0);
  m.impl("dequantize_q4_0", &mtp_kernels::dequantize_q4_0);
  m.impl("dequantize_q4_1", &mtp_kernels::dequantize_q4_1);
}
