// safetensors files: a read-only mmap reader and a writer.
//
// Format: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"k": "v"}}, then the data section; offsets are relative to its start.
//
// The reader trusts nothing: the header length is checked against the file size, the JSON's
// nesting depth and entry count are bounded before it is parsed, every tensor's byte range must
// lie in the data section, match shape × dtype size exactly and not overlap another tensor's.
// Only F32, F16 and BF16 are accepted; other dtypes are refused with a message naming the tensor
// and its dtype. Tensor data is never copied; SafetensorsTensor::data points into the mapping,
// which lives as long as any SafetensorsFile copy sharing it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/model/dtype.h"

namespace cleave {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major, outermost first (as in the file)
  uint64_t offset = 0;         // from the start of the data section
  uint64_t nbytes = 0;
  const std::byte* data = nullptr;
  int64_t elements() const;
};

// "F32", "F16", "BF16"; nullopt for anything else.
std::optional<DType> dtype_from_safetensors(std::string_view name);
// "F32", "F16", "BF16"; empty for Q8_0 (not representable).
std::string_view dtype_to_safetensors(DType t);

class SafetensorsFile {
 public:
  static Result<SafetensorsFile> open(const std::string& path);
  // Parses bytes that the caller keeps alive for the life of the result (tests, fuzzing).
  static Result<SafetensorsFile> parse(std::span<const std::byte> bytes);

  // Sorted by offset.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(std::string_view name) const;
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }

 private:
  std::shared_ptr<void> mapping_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

// Writes one safetensors file: tensors in the order added, data contiguous, the header padded
// with spaces so that the data section starts 8-byte aligned (as the reference writer does).
// Data is borrowed: spans must stay valid until write()/to_bytes() returns.
class SafetensorsWriter {
 public:
  void set_metadata(std::string key, std::string value);
  // InvalidArgument for Q8_0, a duplicate name, or a size that does not match shape × dtype.
  Status add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                    std::span<const std::byte> data);
  // Same, but the writer keeps the bytes.
  Status add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                    std::vector<std::byte> data);
  uint64_t data_bytes() const { return data_bytes_; }

  Status write(const std::string& path) const;
  Result<std::vector<std::byte>> to_bytes() const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::span<const std::byte> data;
    std::shared_ptr<std::vector<std::byte>> owned;
  };
  std::string header_json() const;
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_bytes_ = 0;
};

}  // namespace cleave
