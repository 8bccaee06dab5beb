#include "cleave/model/requantize.h"

#include <memory>
#include <vector>

#include "cleave/model/gguf.h"
#include "cleave/model/gguf_writer.h"
#include "cleave/model/quants.h"
#include "fmt/format.h"

namespace cleave {
namespace {

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
  w.set_u32("general.file_type", ggml_file_type(dtype));
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
