// Batch-invariant layer ops beside the matmul kernels (see mtp/core/runtime/kernels/__init__.py), as torch custom ops:
//
//   mtp::attention(q [B, H, T, hd], k [B, Hkv, S, hd], v [B, Hkv, S, hd], mask [B, 1 or H, T, S] bool, scale)
//       -> [B, T, H, hd]       softmax(q k^T * scale over the keys the mask shows) v, one query row at a time
//   mtp::rmsnorm(x [M, n], w [n], eps) -> [M, n]
//   mtp::silu_mul(g [M, n], u [M, n]) -> [M, n]       silu(g) * u (SwiGLU's product)
//   mtp::rope(x [B, T, n, hd], cos, sin [B, 1, T, hd]) -> [B, n, T, hd]   rotary embedding, per head
//   mtp::kv_write(kc, vc [rows, Hkv, capacity, hd], rows [B], positions [B, T], k, v [B, Hkv, T, hd])
//       writes a block into the KV cache in place
//
// attention, rmsnorm and silu_mul take an `isa` argument like the matmul ops (-1 = the best this CPU runs). Their fixed arithmetic is
// stated in layer_ops.h; a row's bits depend on that row's inputs alone, never on the other rows, the thread
// split (threads take whole rows; in attention, the query rows of one KV head at a chunk of positions) or the ISA
// path.
// Inputs may be strided views (the innermost dimension contiguous): q is a transposed projection, k and v are
// slices of the KV cache, the mask may be expanded.
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

namespace mtp_layer_ops {

struct Attn {
  const float* q;
  int64_t qs[3];  // strides of q's B, H, T
  const float* k;
  int64_t ks[3];  // strides of k's row, Hkv, S
  const float* v;
  int64_t vs[3];
  const uint8_t* mask;
  int64_t ms[4];  // strides of the mask's B, H (0 when broadcast), T, S
  float* y;       // [B, T, H, hd]
  int64_t B, H, Hkv, T, S, hd;
  float scale;
  const int64_t* krow;  // batch row -> key/value row (nullptr: the same)
};

namespace scalar {
constexpr int kIsa = 0;
#include "layer_ops.h"
}  // namespace scalar

}  // namespace mtp_layer_ops

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace mtp_layer_ops {
namespace avx2 {
constexpr int kIsa = 1;
#include "layer_ops.h"
}  // namespace avx2
}  // namespace mtp_layer_ops
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace mtp_layer_ops {
namespace avx512 {
constexpr int kIsa = 2;
#include "layer_ops.h"
}  // namespace avx512
}  // namespace mtp_layer_ops
#pragma GCC pop_options

namespace mtp_layer_ops {

static int pick(int64_t isa) { return mtp_isa::pick_isa(isa); }  // isa.h: the matmuls' choice too

static void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim, "mtp layer ops: ", name,
              " must be a float32 CPU tensor of ", dim, " dimensions");
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "mtp layer ops: ", name, "'s last dimension must be contiguous");
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     double scale, int64_t isa_arg) {
  const int isa = pick(isa_arg);
  check_float(q, "q", 4);
  check_float(k, "k", 4);
  check_float(v, "v", 4);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.device().is_cpu(),
              "mtp layer ops: mask must be a bool [B, 1 or H, T, S] CPU tensor");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == hd &&
                  v.size(3) == hd,
              "mtp layer ops: k and v must be [B, Hkv, S, hd] with q's B and hd");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "mtp layer ops: ", H, " query heads cannot share ", Hkv, " key heads");
  TORCH_CHECK(mask.size(0) == B && (mask.size(1) == 1 || mask.size(1) == H) && mask.size(2) == T &&
                  mask.size(3) == S,
              "mtp layer ops: mask must be [B, 1 or H, T, S] = [", B, ", 1, ", T, ", ", S, "]");
  at::Tensor y = at::empty({B, T, H, hd}, q.options());
  if (y.numel() == 0) return y;
  attend_into(q, k, v, mask, S, scale, nullptr, y, isa);
  return y;
}

