#include "cleave/model/dtype.h"

#include "cleave/model/quants.h"

#include <array>
#include <cmath>
#include <limits>

namespace cleave {
namespace {
constexpr std::array<DTypeInfo, kNumDTypes> kInfos = {{
    {"f32", 1, 4},
    {"f16", 1, 2},
    {"bf16", 1, 2},
    {"q8_0", kQ8_0BlockElems, sizeof(BlockQ8_0)},
    {"q4_0", kQK, sizeof(BlockQ4_0)},
    {"q4_1", kQK, sizeof(BlockQ4_1)},
    {"q5_0", kQK, sizeof(BlockQ5_0)},
    {"q5_1", kQK, sizeof(BlockQ5_1)},
    {"q2_k", kQK_K, sizeof(BlockQ2_K)},
    {"q3_k", kQK_K, sizeof(BlockQ3_K)},
    {"q4_k", kQK_K, sizeof(BlockQ4_K)},
    {"q5_k", kQK_K, sizeof(BlockQ5_K)},
    {"q6_k", kQK_K, sizeof(BlockQ6_K)},
}};
// ggml type id of each DType, in DType order.
constexpr std::array<uint32_t, kNumDTypes> kGgmlIds = {0, 1, 30, 8, 2, 3, 6, 7, 10, 11, 12, 13, 14};
}  // namespace

const DTypeInfo& dtype_info(DType t) { return kInfos[static_cast<size_t>(t)]; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (size_t i = 0; i < kInfos.size(); ++i) {
    const auto& n = kInfos[i].name;
    if (n.size() != name.size()) continue;
    bool eq = true;
    for (size_t j = 0; j < n.size(); ++j) {
      char c = name[j];
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      if (c != n[j]) eq = false;
    }
    if (eq) return static_cast<DType>(i);
  }
  return std::nullopt;
}

std::optional<DType> dtype_from_ggml(uint32_t ggml_type) {
  for (size_t i = 0; i < kGgmlIds.size(); ++i)
    if (kGgmlIds[i] == ggml_type) return static_cast<DType>(i);
  return std::nullopt;
}

uint32_t dtype_to_ggml(DType t) { return kGgmlIds[static_cast<size_t>(t)]; }

uint32_t ggml_file_type(DType t) {
  // In DType order: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k.
  constexpr std::array<uint32_t, kNumDTypes> kFileTypes = {0, 1, 32, 7, 2, 3, 8, 9, 10, 11, 14, 16, 18};
  return kFileTypes[static_cast<size_t>(t)];
}

std::optional<uint64_t> dtype_row_bytes(DType t, uint64_t n) {
  const auto& info = dtype_info(t);
  if (n % static_cast<uint64_t>(info.block_elems) != 0) return std::nullopt;
  uint64_t blocks = n / static_cast<uint64_t>(info.block_elems);
  if (blocks > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(info.block_bytes))
    return std::nullopt;
  return blocks * static_cast<uint64_t>(info.block_bytes);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value / 2^-24 = m * 2^(e - 126)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace cleave
