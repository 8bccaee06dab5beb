// A read-only view of one weight tensor in a model file (or in memory the model owns).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cleave/model/dtype.h"

namespace cleave {

struct TensorView {
  std::string name;            // canonical (GGUF) name, e.g. "blk.0.attn_q.weight"
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major, outermost first: a matrix is [rows(out), cols(in)]
  const std::byte* data = nullptr;
  uint64_t nbytes = 0;

  int64_t rows() const { return shape.size() >= 2 ? shape[0] : 1; }
  int64_t cols() const { return shape.empty() ? 0 : shape.back(); }
  int64_t elements() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  uint64_t row_bytes() const { return rows() ? nbytes / static_cast<uint64_t>(rows()) : 0; }
};

}  // namespace cleave
