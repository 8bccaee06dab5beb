// Element types of model tensors, as they are stored in model files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace cleave {

enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kQ8_0,  // blocks of 32 int8 values with one f16 scale (34 bytes), as GGML's Q8_0
  // ggml's other block formats (include/cleave/model/quants.h has their layouts).
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ5_1,
  kQ2_K,
  kQ3_K,
  kQ4_K,
  kQ5_K,
  kQ6_K,
};
inline constexpr int kNumDTypes = 13;

struct DTypeInfo {
  std::string_view name;  // "f32", "f16", "bf16", "q8_0", "q4_0", ..., "q6_k"
  int64_t block_elems;    // elements per block (1 for plain types)
  int64_t block_bytes;    // bytes per block
};

const DTypeInfo& dtype_info(DType t);
inline std::string_view dtype_name(DType t) { return dtype_info(t).name; }
// Parses a name of dtype_info (case-insensitive): "f32", "q4_k", "Q6_K", ...
std::optional<DType> parse_dtype(std::string_view name);
// GGML type ids (ggml.h): F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10,
// Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14, BF16=30. Others (Q8_1, Q8_K, the IQ formats) are
// unsupported.
std::optional<DType> dtype_from_ggml(uint32_t ggml_type);
uint32_t dtype_to_ggml(DType t);
// llama.cpp's general.file_type (LLAMA_FTYPE_MOSTLY_*) of a file whose matrices are all t; a
// K-quant gives its _S kind (Q4_K -> 14).
uint32_t ggml_file_type(DType t);
// Bytes of a row of n elements; nullopt when n is not a whole number of blocks or overflows.
std::optional<uint64_t> dtype_row_bytes(DType t, uint64_t n);

inline constexpr int kQ8_0BlockElems = 32;
struct BlockQ8_0 {
  uint16_t scale;  // f16
  int8_t q[kQ8_0BlockElems];
};
static_assert(sizeof(BlockQ8_0) == 34);

// IEEE half and bfloat16 conversions (round to nearest even).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint16_t f32_to_bf16(float f);

}  // namespace cleave
