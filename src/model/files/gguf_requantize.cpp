#include "cleave/model/requantize.h"

#include <memory>
#include <vector>

#include "cleave/model/gguf.h"
#include "cleave/model/gguf_writer.h"
#include "cleave/model/quants.h"
#include "fmt/format.h"

namespace cleave {
namespace {

// llama.cpp's LLAMA_FTYPE_MOSTLY_* for a file whose matrices are all `t` (K-quants: the _S kind).
uint32_t file_type(DType t) {
  switch (t) {
    case DType::kF32: return 0;
    case DType::kF16: return 1;
    case DType::kQ4_0: return 2;
    case DType::kQ4_1: return 3;
    case DType::kQ8_0: return 7;
    case DType::kQ5_0: return 8;
    case DType::kQ5_1: return 9;
    case DType::kQ2_K: return 10;
    case DType::kQ3_K: return 11;
    case DType::kQ4_K: return 14;
    case DType::kQ5_K: return 16;
    case DType::kQ6_K: return 18;
    case DType::kBF16: return 32;
  }
  return 0;
}

bool is_matrix(const GgufTensorInfo& t) {
  return t.shape.size() == 2 && t.name.size() > 7 &&
         t.name.compare(t.name.size() - 7, 7, ".weight") == 0;
}

}  // namespace

Result<RequantizeReport> requantize_gguf(const std::string& in_path, const std::string& out_path,
                                         DType dtype) {
  CLEAVE_ASSIGN_OR_RETURN(GgufFile parsed, GgufFile::open(in_path));
  auto in = std::make_shared<GgufFile>(std::move(parsed));
  GgufWriter w(in->alignment());
  for (const auto& [key, value] : in->metadata()) w.set(key, value);
  w.set_u32("general.file_type", file_type(dtype));
  RequantizeReport report;
  for (const GgufTensorInfo& t : in->tensors()) {
    if (!is_matrix(t)) {
      w.add_tensor(t.name, t.dtype, t.shape,
                   std::vector<std::byte>(t.data, t.data + t.nbytes));
      ++report.kept;
      report.bytes += t.nbytes;
      continue;
    }
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const DType out = quant_fallback(dtype, cols);
    (out == dtype ? report.converted : report.fell_back) += 1;
    report.bytes += *dtype_row_bytes(out, static_cast<uint64_t>(cols)) * static_cast<uint64_t>(rows);
    const uint64_t in_row = *dtype_row_bytes(t.dtype, static_cast<uint64_t>(cols));
    const std::byte* src = t.data;
    const DType src_type = t.dtype;
    w.add_tensor(t.name, out, t.shape,
                 [in, src, src_type, in_row, rows, cols, out](std::span<std::byte> dst) -> Status {
                   const uint64_t out_row = *dtype_row_bytes(out, static_cast<uint64_t>(cols));
                   std::vector<float> row(static_cast<size_t>(cols));
                   for (int64_t r = 0; r < rows; ++r) {
                     decode_row(src_type, src + static_cast<uint64_t>(r) * in_row, cols, row.data());
                     encode_row(out, row.data(), cols, dst.data() + static_cast<uint64_t>(r) * out_row);
                   }
                   return Status::Ok();
                 });
  }
  CLEAVE_RETURN_IF_ERROR(w.write(out_path));
  return report;
}

}  // namespace cleave
