#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "cleave/model/gguf.h"
#include "fmt/format.h"
#include "mapped_file.h"

namespace cleave {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kMaxStringLen = 1ull << 30;
constexpr uint32_t kMaxDims = 4;

// Bounds-checked little-endian cursor over the file bytes.
class Cursor {
 public:
  explicit Cursor(std::span<const std::byte> b) : b_(b) {}
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return b_.size() - pos_; }

  template <typename T>
  Status read(T* out, std::string_view what) {
    if (remaining() < sizeof(T))
      return DataLoss(fmt::format("file truncated while reading {} at byte {}", what, pos_));
    std::memcpy(out, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status read_string(std::string* out, std::string_view what) {
    uint64_t len = 0;
    CLEAVE_RETURN_IF_ERROR(read(&len, what));
    if (len > kMaxStringLen || len > remaining())
      return DataLoss(fmt::format("{} at byte {} claims {} bytes but only {} remain", what,
                                  pos_ - 8, len, remaining()));
    out->assign(reinterpret_cast<const char*>(b_.data() + pos_), len);
    pos_ += len;
    return Status::Ok();
  }

 private:
  std::span<const std::byte> b_;
  uint64_t pos_ = 0;
};

uint64_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::kUint8: case GgufType::kInt8: case GgufType::kBool: return 1;
    case GgufType::kUint16: case GgufType::kInt16: return 2;
    case GgufType::kUint32: case GgufType::kInt32: case GgufType::kFloat32: return 4;
    case GgufType::kUint64: case GgufType::kInt64: case GgufType::kFloat64: return 8;
    case GgufType::kString: return 8;  // at least the length prefix
    case GgufType::kArray: return 12;
  }
  return 0;
}

bool valid_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kFloat64); }

// Reads one scalar of type t into v (as a scalar) or appends it to v's array storage.
Status read_scalar(Cursor& c, GgufType t, GgufValue& v, bool as_element, std::string_view key) {
  auto name = fmt::format("value of '{}'", key);
  auto put_u = [&](uint64_t x) { as_element ? v.ints.push_back(static_cast<int64_t>(x)) : void(v.u = x); };
  auto put_i = [&](int64_t x) { as_element ? v.ints.push_back(x) : void(v.i = x); };
  auto put_f = [&](double x) { as_element ? v.floats.push_back(x) : void(v.f = x); };
  switch (t) {
    case GgufType::kUint8: { uint8_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_u(x); break; }
    case GgufType::kInt8: { int8_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_i(x); break; }
    case GgufType::kUint16: { uint16_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_u(x); break; }
    case GgufType::kInt16: { int16_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_i(x); break; }
    case GgufType::kUint32: { uint32_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_u(x); break; }
    case GgufType::kInt32: { int32_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_i(x); break; }
    case GgufType::kUint64: { uint64_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_u(x); break; }
    case GgufType::kInt64: { int64_t x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_i(x); break; }
    case GgufType::kFloat32: { float x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_f(x); break; }
    case GgufType::kFloat64: { double x{}; CLEAVE_RETURN_IF_ERROR(c.read(&x, name)); put_f(x); break; }
    case GgufType::kBool: {
      uint8_t x = 0;
      CLEAVE_RETURN_IF_ERROR(c.read(&x, name));
      if (x > 1) return DataLoss(fmt::format("bool {} is {}, not 0 or 1", name, x));
      put_u(x);
      break;
    }
    case GgufType::kString: {
      std::string s;
      CLEAVE_RETURN_IF_ERROR(c.read_string(&s, name));
      if (as_element) v.strs.push_back(std::move(s)); else v.str = std::move(s);
      break;
    }
    case GgufType::kArray:
      return DataLoss(fmt::format("'{}' is an array of arrays, which is not supported", key));
  }
  return Status::Ok();
}

Status read_value(Cursor& c, GgufValue& v, std::string_view key) {
  uint32_t type = 0;
  CLEAVE_RETURN_IF_ERROR(c.read(&type, fmt::format("type of '{}'", key)));
  if (!valid_type(type)) return DataLoss(fmt::format("'{}' has unknown value type {}", key, type));
  v.type = static_cast<GgufType>(type);
  if (v.type != GgufType::kArray) return read_scalar(c, v.type, v, false, key);

  uint32_t et = 0;
  uint64_t n = 0;
  CLEAVE_RETURN_IF_ERROR(c.read(&et, fmt::format("element type of '{}'", key)));
  if (!valid_type(et)) return DataLoss(fmt::format("array '{}' has unknown element type {}", key, et));
  v.elem_type = static_cast<GgufType>(et);
  if (v.elem_type == GgufType::kArray)
    return DataLoss(fmt::format("'{}' is an array of arrays, which is not supported", key));
  CLEAVE_RETURN_IF_ERROR(c.read(&n, fmt::format("length of array '{}'", key)));
  // Each element takes at least scalar_size bytes: a lying count cannot make us allocate more
  // than the file could hold.
  if (n > c.remaining() / scalar_size(v.elem_type))
    return DataLoss(fmt::format("array '{}' claims {} elements but only {} bytes remain", key, n,
                                c.remaining()));
  if (v.elem_type == GgufType::kString) v.strs.reserve(n);
  else if (v.elem_type == GgufType::kFloat32 || v.elem_type == GgufType::kFloat64) v.floats.reserve(n);
  else v.ints.reserve(n);
  for (uint64_t k = 0; k < n; ++k) CLEAVE_RETURN_IF_ERROR(read_scalar(c, v.elem_type, v, true, key));
  return Status::Ok();
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

}  // namespace

