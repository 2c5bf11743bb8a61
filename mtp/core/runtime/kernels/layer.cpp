// One decoder layer of a llama-style model in one call, as a torch custom op (the lean pass of issue 49):
//
//   mtp::decoder_layer(x [B, T, D], cos, sin [B, 1, T, hd], mask [B, 1, T, S] bool,
//                      kc, vc [rows, Hkv, capacity, hd] (this layer's KV cache, written in place),
//                      rows [B] int64 (the batch's cache rows), positions [B, T] int64 (the cache slots written),
//                      weights [ln1 [D], qkv, o, ln2 [D], gate_up, down], qkv_bias [(H + 2 Hkv) hd] or None,
//                      formats [4], sizes [4] (qkv, o, gate_up, down: format code + 4 when int8, output size),
//                      n_heads, n_kv_heads, eps, scale, isa, isa_i8) -> [B, T, D]
//
// It runs the per-op path of mtp/core/runtime/model.py (Block.forward with the kernels attached) step for step, on the same
// C++ functions, so its result has the same bits; only the dispatcher and Python between the steps are gone:
//   h = rmsnorm(x);  qkv = h @ Wqkv (+ bias);  q, k = rope(q), rope(k);  write k, v at (rows, positions)
//   a = attention(q over the cache rows' slots 0..S-1 the mask shows);  x1 = x + a @ Wo
//   g, u = rmsnorm(x1) @ Wgate_up;  y = x1 + silu_mul(g, u) @ Wdown
// mtp::eagle3_layer(emb, g [B, T, D], cos, ...): the EAGLE-3 drafter's layer on the same steps; its attention reads
// [rmsnorm(emb, ln_in), rmsnorm(g, ln_hidden)] and its residual is g (weights [ln_in, ln_hidden, qkv, o, ln2,
// gate_up, down], no qkv bias).
// Weights: a format code 0-3 is float32 / Q8_0 / Q4_0 / Q4_1 as the linear_* ops take it; 4 + code is the same
// format in the i8 packing with int8 activations (linear_*_i8).
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "isa.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace mtp_layer {

using at::Tensor;

static Tensor linear(const Tensor& x, const Tensor& w, int64_t code, int64_t n, int64_t isa, int64_t isa_i8) {
  const bool int8 = code >= 4;
  return mtp_kernels::linear_any(int8 ? code - 4 : code, int8, x, w, n, int8 ? isa_i8 : isa);
}

// What follows the attention input in both layers: qkv = h @ Wqkv (+ bias), RoPE, the cache write, attention over
// slots 0..S-1 as the mask shows, x1 = residual + a @ Wo, then the MLP half. h [B T, K], residual [B T, D].
static Tensor layer_body(const Tensor& residual, const Tensor& h, const Tensor& cos, const Tensor& sin, const Tensor& mask,
                         Tensor kc, Tensor vc, const Tensor& rows, const Tensor& positions, at::TensorList w,
                         const std::optional<Tensor>& qkv_bias, at::IntArrayRef formats, at::IntArrayRef sizes,
                         int64_t B, int64_t T, int64_t n_heads, int64_t n_kv_heads, double eps, double scale, int64_t isa,
                         int64_t isa_i8) {
  const int64_t D = residual.size(1), H = n_heads, Hkv = n_kv_heads;
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && sizes[0] % (H + 2 * Hkv) == 0,
              "mtp decoder_layer: ", H, " query heads, ", Hkv, " key heads and a qkv of ", sizes[0], " outputs disagree");
  const int64_t hd = sizes[0] / (H + 2 * Hkv), I = sizes[2] / 2;
  TORCH_CHECK(sizes[1] == D && sizes[3] == D && sizes[2] % 2 == 0, "mtp decoder_layer: o and down must give D = ", D,
              " outputs, gate_up an even number");
  TORCH_CHECK(kc.dim() == 4 && kc.size(1) == Hkv && kc.size(3) == hd, "mtp decoder_layer: the cache must be [rows, ",
              Hkv, ", capacity, ", hd, "]");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 &&
                  mask.size(2) == T && mask.size(3) <= kc.size(2),
              "mtp decoder_layer: mask must be bool [B, 1, T, S] with S within the cache capacity");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == B && rows.is_contiguous(),
              "mtp decoder_layer: rows must be a contiguous int64 [B] tensor");
  const int64_t S = mask.size(3);

  // attention half: x1 = residual + attention(h) @ Wo
  Tensor qkv = linear(h, w[0], formats[0], sizes[0], isa, isa_i8);  // [B T, (H + 2 Hkv) hd]
  if (qkv_bias.has_value()) qkv = at::add(qkv, *qkv_bias);
  const Tensor q = mtp_layer_ops::rope(qkv.narrow(1, 0, H * hd).view({B, T, H, hd}), cos, sin);           // [B, H, T, hd]
  const Tensor k = mtp_layer_ops::rope(qkv.narrow(1, H * hd, Hkv * hd).view({B, T, Hkv, hd}), cos, sin);  // [B, Hkv, T, hd]
  const Tensor v = qkv.narrow(1, (H + Hkv) * hd, Hkv * hd).view({B, T, Hkv, hd}).transpose(1, 2);
  mtp_layer_ops::kv_write(kc, vc, rows, positions, k, v);  // checks rows and slots against the cache
  Tensor a = at::empty({B, T, H, hd}, residual.options());
  if (a.numel())  // over the cache rows of the batch, slots 0..S-1 as the mask shows
    mtp_layer_ops::attend_into(q, kc, vc, mask, S, scale, rows.data_ptr<int64_t>(), a, mtp_isa::pick_isa(-1));
  const Tensor x1 = at::add(residual, linear(a.view({B * T, H * hd}), w[1], formats[1], sizes[1], isa, isa_i8));

  // MLP half: y = x1 + silu(g) u @ Wdown, [g, u] = rmsnorm(x1) @ Wgate_up
  const Tensor gu = linear(mtp_layer_ops::rmsnorm(x1, w[2], eps, -1), w[3], formats[2], sizes[2], isa, isa_i8);
  const Tensor s = mtp_layer_ops::silu_mul(gu.narrow(1, 0, I), gu.narrow(1, I, I), -1);
  return at::add(x1, linear(s, w[4], formats[3], sizes[3], isa, isa_i8)).view({B, T, D});
}

