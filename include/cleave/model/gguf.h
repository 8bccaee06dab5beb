// GGUF (v2/v3) reader: metadata and tensor directory over a read-only mmap.
//
// The parser trusts nothing in the file: every count, length, offset and size is checked against
// the bytes that are there before anything is allocated or read, and a bad file gives a DataLoss
// or InvalidArgument Status that names the problem. Tensor data is never copied; TensorInfo::data
// points into the mapping, which lives as long as any GgufFile copy sharing it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/model/dtype.h"

namespace cleave {

enum class GgufType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6,
  kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};
std::string_view gguf_type_name(GgufType t);

// One metadata value. Scalars keep their declared type; integers are widened to i64/u64,
// floats to double. Arrays hold one element type (arrays of arrays are refused).
struct GgufValue {
  GgufType type = GgufType::kUint8;
  GgufType elem_type = GgufType::kUint8;  // for arrays
  uint64_t u = 0;                         // unsigned integer types and bool
  int64_t i = 0;                          // signed integer types
  double f = 0;                           // float types
  std::string str;                        // kString
  std::vector<std::string> strs;          // array of strings
  std::vector<int64_t> ints;              // array of any integer type or bool
  std::vector<double> floats;             // array of float types

  bool is_integer() const;
  bool is_float() const { return type == GgufType::kFloat32 || type == GgufType::kFloat64; }
  uint64_t array_size() const { return strs.size() + ints.size() + floats.size(); }
};

struct GgufTensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major, outermost first (GGUF's ne reversed): [rows, cols]
  uint64_t offset = 0;         // from the start of the data section
  uint64_t nbytes = 0;
  const std::byte* data = nullptr;  // into the mapping
  int64_t elements() const;
};

class GgufFile {
 public:
  // Maps `path` read-only and parses it.
  static Result<GgufFile> open(const std::string& path);
  // Parses bytes that the caller keeps alive for the life of the result (tests, fuzzing).
  static Result<GgufFile> parse(std::span<const std::byte> bytes);

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(std::string_view key) const;
  const GgufTensorInfo* find_tensor(std::string_view name) const;

  // Typed look-ups. Missing key: NotFound. Wrong type: InvalidArgument naming the key.
  Result<std::string> get_string(std::string_view key) const;
  Result<uint64_t> get_uint(std::string_view key) const;  // any non-negative integer type
  Result<double> get_float(std::string_view key) const;   // float or integer types
  Result<bool> get_bool(std::string_view key) const;
  // Array accessors return the array value; its elements are in strs/ints/floats.
  Result<const GgufValue*> get_array(std::string_view key, GgufType elem_kind) const;

  std::string get_string_or(std::string_view key, std::string def) const;
  uint64_t get_uint_or(std::string_view key, uint64_t def) const;
  double get_float_or(std::string_view key, double def) const;
  bool get_bool_or(std::string_view key, bool def) const;

 private:
  std::shared_ptr<void> mapping_;  // keeps an mmap alive (null for parse())
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue, std::less<>> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace cleave
