// The plain and legacy block formats (f32, f16, bf16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the
// dispatch of encode_row / decode_row / int_block over every format. The K-quants are in
// quants_k.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cleave/model/quants.h"
#include "quants_k.h"

namespace cleave {
namespace {

using detail::load_block;
using detail::store_block;

// The 5th bits of a Q5 block, element j in bit j.
uint32_t high_bits(const uint8_t qh[4]) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return h;
}

// Level j (0..31) of a 4-bit block: element j in the low nibble of qs[j], j+16 in the high one.
int nibble(const uint8_t qs[16], int j) { return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4; }

void set_nibble(uint8_t qs[16], int j, int q) {
  if (j < 16) {
    qs[j] = static_cast<uint8_t>((qs[j] & 0xF0) | q);
  } else {
    qs[j - 16] = static_cast<uint8_t>((qs[j - 16] & 0x0F) | (q << 4));
  }
}

// As ggml's quantize_row_q4_0_ref / q5_0_ref: d = (the value of largest magnitude) / -levels/2,
// so that value maps exactly onto the most negative level.
template <int kLevels>
void symmetric_levels(const float* x, uint16_t* d_out, int q[kQK]) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQK; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -static_cast<float>(kLevels / 2);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = f32_to_f16(d);
  for (int j = 0; j < kQK; ++j)
    q[j] = std::min(kLevels - 1, static_cast<int>(x[j] * id + static_cast<float>(kLevels / 2) + 0.5f));
}

// As ggml's quantize_row_q4_1_ref / q5_1_ref: levels spread from the block's min to its max.
template <int kLevels>
void affine_levels(const float* x, uint16_t* d_out, uint16_t* m_out, int q[kQK]) {
  float min = x[0], max = x[0];
  for (int j = 1; j < kQK; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / static_cast<float>(kLevels - 1);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = f32_to_f16(d);
  *m_out = f32_to_f16(min);
  for (int j = 0; j < kQK; ++j)
    q[j] = std::min(kLevels - 1, static_cast<int>((x[j] - min) * id + 0.5f));
}

void encode_legacy_block(DType t, const float* x, std::byte* row, int64_t b) {
  int q[kQK];
  switch (t) {
    case DType::kQ4_0: {
      BlockQ4_0 blk{};
      symmetric_levels<16>(x, &blk.d, q);
      for (int j = 0; j < kQK; ++j) set_nibble(blk.qs, j, q[j]);
      return store_block(blk, row, b);
    }
    case DType::kQ4_1: {
      BlockQ4_1 blk{};
      affine_levels<16>(x, &blk.d, &blk.m, q);
      for (int j = 0; j < kQK; ++j) set_nibble(blk.qs, j, q[j]);
      return store_block(blk, row, b);
    }
    case DType::kQ5_0: {
      BlockQ5_0 blk{};
      symmetric_levels<32>(x, &blk.d, q);
      uint32_t h = 0;
      for (int j = 0; j < kQK; ++j) {
        set_nibble(blk.qs, j, q[j] & 0x0F);
        h |= static_cast<uint32_t>(q[j] >> 4) << j;
      }
      std::memcpy(blk.qh, &h, 4);
      return store_block(blk, row, b);
    }
    case DType::kQ5_1: {
      BlockQ5_1 blk{};
      affine_levels<32>(x, &blk.d, &blk.m, q);
      uint32_t h = 0;
      for (int j = 0; j < kQK; ++j) {
        set_nibble(blk.qs, j, q[j] & 0x0F);
        h |= static_cast<uint32_t>(q[j] >> 4) << j;
      }
      std::memcpy(blk.qh, &h, 4);
      return store_block(blk, row, b);
    }
    case DType::kQ8_0: {  // as ggml's quantize_row_q8_0_ref
      float amax = 0.0f;
      for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      BlockQ8_0 blk;
      blk.scale = f32_to_f16(d);
      for (int j = 0; j < kQK; ++j) blk.q[j] = static_cast<int8_t>(std::lround(x[j] * id));
      return store_block(blk, row, b);
    }
    default: return;
  }
}

void int_block_legacy(DType t, const std::byte* row, int64_t b, IntBlock* o) {
  o->sc[0] = o->sc[1] = 1;
  o->mn[0] = o->mn[1] = 0;
  o->m = 0.0f;
  switch (t) {
    case DType::kQ4_0: {
      const auto blk = load_block<BlockQ4_0>(row, b);
      o->d = f16_to_f32(blk.d);
      for (int j = 0; j < kQK; ++j) o->q[j] = static_cast<int8_t>(nibble(blk.qs, j) - 8);
      return;
    }
    case DType::kQ4_1: {
      const auto blk = load_block<BlockQ4_1>(row, b);
      o->d = f16_to_f32(blk.d);
      o->m = f16_to_f32(blk.m);
      o->mn[0] = o->mn[1] = 1;
      for (int j = 0; j < kQK; ++j) o->q[j] = static_cast<int8_t>(nibble(blk.qs, j));
      return;
    }
    case DType::kQ5_0: {
      const auto blk = load_block<BlockQ5_0>(row, b);
      const uint32_t h = high_bits(blk.qh);
      o->d = f16_to_f32(blk.d);
      for (int j = 0; j < kQK; ++j)
        o->q[j] = static_cast<int8_t>((nibble(blk.qs, j) | (((h >> j) & 1u) << 4)) - 16);
      return;
    }
    case DType::kQ5_1: {
      const auto blk = load_block<BlockQ5_1>(row, b);
      const uint32_t h = high_bits(blk.qh);
      o->d = f16_to_f32(blk.d);
      o->m = f16_to_f32(blk.m);
      o->mn[0] = o->mn[1] = 1;
      for (int j = 0; j < kQK; ++j)
        o->q[j] = static_cast<int8_t>(nibble(blk.qs, j) | (((h >> j) & 1u) << 4));
      return;
    }
    case DType::kQ8_0: {
      const auto blk = load_block<BlockQ8_0>(row, b);
      o->d = f16_to_f32(blk.scale);
      std::memcpy(o->q, blk.q, kQK);
      return;
    }
    default: return;
  }
}

// Decodes one legacy block as ggml's dequantize_row_*: value = d * q (+ m), one f32 product.
void decode_legacy_block(DType t, const std::byte* row, int64_t b, float* out) {
  IntBlock ib;
  int_block_legacy(t, row, b, &ib);
  for (int j = 0; j < kQK; ++j) {
    const float v = ib.d * static_cast<float>(ib.q[j]);
    out[j] = ib.mn[0] != 0 ? v + ib.m : v;
  }
}

bool is_k_quant(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K ||
         t == DType::kQ6_K;
}

}  // namespace

