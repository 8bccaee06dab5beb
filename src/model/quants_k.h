// Internal: the K-quant half of quants.h (quants_k.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cleave/model/quants.h"

namespace cleave::detail {

// Super-block b (elements [256 b, 256 b + 256)) of a row of K-quant dtype t.
void encode_k_block(DType t, const float* x, std::byte* row, int64_t b);
void decode_k_block(DType t, const std::byte* row, int64_t b, float* out);
// 32-element block b of the row (eight per super-block).
void int_block_k(DType t, const std::byte* row, int64_t b, IntBlock* out);

}  // namespace cleave::detail