void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, int64_t S,
                 double scale, const int64_t* krow, at::Tensor& y, int isa) {
  const Attn a{q.data_ptr<float>(),
               {q.stride(0), q.stride(1), q.stride(2)},
               k.data_ptr<float>(),
               {k.stride(0), k.stride(1), k.stride(2)},
               v.data_ptr<float>(),
               {v.stride(0), v.stride(1), v.stride(2)},
               reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()),
               {mask.stride(0), mask.size(1) == 1 ? 0 : mask.stride(1), mask.stride(2), mask.stride(3)},
               y.data_ptr<float>(),
               q.size(0),
               q.size(1),
               k.size(1),
               q.size(2),
               S,
               q.size(3),
               float(scale),
               krow};
  // units (batch row, KV head, chunk of positions): the query rows of the KV head's heads at those positions, which
  // read the same keys and values (taken once for all of them). Chunks of at most 16 positions, and enough units
  // that every thread gets some; how the rows fall into units changes no row's bits (layer_ops.h)
  const int64_t pairs = a.B * a.Hkv, threads = at::get_num_threads();
  const int64_t chunks = std::min<int64_t>(a.T, std::max<int64_t>((a.T + 15) / 16, (2 * threads + pairs - 1) / pairs));
  const int64_t units = pairs * chunks;
  const int64_t per_unit = a.S * a.hd * a.H / a.Hkv * ((a.T + chunks - 1) / chunks);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, per_unit));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    if (isa == 2) avx512::attend(a, chunks, u0, u1);
    else if (isa == 1) avx2::attend(a, chunks, u0, u1);
    else scalar::attend(a, chunks, u0, u1);
  });
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t isa_arg) {
  const int isa = pick(isa_arg);
  check_float(x, "x", 2);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1),
              "mtp layer ops: rmsnorm weight must be a contiguous float32 [n] tensor, n = x's columns");
  const int64_t M = x.size(0), n = x.size(1);
  at::Tensor y = at::empty({M, n}, x.options());
  if (y.numel() == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float e = float(eps);
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, n)), [&](int64_t m0, int64_t m1) {
    if (isa == 2) avx512::rmsnorm_rows(xp, xs, wp, yp, n, e, m0, m1);
    else if (isa == 1) avx2::rmsnorm_rows(xp, xs, wp, yp, n, e, m0, m1);
    else scalar::rmsnorm_rows(xp, xs, wp, yp, n, e, m0, m1);
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u, int64_t isa_arg) {
  const int isa = pick(isa_arg);
  check_float(g, "g", 2);
  check_float(u, "u", 2);
  TORCH_CHECK(g.sizes() == u.sizes(), "mtp layer ops: silu_mul's g and u must have one shape");
  const int64_t M = g.size(0), n = g.size(1);
  at::Tensor y = at::empty({M, n}, g.options());
  if (y.numel() == 0) return y;
  const float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t gs = g.stride(0), us = u.stride(0);
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t(1) << 13) / std::max<int64_t>(1, n)), [&](int64_t m0, int64_t m1) {
    if (isa == 2) avx512::silu_mul_rows(gp, gs, up, us, yp, n, m0, m1);
    else if (isa == 1) avx2::silu_mul_rows(gp, gs, up, us, yp, n, m0, m1);
    else scalar::silu_mul_rows(gp, gs, up, us, yp, n, m0, m1);
  });
  return y;
}

