// Rewrites a GGUF model's weight matrices in another dtype (`cleave convert --to gguf`).
#pragma once

#include <string>

#include "cleave/common/status.h"
#include "cleave/model/dtype.h"

namespace cleave {

struct RequantizeReport {
  int converted = 0;     // matrices written in the dtype asked for
  int fell_back = 0;     // matrices written in quant_fallback()'s dtype instead
  int kept = 0;          // tensors copied as they were (vectors: norms, biases)
  uint64_t bytes = 0;    // tensor bytes written
};

// Reads the GGUF file at `in_path` and writes `out_path` with the same metadata (but
// general.file_type) and the same tensors in the same order, every 2-D `*.weight` matrix decoded
// to f32 and encoded as `dtype` (or as quant_fallback(dtype, cols) when its rows cannot hold
// whole blocks of `dtype`, as llama.cpp's quantiser falls back). Vectors are copied unchanged.
Result<RequantizeReport> requantize_gguf(const std::string& in_path, const std::string& out_path,
                                         DType dtype);

}  // namespace cleave
