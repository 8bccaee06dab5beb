// Internal: the per-ISA kernel tables behind cpu_kernels.h.
//
// Every dot kernel computes dot(row, x) with one fixed reduction order per ISA:
//   two 8-lane accumulators a0, a1; for each full chunk of 16 elements i:
//     a0 = a0 + w[i..i+8) * x[i..i+8),  a1 = a1 + w[i+8..i+16) * x[i+8..i+16)
//   then, when 8 or more elements remain, one more chunk of 8 into a0;
//   then a fixed horizontal sum of (a0 + a1) (8 -> 4 -> 2 -> 1 lanes);
//   then each remaining element (< 8) added in order.
// Quantised weights are first turned into exact f32 values (q8_0: scale * q is exact in f32), so
// the order above holds for every dtype. A tile of several rows and tokens keeps this order for
// each (row, token) pair: tiling only interleaves independent accumulators, which is why results
// are bit-identical whatever the tile shape, the thread count or the batch size.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cleave/model/dtype.h"

namespace cleave::cpu::detail {

inline constexpr int kMaxTileRows = 4;
inline constexpr int kMaxTileTokens = 4;

// y[t * y_stride + r] = dot(row r, x + t * x_stride) for r < nr, t < nt, where row r starts at
// w + r * row_bytes and holds n elements. 1 <= nr <= kMaxTileRows, 1 <= nt <= kMaxTileTokens.
// n must be a whole number of the dtype's blocks.
using DotTileFn = void (*)(const std::byte* w, uint64_t row_bytes, int nr, const float* x,
                           int64_t x_stride, int nt, int64_t n, float* y, int64_t y_stride);

struct KernelSet {
  const char* name;
  DotTileFn dot_tile[4];  // indexed by DType
};

const KernelSet& generic_kernels();
// Only valid to call when the CPU has AVX2, FMA and F16C.
const KernelSet& avx2_kernels();
// The set chosen at run time for this CPU (AVX2 when supported, else generic).
const KernelSet& active_kernels();
// Whether this CPU supports the AVX2 kernel set.
bool cpu_has_avx2_kernels();

}  // namespace cleave::cpu::detail
