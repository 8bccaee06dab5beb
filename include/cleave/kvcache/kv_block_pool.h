// The paged KV block pool of one worker: one buffer (see kv_layout.h) in its storage (host or
// device memory, kv_storage.h), a block allocator with reference counts, and the prefix cache.
//
// Block states (every block is in exactly one):
//   free    - holds nothing reusable; refcount 0
//   cached  - full, immutable, indexed by its prefix hash; refcount 0; evictable (LRU)
//   used    - refcount > 0 (held by one or more sequences; a cached block may be shared)
// Invariant: free_blocks() + cached_blocks() + used_blocks() == total_blocks().
// "All blocks back" after a workload means used_blocks() == 0.
//
// Prefix cache: a full block of tokens is keyed by a hash chain, hash_i = H(hash_{i-1}, tokens of
// block i) (see prefix_hash.h), so a key names the whole prefix up to and including the block.
// A sequence reuses the longest chain of cached blocks matching its prompt. Blocks no sequence
// holds stay cached until allocate() needs the space; the least recently released goes first.
//
// Allocation prefers contiguous runs of block ids (so that transfers coalesce): it takes the
// lowest-numbered run of free blocks long enough when there is one, else the lowest free ids,
// and only then evicts cached blocks (LRU).
//
// Misuse (ids out of range, acquire of a free block, release of a block nobody holds, register of
// a block nobody holds or re-keying a block) is a bug in the caller: it asserts in debug builds;
// in release builds it is logged as an error and ignored, so the counters stay consistent.
//
// Cost: allocate is O(n log B), acquire / release O(1) per block plus O(log B) when a block
// becomes free (B = total blocks); lookup / register are hash-map operations.
//
// Thread-safety: none; owned by one engine thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/kvcache/kv_layout.h"
#include "cleave/kvcache/kv_storage.h"

namespace cleave {

class KvBlockPool {
 public:
  // A pool over `storage` (at least layout.total_bytes(), zeroed), or with no storage given over
  // host memory from make_host_kv_storage (anonymous, 2 MiB-aligned for RDMA, committed up
  // front). Every block starts free. InvalidArgument for a bad layout or a storage too small;
  // ResourceExhausted (naming the byte count) when host memory cannot be had.
  static Result<std::unique_ptr<KvBlockPool>> create(const KvLayout& layout,
                                                     std::unique_ptr<KvStorage> storage = nullptr);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  const KvLayout& layout() const { return layout_; }
  const KvStorage& storage() const { return *storage_; }
  KvStorage& storage() { return *storage_; }
  // The buffer: host memory, or device memory when storage().on_device() (then never read on the
  // host; k() and v() below are for host pools only).
  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  uint64_t size_bytes() const { return layout_.total_bytes(); }
  // K of (layer, block): [block_size, kv_dim] floats; V follows at + block_size * kv_dim.
  // K and V as floats: f32 pools only (the bytes of any pool: data() + layout().offset()).
  float* k(int64_t layer, BlockId block) {
    return reinterpret_cast<float*>(data_ + layout_.offset(layer, block));
  }
  float* v(int64_t layer, BlockId block) { return k(layer, block) + layout_.block_size * layout_.kv_dim(); }
  const float* k(int64_t layer, BlockId block) const {
    return reinterpret_cast<const float*>(data_ + layout_.offset(layer, block));
  }
  const float* v(int64_t layer, BlockId block) const {
    return k(layer, block) + layout_.block_size * layout_.kv_dim();
  }

  // ---- allocation ----
  // n fresh blocks with refcount 1 (appended to `out` in ascending id order), evicting cached
  // blocks if needed: when fewer than n are free, exactly the missing number of cached blocks is
  // evicted, least recently released first (their keys leave the index), and then every free
  // block is taken. n == 0 is a no-op; n < 0 is InvalidArgument.
  // ResourceExhausted (and nothing taken, nothing evicted) when fewer than n are free or evictable.
  Status allocate(int64_t n, std::vector<BlockId>& out);
  bool can_allocate(int64_t n) const { return n <= free_blocks() + cached_blocks(); }
  // refcount + 1; a cached block leaves the eviction list.
  void acquire(BlockId block);
  // refcount - 1 for each; at 0 a hashed block becomes cached (most recently used), others free.
  // The span is processed last to first, so pass a sequence's block table in order: its tail
  // blocks then become older in the LRU than its head, and the head of a chain (which every
  // longer prefix needs) is evicted last. A block may appear more than once.
  void release(std::span<const BlockId> blocks);

  // ---- prefix cache ----
  // Marks a used, full block as holding the prefix with chain hash `hash`. If another block
  // already holds that hash, nothing changes (the first stays the canonical copy, and this block
  // is freed, not cached, when released). Registering a block again with the same hash is a
  // no-op; with another hash it is misuse.
  void register_full_block(BlockId block, uint64_t hash);
  // The block holding prefix `hash`, if cached or in use. Does not take a reference.
  std::optional<BlockId> lookup(uint64_t hash) const;
  // Drops every cached block back to free and empties the index (e.g. after a model reload);
  // blocks in use lose their keys too, so they are freed, not cached, when released. Not counted
  // as evictions.
  void clear_prefix_cache();

  // ---- counters ----
  int64_t total_blocks() const { return layout_.num_blocks; }
  int64_t free_blocks() const;
  int64_t cached_blocks() const;
  int64_t used_blocks() const;
  int32_t refcount(BlockId block) const;
  // Cached blocks evicted by allocate() since creation.
  uint64_t evictions() const { return evictions_; }

 private:
  explicit KvBlockPool(const KvLayout& layout);
  struct State;
  KvLayout layout_;
  std::unique_ptr<KvStorage> storage_;
  std::byte* data_ = nullptr;
  std::unique_ptr<State> state_;
  uint64_t evictions_ = 0;
};

}  // namespace cleave
