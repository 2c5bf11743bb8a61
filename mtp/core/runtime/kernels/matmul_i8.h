// The int8-activation variant (ops linear_*_i8), included by matmul.cpp after its float32 kernels.
//
// Activations are quantised per row per 32-block, as ggml's Q8 activation blocks are, but with a float32
// scale and round-half-even: d = amax / 127, q = nearbyint(x * (1 / d)) in [-127, 127] (a block holding a
// NaN or an infinity gets d = NaN, so its outputs are NaN, as float32 math would give). Quantising a row is
// a function of that row alone (SSE2 code shared by every path).
//
// Weights come in the "i8 packing" (mtp.core.runtime.kernels.qlinear.pack_int8): a byte permutation of the GGUF
// blocks, 16 output columns interleaved so one integer dot-product instruction serves 16 columns. Record
// (tile t of 16 columns, block b), tiles outermost:
//   Q8_0: qs[8][16][4] (group g = elements 4g..4g+3 of column c's block) | d[16] fp16        544 bytes
//   Q4_0: qs[4][16][4] (byte i of group g: column c's block byte 4g+i, whose low nibble is element 4g+i and
//         high nibble element 16+4g+i)                                      | d[16]          288 bytes
//   Q4_1: as Q4_0                                                          | d[16] | m[16]  320 bytes
//
// The one reduction order per output element (every ISA, every M, every split), blocks in increasing b:
//   p_b = sum over the block of W * q          (an exact integer; W = Q8_0 q, Q4_0 q - 8, Q4_1 q)
//   acc = fma(float(p_b), d_w * d_x, acc)      (acc starts at +0)
//   acc = fma(float(s_b) * d_x, m_w, acc)      (Q4_1 only: its m term, s_b = the block's sum of q)
// Integer sums are exact in any order, so the AVX-512 VNNI (vpdpbusd), AVX2 (maddubs) and scalar paths
// give the same bits. Results differ from the float32-activation ops by the activation rounding.

namespace mtp_kernels {

constexpr int64_t TILE_I8 = 16;

constexpr int64_t rec_bytes(int f) { return f == Q8_0 ? 544 : f == Q4_0 ? 288 : 320; }
constexpr int64_t qs_bytes(int f) { return f == Q8_0 ? 512 : 256; }

struct QAct {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> dx;     // [M, nb]
  std::vector<float> sxd;    // [M, nb]: float(s_b) * d_x (Q4_1's m term)
  std::vector<int32_t> s8;   // [M, nb]: -8 * s_b (Q4_0's offset)
  std::vector<int32_t> s128; // [M, nb]: -128 * s_b (Q8_0 on AVX-512: its weights taken as w + 128, unsigned)
};

static void quantize_rows(const float* x, int64_t xs, int64_t M, int64_t K, QAct& a) {
  a.M = M, a.K = K, a.nb = K / 32;
  a.q.resize(M * K), a.dx.resize(M * a.nb), a.sxd.resize(M * a.nb), a.s8.resize(M * a.nb), a.s128.resize(M * a.nb);
  const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff)), inf = _mm_set1_ps(INFINITY);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < a.nb; b++) {
      const float* xb = x + m * xs + 32 * b;
      __m128 amax = _mm_setzero_ps(), bad = _mm_setzero_ps();
      for (int i = 0; i < 32; i += 4) {
        const __m128 v = _mm_loadu_ps(xb + i), av = _mm_and_ps(v, absmask);
        amax = _mm_max_ps(amax, av);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(v, v), _mm_cmpeq_ps(av, inf)));
      }
      float lanes[4];
      _mm_storeu_ps(lanes, amax);
      const float mx = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
      const bool finite = _mm_movemask_ps(bad) == 0;
      const float d = finite ? mx / 127.0f : NAN;
      const float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
      const __m128 idv = _mm_set1_ps(id);
      int8_t* q = a.q.data() + m * K + 32 * b;
      for (int i = 0; i < 32; i += 8) {  // cvtps rounds half to even (the default MXCSR mode)
        __m128i lo = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(xb + i), idv));
        __m128i hi = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(xb + i + 4), idv));
        if (!finite) lo = hi = _mm_setzero_si128();
        const __m128i p = _mm_packs_epi16(_mm_packs_epi32(lo, hi), _mm_setzero_si128());
        std::memcpy(q + i, &p, 8);
      }
      int s = 0;
      for (int i = 0; i < 32; i++) {
        if (q[i] < -127) q[i] = -127;  // cannot occur (|x| * id <= 127 + rounding)
        s += q[i];
      }
      a.dx[m * a.nb + b] = d;
      a.sxd[m * a.nb + b] = float(s) * d;
      a.s8[m * a.nb + b] = -8 * s;
      a.s128[m * a.nb + b] = -128 * s;
    }
  }
}