Tensor decoder_layer(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& mask, Tensor kc, Tensor vc,
                     const Tensor& rows, const Tensor& positions, at::TensorList w, const std::optional<Tensor>& qkv_bias,
                     at::IntArrayRef formats, at::IntArrayRef sizes, int64_t n_heads, int64_t n_kv_heads, double eps,
                     double scale, int64_t isa, int64_t isa_i8) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "mtp decoder_layer: x must be a float32 CPU [B, T, D] tensor");
  TORCH_CHECK(w.size() == 6 && formats.size() == 4 && sizes.size() == 4,
              "mtp decoder_layer: 6 weights (ln1, qkv, o, ln2, gate_up, down), 4 formats, 4 sizes");
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const Tensor x2 = x.reshape({B * T, D});
  const Tensor h = mtp_layer_ops::rmsnorm(x2, w[0], eps, -1);
  return layer_body(x2, h, cos, sin, mask, kc, vc, rows, positions, w.slice(1), qkv_bias, formats, sizes, B, T, n_heads,
                    n_kv_heads, eps, scale, isa, isa_i8);
}

// The EAGLE-3 drafter's layer (mtp/core/decoding/proposers/eagle3.py, Eagle3Drafter.step): its attention reads
// [rmsnorm(emb, ln_in), rmsnorm(g, ln_hidden)] (2 D columns) and its residual is g; the rest is decoder_layer's.
Tensor eagle3_layer(const Tensor& emb, const Tensor& g, const Tensor& cos, const Tensor& sin, const Tensor& mask,
                    Tensor kc, Tensor vc, const Tensor& rows, const Tensor& positions, at::TensorList w,
                    at::IntArrayRef formats, at::IntArrayRef sizes, int64_t n_heads, int64_t n_kv_heads, double eps,
                    double scale, int64_t isa, int64_t isa_i8) {
  TORCH_CHECK(g.dim() == 3 && g.scalar_type() == at::kFloat && g.device().is_cpu() && emb.sizes() == g.sizes() &&
                  emb.scalar_type() == at::kFloat,
              "mtp eagle3_layer: emb and g must be float32 CPU [B, T, D] tensors of one shape");
  TORCH_CHECK(w.size() == 7 && formats.size() == 4 && sizes.size() == 4,
              "mtp eagle3_layer: 7 weights (ln_in, ln_hidden, qkv, o, ln2, gate_up, down), 4 formats, 4 sizes");
  const int64_t B = g.size(0), T = g.size(1), D = g.size(2);
  const Tensor g2 = g.reshape({B * T, D});
  const Tensor h = at::cat({mtp_layer_ops::rmsnorm(emb.reshape({B * T, D}), w[0], eps, -1),
                            mtp_layer_ops::rmsnorm(g2, w[1], eps, -1)}, 1);  // [B T, 2 D]
  return layer_body(g2, h, cos, sin, mask, kc, vc, rows, positions, w.slice(2), std::nullopt, formats, sizes, B, T,
                    n_heads, n_kv_heads, eps, scale, isa, isa_i8);
}

}  // namespace mtp_layer

TORCH_LIBRARY_FRAGMENT(mtp, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor mask, Tensor(a!) kc, Tensor(b!) vc, Tensor rows, "
      "Tensor positions, Tensor[] weights, Tensor? qkv_bias, int[] formats, int[] sizes, int n_heads, int n_kv_heads, "
      "float eps, float scale, int isa=-1, int isa_i8=-1) -> Tensor");
  m.def(
      "eagle3_layer(Tensor emb, Tensor g, Tensor cos, Tensor sin, Tensor mask, Tensor(a!) kc, Tensor(b!) vc, "
      "Tensor rows, Tensor positions, Tensor[] weights, int[] formats, int[] sizes, int n_heads, int n_kv_heads, "
      "float eps, float scale, int isa=-1, int isa_i8=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp, CPU, m) {
  m.impl("decoder_layer", &mtp_layer::decoder_layer);
  m.impl("eagle3_layer", &mtp_layer::eagle3_layer);
}
