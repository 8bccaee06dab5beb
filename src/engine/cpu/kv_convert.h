// K/V elements of the KV pool as f32, f16 or bf16 (engine.kv_dtype), for the CPU backend.
//
// Values never depend on the ISA: stores round with the library's conversions (dtype.h:
// f32_to_f16 / f32_to_bf16, round to nearest even), and loads are exact (a half or bfloat16 is
// a float), whether they run on F16C or in plain C++. Attention converts a row to f32 and then
// reduces it with the same fixed-order kernels as an f32 pool, so batch invariance holds for every
// KV dtype (engine-internal).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cleave/model/dtype.h"

namespace cleave::cpu {

// Whether the KV pool can hold `dtype` (f32, f16, bf16).
bool kv_dtype_supported(DType dtype);
// Bytes of one element of a supported KV dtype.
size_t kv_element_bytes(DType dtype);
// Stores n floats at `dst` as `dtype`.
void kv_store(DType dtype, const float* src, std::byte* dst, int64_t n);
// Loads n elements of `dtype` from `src` into floats (exact).
void kv_load(DType dtype, const std::byte* src, float* dst, int64_t n);

}  // namespace cleave::cpu
