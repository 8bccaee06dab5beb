// Internal: the K-quant half of quants.h (quants_k.cpp), and block access shared with quants.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cleave/model/quants.h"

#include <cstring>

namespace cleave::detail {

// Block b of a row of blocks of type B (unaligned, so copied).
template <typename B>
B load_block(const std::byte* row, int64_t b) {
  B blk;
  std::memcpy(&blk, row + b * static_cast<int64_t>(sizeof(B)), sizeof(B));
  return blk;
}
template <typename B>
void store_block(const B& blk, std::byte* row, int64_t b) {
  std::memcpy(row + b * static_cast<int64_t>(sizeof(B)), &blk, sizeof(B));
}

// Super-block b (elements [256 b, 256 b + 256)) of a row of K-quant dtype t.
void encode_k_block(DType t, const float* x, std::byte* row, int64_t b);
void decode_k_block(DType t, const std::byte* row, int64_t b, float* out);
// 32-element block b of the row (eight per super-block).
void int_block_k(DType t, const std::byte* row, int64_t b, IntBlock* out);

}  // namespace cleave::detail
