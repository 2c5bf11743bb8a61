// The bodies of the batch-invariant layer ops (attention over a KV cache, RMSNorm, SiLU-gated product),
// included by layer_ops.cpp once per ISA region (scalar, AVX2, AVX-512) inside that region's namespace.
// The code is written once, as plain loops whose arithmetic is fixed (explicit fused multiply-adds, one
// summation order, one exponential, `exp_fixed`): the compiler may vectorise it differently per region,
// never change its results, so every path gives the same bits.
//
// The fixed orders:
//   dot(a, b, n): 16 lanes, lane i accumulates the products of elements c + i for c = 0, 16, 32, ... with
//     one fused multiply-add each from +0, then the lanes summed in the tree of isa.h (tree16).
//   attention, one query row (one batch row, one head, one position): the keys the mask lets it see, in
//     increasing slot order, and only those (a hidden key is skipped, not added as a zero):
//       s_j = dot(q, k_j, hd) * scale;  mx = max_j s_j;  p_j = exp_fixed(s_j - mx)
//       l = ((p_1 + p_2) + p_3) + ...   acc[d] = fma(p_j, v_j[d], acc[d]) in the same order
//       y[d] = acc[d] / l
//     So the row's result depends on its own query, its visible keys and values and their order, and on
//     nothing else: not on how many other rows share the pass, how the block is laid out (chain, tree,
//     branched mask groups), or how far the cache is padded behind the visible keys.
//   rmsnorm, one row: ss = dot(x, x, n);  r = 1 / sqrtf(ss / n + eps);  y[i] = w[i] * (x[i] * r)
//   silu_mul, one element: y = g / (1 + exp_fixed(-g)) * u

using mtp_isa::tree16;  // isa.h

// e^x in a fixed sequence of float32 operations (range reduction by ln 2 in two parts, a degree-7
// polynomial, scaling by 2^n through the exponent bits): the same bits in scalar and vector code, so the
// loops that call it vectorise on every path without changing a result (the C library's expf differs by
// CPU: glibc picks an FMA variant at run time). Relative error ~2e-7; x is clamped to [-87.3, 88.3] (the
// result stays finite and positive); NaN stays NaN.
static inline float exp_fixed(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  float r = __builtin_fmaf(n, -0.693145751953125f, x);
  r = __builtin_fmaf(n, -1.428606765330187e-06f, r);
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  p = __builtin_fmaf(p, r * r, r);
  const float e = p + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return e * scale;
}

// kIsa: the region's path (layer_ops.cpp defines it before including this file): 2 AVX-512, 1 AVX2, 0 scalar
template <int I>
static inline float dot_isa(const float* a, const float* b, int64_t n) {
  if constexpr (I == 2) {
    if (n % 16 == 0) {  // the same lanes and tree, in registers (attention's hd = 64, 128)
      __m512 v = _mm512_setzero_ps();
      for (int64_t c = 0; c < n; c += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), v);
      const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
  } else if constexpr (I == 1) {
    if (n % 16 == 0) {  // lanes 0-7 and 8-15 in two registers, then the same tree
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int64_t c = 0; c < n; c += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), hi);
      }
      const __m256 s8 = _mm256_add_ps(lo, hi);
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
  }
  float acc[16] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    for (int i = 0; i < 16; i++) acc[i] = __builtin_fmaf(a[c + i], b[c + i], acc[i]);
  for (int i = 0; c + i < n; i++) acc[i] = __builtin_fmaf(a[c + i], b[c + i], acc[i]);
  return tree16(acc);
}

static inline float dot(const float* a, const float* b, int64_t n) { return dot_isa<kIsa>(a, b, n); }

