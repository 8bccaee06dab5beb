// Internal: the per-ISA kernel tables behind cpu_kernels.h.
//
// Every dot kernel computes dot(row, x) with one fixed reduction order per ISA:
//   one 8-lane accumulator a; for each full chunk of 8 elements i, in increasing order:
//     a = a + w[i..i+8) * x[i..i+8)
//   then a fixed horizontal sum of a (8 -> 4 -> 2 -> 1 lanes: lane j + lane j + 4, then j + 2,
//   then j + 1);
//   then each remaining element (< 8) added in order.
// This is the f32 path (f32, f16, bf16 weights). A tile of several rows and tokens keeps this
// order for each (row, token) pair: tiling only interleaves independent accumulators, which is why results
// are bit-identical whatever the tile shape, the thread count or the batch size.
// The SIMD sets fuse each product into its sum (one rounding); the portable set rounds the
// product and the sum separately. The AVX-512 set packs the accumulators of two pairs in one
// 16-lane register (two rows, one token), and a 512-bit fused multiply-add is eight-lane FMAs
// side by side, so it gives the AVX2 set's bits. The multi-token matmuls of both keep each
// accumulator in memory between K-chunks (storing and reloading is exact) and visit the chunks
// in increasing order, so the order above still holds per (row, token).
// One accumulator per pair, not two (as before 2026-12): a multi-token micro-kernel then holds
// 4 rows x 3 tokens in one pass over the activations (f16 prefill at one thread on Zen 3: 62-68
// -> 74-85 GFLOP/s), and decode hides the chain's latency by reading four runs of rows side by
// side (dot_avx2.cpp, matvec).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

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

// y[r] = dot(row r, x) for every r < nr (any number), bit-identical to dot_tile with nt = 1:
// decode's matrix-vector product over a thread's share of the rows, which a set may read in
// whatever order keeps the memory busy.
using MatvecFn = void (*)(const std::byte* w, uint64_t row_bytes, int64_t nr, const float* x,
                          int64_t n, float* y);

// dot of two f32 vectors: bit-identical to dot_tile[kF32] with nr = nt = 1 (attention scores).
using DotF32Fn = float (*)(const float* a, const float* b, int64_t n);
// y[i] = y[i] + a * x[i], a rounded product then a rounded sum per element (never fused), so the
// result equals the portable loop's.
using AxpyFn = void (*)(float* y, float a, const float* x, int64_t n);
// For each output o < n_y (at y + o * y_stride), axpy of rows r = 0 .. n_rows - 1 (at rows +
// r * stride) in order, with a[o * a_stride + r]: each element the same rounded products and
// sums as n_rows calls of axpy.
using AxpyRowsFn = void (*)(float* y, int64_t y_stride, const float* a, int64_t a_stride,
                            int64_t n_y, const float* rows, int64_t stride, int64_t n_rows,
                            int64_t n);

// The integer path (every block format, see uses_int_path() in cpu_kernels.h). The
// activation row of each token is first quantised, per group g of G elements (G = 32 for the
// legacy formats, 256 for the K-quants: kernel_group()), to
//   dx[g] = amax / 127 (f32),  xq[i] = nearbyint(x[i] * (1 / dx[g]))  (round half to even),
// and each weight block is seen as value[i] = d * sc[i/16] * q[i] + m * mn[i/16] (IntBlock in
// quants.h).
// Legacy formats (one scale per 32-element block, sc = 1): per (row, token), with an 8-lane f32
// accumulator `as` and a scalar `am`, for each block b in increasing order:
//   S_j = sum_{k<4} q[4j+k] * xq[4j+k]  for lanes j < 8                  (exact, int32)
//   as_j = fma(d * dx[b], float(S_j), as_j)
//   formats with a min: am = fma(m * dx[b], float(X), am), X the sum of xq over the block.
// The result is the fixed horizontal sum of `as` (8 -> 4 -> 2 -> 1 lanes), plus am.
// K-quants (256-element super-blocks, one activation scale each, as ggml's q8_K): per (row,
// token), one 8-lane f32 accumulator `as`; for each super-block u in increasing order:
//   I_j = sum over its eight 32-element blocks b and k < 4 of sc * (q + o) * xq at element
//         32 b + 4 j + k, minus o * (sc[2 j] * X16[2 j] + sc[2 j + 1] * X16[2 j + 1])
//                                                           (exact, int32; any order)
//   as_j = fma(d * dx[u], float(I_j), as_j)
//   with o the format's level offset (Q3_K 4, Q6_K 32, else 0; level_offset()), sc[i] the
//   sub-scale and X16[i] the xq sum of the super-block's i-th 16 elements: sum_j I_j is the
//   exact sum of sc * q * xq, and a kernel takes the offset off once per super-block instead
//   of per block (as ggml's q6_K dot product does), on unsigned levels.
//   formats with a min: B_j = mn[2 j] * X16[2 j] + mn[2 j + 1] * X16[2 j + 1], with mn[i] the
//     min of the super-block's i-th 16 elements (exact), and
//     as_j = fma(m * dx[u], float(B_j), as_j)
// The result is the fixed horizontal sum of `as`. float(I_j) may round (|I_j| < 2^25), the same
// way on every set. The integer steps are exact and the f32 steps are the same on every kernel
// set, so every set gives the same bits, whatever the tile.
struct QuantActs {
  const int8_t* q;      // [n_tokens][n] levels
  const float* d;       // [n_tokens][n / group] group scales
  const int16_t* sum16; // [n_tokens][n / 16] sums of each 16 consecutive levels
  const float* sum32;   // [n_tokens][n / 32] float(sum of each 32 consecutive levels), exact
  int64_t n;            // elements per token
  int64_t group;        // elements per activation scale: 32 or 256
};
// The K-quant level offset o of kernel_set.h's order: Q3_K 4, Q6_K 32, else 0.
constexpr int level_offset(DType t) {
  return t == DType::kQ3_K ? 4 : t == DType::kQ6_K ? 32 : 0;
}
// Whether block format t has a scale per 16 elements (applied to the integer lane sums).
inline bool sub16_scales(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ6_K;
}
// The activation group of integer-path format t: 256 for the K-quants, 32 for the others.
inline int64_t kernel_group(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K ||
                 t == DType::kQ6_K
             ? 256
             : 32;
}
// Quantises n_tokens rows of n elements (n a multiple of group, 32 or 256; row t at
// x + t * x_stride) into q, d, sum16 and sum32 laid out as QuantActs describes.
using QuantizeActsFn = void (*)(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                                int64_t group, int8_t* q, float* d, int16_t* sum16, float* sum32);
// y[t * y_stride + r] = the integer-path dot of row r with token t, r < nr, t < nt (any sizes);
// x points at token 0's activations.
using QDotFn = void (*)(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                        const QuantActs& x, int64_t nt, float* y, int64_t y_stride);

