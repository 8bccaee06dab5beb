// GGUF v3 writer: metadata of every GGUF type (scalars, strings, arrays) and tensors, laid out
// as the GGUF spec and llama.cpp expect (little-endian, tensor data aligned to `alignment`,
// default 32). Used by `cleave model synth`, tests and fuzz seeds.
//
// Keys and tensors are written in the order they were first added; adding a key or tensor
// again replaces the earlier one. Tensor data is either owned bytes or produced on demand by a
// fill callback while writing (so that a large synthetic model never sits in memory whole).
// Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/model/dtype.h"
#include "cleave/model/gguf.h"

namespace cleave {

class GgufWriter {
 public:
  // Fills exactly the tensor's byte size (dtype_row_bytes(cols) * rows).
  using FillFn = std::function<Status(std::span<std::byte> dst)>;

  explicit GgufWriter(uint64_t alignment = 32);

  // Metadata. `set` takes a fully formed value (scalar or array, as GgufFile returns them).
  void set(std::string key, GgufValue value);
  void set_u8(std::string key, uint8_t v);
  void set_i8(std::string key, int8_t v);
  void set_u16(std::string key, uint16_t v);
  void set_i16(std::string key, int16_t v);
  void set_u32(std::string key, uint32_t v);
  void set_i32(std::string key, int32_t v);
  void set_u64(std::string key, uint64_t v);
  void set_i64(std::string key, int64_t v);
  void set_f32(std::string key, float v);
  void set_f64(std::string key, double v);
  void set_bool(std::string key, bool v);
  void set_string(std::string key, std::string v);
  void set_string_array(std::string key, std::vector<std::string> v);
  // elem: any integer type or kBool; values are narrowed to it when written.
  void set_int_array(std::string key, GgufType elem, std::vector<int64_t> v);
  // elem: kFloat32 or kFloat64.
  void set_float_array(std::string key, GgufType elem, std::vector<double> v);

  // Tensors. `shape` is row-major, outermost first ([rows, cols] for a matrix), as in
  // GgufTensorInfo; it is written reversed (GGUF's ne order). The byte size is checked when
  // writing: a mismatch is InvalidArgument naming the tensor.
  void add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                  std::vector<std::byte> data);
  void add_tensor(std::string name, DType dtype, std::vector<int64_t> shape, FillFn fill);

  // Removes a tensor or key; false when there was none.
  bool remove_tensor(std::string_view name);
  bool remove_key(std::string_view key);

  // Writes the file (to `path`.tmp, then renamed, so a failed write leaves no partial file).
  Status write(const std::string& path) const;
  // The whole file in memory (tests, fuzz seeds).
  Result<std::vector<std::byte>> to_bytes() const;

 private:
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> data;
    FillFn fill;
  };
  // Calls sink(bytes) for every piece of the file in order.
  Status emit(const std::function<Status(std::span<const std::byte>)>& sink) const;

  uint64_t alignment_;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace cleave
