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

static void attend(const Attn& a, int64_t r0, int64_t r1) {
  std::vector<float> s(a.S);
  std::vector<int64_t> idx(a.S);
  std::vector<float> acc(a.hd);
  const int64_t group = a.H / a.Hkv;
  for (int64_t r = r0; r < r1; r++) {
    const int64_t b = r / (a.H * a.T), h = (r / a.T) % a.H, t = r % a.T, kvh = h / group;
    const float* q = a.q + b * a.qs[0] + h * a.qs[1] + t * a.qs[2];
    const int64_t kr = a.krow ? a.krow[b] : b;  // the batch row's cache row
    const float* kb = a.k + kr * a.ks[0] + kvh * a.ks[1];
    const float* vb = a.v + kr * a.vs[0] + kvh * a.vs[1];
    const uint8_t* mrow = a.mask + b * a.ms[0] + h * a.ms[1] + t * a.ms[2];
    float* y = a.y + ((b * a.T + t) * a.H + h) * a.hd;
    int64_t n = 0;
    float mx = -INFINITY;
    for (int64_t j = 0; j < a.S; j++) {
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
