// What one kernel source calls in another (matmul.cpp, layer_ops.cpp, layer.cpp are compiled into one library):
// the C++ entry points behind the torch ops, so a whole decoder layer (layer.cpp) runs them without going through
// the dispatcher. Each computes exactly what its torch op computes (same bits).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mtp_kernels {

// x [M, K] float32 @ W.T -> [M, n]. fmt: 0 float32, 1 Q8_0, 2 Q4_0, 3 Q4_1 (w as the matching linear_* op takes
// it); int8: w is the i8 packing (qlinear.pack_int8) and the activations are quantised (linear_*_i8). isa as the ops'.
at::Tensor linear_any(int64_t fmt, bool int8, const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t isa);

}  // namespace mtp_kernels

namespace mtp_layer_ops {

// one attention problem: query rows q [B, H, T, hd] (strided) over keys and values [*, Hkv, S, hd] (strided);
// krow maps batch row b to the key/value row (nullptr: b itself; a KV cache's rows otherwise)
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
  const int64_t* krow;
};

void attend_all(const Attn& a, int isa);  // every query row, threads over rows (layer_ops.h: the fixed order)
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t isa);
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u, int64_t isa);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void kv_write(at::Tensor kc, at::Tensor vc, const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& k,
              const at::Tensor& v);

}  // namespace mtp_layer_ops
