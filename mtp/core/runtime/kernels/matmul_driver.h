// The driver of one ISA's float32-activation kernels, included inside that ISA's `#pragma GCC target`
// region and namespace (matmul.cpp), after its `rows`, `dequant_rows`, MT and NT, and PANEL_ABOVE_M: the row
// count above which a column tile's weights are dequantised once into a float32 panel that every row tile then
// reads (below it, each row tile dequantises its blocks in registers). Neither choice changes a row's reduction
// order, so a row's bits stay the same whichever is taken.
template <int F>
static void run_fmt(const Pass& p, int64_t t0, int64_t t1) {
  std::vector<float> panel;
  const bool use_panel = F != F32 && p.M > PANEL_ABOVE_M;
  if (use_panel) panel.resize(NT * p.K);
  const uint8_t* pw = reinterpret_cast<const uint8_t*>(panel.data());
  for (int64_t t = t0; t < t1; t++) {
    const int64_t n0 = t * NT, nt = std::min<int64_t>(NT, p.N - n0);
    const uint8_t* w = p.w + n0 * p.w_stride;
    if (use_panel) dequant_rows<F>(w, p.w_stride, nt, p.K, panel.data(), p.K);
    if (nt == NT) {
      if (use_panel) rows<F32, NT>(pw, p.K * 4, p, n0);
      else rows<F, NT>(w, p.w_stride, p, n0);
    } else {
      for (int64_t j = 0; j < nt; j++) {
        if (use_panel) rows<F32, 1>(pw + j * p.K * 4, p.K * 4, p, n0 + j);
        else rows<F, 1>(w + j * p.w_stride, p.w_stride, p, n0 + j);
      }
    }
  }
}

static void run(const Pass& p, int64_t t0, int64_t t1) {
  switch (p.fmt) {
    case F32: return run_fmt<F32>(p, t0, t1);
    case Q8_0: return run_fmt<Q8_0>(p, t0, t1);
    case Q4_0: return run_fmt<Q4_0>(p, t0, t1);
    default: return run_fmt<Q4_1>(p, t0, t1);
  }
}

static void dequant(int fmt, const uint8_t* w, int64_t ws, int64_t rows, int64_t K, float* out) {
  switch (fmt) {
    case Q8_0: return dequant_rows<Q8_0>(w, ws, rows, K, out, K);
    case Q4_0: return dequant_rows<Q4_0>(w, ws, rows, K, out, K);
    default: return dequant_rows<Q4_1>(w, ws, rows, K, out, K);
  }
}