// integer weight value of element k (0..31) of column c in a packed record
static inline int weight_int_packed(int fmt, const uint8_t* rec, int c, int k) {
  const int g = k / 4, i = k % 4;
  if (fmt == Q8_0) return int(int8_t(rec[64 * g + 4 * c + i]));
  const uint8_t byte = rec[64 * (g % 4) + 4 * c + i];
  const int nib = g < 4 ? byte & 0xF : byte >> 4;
  return fmt == Q4_0 ? nib - 8 : nib;
}

static void run_i8_scalar(int fmt, const uint8_t* w, const QAct& a, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t nb = a.nb, rb = rec_bytes(fmt);
  for (int64_t t = t0; t < t1; t++) {
    for (int c = 0; c < TILE_I8 && t * TILE_I8 + c < N; c++) {
      for (int64_t m = 0; m < a.M; m++) {
        const int8_t* q = a.q.data() + m * a.K;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
          const uint8_t* rec = w + (t * nb + b) * rb;
          int p = 0;
          for (int k = 0; k < 32; k++) p += weight_int_packed(fmt, rec, c, k) * q[32 * b + k];
          const float dw = half_to_float(load_u16(rec + qs_bytes(fmt) + 2 * c));
          acc = std::fma(float(p), dw * a.dx[m * nb + b], acc);
          if (fmt == Q4_1) acc = std::fma(a.sxd[m * nb + b], half_to_float(load_u16(rec + qs_bytes(fmt) + 32 + 2 * c)), acc);
        }
        y[m * N + t * TILE_I8 + c] = acc;
      }
    }
  }
}

}  // namespace mtp_kernels

// ---------------------------------------------------------------------------------------------- AVX2 (int8)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace mtp_kernels {
namespace avx2 {

static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// MT rows x 8 columns (half h of tile t), the whole of K
template <int F, int MT>
static void tile_i8(const uint8_t* w, const QAct& a, int64_t m0, int64_t t, int h, float* y, int64_t ys, int64_t cols) {
  const int64_t nb = a.nb, rb = rec_bytes(F);
  const __m256i ones16 = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + (t * nb + b) * rb;
    _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * rb), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * rb + 64), _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + qs_bytes(F) + 16 * h)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (F == Q4_1)
      mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + qs_bytes(F) + 32 + 16 * h)));
    if constexpr (F == Q8_0) {
      for (int m = 0; m < MT; m++) {
        const int8_t* xq = a.q.data() + (m0 + m) * a.K + 32 * b;
        __m256i p = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
          const __m256i wg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * g + 32 * h));
          const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(wg), _mm256_sign_epi8(bcast4(xq + 4 * g), wg));
          p = _mm256_add_epi32(p, _mm256_madd_epi16(prod, ones16));  // pairs reach 2 * 128 * 127: madd each
        }
        const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(a.dx[(m0 + m) * nb + b]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc[m]);
      }
    } else {
      __m256i wq[8];
      for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * g + 32 * h));
        wq[g] = _mm256_and_si256(v, low4);
        wq[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      for (int m = 0; m < MT; m++) {
        const int64_t row = m0 + m;
        const int8_t* xq = a.q.data() + row * a.K + 32 * b;
        __m256i s16 = _mm256_maddubs_epi16(wq[0], bcast4(xq));
        for (int g = 1; g < 8; g++)  // 16-bit sums stay below 8 * 2 * 15 * 127 = 30480: no overflow
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wq[g], bcast4(xq + 4 * g)));
        __m256i p = _mm256_madd_epi16(s16, ones16);
        if constexpr (F == Q4_0) p = _mm256_add_epi32(p, _mm256_set1_epi32(a.s8[row * nb + b]));
        const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(a.dx[row * nb + b]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc[m]);
        if constexpr (F == Q4_1) acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(a.sxd[row * nb + b]), mw, acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) {
    if (cols >= 8) {
      _mm256_storeu_ps(y + m * ys, acc[m]);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, acc[m]);
      std::memcpy(y + m * ys, tmp, cols * sizeof(float));
    }
  }
}

constexpr int MT_I8 = 4;

template <int F>
static void run_i8_fmt(const uint8_t* w, const QAct& a, float* y, int64_t N, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; t++)
    for (int h = 0; h < 2; h++) {
      const int64_t n0 = t * TILE_I8 + 8 * h, cols = std::min<int64_t>(8, N - n0);
      if (cols <= 0) break;
      int64_t m = 0;
      for (; m + MT_I8 <= a.M; m += MT_I8) tile_i8<F, MT_I8>(w, a, m, t, h, y + m * N + n0, N, cols);
      switch (a.M - m) {
        case 3: tile_i8<F, 3>(w, a, m, t, h, y + m * N + n0, N, cols); break;
        case 2: tile_i8<F, 2>(w, a, m, t, h, y + m * N + n0, N, cols); break;
        case 1: tile_i8<F, 1>(w, a, m, t, h, y + m * N + n0, N, cols); break;
        default: break;
      }
    }
}

