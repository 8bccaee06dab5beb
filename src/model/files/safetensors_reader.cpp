#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include "cleave/model/safetensors.h"
#include "fmt/format.h"
#include "mapped_file.h"
#include "nlohmann/json.hpp"

namespace cleave {
namespace {

// The reference implementation refuses headers over 100 MB as well.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr int kMaxJsonDepth = 8;
constexpr size_t kMaxDims = 8;
constexpr uint64_t kMaxDim = 1ull << 40;

// Checks brace/bracket nesting outside strings so that nlohmann never sees a hostile depth.
Status check_json_depth(std::string_view s) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (char c : s) {
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') in_str = true;
    else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth)
        return DataLoss(fmt::format("safetensors header nests deeper than {} levels", kMaxJsonDepth));
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return Status::Ok();
}

Result<uint64_t> json_u64(const nlohmann::json& j, std::string_view what) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0) return static_cast<uint64_t>(j.get<int64_t>());
  return DataLoss(fmt::format("{} must be a non-negative integer, got {}", what, j.dump()));
}

Status parse_tensor(const std::string& name, const nlohmann::json& e, uint64_t data_len,
                    SafetensorsTensor* t) {
  t->name = name;
  if (!e.is_object())
    return DataLoss(fmt::format("safetensors entry '{}' is not an object", name));
  auto dt = e.find("dtype");
  auto sh = e.find("shape");
  auto off = e.find("data_offsets");
  if (dt == e.end() || !dt->is_string())
    return DataLoss(fmt::format("tensor '{}' has no dtype string", name));
  if (sh == e.end() || !sh->is_array())
    return DataLoss(fmt::format("tensor '{}' has no shape array", name));
  if (off == e.end() || !off->is_array() || off->size() != 2)
    return DataLoss(fmt::format("tensor '{}' needs data_offsets [begin, end]", name));
  const std::string dts = dt->get<std::string>();
  auto dtype = dtype_from_safetensors(dts);
  if (!dtype)
    return InvalidArgument(fmt::format("tensor '{}' has dtype {}, which is not supported (F32, "
                                       "F16 and BF16 are)", name, dts));
  t->dtype = *dtype;
  if (sh->size() > kMaxDims)
    return DataLoss(fmt::format("tensor '{}' has {} dimensions (at most {})", name, sh->size(), kMaxDims));
  uint64_t elems = 1;
  for (const auto& d : *sh) {
    CLEAVE_ASSIGN_OR_RETURN(uint64_t n, json_u64(d, fmt::format("a dimension of '{}'", name)));
    if (n > kMaxDim || (n != 0 && elems > (1ull << 50) / n))
      return DataLoss(fmt::format("tensor '{}' has an absurd shape {}", name, sh->dump()));
    elems *= n;
    t->shape.push_back(static_cast<int64_t>(n));
  }
  CLEAVE_ASSIGN_OR_RETURN(uint64_t begin, json_u64((*off)[0], fmt::format("data_offsets of '{}'", name)));
  CLEAVE_ASSIGN_OR_RETURN(uint64_t end, json_u64((*off)[1], fmt::format("data_offsets of '{}'", name)));
  if (begin > end || end > data_len)
    return DataLoss(fmt::format("tensor '{}' data_offsets [{}, {}] lie outside the data section "
                                "of {} bytes: the file is truncated or lies", name, begin, end,
                                data_len));
  const uint64_t want = elems * static_cast<uint64_t>(dtype_info(*dtype).block_bytes);
  if (end - begin != want)
    return DataLoss(fmt::format("tensor '{}' has {} bytes but its shape {} of {} needs {}", name,
                                end - begin, sh->dump(), dts, want));
  t->offset = begin;
  t->nbytes = want;
  return Status::Ok();
}

}  // namespace

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

std::string_view dtype_to_safetensors(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    default: return "";  // block formats have no safetensors dtype
  }
}

int64_t SafetensorsTensor::elements() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

Result<SafetensorsFile> SafetensorsFile::parse(std::span<const std::byte> bytes) {
  if (bytes.size() < 8)
    return DataLoss(fmt::format("safetensors file is {} bytes, too short for its header length",
                                bytes.size()));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > kMaxHeaderBytes)
    return DataLoss(fmt::format("safetensors header claims {} bytes (limit {})", n, kMaxHeaderBytes));
  if (n > bytes.size() - 8)
    return DataLoss(fmt::format("safetensors header claims {} bytes but the file has only {} after "
                                "the length: truncated", n, bytes.size() - 8));
  std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), n);
  if (text.empty() || text.front() != '{')
    return DataLoss("safetensors header does not start with '{'");
  CLEAVE_RETURN_IF_ERROR(check_json_depth(text));
  // nlohmann keeps the last of duplicate keys; a top-level duplicate (a tensor named twice) is
  // caught while parsing instead.
  std::string duplicate;
  std::set<std::string> top_keys;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    if (ev == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        !top_keys.insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, on_event, /*allow_exceptions=*/false);
  } catch (const std::exception& e) {
    return DataLoss(fmt::format("safetensors header: {}", e.what()));
  }
  if (j.is_discarded() || !j.is_object())
    return DataLoss("safetensors header is not a valid JSON object");
  if (!duplicate.empty())
    return DataLoss(fmt::format("safetensors header names '{}' more than once", duplicate));

  SafetensorsFile f;
  const uint64_t data_len = bytes.size() - 8 - n;
  const std::byte* data = bytes.data() + 8 + n;
  try {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) return DataLoss("safetensors __metadata__ is not an object");
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string())
            return DataLoss(fmt::format("safetensors __metadata__ '{}' is not a string", m.key()));
          f.metadata_.emplace(m.key(), m->get<std::string>());
        }
        continue;
      }
      SafetensorsTensor t;
      CLEAVE_RETURN_IF_ERROR(parse_tensor(it.key(), it.value(), data_len, &t));
      t.data = data + t.offset;
      f.tensors_.push_back(std::move(t));
    }
  } catch (const std::exception& e) {
    return DataLoss(fmt::format("safetensors header: {}", e.what()));
  }
  std::sort(f.tensors_.begin(), f.tensors_.end(),
            [](const auto& a, const auto& b) { return a.offset < b.offset || (a.offset == b.offset && a.nbytes < b.nbytes); });
  for (size_t i = 1; i < f.tensors_.size(); ++i) {
    const auto& a = f.tensors_[i - 1];
    const auto& b = f.tensors_[i];
    if (a.offset + a.nbytes > b.offset)
      return DataLoss(fmt::format("tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", a.name,
                                  a.offset, a.offset + a.nbytes, b.name, b.offset,
                                  b.offset + b.nbytes));
  }
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  CLEAVE_ASSIGN_OR_RETURN(MappedFile file, map_file_readonly(path));
  auto r = parse(file.bytes);
  if (!r.ok()) return r.status().with_context(path);
  r->mapping_ = std::move(file.mapping);
  return r;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace cleave