bool dtype_is_quantized(DType t) {
  return t != DType::kF32 && t != DType::kF16 && t != DType::kBF16;
}

void encode_row(DType t, const float* x, int64_t n, std::byte* dst) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, x, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = t == DType::kF16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    default: break;
  }
  if (is_k_quant(t)) {
    for (int64_t b = 0; b < n / kQK_K; ++b) detail::encode_k_block(t, x + b * kQK_K, dst, b);
    return;
  }
  for (int64_t b = 0; b < n / kQK; ++b) encode_legacy_block(t, x + b * kQK, dst, b);
}

void decode_row(DType t, const std::byte* src, int64_t n, float* out) {
  switch (t) {
    case DType::kF32:
      std::memcpy(out, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = t == DType::kF16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      return;
    default: break;
  }
  if (is_k_quant(t)) {
    for (int64_t b = 0; b < n / kQK_K; ++b) detail::decode_k_block(t, src, b, out + b * kQK_K);
    return;
  }
  for (int64_t b = 0; b < n / kQK; ++b) decode_legacy_block(t, src, b, out + b * kQK);
}

void int_block(DType t, const std::byte* row, int64_t b, IntBlock* out) {
  if (is_k_quant(t)) return detail::int_block_k(t, row, b, out);
  int_block_legacy(t, row, b, out);
}

DType quant_fallback(DType t, int64_t cols) {
  auto fits = [cols](DType d) { return dtype_row_bytes(d, static_cast<uint64_t>(cols)).has_value(); };
  if (fits(t)) return t;
  DType next = DType::kF16;
  switch (t) {
    case DType::kQ2_K: case DType::kQ3_K: case DType::kQ4_K: next = DType::kQ5_0; break;
    case DType::kQ5_K: next = DType::kQ5_1; break;
    case DType::kQ6_K: next = DType::kQ8_0; break;
    default: break;
  }
  return fits(next) ? next : DType::kF16;
}

}  // namespace cleave