// The vector paths of `attend` (AVX2, AVX-512, hd a multiple of 16 up to 128): the same arithmetic as the
// plain loops below, operation for operation, only arranged for registers:
//   - scores for a group of keys at once (16 on AVX-512, 8 on AVX2): each key's 16 lanes by the fused
//     multiply-adds of `dot`, then the lanes of all the group's keys summed by shuffles that pair exactly the
//     lanes tree16 pairs (s8[i] = a[i] + a[i+8], s4[i] = s8[i] + s8[i+4], ...), the results put back in key order;
//   - exp_fixed on a vector: the same clamps, rounding (to nearest even), fused multiply-adds and scaling;
//   - the value sum with acc held in registers: acc[d] = fma(p_j, v_j[d], acc[d]) over the keys in order and
//     l = ((p_1 + p_2) + p_3) + ... beside it.
// A max over the lanes (the softmax's mx) can differ from the sequential max only in the sign of a zero,
// which s - mx and exp_fixed do not see. So a row's bits are those of the plain loops on every path.
template <int I>
struct Lanes;

template <int I>
  requires(I == 2)
struct Lanes<I> {  // AVX-512: one key's 16 lanes in one register; 16 keys a group
  static constexpr int G = 16;
  using V = __m512;
  static inline V exp(V x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // (-87.3 > x) ? -87.3 : x, NaN stays NaN
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), x);   // (88.3 < x) ? 88.3 : x
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
    V p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    const V e = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
  }
  // scores of keys k[0..G) (rows of hd = 16 NC floats; a null key gives garbage in its lane) into out[0..G)
  template <int NC>
  static inline void scores(const V* qv, const float* const* k, float scale, float* out) {
    V L[16];
    for (int j = 0; j < 16; j++) {
      V v = _mm512_setzero_ps();
      if (k[j])
        for (int c = 0; c < NC; c++) v = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k[j] + 16 * c), v);
      L[j] = v;
    }
    V W[8], X[4], Y[2];
    for (int p = 0; p < 8; p++)  // [s8(key 2p), s8(key 2p+1)]
      W[p] = _mm512_add_ps(_mm512_shuffle_f32x4(L[2 * p], L[2 * p + 1], 0x44),
                           _mm512_shuffle_f32x4(L[2 * p], L[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++)  // [s4(4p), s4(4p+1), s4(4p+2), s4(4p+3)]
      X[p] = _mm512_add_ps(_mm512_shuffle_f32x4(W[2 * p], W[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(W[2 * p], W[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; p++)  // block b: [s2(8p+b), s2(8p+4+b)]
      Y[p] = _mm512_add_ps(_mm512_shuffle_ps(X[2 * p], X[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(X[2 * p], X[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // block b, lane m: the sum of key 4m + b
    const V Z = _mm512_add_ps(_mm512_shuffle_ps(Y[0], Y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(Y[0], Y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(order, Z), _mm512_set1_ps(scale)));
  }
  static inline float max(const float* s, int64_t n) {
    V m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(s + i), m);  // a NaN score is skipped
    if (i < n) m = _mm512_mask_max_ps(m, __mmask16((1u << (n - i)) - 1u), _mm512_loadu_ps(s + i), m);
    float lanes[16], mx = -INFINITY;
    _mm512_storeu_ps(lanes, m);
    for (int j = 0; j < 16; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    return mx;
  }
  static inline void exp_shift(float* s, int64_t n, float mx) {  // s[i] = exp_fixed(s[i] - mx), i < n (+ padding)
    const V m = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(s + i, exp(_mm512_sub_ps(_mm512_loadu_ps(s + i), m)));
  }
  // R rows over the same keys (a unit's rows): row r's weights s[r][0..n), its output y[r]; key i counts for row r
  // only where bit r of bits[i] is set (a hidden key is skipped). The rows' chains interleave; each row's
  // arithmetic is its own: l = ((p_1 + p_2) + p_3) + ..., acc = fma(p_j, v_j, acc) over its keys in order.
  template <int NC, int R>
  static inline void values(const float* const* s, const float* const* vrow, const uint32_t* bits, int64_t n,
                            float* const* y) {
    constexpr uint32_t full = (1u << R) - 1u;
    V acc[R][NC];
    float l[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      l[r] = 0.0f;
      for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < n; i++) {
      V vv[NC];
      for (int c = 0; c < NC; c++) vv[c] = _mm512_loadu_ps(vrow[i] + 16 * c);
      const uint32_t bi = bits[i];
      if (bi == full) {
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          const float p = s[r][i];
          const V pv = _mm512_set1_ps(p);
          l[r] += p;
          for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
        }
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          if (!((bi >> r) & 1u)) continue;
          const float p = s[r][i];
          const V pv = _mm512_set1_ps(p);
          l[r] += p;
          for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const V lv = _mm512_set1_ps(l[r]);
      for (int c = 0; c < NC; c++) _mm512_storeu_ps(y[r] + 16 * c, _mm512_div_ps(acc[r][c], lv));
    }
  }
  template <int NC>
  static inline void load_q(const float* q, V* qv) {
    for (int c = 0; c < NC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
  }
  static constexpr int QREGS = 1;  // registers per 16 lanes
};

template <int I>
  requires(I == 1)
struct Lanes<I> {  // AVX2: one key's 16 lanes in two registers (0-7, 8-15); 8 keys a group
  static constexpr int G = 8;
  using V = __m256;
  static inline V exp(V x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), x);
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f), r);
    V p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    const V e = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
  }
  template <int NC>
  static inline void scores(const V* qv, const float* const* k, float scale, float* out) {
    V S8[8], X[4], Y[2];
    for (int j = 0; j < 8; j++) {
      V lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      if (k[j])
        for (int c = 0; c < NC; c++) {
          lo = _mm256_fmadd_ps(qv[2 * c], _mm256_loadu_ps(k[j] + 16 * c), lo);
          hi = _mm256_fmadd_ps(qv[2 * c + 1], _mm256_loadu_ps(k[j] + 16 * c + 8), hi);
        }
      S8[j] = _mm256_add_ps(lo, hi);
    }
    for (int p = 0; p < 4; p++)  // [s4(2p), s4(2p+1)]
      X[p] = _mm256_add_ps(_mm256_permute2f128_ps(S8[2 * p], S8[2 * p + 1], 0x20),
                           _mm256_permute2f128_ps(S8[2 * p], S8[2 * p + 1], 0x31));
    for (int p = 0; p < 2; p++)  // block b: [s2(4p+b), s2(4p+2+b)]
      Y[p] = _mm256_add_ps(_mm256_shuffle_ps(X[2 * p], X[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(X[2 * p], X[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // block b, lane m: the sum of key 2m + b
    const V Z = _mm256_add_ps(_mm256_shuffle_ps(Y[0], Y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(Y[0], Y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_permutevar8x32_ps(Z, order), _mm256_set1_ps(scale)));
  }
  static inline float max(const float* s, int64_t n) {
    V m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + i), m);
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    return mx;
  }
  static inline void exp_shift(float* s, int64_t n, float mx) {
    const V m = _mm256_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(s + i, exp(_mm256_sub_ps(_mm256_loadu_ps(s + i), m)));
  }
  template <int NC, int R>
  static inline void values(const float* const* s, const float* const* vrow, const uint32_t* bits, int64_t n,
                            float* const* y) {
    constexpr uint32_t full = (1u << R) - 1u;
    V acc[R][2 * NC];
    float l[R];
    for (int r = 0; r < R; r++) {
      l[r] = 0.0f;
      for (int c = 0; c < 2 * NC; c++) acc[r][c] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n; i++) {
      const uint32_t bi = bits[i];
      for (int r = 0; r < R; r++) {
        if (bi != full && !((bi >> r) & 1u)) continue;
        const float p = s[r][i];
        const V pv = _mm256_set1_ps(p);
        l[r] += p;
        for (int c = 0; c < 2 * NC; c++) acc[r][c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vrow[i] + 8 * c), acc[r][c]);
      }
    }
    for (int r = 0; r < R; r++) {
      const V lv = _mm256_set1_ps(l[r]);
      for (int c = 0; c < 2 * NC; c++) _mm256_storeu_ps(y[r] + 8 * c, _mm256_div_ps(acc[r][c], lv));
    }
  }
  template <int NC>
  static inline void load_q(const float* q, V* qv) {
    for (int c = 0; c < 2 * NC; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);
  }
  static constexpr int QREGS = 2;
};

// The vector path for one unit: the rows of KV head kvh of batch row b at positions t0 .. t1 - 1 (each position's
// group of query heads), which all read the same cache row. The keys any of them sees, in slot order, are taken
// once for all the rows: a group of keys (L::G) is scored against every row while it sits in L1, and the value
// sum runs over the keys once per batch of rows. Scores for a key a row does not see are computed and then
// dropped (each key's score is its own dot product: the others in its group change nothing); the softmax and
// the value sum of a row read its visible keys only, in slot order. So each row's arithmetic is the one-row
// arithmetic above, whichever rows share its unit.
struct Scratch {
  std::vector<const float*> krows, vrows;
  std::vector<uint8_t> vis;  // [rows, keys of the unit]: row r sees key i
  std::vector<uint8_t> any;
  std::vector<int64_t> slots;
  std::vector<float> s;  // [rows, keys + padding]
  std::vector<uint32_t> bits;
  std::vector<int64_t> nvis;
};

template <int I, int NC, int R>
static inline void values_rows(int64_t R_, const float* const* s, const float* const* vrow, const uint32_t* bits,
                               int64_t n, float* const* y) {
  if constexpr (R > 1) {
    if (R_ < R) return values_rows<I, NC, R - 1>(R_, s, vrow, bits, n, y);
  }
  Lanes<I>::template values<NC, R>(s, vrow, bits, n, y);
}

template <int I, int NC>
static void attend_unit(const Attn& a, int64_t b, int64_t kvh, int64_t t0, int64_t t1, Scratch& w) {
  using L = Lanes<I>;
  constexpr int fit = (I == 2 ? 24 : 12) / (NC * (I == 2 ? 1 : 2));  // accumulators that stay in registers
  constexpr int RB = fit < 1 ? 1 : fit > 8 ? 8 : fit;                // rows per value pass
  const int64_t group = a.H / a.Hkv, S = a.S, nr = (t1 - t0) * group;
  const int64_t kr = a.krow ? a.krow[b] : b;  // the batch row's cache row
  const float* kb = a.k + kr * a.ks[0] + kvh * a.ks[1];
  const float* vb = a.v + kr * a.vs[0] + kvh * a.vs[1];
  const int64_t ms3 = a.ms[3];
  // which slots each row sees (rows r = (t - t0) * group + (h - kvh * group)), and their union
  w.vis.resize(nr * S);
  w.any.assign(S, 0);
  for (int64_t r = 0; r < nr; r++) {
    const int64_t t = t0 + r / group, h = kvh * group + r % group;
    const uint8_t* mrow = a.mask + b * a.ms[0] + h * a.ms[1] + t * a.ms[2];
    uint8_t* vr = w.vis.data() + r * S;
    if (r % group && a.ms[1] == 0) {
      std::memcpy(vr, vr - S, S);  // the heads at one position share the mask
      continue;
    }
    if (ms3 == 1)
      for (int64_t j = 0; j < S; j++) vr[j] = mrow[j] != 0;
    else
      for (int64_t j = 0; j < S; j++) vr[j] = mrow[j * ms3] != 0;
    uint8_t* any = w.any.data();
    for (int64_t j = 0; j < S; j++) any[j] |= vr[j];
  }
  w.slots.resize(S);
  int64_t n = 0;
  for (int64_t j = 0; j < S; j++)
    if (w.any[j]) w.slots[n++] = j;
  const int64_t pad = n + 2 * L::G;  // room for the last group and exp_shift's padding
  w.krows.resize(n), w.vrows.resize(n), w.s.resize(nr * pad), w.bits.resize(n), w.nvis.resize(nr);
  for (int64_t i = 0; i < n; i++) w.krows[i] = kb + w.slots[i] * a.ks[2], w.vrows[i] = vb + w.slots[i] * a.vs[2];
  for (int64_t r = 0; r < nr; r++) {  // compact each row's visibility to the union's keys
    uint8_t* vr = w.vis.data() + r * S;
    if (n < S)
      for (int64_t i = 0; i < n; i++) vr[i] = vr[w.slots[i]];
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += vr[i];
    w.nvis[r] = c;
  }
  auto row_q = [&](int64_t r) {
    return a.q + b * a.qs[0] + (kvh * group + r % group) * a.qs[1] + (t0 + r / group) * a.qs[2];
  };
  auto row_y = [&](int64_t r) { return a.y + ((b * a.T + t0 + r / group) * a.H + kvh * group + r % group) * a.hd; };
  // scores: each group of keys against every row
  const float* keys[L::G];
  typename L::V qv[NC * L::QREGS];
  for (int64_t i = 0; i < n; i += L::G) {
    for (int j = 0; j < L::G; j++) keys[j] = i + j < n ? w.krows[i + j] : nullptr;
    for (int64_t r = 0; r < nr; r++) {
      L::template load_q<NC>(row_q(r), qv);
      L::template scores<NC>(qv, keys, a.scale, w.s.data() + r * pad + i);
    }
  }
  // each row's softmax weights over the keys it sees
  for (int64_t r = 0; r < nr; r++) {
    float* s = w.s.data() + r * pad;
    const uint8_t* vr = w.vis.data() + r * S;
    if (w.nvis[r] < n)
      for (int64_t i = 0; i < n; i++) s[i] = vr[i] ? s[i] : -INFINITY;
    L::exp_shift(s, n, L::max(s, n));
  }
  // the value sums, RB rows at a time
  for (int64_t r0 = 0; r0 < nr; r0 += RB) {
    const int64_t R = std::min<int64_t>(RB, nr - r0);
    const float* sr[8];
    float* yr[8];
    for (int64_t r = 0; r < R; r++) sr[r] = w.s.data() + (r0 + r) * pad, yr[r] = row_y(r0 + r);
    uint32_t* bits = w.bits.data();
    for (int64_t i = 0; i < n; i++) bits[i] = 0;
    for (int64_t r = 0; r < R; r++) {
      const uint8_t* vr = w.vis.data() + (r0 + r) * S;
      for (int64_t i = 0; i < n; i++) bits[i] |= uint32_t(vr[i]) << r;
    }
    values_rows<I, NC, RB>(R, sr, w.vrows.data(), w.bits.data(), n, yr);
    for (int64_t r = 0; r < R; r++)
      if (w.nvis[r0 + r] == 0)  // a row that sees no key (never in decoding): zeros
        for (int64_t d = 0; d < a.hd; d++) yr[r][d] = 0.0f;
  }
}

using UnitFn = void (*)(const Attn&, int64_t, int64_t, int64_t, int64_t, Scratch&);

// the vector path for hd = 16 NC (up to 128), or nullptr (another hd, or the scalar path)
template <int I>
static UnitFn vec_unit(int64_t hd) {
  if constexpr (I >= 1) {
    switch (hd) {
      case 16: return &attend_unit<I, 1>;
      case 32: return &attend_unit<I, 2>;
      case 48: return &attend_unit<I, 3>;
      case 64: return &attend_unit<I, 4>;
      case 80: return &attend_unit<I, 5>;
      case 96: return &attend_unit<I, 6>;
      case 112: return &attend_unit<I, 7>;
      case 128: return &attend_unit<I, 8>;
      default: return nullptr;
    }
  }
  return nullptr;
}

// units u0..u1 of the pass: unit u = (batch row b, KV head kvh, chunk c of the positions), u = (b * Hkv + kvh) *
// chunks + c, takes the query rows of kvh's heads at the chunk's positions; which unit a row falls in, and which
// thread takes it, changes none of its bits
static void attend(const Attn& a, int64_t chunks, int64_t u0, int64_t u1) {
  const int64_t group = a.H / a.Hkv, S = a.S;
  const UnitFn vec = vec_unit<kIsa>(a.hd);
  Scratch w;
  std::vector<float> sbuf(vec ? 0 : S), acc(vec ? 0 : a.hd);
  std::vector<int64_t> idx(vec ? 0 : S);
  for (int64_t u = u0; u < u1; u++) {
    const int64_t b = u / (a.Hkv * chunks), kvh = (u / chunks) % a.Hkv, c = u % chunks;
    const int64_t t0 = c * a.T / chunks, t1 = (c + 1) * a.T / chunks;
    if (t0 == t1) continue;
    if (vec) {
      vec(a, b, kvh, t0, t1, w);
      continue;
    }
    const int64_t kr = a.krow ? a.krow[b] : b;  // the batch row's cache row
    const float* kb = a.k + kr * a.ks[0] + kvh * a.ks[1];
    const float* vb = a.v + kr * a.vs[0] + kvh * a.vs[1];
    for (int64_t t = t0; t < t1; t++)
      for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
        const uint8_t* mrow = a.mask + b * a.ms[0] + h * a.ms[1] + t * a.ms[2];
        float* s = sbuf.data();
        const float* q = a.q + b * a.qs[0] + h * a.qs[1] + t * a.qs[2];
        float* y = a.y + ((b * a.T + t) * a.H + h) * a.hd;
        int64_t n = 0;
        float mx = -INFINITY;
        for (int64_t j = 0; j < S; j++) {
          if (!mrow[j * a.ms[3]]) continue;
          const float sc = dot(q, kb + j * a.ks[2], a.hd) * a.scale;
          s[n] = sc;
          idx[n++] = j;
          mx = sc > mx ? sc : mx;
        }
        if (n == 0) {  // a row that sees no key (never in decoding): zeros
          for (int64_t d = 0; d < a.hd; d++) y[d] = 0.0f;
          continue;
        }
        for (int64_t i = 0; i < n; i++) s[i] = exp_fixed(s[i] - mx);
        float l = 0.0f;
        for (int64_t d = 0; d < a.hd; d++) acc[d] = 0.0f;
        for (int64_t i = 0; i < n; i++) {
          const float p = s[i];
          const float* v = vb + idx[i] * a.vs[2];
          l += p;
          for (int64_t d = 0; d < a.hd; d++) acc[d] = __builtin_fmaf(p, v[d], acc[d]);
        }
        for (int64_t d = 0; d < a.hd; d++) y[d] = acc[d] / l;
      }
  }
}

static void rmsnorm_rows(const float* x, int64_t xs, const float* w, float* y, int64_t n, float eps, int64_t m0,
                         int64_t m1) {
  for (int64_t m = m0; m < m1; m++) {
    const float* xr = x + m * xs;
    float* yr = y + m * n;
    const float r = 1.0f / sqrtf(dot(xr, xr, n) / float(n) + eps);
    for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * r);
  }
}

static void silu_mul_rows(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t n, int64_t m0,
                          int64_t m1) {
  for (int64_t m = m0; m < m1; m++) {
    const float* gr = g + m * gs;
    const float* ur = u + m * us;
    float* yr = y + m * n;
    for (int64_t i = 0; i < n; i++) yr[i] = gr[i] / (1.0f + exp_fixed(-gr[i])) * ur[i];
  }
}