// exp(x) as the engine computes it (softmax, SiLU), the same bits on every kernel set: x clamped
// to [-87, 88] (a NaN stays NaN, as max_ps(lo, x) and min_ps(hi, x) return it, so corrupt
// scores are never hidden as tiny weights), n = nearbyint(x * log2(e)), r = x -
// n ln2 in two fused steps (Cody-Waite), Cephes' degree-5 polynomial p by fused Horner steps,
// y = fma(p, r * r, r) + 1, result y * 2^n. Every step is one IEEE operation (fma or a rounded
// mul/add), which the SIMD sets repeat lane by lane. About 1 ulp from the true value. Internal
// linkage: each translation unit (compiled for its own ISA) keeps its own copy.
inline constexpr float kExpLo = -87.0f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f;
inline constexpr float kExpC1 = 0.693359375f, kExpC2 = -2.12194440e-4f;
inline constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static inline float exp_ref(float x) {
  if (x != x) return x;  // NaN (and no float-to-int conversion of it below)
  x = x < kExpLo ? kExpLo : x;
  x = x > kExpHi ? kExpHi : x;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kExpC1, x);
  r = std::fma(-n, kExpC2, r);
  float p = kExpP[0];
  for (int k = 1; k < 6; ++k) p = std::fma(p, r, kExpP[k]);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}
// out[i] = exp_ref(x[i]); x and out may alias.
using ExpFn = void (*)(const float* x, float* out, int64_t n);

struct KernelSet {
  const char* name;
  DotTileFn dot_tile[kNumDTypes];  // indexed by DType; null for the integer-path formats
  // Indexed by DType; null entries fall back to tiling with dot_tile (matmul.cpp).
  MatmulBlockFn matmul_block[kNumDTypes];
  // Null: dot_tile[kF32] / the portable loop (ops.cpp).
  DotF32Fn dot_f32 = nullptr;
  AxpyFn axpy = nullptr;
  AxpyRowsFn axpy_rows = nullptr;  // null: axpy row after row
  QuantizeActsFn quantize_acts = nullptr;
  QDotFn qdot = nullptr;  // every integer-path format
  ExpFn exp = nullptr;    // null: exp_ref element by element
  // Indexed by DType, the f32 path only; null entries: dot_tile on kMaxTileRows rows at a time.
  MatvecFn matvec[kNumDTypes] = {};
};

// The integer path of each set: portable (qdot_generic.cpp), AVX2 (qdot_avx2.cpp, maddubs) and
// AVX-512 VNNI (qdot_avx512.cpp, vpdpbusd on 256-bit vectors). The AVX-512 set uses the VNNI
// kernels where the CPU has AVX512-VNNI/VL/BW and the AVX2 ones elsewhere; all give the same bits.
void quantize_acts_generic(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                           int64_t group, int8_t* q, float* d, int16_t* sum16, float* sum32);
void qdot_generic(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                  const QuantActs& x, int64_t nt, float* y, int64_t y_stride);
void quantize_acts_avx2(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                        int64_t group, int8_t* q, float* d, int16_t* sum16, float* sum32);
void qdot_avx2(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
               const QuantActs& x, int64_t nt, float* y, int64_t y_stride);
void qdot_avx512_vnni(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                      const QuantActs& x, int64_t nt, float* y, int64_t y_stride);
// Whether this CPU (and OS) runs the AVX-512 VNNI kernels (AVX512-VNNI, -VL and -BW on top of
// cpu_has_avx512_kernels()).
bool cpu_has_avx512_vnni();

// Quantises n_tokens rows with set.quantize_acts in groups of `group` into the calling thread's
// scratch buffers for that group size (matmul.cpp), valid until that thread's next call for it.
QuantActs quantize_to_scratch(const KernelSet& set, const float* x, int64_t x_stride,
                              int64_t n_tokens, int64_t n, int64_t group);

const KernelSet& generic_kernels();
// Only valid to call when the CPU has AVX2, FMA and F16C.
const KernelSet& avx2_kernels();
// Only valid to call when cpu_has_avx512_kernels() is true. Bit-identical to the AVX2 set: a
// 16-lane accumulator holds two pairs' 8-lane accumulators, and lane-wise fused multiply-adds
// do not depend on the vector width.
const KernelSet& avx512_kernels();
// The set chosen at run time for this CPU (AVX2 when supported, else generic).
const KernelSet& active_kernels();
// Whether this CPU supports the AVX2 kernel set.
bool cpu_has_avx2_kernels();
// Whether this CPU (and OS) supports the AVX-512 kernel set (AVX-512F on top of the AVX2 set).
bool cpu_has_avx512_kernels();

}  // namespace cleave::cpu::detail
