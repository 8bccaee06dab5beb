// Host storage of a KV pool: anonymous memory, 2 MiB-aligned, committed up front.
#include "cleave/kvcache/kv_storage.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"

namespace cleave {
namespace {

constexpr uint64_t kBufferAlign = uint64_t{2} << 20;  // 2 MiB

// Anonymous memory (zero-filled by the kernel), 2 MiB-aligned: maps one alignment more than
// needed and unmaps the unaligned head and the tail. nullptr with errno set on failure.
std::byte* map_aligned(uint64_t bytes) {
  const uint64_t over = bytes + kBufferAlign;
  if (over < bytes) {
    errno = ENOMEM;
    return nullptr;
  }
  void* p = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (base + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
  if (aligned > base) munmap(p, aligned - base);
  const uintptr_t end = base + over;
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - (aligned + bytes));
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
#ifdef MADV_POPULATE_WRITE
  // Commit (fault in and zero) the whole pool now: page faults stay out of the engine's steps,
  // and a pool the machine cannot hold fails here, cleanly, instead of an OOM kill mid-serving.
  // EINVAL: a kernel older than 5.14 without the advice; the pages then fault in on first use.
  if (madvise(reinterpret_cast<void*>(aligned), bytes, MADV_POPULATE_WRITE) != 0 && errno != EINVAL) {
    const int e = errno;
    munmap(reinterpret_cast<void*>(aligned), bytes);
    errno = e == EINVAL ? ENOMEM : e;
    return nullptr;
  }
#endif
  return reinterpret_cast<std::byte*>(aligned);
}

class HostKvStorage final : public KvStorage {
 public:
  HostKvStorage(std::byte* data, uint64_t mapped, uint64_t bytes)
      : data_(data), mapped_(mapped), bytes_(bytes) {}
  ~HostKvStorage() override { munmap(data_, mapped_); }
  std::byte* data() override { return data_; }
  uint64_t size_bytes() const override { return bytes_; }
  int device() const override { return -1; }

 private:
  std::byte* data_;
  uint64_t mapped_;
  uint64_t bytes_;
};

}  // namespace

Result<std::unique_ptr<KvStorage>> make_host_kv_storage(uint64_t bytes) {
  const uint64_t mapped = (bytes + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
  std::byte* p = map_aligned(mapped);
  if (p == nullptr) {
    const int e = errno;
    return ResourceExhausted(
        fmt::format("cannot map {} bytes of host memory: {}", mapped, std::strerror(e)));
  }
  return std::unique_ptr<KvStorage>(new HostKvStorage(p, mapped, bytes));
}

}  // namespace cleave
