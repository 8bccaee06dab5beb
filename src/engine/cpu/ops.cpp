// Plain f32 helpers of cpu_kernels.h. Reductions use the dot kernels' fixed order; element-wise
// operations are independent per element, so vectorisation cannot change their results.
#include <algorithm>
#include <cmath>

#include "cleave/engine/cpu_kernels.h"
#include "kernel_set.h"

namespace cleave::cpu {

float dot_f32(const float* a, const float* b, int64_t n) {
  const detail::KernelSet& set = detail::active_kernels();
  if (set.dot_f32 != nullptr) return set.dot_f32(a, b, n);
  float y = 0.0f;
  set.dot_tile[static_cast<size_t>(DType::kF32)](reinterpret_cast<const std::byte*>(a), 0, 1, b,
                                                 0, 1, n, &y, 0);
  return y;
}

void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float sum_sq = dot_f32(x, x, n);
  const float scale = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

void exp_f32(const float* x, float* out, int64_t n) {
  const detail::KernelSet& set = detail::active_kernels();
  if (set.exp != nullptr) return set.exp(x, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = detail::exp_ref(x[i]);
}

void softmax(float* x, int64_t n) { softmax_rows(x, 0, &n, 1, 1.0f); }

void softmax_rows(float* x, int64_t stride, const int64_t* n, int64_t n_rows, float div) {
  // Rows go kChains at a time: each row's sum is one chain of adds in index order, and the
  // rows' chains run side by side (one row's chain alone waits on each add's latency).
  constexpr int64_t kChains = 8;
  for (int64_t r0 = 0; r0 < n_rows; r0 += kChains) {
    const int64_t m = std::min(kChains, n_rows - r0);
    float* row[kChains];
    float sum[kChains];
    int64_t common = n[r0];
    for (int64_t r = 0; r < m; ++r) {
      float* xr = row[r] = x + (r0 + r) * stride;
      const int64_t nr = n[r0 + r];
      common = std::min(common, nr);
      sum[r] = 0.0f;
      if (nr <= 0) continue;
      for (int64_t i = 0; i < nr; ++i) xr[i] /= div;
      // The maximum is the same whatever the order (a signed zero aside, which the subtraction
      // below turns into the same values), so it is taken in eight lanes.
      float lane[8];
      for (int k = 0; k < 8; ++k) lane[k] = xr[0];
      int64_t i = 0;
      for (; i + 8 <= nr; i += 8)
        for (int k = 0; k < 8; ++k) lane[k] = std::max(lane[k], xr[i + k]);
      for (; i < nr; ++i) lane[0] = std::max(lane[0], xr[i]);
      float max = lane[0];
      for (int k = 1; k < 8; ++k) max = std::max(max, lane[k]);
      for (i = 0; i < nr; ++i) xr[i] -= max;
      exp_f32(xr, xr, nr);
    }
    common = std::max<int64_t>(common, 0);
    if (m == kChains) {  // the sums in registers
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, s4 = 0.0f, s5 = 0.0f, s6 = 0.0f, s7 = 0.0f;
      for (int64_t i = 0; i < common; ++i) {
        s0 += row[0][i];
        s1 += row[1][i];
        s2 += row[2][i];
        s3 += row[3][i];
        s4 += row[4][i];
        s5 += row[5][i];
        s6 += row[6][i];
        s7 += row[7][i];
      }
      const float all[kChains] = {s0, s1, s2, s3, s4, s5, s6, s7};
      std::copy(all, all + kChains, sum);
    } else {
      for (int64_t i = 0; i < common; ++i)
        for (int64_t r = 0; r < m; ++r) sum[r] += row[r][i];
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t nr = n[r0 + r];
      for (int64_t i = common; i < nr; ++i) sum[r] += row[r][i];
      const float inv = 1.0f / sum[r];
      for (int64_t i = 0; i < nr; ++i) row[r][i] *= inv;
    }
  }
}

void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  constexpr int64_t kChunk = 256;
  float e[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    for (int64_t i = 0; i < m; ++i) e[i] = -gate[i0 + i];
    exp_f32(e, e, m);
    for (int64_t i = 0; i < m; ++i) {
      const float g = gate[i0 + i];
      out[i0 + i] = g / (1.0f + e[i]) * up[i0 + i];
    }
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void axpy(float* y, float a, const float* x, int64_t n) {
  const detail::KernelSet& set = detail::active_kernels();
  if (set.axpy != nullptr) return set.axpy(y, a, x, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Tiles of dot_tile: every (row, x) pair by the f32 path's one reduction order (kernel_set.h),
// which dot_f32 shares; f16 and bf16 rows convert exactly inside the kernel. Several x go to the
// set's matmul_block where it has one (the same bits): its micro-kernels and its eight-row
// horizontal sums cost less per pair than dot_tile's one sum per pair, which matters for
// attention's short rows (callgrind, engine_bench F16 SmolLM2, 512-token prompt, 1 thread: the
// attention's instructions 361M -> 305M).
void dot_rows(DType dtype, const std::byte* rows, uint64_t row_bytes, int64_t n_rows,
              const float* x, int64_t x_stride, int64_t n_x, int64_t n, float* out,
              int64_t out_stride) {
  const detail::KernelSet& set = detail::active_kernels();
  if (const detail::MatmulBlockFn block = set.matmul_block[static_cast<size_t>(dtype)];
      block != nullptr && n_x > 1) {
    return block(rows, row_bytes, n_rows, x, x_stride, n_x, n, out, out_stride);
  }
  const detail::DotTileFn tile = set.dot_tile[static_cast<size_t>(dtype)];
  for (int64_t t = 0; t < n_x; t += detail::kMaxTileTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(detail::kMaxTileTokens, n_x - t));
    for (int64_t r = 0; r < n_rows; r += detail::kMaxTileRows) {
      const int nr = static_cast<int>(std::min<int64_t>(detail::kMaxTileRows, n_rows - r));
      tile(rows + static_cast<uint64_t>(r) * row_bytes, row_bytes, nr, x + t * x_stride,
           x_stride, nt, n, out + t * out_stride + r, out_stride);
    }
  }
}

void axpy_rows(float* y, int64_t y_stride, const float* a, int64_t a_stride, int64_t n_y,
               const float* rows, int64_t stride, int64_t n_rows, int64_t n) {
  const detail::KernelSet& set = detail::active_kernels();
  if (set.axpy_rows != nullptr)
    return set.axpy_rows(y, y_stride, a, a_stride, n_y, rows, stride, n_rows, n);
  for (int64_t o = 0; o < n_y; ++o)
    for (int64_t r = 0; r < n_rows; ++r)
      axpy(y + o * y_stride, a[o * a_stride + r], rows + r * stride, n);
}

}  // namespace cleave::cpu