static void run_i8(int fmt, const uint8_t* w, const QAct& a, float* y, int64_t N, int64_t t0, int64_t t1) {
  switch (fmt) {
    case Q8_0: return run_i8_fmt<Q8_0>(w, a, y, N, t0, t1);
    case Q4_0: return run_i8_fmt<Q4_0>(w, a, y, N, t0, t1);
    default: return run_i8_fmt<Q4_1>(w, a, y, N, t0, t1);
  }
}

}  // namespace avx2
}  // namespace mtp_kernels
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX-512 VNNI (int8)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace mtp_kernels {
namespace avx512 {

static inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MT rows x the 16 columns of tile t, the whole of K. The row loop is unrolled so the MT accumulators stay in
// registers and the rows' dot-product chains interleave. Q8_0: vpdpbusd wants one unsigned side; the weights
// are taken as w + 128 (w xor 0x80, once per block for all the rows) and 128 * (the block's sum of x) comes back
// off as the start value (exact integers, so the same p_b).
template <int F, int MT>
static void tile_i8(const uint8_t* w, const QAct& a, int64_t m0, int64_t t, float* y, int64_t ys, int64_t cols) {
  const int64_t nb = a.nb, rb = rec_bytes(F), K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F), sign8 = _mm512_set1_epi8(char(0x80));
  const int8_t* xq0 = a.q.data() + m0 * K;
  const float* dx0 = a.dx.data() + m0 * nb;
  const float* sxd0 = a.sxd.data() + m0 * nb;
  const int32_t* off0 = (F == Q8_0 ? a.s128.data() : a.s8.data()) + m0 * nb;
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + (t * nb + b) * rb;
    for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * rb + o), _MM_HINT_T0);
    __m512i wq[8];
    if constexpr (F == Q8_0) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) wq[g] = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * g), sign8);
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(rec + 64 * g);
        wq[g] = _mm512_and_si512(v, low4);
        wq[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + qs_bytes(F))));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (F == Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + qs_bytes(F) + 32)));
#pragma GCC unroll 16
    for (int m = 0; m < MT; m++) {
      const int8_t* xq = xq0 + m * K + 32 * b;
      __m512i p = F == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(off0[m * nb + b]);
#pragma GCC unroll 8
      for (int g = 0; g < 8; g++) p = _mm512_dpbusd_epi32(p, wq[g], bcast4(xq + 4 * g));
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(dx0[m * nb + b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dd, acc[m]);
      if constexpr (F == Q4_1) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(sxd0[m * nb + b]), mw, acc[m]);
    }
  }
  const __mmask16 keep = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u);
#pragma GCC unroll 16
  for (int m = 0; m < MT; m++) _mm512_mask_storeu_ps(y + m * ys, keep, acc[m]);
}

constexpr int MT_I8 = 16;

// rows m .. m + R - 1 (R = 1 .. MT_I8) against tile t
template <int F, int R = MT_I8>
static inline void tile_rows(const uint8_t* w, const QAct& a, int64_t m, int64_t R_, int64_t t, float* y, int64_t N,
                             int64_t cols) {
  if constexpr (R > 1) {
    if (R_ < R) return tile_rows<F, R - 1>(w, a, m, R_, t, y, N, cols);
  }
  tile_i8<F, R>(w, a, m, t, y, N, cols);
}

template <int F>
static void run_i8_fmt(const uint8_t* w, const QAct& a, float* y, int64_t N, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; t++) {
    const int64_t n0 = t * TILE_I8, cols = std::min<int64_t>(TILE_I8, N - n0);
    for (int64_t m = 0; m < a.M; m += MT_I8)
      tile_rows<F>(w, a, m, std::min<int64_t>(MT_I8, a.M - m), t, y + m * N + n0, N, cols);
  }
}

static void run_i8(int fmt, const uint8_t* w, const QAct& a, float* y, int64_t N, int64_t t0, int64_t t1) {
  switch (fmt) {
    case Q8_0: return run_i8_fmt<Q8_0>(w, a, y, N, t0, t1);
    case Q4_0: return run_i8_fmt<Q4_0>(w, a, y, N, t0, t1);
    default: return run_i8_fmt<Q4_1>(w, a, y, N, t0, t1);
  }
}

}  // namespace avx512
}  // namespace mtp_kernels
#pragma GCC pop_options
