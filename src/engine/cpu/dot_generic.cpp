// Portable dot kernels (no SIMD intrinsics), following the reduction order in kernel_set.h.
#include <cstring>

#include "kernel_set.h"

namespace cleave::cpu::detail {
namespace {

struct F32Weights {
  static void load(const std::byte* row, int64_t i, int count, float* out) {
    std::memcpy(out, row + i * 4, static_cast<size_t>(count) * 4);
  }
};

struct F16Weights {
  static void load(const std::byte* row, int64_t i, int count, float* out) {
    uint16_t h[8];
    std::memcpy(h, row + i * 2, static_cast<size_t>(count) * 2);
    for (int j = 0; j < count; ++j) out[j] = f16_to_f32(h[j]);
  }
};

struct BF16Weights {
  static void load(const std::byte* row, int64_t i, int count, float* out) {
    uint16_t h[8];
    std::memcpy(h, row + i * 2, static_cast<size_t>(count) * 2);
    for (int j = 0; j < count; ++j) out[j] = bf16_to_f32(h[j]);
  }
};

template <typename W>
float dot_one(const std::byte* row, const float* x, int64_t n) {
  float acc[8] = {};
  float w[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    W::load(row, i, 8, w);
    for (int j = 0; j < 8; ++j) acc[j] = acc[j] + w[j] * x[i + j];
  }
  float v4[4], v2[2];
  for (int j = 0; j < 4; ++j) v4[j] = acc[j] + acc[j + 4];
  for (int j = 0; j < 2; ++j) v2[j] = v4[j] + v4[j + 2];
  float r = v2[0] + v2[1];
  const int rest = static_cast<int>(n - i);
  if (rest > 0) {
    W::load(row, i, rest, w);
    for (int j = 0; j < rest; ++j) r = r + w[j] * x[i + j];
  }
  return r;
}

template <typename W>
void dot_tile(const std::byte* w, uint64_t row_bytes, int nr, const float* x, int64_t x_stride,
              int nt, int64_t n, float* y, int64_t y_stride) {
  for (int r = 0; r < nr; ++r)
    for (int t = 0; t < nt; ++t)
      y[t * y_stride + r] = dot_one<W>(w + r * row_bytes, x + t * x_stride, n);
}

}  // namespace

const KernelSet& generic_kernels() {
  static const KernelSet set{"generic",
                             {&dot_tile<F32Weights>, &dot_tile<F16Weights>,
                              &dot_tile<BF16Weights>},
                             {nullptr, nullptr, nullptr, nullptr},
                             nullptr,
                             nullptr,
                             nullptr,
                             &quantize_acts_generic,
                             &qdot_generic};
  return set;
}

}  // namespace cleave::cpu::detail