std::string_view gguf_type_name(GgufType t) {
  static constexpr std::string_view kNames[] = {"uint8", "int8", "uint16", "int16", "uint32",
                                                "int32", "float32", "bool", "string", "array",
                                                "uint64", "int64", "float64"};
  auto i = static_cast<uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kUint8: case GgufType::kInt8: case GgufType::kUint16: case GgufType::kInt16:
    case GgufType::kUint32: case GgufType::kInt32: case GgufType::kUint64: case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

int64_t GgufTensorInfo::elements() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

Result<GgufFile> GgufFile::parse(std::span<const std::byte> bytes) {
  GgufFile f;
  Cursor c(bytes);
  uint32_t magic = 0;
  CLEAVE_RETURN_IF_ERROR(c.read(&magic, "magic"));
  if (magic != kMagic) return DataLoss(fmt::format("not a GGUF file (bad magic 0x{:08x})", magic));
  CLEAVE_RETURN_IF_ERROR(c.read(&f.version_, "version"));
  if (f.version_ != 2 && f.version_ != 3)
    return DataLoss(fmt::format("unsupported GGUF version {} (2 and 3 are supported)", f.version_));
  uint64_t n_tensors = 0, n_kv = 0;
  CLEAVE_RETURN_IF_ERROR(c.read(&n_tensors, "tensor count"));
  CLEAVE_RETURN_IF_ERROR(c.read(&n_kv, "metadata count"));
  // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at
  // least 8 + 4 + 8 + 4 + 8.
  if (n_kv > c.remaining() / 13)
    return DataLoss(fmt::format("metadata count {} is larger than the file could hold", n_kv));
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    CLEAVE_RETURN_IF_ERROR(c.read_string(&key, fmt::format("metadata key #{}", k)));
    GgufValue v;
    CLEAVE_RETURN_IF_ERROR(read_value(c, v, key));
    if (f.kv_.count(key)) return DataLoss(fmt::format("metadata key '{}' appears twice", key));
    f.kv_.emplace(std::move(key), std::move(v));
  }
  if (const GgufValue* a = f.find("general.alignment")) {
    if (!a->is_integer() || a->u == 0 || a->u > (1u << 20) || (a->u & (a->u - 1)) != 0)
      return DataLoss("general.alignment must be a power of two no larger than 1 MiB");
    f.alignment_ = a->u;
  }
  if (n_tensors > c.remaining() / 32)
    return DataLoss(fmt::format("tensor count {} is larger than the file could hold", n_tensors));
  f.tensors_.reserve(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    CLEAVE_RETURN_IF_ERROR(c.read_string(&t.name, fmt::format("name of tensor #{}", k)));
    uint32_t n_dims = 0;
    CLEAVE_RETURN_IF_ERROR(c.read(&n_dims, fmt::format("dimension count of '{}'", t.name)));
    if (n_dims == 0 || n_dims > kMaxDims)
      return DataLoss(fmt::format("tensor '{}' has {} dimensions (1 to {} allowed)", t.name, n_dims,
                                  kMaxDims));
    std::vector<uint64_t> ne(n_dims);
    uint64_t elems = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      CLEAVE_RETURN_IF_ERROR(c.read(&ne[d], fmt::format("dimensions of '{}'", t.name)));
      if (ne[d] == 0 || ne[d] > (1ull << 40) || !checked_mul(elems, ne[d], &elems) ||
          elems > (1ull << 50))
        return DataLoss(fmt::format("tensor '{}' has an absurd dimension {}", t.name, ne[d]));
    }
    for (auto it = ne.rbegin(); it != ne.rend(); ++it) t.shape.push_back(static_cast<int64_t>(*it));
    uint32_t type = 0;
    CLEAVE_RETURN_IF_ERROR(c.read(&type, fmt::format("type of '{}'", t.name)));
    auto dt = dtype_from_ggml(type);
    if (!dt)
      return InvalidArgument(fmt::format("tensor '{}' has GGML type {}, which is not supported "
                                         "(f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, "
                                         "q4_k, q5_k and q6_k are)", t.name, type));
    t.dtype = *dt;
    CLEAVE_RETURN_IF_ERROR(c.read(&t.offset, fmt::format("offset of '{}'", t.name)));
    if (t.offset % f.alignment_ != 0)
      return DataLoss(fmt::format("tensor '{}' offset {} is not aligned to {}", t.name, t.offset,
                                  f.alignment_));
    auto row = dtype_row_bytes(t.dtype, ne[0]);
    if (!row)
      return DataLoss(fmt::format("tensor '{}' row of {} elements is not a whole number of {} "
                                  "blocks", t.name, ne[0], dtype_name(t.dtype)));
    if (!checked_mul(*row, elems / ne[0], &t.nbytes))
      return DataLoss(fmt::format("tensor '{}' size overflows", t.name));
    if (f.tensor_index_.count(t.name))
      return DataLoss(fmt::format("tensor '{}' appears twice", t.name));
    f.tensor_index_.emplace(t.name, f.tensors_.size());
    f.tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (c.pos() + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  const uint64_t data_len = bytes.size() > data_start ? bytes.size() - data_start : 0;
  for (auto& t : f.tensors_) {
    if (t.offset > data_len || t.nbytes > data_len - t.offset)
      return DataLoss(fmt::format("tensor '{}' (bytes {}..{} of the data section) lies beyond the "
                                  "end of the file ({} data bytes): the file is truncated or lies",
                                  t.name, t.offset, t.offset + t.nbytes, data_len));
    t.data = bytes.data() + data_start + t.offset;
  }
  return f;
}

Result<GgufFile> GgufFile::open(const std::string& path) {
  CLEAVE_ASSIGN_OR_RETURN(MappedFile file, map_file_readonly(path));
  auto r = parse(file.bytes);
  if (!r.ok()) return r.status().with_context(path);
  r->mapping_ = std::move(file.mapping);
  return r;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return NotFound(fmt::format("metadata key '{}' is missing", key));
  if (v->type != GgufType::kString)
    return InvalidArgument(fmt::format("metadata '{}' is {}, expected string", key, gguf_type_name(v->type)));
  return v->str;
}

Result<uint64_t> GgufFile::get_uint(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return NotFound(fmt::format("metadata key '{}' is missing", key));
  if (!v->is_integer())
    return InvalidArgument(fmt::format("metadata '{}' is {}, expected an integer", key, gguf_type_name(v->type)));
  switch (v->type) {
    case GgufType::kInt8: case GgufType::kInt16: case GgufType::kInt32: case GgufType::kInt64:
      if (v->i < 0) return InvalidArgument(fmt::format("metadata '{}' is negative ({})", key, v->i));
      return static_cast<uint64_t>(v->i);
    default:
      return v->u;
  }
}

Result<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return NotFound(fmt::format("metadata key '{}' is missing", key));
  if (v->is_float()) return v->f;
  if (v->is_integer()) {
    switch (v->type) {
      case GgufType::kInt8: case GgufType::kInt16: case GgufType::kInt32: case GgufType::kInt64:
        return static_cast<double>(v->i);
      default:
        return static_cast<double>(v->u);
    }
  }
  return InvalidArgument(fmt::format("metadata '{}' is {}, expected a number", key, gguf_type_name(v->type)));
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return NotFound(fmt::format("metadata key '{}' is missing", key));
  if (v->type != GgufType::kBool)
    return InvalidArgument(fmt::format("metadata '{}' is {}, expected bool", key, gguf_type_name(v->type)));
  return v->u != 0;
}

