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
// The AVX-512 set keeps a0 and a1 as the low and high halves of one 16-lane accumulator (the
// same lanes, the same fused multiply-adds) and so gives the AVX2 set's bits. Its multi-token
// matmul keeps each accumulator in memory between K-chunks (storing and reloading is exact) and
// visits the chunks in increasing order, so the order above still holds per (row, token).
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

// y[t * y_stride + r] = dot(row r, x + t * x_stride) for every r < nr and t < nt (any sizes),
// bit-identical to dot_tile for each (row, token) pair. The multi-token path of matmul: a set
// that has one streams each weight byte once per call and reuses it, converted, for every token.
using MatmulBlockFn = void (*)(const std::byte* w, uint64_t row_bytes, int64_t nr,
                               const float* x, int64_t x_stride, int64_t nt, int64_t n, float* y,
                               int64_t y_stride);

// dot of two f32 vectors: bit-identical to dot_tile[kF32] with nr = nt = 1 (attention scores).
using DotF32Fn = float (*)(const float* a, const float* b, int64_t n);
// y[i] = y[i] + a * x[i], a rounded product then a rounded sum per element (never fused), so the
// result equals the portable loop's.
using AxpyFn = void (*)(float* y, float a, const float* x, int64_t n);

struct KernelSet {
  const char* name;
  DotTileFn dot_tile[4];  // indexed by DType
  // Indexed by DType; null entries fall back to tiling with dot_tile (matmul.cpp).
  MatmulBlockFn matmul_block[4];
  // Null: dot_tile[kF32] / the portable loop (ops.cpp).
  DotF32Fn dot_f32 = nullptr;
  AxpyFn axpy = nullptr;
};

const KernelSet& generic_kernels();
// Only valid to call when the CPU has AVX2, FMA and F16C.
const KernelSet& avx2_kernels();
// Only valid to call when cpu_has_avx512_kernels() is true. Bit-identical to the AVX2 set: a
// 16-lane accumulator holds exactly the AVX2 pair (a0 = lanes 0-7, a1 = lanes 8-15), and
// lane-wise fused multiply-adds do not depend on the vector width.
const KernelSet& avx512_kernels();
// The set chosen at run time for this CPU (AVX2 when supported, else generic).
const KernelSet& active_kernels();
// Whether this CPU supports the AVX2 kernel set.
bool cpu_has_avx2_kernels();
// Whether this CPU (and OS) supports the AVX-512 kernel set (AVX-512F on top of the AVX2 set).
bool cpu_has_avx512_kernels();

}  // namespace cleave::cpu::detail
