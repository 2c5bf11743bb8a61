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

// softmax(q k^T * scale over the keys the mask shows) v into y [B, T, H, hd], one query row at a time
// (layer_ops.h: the fixed order): q [B, H, T, hd], k and v [*, Hkv, >= S, hd], mask [B, 1 or H, T, S] bool, all
// strided with the last dimension contiguous; krow maps batch row b to its key/value row (nullptr: b itself, else
// a KV cache's rows). The caller checks the shapes.
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, int64_t S,
                 double scale, const int64_t* krow, at::Tensor& y, int isa);
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t isa);
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u, int64_t isa);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void kv_write(at::Tensor kc, at::Tensor vc, const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& k,
              const at::Tensor& v);

}  // namespace mtp_layer_ops