// rotary embedding of x [B, T, n, hd] (a projection's output seen per head) into [B, n, T, hd]:
// y[d] = x[d] * cos[d] + r[d] * sin[d], r = (-x[hd/2:], x[:hd/2]), each product and the sum rounded on its
// own (no fused multiply-add), as torch's `x * cos + rotate_half(x) * sin`. cos, sin: [B, 1, T, hd].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "x", 4);
  check_float(cos, "cos", 4);
  check_float(sin, "sin", 4);
  const int64_t B = x.size(0), T = x.size(1), n = x.size(2), hd = x.size(3), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0 && cos.size(0) == B && cos.size(2) == T && cos.size(3) == hd && sin.sizes() == cos.sizes(),
              "mtp layer ops: rope needs cos and sin [B, 1, T, hd] for x [B, T, n, hd], hd even");
  at::Tensor y = at::empty({B, n, T, hd}, x.options());
  if (y.numel() == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < n; h++)
      for (int64_t t = 0; t < T; t++) {
        const float* xr = xp + b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
        const float* c = cp + b * cos.stride(0) + t * cos.stride(2);
        const float* s = sp + b * sin.stride(0) + t * sin.stride(2);
        float* yr = yp + ((b * n + h) * T + t) * hd;
        for (int64_t d = 0; d < half; d++) {
          const float a = xr[d] * c[d], r = -xr[d + half] * s[d];
          yr[d] = a + r;
        }
        for (int64_t d = half; d < hd; d++) {
          const float a = xr[d] * c[d], r = xr[d - half] * s[d];
          yr[d] = a + r;
        }
      }
  return y;
}

// write a block's keys and values [B, Hkv, T, hd] into cache buffers [rows, Hkv, capacity, hd] at cache row
// rows[b] and slot positions[b, t] (what `cache[rows, :, positions] = k.transpose(1, 2)` does), in place.
void kv_write(at::Tensor kc, at::Tensor vc, const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& k,
              const at::Tensor& v) {
  check_float(k, "k", 4);
  check_float(v, "v", 4);
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat && kc.dim() == 4 &&
                  vc.sizes() == kc.sizes() && vc.scalar_type() == at::kFloat,
              "mtp layer ops: the cache buffers must be contiguous float32 [rows, Hkv, capacity, hd]");
  const int64_t B = k.size(0), H = k.size(1), T = k.size(2), hd = k.size(3), cap = kc.size(2);
  TORCH_CHECK(v.sizes() == k.sizes() && kc.size(1) == H && kc.size(3) == hd, "mtp layer ops: k, v and cache disagree");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == B &&
                  positions.scalar_type() == at::kLong && positions.dim() == 2 && positions.size(0) == B &&
                  positions.size(1) == T,
              "mtp layer ops: rows must be int64 [B] and positions int64 [B, T]");
  const at::Tensor rc = rows.contiguous(), pc = positions.contiguous();
  const int64_t* r = rc.data_ptr<int64_t>();
  const int64_t* p = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(r[b] >= 0 && r[b] < kc.size(0), "mtp layer ops: cache row ", r[b], " out of range");
    for (int64_t t = 0; t < T; t++)
      TORCH_CHECK(p[b * T + t] >= 0 && p[b * T + t] < cap, "mtp layer ops: slot ", p[b * T + t], " beyond capacity ", cap);
  }
  float* kd = kc.data_ptr<float>();
  float* vd = vc.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t = 0; t < T; t++) {
        const int64_t dst = ((r[b] * H + h) * cap + p[b * T + t]) * hd;
        std::memcpy(kd + dst, ks + b * k.stride(0) + h * k.stride(1) + t * k.stride(2), hd * sizeof(float));
        std::memcpy(vd + dst, vs + b * v.stride(0) + h * v.stride(1) + t * v.stride(2), hd * sizeof(float));
      }
}

}  // namespace mtp_layer_ops

TORCH_LIBRARY_FRAGMENT(mtp, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("kv_write(Tensor(a!) kc, Tensor(b!) vc, Tensor rows, Tensor positions, Tensor k, Tensor v) -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, int isa=-1) -> Tensor");
  m.def("rmsnorm(Tensor x, Tensor w, float eps, int isa=-1) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp, CPU, m) {
  m.impl("attention", &mtp_layer_ops::attention);
  m.impl("rmsnorm", &mtp_layer_ops::rmsnorm);
  m.impl("silu_mul", &mtp_layer_ops::silu_mul);
  m.impl("rope", &mtp_layer_ops::rope);
  m.impl("kv_write", &mtp_layer_ops::kv_write);
}
