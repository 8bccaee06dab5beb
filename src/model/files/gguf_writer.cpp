#include "cleave/model/gguf_writer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "fmt/format.h"

namespace cleave {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF"
constexpr uint32_t kVersion = 3;

class ByteSink {
 public:
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void put_string(std::string_view s) {
    put<uint64_t>(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    buf_.insert(buf_.end(), p, p + s.size());
  }
  void pad_to(uint64_t alignment) {
    while (buf_.size() % alignment != 0) buf_.push_back(std::byte{0});
  }
  std::vector<std::byte>& bytes() { return buf_; }

 private:
  std::vector<std::byte> buf_;
};

// Writes one scalar of type t from the integer / float / string given.
void put_scalar(ByteSink& s, GgufType t, uint64_t u, int64_t i, double f, const std::string& str) {
  switch (t) {
    case GgufType::kUint8: s.put<uint8_t>(static_cast<uint8_t>(u)); break;
    case GgufType::kInt8: s.put<int8_t>(static_cast<int8_t>(i)); break;
    case GgufType::kUint16: s.put<uint16_t>(static_cast<uint16_t>(u)); break;
    case GgufType::kInt16: s.put<int16_t>(static_cast<int16_t>(i)); break;
    case GgufType::kUint32: s.put<uint32_t>(static_cast<uint32_t>(u)); break;
    case GgufType::kInt32: s.put<int32_t>(static_cast<int32_t>(i)); break;
    case GgufType::kUint64: s.put<uint64_t>(u); break;
    case GgufType::kInt64: s.put<int64_t>(i); break;
    case GgufType::kFloat32: s.put<float>(static_cast<float>(f)); break;
    case GgufType::kFloat64: s.put<double>(f); break;
    case GgufType::kBool: s.put<uint8_t>(u ? 1 : 0); break;
    case GgufType::kString: s.put_string(str); break;
    case GgufType::kArray: break;  // never a scalar
  }
}

void put_value(ByteSink& s, const GgufValue& v) {
  s.put<uint32_t>(static_cast<uint32_t>(v.type));
  if (v.type != GgufType::kArray) {
    put_scalar(s, v.type, v.u, v.i, v.f, v.str);
    return;
  }
  s.put<uint32_t>(static_cast<uint32_t>(v.elem_type));
  s.put<uint64_t>(v.array_size());
  static const std::string kEmpty;
  if (v.elem_type == GgufType::kString) {
    for (const auto& x : v.strs) put_scalar(s, v.elem_type, 0, 0, 0, x);
  } else if (v.elem_type == GgufType::kFloat32 || v.elem_type == GgufType::kFloat64) {
    for (double x : v.floats) put_scalar(s, v.elem_type, 0, 0, x, kEmpty);
  } else {
    for (int64_t x : v.ints)
      put_scalar(s, v.elem_type, static_cast<uint64_t>(x), x, 0, kEmpty);
  }
}

GgufValue scalar(GgufType t) {
  GgufValue v;
  v.type = t;
  return v;
}

}  // namespace

GgufWriter::GgufWriter(uint64_t alignment) : alignment_(alignment ? alignment : 32) {
  if (alignment_ != 32) set_u32("general.alignment", static_cast<uint32_t>(alignment_));
}

void GgufWriter::set(std::string key, GgufValue value) {
  for (auto& [k, v] : kv_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  kv_.emplace_back(std::move(key), std::move(value));
}

void GgufWriter::set_u8(std::string key, uint8_t x) { auto v = scalar(GgufType::kUint8); v.u = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_i8(std::string key, int8_t x) { auto v = scalar(GgufType::kInt8); v.i = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_u16(std::string key, uint16_t x) { auto v = scalar(GgufType::kUint16); v.u = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_i16(std::string key, int16_t x) { auto v = scalar(GgufType::kInt16); v.i = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_u32(std::string key, uint32_t x) { auto v = scalar(GgufType::kUint32); v.u = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_i32(std::string key, int32_t x) { auto v = scalar(GgufType::kInt32); v.i = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_u64(std::string key, uint64_t x) { auto v = scalar(GgufType::kUint64); v.u = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_i64(std::string key, int64_t x) { auto v = scalar(GgufType::kInt64); v.i = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_f32(std::string key, float x) { auto v = scalar(GgufType::kFloat32); v.f = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_f64(std::string key, double x) { auto v = scalar(GgufType::kFloat64); v.f = x; set(std::move(key), std::move(v)); }
void GgufWriter::set_bool(std::string key, bool x) { auto v = scalar(GgufType::kBool); v.u = x ? 1 : 0; set(std::move(key), std::move(v)); }
void GgufWriter::set_string(std::string key, std::string x) { auto v = scalar(GgufType::kString); v.str = std::move(x); set(std::move(key), std::move(v)); }

void GgufWriter::set_string_array(std::string key, std::vector<std::string> x) {
  auto v = scalar(GgufType::kArray);
  v.elem_type = GgufType::kString;
  v.strs = std::move(x);
  set(std::move(key), std::move(v));
}

void GgufWriter::set_int_array(std::string key, GgufType elem, std::vector<int64_t> x) {
  auto v = scalar(GgufType::kArray);
  v.elem_type = elem;
  v.ints = std::move(x);
  set(std::move(key), std::move(v));
}

void GgufWriter::set_float_array(std::string key, GgufType elem, std::vector<double> x) {
  auto v = scalar(GgufType::kArray);
  v.elem_type = elem;
  v.floats = std::move(x);
  set(std::move(key), std::move(v));
}

void GgufWriter::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                            std::vector<std::byte> data) {
  Tensor t{std::move(name), dtype, std::move(shape), std::move(data), nullptr};
  for (auto& old : tensors_) {
    if (old.name == t.name) {
      old = std::move(t);
      return;
    }
  }
  tensors_.push_back(std::move(t));
}

void GgufWriter::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                            FillFn fill) {
  Tensor t{std::move(name), dtype, std::move(shape), {}, std::move(fill)};
  for (auto& old : tensors_) {
    if (old.name == t.name) {
      old = std::move(t);
      return;
    }
  }
  tensors_.push_back(std::move(t));
}

bool GgufWriter::remove_tensor(std::string_view name) {
  return std::erase_if(tensors_, [&](const Tensor& t) { return t.name == name; }) > 0;
}

bool GgufWriter::remove_key(std::string_view key) {
  return std::erase_if(kv_, [&](const auto& kv) { return kv.first == key; }) > 0;
}

Status GgufWriter::emit(const std::function<Status(std::span<const std::byte>)>& sink) const {
  // Sizes and offsets first: every check happens before the first byte goes out.
  std::vector<uint64_t> sizes, offsets;
  uint64_t off = 0;
  for (const auto& t : tensors_) {
    if (t.shape.empty() || t.shape.size() > 4)
      return InvalidArgument(fmt::format("tensor '{}' has {} dimensions (1 to 4 allowed)", t.name,
                                         t.shape.size()));
    uint64_t rows = 1;
    for (size_t d = 0; d + 1 < t.shape.size(); ++d) {
      if (t.shape[d] <= 0)
        return InvalidArgument(fmt::format("tensor '{}' has dimension {}", t.name, t.shape[d]));
      rows *= static_cast<uint64_t>(t.shape[d]);
    }
    if (t.shape.back() <= 0)
      return InvalidArgument(fmt::format("tensor '{}' has dimension {}", t.name, t.shape.back()));
    auto row = dtype_row_bytes(t.dtype, static_cast<uint64_t>(t.shape.back()));
    if (!row)
      return InvalidArgument(fmt::format("tensor '{}': a row of {} elements is not a whole "
                                         "number of {} blocks", t.name, t.shape.back(),
                                         dtype_name(t.dtype)));
    const uint64_t n = *row * rows;
    if (!t.fill && t.data.size() != n)
      return InvalidArgument(fmt::format("tensor '{}' has {} bytes of data but its shape and "
                                         "dtype {} need {}", t.name, t.data.size(),
                                         dtype_name(t.dtype), n));
    sizes.push_back(n);
    offsets.push_back(off);
    off += (n + alignment_ - 1) / alignment_ * alignment_;
  }

  ByteSink h;
  h.put<uint32_t>(kMagic);
  h.put<uint32_t>(kVersion);
  h.put<uint64_t>(tensors_.size());
  h.put<uint64_t>(kv_.size());
  for (const auto& [k, v] : kv_) {
    h.put_string(k);
    put_value(h, v);
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    h.put_string(t.name);
    h.put<uint32_t>(static_cast<uint32_t>(t.shape.size()));
    for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) h.put<uint64_t>(static_cast<uint64_t>(*it));
    h.put<uint32_t>(dtype_to_ggml(t.dtype));
    h.put<uint64_t>(offsets[i]);
  }
  h.pad_to(alignment_);
  CLEAVE_RETURN_IF_ERROR(sink(h.bytes()));

  std::vector<std::byte> scratch;
  const std::vector<std::byte> zeros(alignment_);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    if (t.fill) {
      scratch.assign(sizes[i], std::byte{0});
      Status st = t.fill(scratch);
      if (!st.ok()) return st.with_context(fmt::format("tensor '{}'", t.name));
      CLEAVE_RETURN_IF_ERROR(sink(scratch));
      scratch.clear();
      scratch.shrink_to_fit();
    } else {
      CLEAVE_RETURN_IF_ERROR(sink(t.data));
    }
    const uint64_t pad = (alignment_ - sizes[i] % alignment_) % alignment_;
    // The last tensor is padded too: some readers expect the file to end aligned.
    if (pad) CLEAVE_RETURN_IF_ERROR(sink(std::span<const std::byte>(zeros.data(), pad)));
  }
  return Status::Ok();
}

Result<std::vector<std::byte>> GgufWriter::to_bytes() const {
  std::vector<std::byte> out;
  CLEAVE_RETURN_IF_ERROR(emit([&](std::span<const std::byte> b) {
    out.insert(out.end(), b.begin(), b.end());
    return Status::Ok();
  }));
  return out;
}

Status GgufWriter::write(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(tmp.c_str(), "wb"), &std::fclose);
  if (!f) return NotFound(fmt::format("cannot create '{}': {}", tmp, std::strerror(errno)));
  Status st = emit([&](std::span<const std::byte> b) {
    if (!b.empty() && std::fwrite(b.data(), 1, b.size(), f.get()) != b.size())
      return Internal(fmt::format("writing '{}': {}", tmp, std::strerror(errno)));
    return Status::Ok();
  });
  if (st.ok() && std::fflush(f.get()) != 0)
    st = Internal(fmt::format("writing '{}': {}", tmp, std::strerror(errno)));
  f.reset();
  if (!st.ok()) {
    std::remove(tmp.c_str());
    return st;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Internal(fmt::format("renaming '{}' to '{}': {}", tmp, path, std::strerror(errno)));
  }
  return Status::Ok();
}

}  // namespace cleave
