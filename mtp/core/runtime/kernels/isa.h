// What the kernel sources share (matmul.cpp, layer_ops.cpp): which ISA path this CPU runs, picking one (an
// explicit choice checked against the CPU), and the one fixed tree that sums 16 lanes. One definition, so the
// matmuls and the layer ops always agree on both.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace mtp_isa {

// 0 scalar, 1 AVX2 + FMA, 2 AVX-512 F/BW/VL/DQ + FMA
static inline int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

// `isa` (-1 = the best), refused with one line when unknown or beyond this CPU
static inline int pick_isa(int64_t isa) {
  const int best = best_isa();
  if (isa < 0) return best;
  TORCH_CHECK(isa <= 2, "mtp kernels: unknown isa ", isa, " (0 scalar, 1 avx2, 2 avx512, -1 best)");
  TORCH_CHECK(isa <= best, "mtp kernels: isa ", isa, " is not supported by this CPU (best: ", best, ")");
  return int(isa);
}

// s8[i] = a[i] + a[i+8], s4[i] = s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2], sum = s2[0] + s2[1]
static inline float tree16(const float* a) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

}  // namespace mtp_isa
