// Little-endian byte writer/reader and the engine address encoding. Internal.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::transfer {

struct ByteWriter {
  std::string out;
  void u8(uint8_t v);
  void u32(uint32_t v);
  void u64(uint64_t v);
  void bytes(std::string_view b);  // u32 length + bytes
};

struct ByteReader {
  std::string_view in;
  size_t pos = 0;
  bool take(size_t n, const char** p);
  bool u8(uint8_t* v);
  bool u32(uint32_t* v);
  bool u64(uint64_t* v);
  bool bytes(std::string* b, size_t max_len);
};

// What TransferEngine::address() serialises: the engine id, its provider, every rail's
// endpoint name (fi_getname), and where the engine's process runs: `host_id` names the kernel
// and pid namespace (boot id + pid namespace inode), so that a peer with the same host_id can
// check with kill(pid, 0) whether the process is still alive before writing to it.
struct EngineAddress {
  uint64_t engine_id = 0;
  std::string provider;
  std::vector<std::string> rail_names;
  std::string host_id;
  uint32_t pid = 0;
  std::string encode() const;
  static Result<EngineAddress> decode(std::string_view bytes);
};

// This process's host id (see EngineAddress); empty when /proc is unreadable.
const std::string& local_host_id();

}  // namespace cleave::transfer
