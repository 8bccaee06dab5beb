// Block-quantised weight formats, laid out byte for byte as ggml's (ggml-common.h), and the
// conversions between them and f32.
//
// Legacy formats (32 elements a block): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
// K-quants (256-element super-blocks of 8 or 16 sub-blocks with their own scales): Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K. A row of a K-quant tensor must be a multiple of 256 elements.
//
// encode_row quantises with round-to-nearest, one scale (and min) per block chosen from the
// block's range as ggml's reference quantisers choose them for the legacy formats; for the
// K-quants the sub-block scale and min are taken from the sub-block's range, quantised to the
// super-block's 6- or 4-bit grid, and each value rounded to the nearest level of its sub-block.
// decode_row is exact: it computes each value as ggml's dequantize_row_* does (the same f32
// products), so a tensor decodes to the values llama.cpp sees.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cleave/model/dtype.h"

namespace cleave {

inline constexpr int kQK = 32;    // elements in a legacy block and in one integer-dot block
inline constexpr int kQK_K = 256; // elements in a K-quant super-block

struct BlockQ4_0 {
  uint16_t d;         // f16 scale
  uint8_t qs[16];     // element j in the low nibble of qs[j], element j+16 in the high nibble
};                    // value = d * (q - 8)
struct BlockQ4_1 {
  uint16_t d, m;      // f16 scale and min
  uint8_t qs[16];     // as Q4_0; value = d * q + m
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];      // bit j: the 5th bit of element j
  uint8_t qs[16];     // low 4 bits as Q4_0; value = d * (q - 16)
};
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];     // value = d * q + m
};
struct BlockQ2_K {
  uint8_t scales[16]; // per 16 elements: low nibble scale, high nibble min
  uint8_t qs[64];     // 2-bit values
  uint16_t d, dmin;   // value = d * sc * q - dmin * m
};
struct BlockQ3_K {
  uint8_t hmask[32];  // the high bit of each 3-bit value (set: +0, clear: -4)
  uint8_t qs[64];     // low 2 bits
  uint8_t scales[12]; // 16 6-bit scales, stored biased by 32
  uint16_t d;         // value = d * (sc - 32) * q
};
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12]; // 8 6-bit scales and 8 6-bit mins, packed as ggml's get_scale_min_k4
  uint8_t qs[128];    // value = d * sc * q - dmin * m
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];     // 5th bits
  uint8_t qs[128];
};
struct BlockQ6_K {
  uint8_t ql[128];    // low 4 bits
  uint8_t qh[64];     // high 2 bits
  int8_t scales[16];  // per 16 elements
  uint16_t d;         // value = d * sc * (q - 32)
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210);

// Whether t is one of the block-quantised formats (Q8_0 included).
bool dtype_is_quantized(DType t);

// Writes n values of x as a row of dtype t (f32, f16, bf16 or any quantised format) into dst,
// which holds dtype_row_bytes(t, n) bytes. n must be a whole number of t's blocks.
void encode_row(DType t, const float* x, int64_t n, std::byte* dst);
// The n values of a row of dtype t, as f32.
void decode_row(DType t, const std::byte* src, int64_t n, float* out);

// The 32 integer levels, integer sub-scales and float multipliers of one 32-element block of a
// quantised row, in the form the integer dot kernels use (src/engine/cpu/kernel_set.h):
//   value[i] = d * sc[i / 16] * q[i] + m * mn[i / 16]   (in exact arithmetic)
// q is within [-128, 127] (|q| <= 32 for every format but Q8_0), sc and mn within [-128, 127].
struct IntBlock {
  int8_t q[kQK];
  int16_t sc[2];
  int16_t mn[2];
  float d;
  float m;  // 0 for formats without a min
};
// Block b (elements [32 b, 32 b + 32)) of a row of quantised dtype t.
void int_block(DType t, const std::byte* row, int64_t b, IntBlock* out);

// The format a tensor with rows of `cols` elements is written in when t is asked for: t itself
// when cols is a whole number of its blocks, else llama.cpp's fallback for a K-quant (Q2_K, Q3_K,
// Q4_K -> Q5_0 when possible, Q5_K -> Q5_1, Q6_K -> Q8_0), else f16.
DType quant_fallback(DType t, int64_t cols);

}  // namespace cleave