Result<const GgufValue*> GgufFile::get_array(std::string_view key, GgufType elem_kind) const {
  const GgufValue* v = find(key);
  if (!v) return NotFound(fmt::format("metadata key '{}' is missing", key));
  if (v->type != GgufType::kArray)
    return InvalidArgument(fmt::format("metadata '{}' is {}, expected an array", key, gguf_type_name(v->type)));
  auto kind = [](GgufType t) {
    if (t == GgufType::kString) return 0;
    if (t == GgufType::kFloat32 || t == GgufType::kFloat64) return 1;
    return 2;
  };
  if (kind(v->elem_type) != kind(elem_kind))
    return InvalidArgument(fmt::format("metadata '{}' is an array of {}, expected {}", key,
                                       gguf_type_name(v->elem_type), gguf_type_name(elem_kind)));
  return v;
}

std::string GgufFile::get_string_or(std::string_view key, std::string def) const {
  auto r = get_string(key);
  return r.ok() ? *r : def;
}
uint64_t GgufFile::get_uint_or(std::string_view key, uint64_t def) const {
  auto r = get_uint(key);
  return r.ok() ? *r : def;
}
double GgufFile::get_float_or(std::string_view key, double def) const {
  auto r = get_float(key);
  return r.ok() ? *r : def;
}
bool GgufFile::get_bool_or(std::string_view key, bool def) const {
  auto r = get_bool(key);
  return r.ok() ? *r : def;
}

}  // namespace cleave
