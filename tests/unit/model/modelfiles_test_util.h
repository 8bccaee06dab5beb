// Helpers shared by the model-file tests: byte patching of files the writers produced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"

namespace cleave::testing {

using Bytes = std::vector<std::byte>;

// Offset of the first occurrence of `needle` in `b` at or after `from`; npos when absent.
inline size_t find_bytes(const Bytes& b, std::string_view needle, size_t from = 0) {
  if (needle.size() > b.size()) return std::string_view::npos;
  std::string_view hay(reinterpret_cast<const char*>(b.data()), b.size());
  return hay.find(needle, from);
}

template <typename T>
void poke(Bytes& b, size_t at, T v) {
  ASSERT_LE(at + sizeof(T), b.size());
  std::memcpy(b.data() + at, &v, sizeof(T));
}

template <typename T>
T peek(const Bytes& b, size_t at) {
  T v{};
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}

inline Bytes floats_to_bytes(const std::vector<float>& f) {
  Bytes b(f.size() * 4);
  std::memcpy(b.data(), f.data(), b.size());
  return b;
}

// A fresh empty directory under the system temp dir, removed by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = std::filesystem::temp_directory_path() /
            (tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::filesystem::path path_;
};

inline std::string shared_dir() { return std::string(CLEAVE_SOURCE_DIR) + "/../shared"; }

}  // namespace cleave::testing
