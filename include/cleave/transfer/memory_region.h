// Registered memory and the descriptors that name it to a remote peer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::transfer {

struct MemoryKind {
  enum class Type : uint8_t { kHost = 0, kCuda = 1 };
  Type type = Type::kHost;
  int device = 0;  // CUDA device ordinal for kCuda

  static MemoryKind host() { return {}; }
  static MemoryKind cuda(int device) { return {Type::kCuda, device}; }
};

// What a peer needs to write into a region: which engine owns it, where it is, and its keys.
// `keys` holds one key per rail of the owning engine (rails on one domain share a key).
// `virt_addr` says whether remote addresses are virtual addresses (addr + offset) or offsets
// from the start of the region, as the owning engine's provider requires.
struct RemoteDescriptor {
  uint64_t engine_id = 0;
  uint64_t region_id = 0;
  uint64_t addr = 0;
  uint64_t len = 0;
  bool virt_addr = false;
  std::vector<uint64_t> keys;

  // Fixed little-endian layout, versioned; decode() refuses truncated or unknown input.
  std::string encode() const;
  static Result<RemoteDescriptor> decode(std::string_view bytes);
  bool operator==(const RemoteDescriptor&) const = default;
};

// A local registration, returned by TransferEngine::register_memory. Copyable value; the
// registration lives until TransferEngine::deregister(id) or the engine's destruction.
struct MemoryRegion {
  uint64_t id = 0;
  void* ptr = nullptr;
  uint64_t len = 0;
  MemoryKind kind;
  RemoteDescriptor remote;  // give this to peers (encode() for the control plane)
};

}  // namespace cleave::transfer
