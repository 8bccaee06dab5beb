// Byte encodings of remote descriptors and engine addresses (little-endian, versioned), and
// small shared helpers.
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "fmt/format.h"
#include "transfer_internal.h"
#include "transfer_codec.h"

namespace cleave::transfer {

std::string fabric_error(std::string_view what, int rc) {
  int code = rc < 0 ? -rc : rc;
  return fmt::format("{}: {} (-{})", what, fi_strerror(code), code);
}

void ByteWriter::u8(uint8_t v) { out.push_back(static_cast<char>(v)); }
void ByteWriter::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void ByteWriter::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void ByteWriter::bytes(std::string_view b) {
  u32(static_cast<uint32_t>(b.size()));
  out.append(b);
}

bool ByteReader::take(size_t n, const char** p) {
  if (in.size() - pos < n) return false;
  *p = in.data() + pos;
  pos += n;
  return true;
}
bool ByteReader::u8(uint8_t* v) {
  const char* p;
  if (!take(1, &p)) return false;
  *v = static_cast<uint8_t>(*p);
  return true;
}
bool ByteReader::u32(uint32_t* v) {
  const char* p;
  if (!take(4, &p)) return false;
  *v = 0;
  for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return true;
}
bool ByteReader::u64(uint64_t* v) {
  const char* p;
  if (!take(8, &p)) return false;
  *v = 0;
  for (int i = 0; i < 8; ++i) *v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return true;
}
bool ByteReader::bytes(std::string* b, size_t max_len) {
  uint32_t n;
  if (!u32(&n) || n > max_len) return false;
  const char* p;
  if (!take(n, &p)) return false;
  b->assign(p, n);
  return true;
}

namespace {
constexpr uint32_t kDescriptorMagic = 0x43445231;  // "1RDC"
constexpr uint32_t kAddressMagic = 0x43414432;     // "2DAC": v2 adds host id and pid
constexpr uint32_t kMaxRails = 64;
}  // namespace

std::string RemoteDescriptor::encode() const {
  ByteWriter w;
  w.u32(kDescriptorMagic);
  w.u64(engine_id);
  w.u64(region_id);
  w.u64(addr);
  w.u64(len);
  w.u8(virt_addr ? 1 : 0);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (uint64_t k : keys) w.u64(k);
  return std::move(w.out);
}

Result<RemoteDescriptor> RemoteDescriptor::decode(std::string_view bytes) {
  ByteReader r{bytes};
  RemoteDescriptor d;
  uint32_t magic = 0, nkeys = 0;
  uint8_t virt = 0;
  if (!r.u32(&magic) || magic != kDescriptorMagic) {
    return DataLoss(fmt::format("remote descriptor: bad magic or version ({} bytes)", bytes.size()));
  }
  if (!r.u64(&d.engine_id) || !r.u64(&d.region_id) || !r.u64(&d.addr) || !r.u64(&d.len) ||
      !r.u8(&virt) || !r.u32(&nkeys)) {
    return DataLoss(fmt::format("remote descriptor: truncated ({} bytes)", bytes.size()));
  }
  if (nkeys == 0 || nkeys > kMaxRails) {
    return DataLoss(fmt::format("remote descriptor: {} keys (expected 1..{})", nkeys, kMaxRails));
  }
  d.virt_addr = virt != 0;
  d.keys.resize(nkeys);
  for (auto& k : d.keys) {
    if (!r.u64(&k)) return DataLoss("remote descriptor: truncated key list");
  }
  if (r.pos != bytes.size()) {
    return DataLoss(fmt::format("remote descriptor: {} trailing bytes", bytes.size() - r.pos));
  }
  return d;
}

std::string EngineAddress::encode() const {
  ByteWriter w;
  w.u32(kAddressMagic);
  w.u64(engine_id);
  w.bytes(provider);
  w.u32(static_cast<uint32_t>(rail_names.size()));
  for (const auto& n : rail_names) w.bytes(n);
  w.bytes(host_id);
  w.u32(pid);
  return std::move(w.out);
}

Result<EngineAddress> EngineAddress::decode(std::string_view bytes) {
  ByteReader r{bytes};
  EngineAddress a;
  uint32_t magic = 0, n = 0;
  if (!r.u32(&magic) || magic != kAddressMagic) {
    return DataLoss(fmt::format("engine address: bad magic or version ({} bytes; this build "
                                "speaks address version 2)", bytes.size()));
  }
  if (!r.u64(&a.engine_id) || !r.bytes(&a.provider, 256) || !r.u32(&n)) {
    return DataLoss(fmt::format("engine address: truncated ({} bytes)", bytes.size()));
  }
  if (n == 0 || n > kMaxRails) {
    return DataLoss(fmt::format("engine address: {} rails (expected 1..{})", n, kMaxRails));
  }
  a.rail_names.resize(n);
  for (auto& name : a.rail_names) {
    if (!r.bytes(&name, 4096)) return DataLoss("engine address: truncated endpoint name");
  }
  if (!r.bytes(&a.host_id, 256) || !r.u32(&a.pid)) {
    return DataLoss(fmt::format("engine address: truncated host id / pid ({} bytes)", bytes.size()));
  }
  if (r.pos != bytes.size()) {
    return DataLoss(fmt::format("engine address: {} trailing bytes", bytes.size() - r.pos));
  }
  return a;
}

const std::string& local_host_id() {
  static const std::string id = [] {
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    if (!(f >> boot)) return std::string();
    char ns[128];
    ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    if (n <= 0) return std::string();
    return boot + "/" + std::string(ns, static_cast<size_t>(n));
  }();
  return id;
}

const char* error_kind_name(TransferErrorKind kind) {
  switch (kind) {
    case TransferErrorKind::kInvalidDescriptor: return "invalid_descriptor";
    case TransferErrorKind::kPeerUnavailable: return "peer_unavailable";
    case TransferErrorKind::kTimeout: return "timeout";
    case TransferErrorKind::kCompletionError: return "completion_error";
    case TransferErrorKind::kPostError: return "post_error";
    case TransferErrorKind::kPastDeadline: return "past_deadline";
    case TransferErrorKind::kCount: break;
  }
  return "unknown";
}

}  // namespace cleave::transfer
