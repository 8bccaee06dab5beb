#include <cerrno>
#include <cstdio>
#include <cstring>

#include "cleave/model/safetensors.h"
#include "fmt/format.h"
#include "nlohmann/json.hpp"

namespace cleave {

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

Status SafetensorsWriter::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                                     std::span<const std::byte> data) {
  if (dtype_to_safetensors(dtype).empty())
    return InvalidArgument(fmt::format("tensor '{}': safetensors cannot hold {} (dequantise it "
                                       "first)", name, dtype_name(dtype)));
  if (name == "__metadata__") return InvalidArgument("'__metadata__' is not a valid tensor name");
  for (const auto& e : entries_)
    if (e.name == name) return InvalidArgument(fmt::format("tensor '{}' added twice", name));
  uint64_t elems = 1;
  for (auto d : shape) {
    if (d < 0) return InvalidArgument(fmt::format("tensor '{}' has dimension {}", name, d));
    elems *= static_cast<uint64_t>(d);
  }
  const uint64_t want = elems * static_cast<uint64_t>(dtype_info(dtype).block_bytes);
  if (data.size() != want)
    return InvalidArgument(fmt::format("tensor '{}' has {} bytes but its shape and dtype {} need "
                                       "{}", name, data.size(), dtype_name(dtype), want));
  entries_.push_back({std::move(name), dtype, std::move(shape), data, nullptr});
  data_bytes_ += want;
  return Status::Ok();
}

Status SafetensorsWriter::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                                     std::vector<std::byte> data) {
  auto owned = std::make_shared<std::vector<std::byte>>(std::move(data));
  CLEAVE_RETURN_IF_ERROR(add_tensor(std::move(name), dtype, std::move(shape),
                                    std::span<const std::byte>(*owned)));
  entries_.back().owned = std::move(owned);
  return Status::Ok();
}

std::string SafetensorsWriter::header_json() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  uint64_t off = 0;
  for (const auto& e : entries_) {
    nlohmann::ordered_json t;
    t["dtype"] = std::string(dtype_to_safetensors(e.dtype));
    t["shape"] = e.shape;
    t["data_offsets"] = {off, off + e.data.size()};
    off += e.data.size();
    j[e.name] = std::move(t);
  }
  std::string s = j.dump();
  // Pad with spaces so that the data section starts at a multiple of 8 (8 + header length).
  while (s.size() % 8 != 0) s.push_back(' ');
  return s;
}

Result<std::vector<std::byte>> SafetensorsWriter::to_bytes() const {
  std::string h;
  try {
    h = header_json();
  } catch (const std::exception& e) {
    return InvalidArgument(fmt::format("safetensors header: {}", e.what()));
  }
  std::vector<std::byte> out(8 + h.size());
  const uint64_t n = h.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, h.data(), h.size());
  out.reserve(out.size() + data_bytes_);
  for (const auto& e : entries_) out.insert(out.end(), e.data.begin(), e.data.end());
  return out;
}

Status SafetensorsWriter::write(const std::string& path) const {
  std::string h;
  try {
    h = header_json();
  } catch (const std::exception& e) {
    return InvalidArgument(fmt::format("safetensors header: {}", e.what()));
  }
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return NotFound(fmt::format("cannot create '{}': {}", tmp, std::strerror(errno)));
  const uint64_t n = h.size();
  bool ok = std::fwrite(&n, 8, 1, f) == 1 && std::fwrite(h.data(), 1, h.size(), f) == h.size();
  for (const auto& e : entries_) {
    if (!ok) break;
    ok = e.data.empty() || std::fwrite(e.data.data(), 1, e.data.size(), f) == e.data.size();
  }
  ok = std::fflush(f) == 0 && ok;
  const int err = errno;
  std::fclose(f);
  if (!ok) {
    std::remove(tmp.c_str());
    return Internal(fmt::format("writing '{}': {}", tmp, std::strerror(err)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Internal(fmt::format("renaming '{}' to '{}': {}", tmp, path, std::strerror(errno)));
  }
  return Status::Ok();
}

}  // namespace cleave
