#include "cleave/kvcache/kv_block_pool.h"

#include <cassert>
#include <cerrno>
#include <cstring>
#include <new>
#include <unordered_map>

#include "cleave/common/log.h"
#include "fmt/format.h"
#include "free_run_index.h"

// A misuse of the pool by its caller (a bug there): aborts in debug builds; in release builds it
// is logged and the operation is ignored, so the counters stay right.
#define CLEAVE_KV_MISUSE(...)                              \
  do {                                                     \
    ::cleave::log::error(__VA_ARGS__);                     \
    assert(false && "KvBlockPool misuse (see the log)");   \
  } while (0)

namespace cleave {

struct KvBlockPool::State {
  explicit State(int64_t n)
      : free_ids(n, /*all_free=*/true),
        refcount(static_cast<size_t>(n), 0),
        hash(static_cast<size_t>(n), 0),
        hashed(static_cast<size_t>(n), 0),
        lru_prev(static_cast<size_t>(n), -1),
        lru_next(static_cast<size_t>(n), -1) {}

  kvcache_detail::FreeRunIndex free_ids;
  std::vector<int32_t> refcount;
  std::vector<uint64_t> hash;    // valid when hashed
  std::vector<uint8_t> hashed;   // hashed[b] <=> index[hash[b]] == b
  // Cached blocks, least recently released at the head.
  std::vector<BlockId> lru_prev, lru_next;
  BlockId lru_head = -1, lru_tail = -1;
  std::unordered_map<uint64_t, BlockId> index;
  int64_t cached = 0;
  int64_t used = 0;

  size_t at(BlockId b) const { return static_cast<size_t>(b); }

  void lru_push_back(BlockId b) {
    lru_prev[at(b)] = lru_tail;
    lru_next[at(b)] = -1;
    if (lru_tail >= 0) lru_next[at(lru_tail)] = b; else lru_head = b;
    lru_tail = b;
  }
  void lru_unlink(BlockId b) {
    const BlockId p = lru_prev[at(b)], n = lru_next[at(b)];
    if (p >= 0) lru_next[at(p)] = n; else lru_head = n;
    if (n >= 0) lru_prev[at(n)] = p; else lru_tail = p;
    lru_prev[at(b)] = lru_next[at(b)] = -1;
  }
  // Forgets the block's key (it must be hashed).
  void unhash(BlockId b) {
    index.erase(hash[at(b)]);
    hashed[at(b)] = 0;
    hash[at(b)] = 0;
  }
  // A cached block becomes free.
  void drop_cached(BlockId b) {
    lru_unlink(b);
    unhash(b);
    free_ids.set_free(b, true);
    --cached;
  }
  // A free block becomes used with refcount 1.
  void take(BlockId b, std::vector<BlockId>& out) {
    free_ids.set_free(b, false);
    refcount[at(b)] = 1;
    ++used;
    out.push_back(b);
  }
};

KvBlockPool::KvBlockPool(const KvLayout& layout) : layout_(layout) {}

KvBlockPool::~KvBlockPool() = default;

Result<std::unique_ptr<KvBlockPool>> KvBlockPool::create(const KvLayout& layout,
                                                         std::unique_ptr<KvStorage> storage) {
  if (std::string err = layout.validate(); !err.empty())
    return InvalidArgument(fmt::format("KV pool layout ({}): {}", layout.to_string(), err));
  std::unique_ptr<KvBlockPool> pool(new KvBlockPool(layout));
  if (storage == nullptr) {
    auto host = make_host_kv_storage(layout.total_bytes());
    if (!host.ok()) {
      return ResourceExhausted(fmt::format(
          "cannot allocate the KV pool ({} blocks x {} layers x {} bytes per block): {}; lower "
          "the block count or the memory budget",
          layout.num_blocks, layout.n_layers, layout.block_bytes(), host.status().message()));
    }
    storage = std::move(host).value();
  } else if (storage->size_bytes() < layout.total_bytes()) {
    return InvalidArgument(fmt::format("KV pool storage holds {} bytes, the layout ({}) needs {}",
                                       storage->size_bytes(), layout.to_string(),
                                       layout.total_bytes()));
  }
  pool->storage_ = std::move(storage);
  pool->data_ = pool->storage_->data();
  try {
    pool->state_ = std::make_unique<State>(layout.num_blocks);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(fmt::format("cannot allocate the bookkeeping of a KV pool of {} blocks",
                                         layout.num_blocks));
  }
  log::debug("KV pool: {} at {} ({})", layout.to_string(), static_cast<const void*>(pool->data_),
             pool->storage_->on_device() ? fmt::format("cuda:{}", pool->storage_->device()) : "host");
  return pool;
}

int64_t KvBlockPool::free_blocks() const { return state_->free_ids.free_count(); }
int64_t KvBlockPool::cached_blocks() const { return state_->cached; }
int64_t KvBlockPool::used_blocks() const { return state_->used; }

int32_t KvBlockPool::refcount(BlockId block) const {
  if (block < 0 || block >= layout_.num_blocks) {
    CLEAVE_KV_MISUSE("KV pool: refcount of block {} (the pool has {})", block, layout_.num_blocks);
    return 0;
  }
  return state_->refcount[static_cast<size_t>(block)];
}

Status KvBlockPool::allocate(int64_t n, std::vector<BlockId>& out) {
  State& s = *state_;
  if (n < 0) return InvalidArgument(fmt::format("KV pool: cannot allocate {} blocks", n));
  if (n == 0) return Status::Ok();
  if (!can_allocate(n)) {
    return ResourceExhausted(fmt::format(
        "KV pool exhausted: {} blocks requested, {} free and {} cached (evictable) of {} ({} in use)",
        n, free_blocks(), cached_blocks(), total_blocks(), used_blocks()));
  }
  // Evict only what is missing, oldest first; the evicted blocks then join the free ones.
  while (s.free_ids.free_count() < n) {
    s.drop_cached(s.lru_head);
    ++evictions_;
  }
  out.reserve(out.size() + static_cast<size_t>(n));
  if (const int64_t start = s.free_ids.find_run(n); start >= 0) {
    for (int64_t b = start; b < start + n; ++b) s.take(static_cast<BlockId>(b), out);
  } else {
    for (int64_t i = 0; i < n; ++i) s.take(static_cast<BlockId>(s.free_ids.first_free()), out);
  }
  return Status::Ok();
}

void KvBlockPool::acquire(BlockId block) {
  State& s = *state_;
  if (block < 0 || block >= layout_.num_blocks) {
    CLEAVE_KV_MISUSE("KV pool: acquire of block {} (the pool has {})", block, layout_.num_blocks);
    return;
  }
  const size_t b = static_cast<size_t>(block);
  if (s.refcount[b] > 0) {
    ++s.refcount[b];
    return;
  }
  if (!s.hashed[b]) {
    CLEAVE_KV_MISUSE("KV pool: acquire of free block {} (allocate it, or look it up in the prefix cache)", block);
    return;
  }
  s.lru_unlink(block);
  --s.cached;
  ++s.used;
  s.refcount[b] = 1;
}

void KvBlockPool::release(std::span<const BlockId> blocks) {
  State& s = *state_;
  // Last to first: a sequence's tail blocks become older in the LRU than its head blocks, so the
  // head of a chain (which every longer prefix needs) is evicted last.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const BlockId block = *it;
    if (block < 0 || block >= layout_.num_blocks) {
      CLEAVE_KV_MISUSE("KV pool: release of block {} (the pool has {})", block, layout_.num_blocks);
      continue;
    }
    const size_t b = static_cast<size_t>(block);
    if (s.refcount[b] <= 0) {
      CLEAVE_KV_MISUSE("KV pool: release of block {}, which nobody holds ({})", block,
                       s.hashed[b] ? "cached" : "free");
      continue;
    }
    if (--s.refcount[b] > 0) continue;
    --s.used;
    if (s.hashed[b]) {
      s.lru_push_back(block);
      ++s.cached;
    } else {
      s.free_ids.set_free(block, true);
    }
  }
}

void KvBlockPool::register_full_block(BlockId block, uint64_t hash) {
  State& s = *state_;
  if (block < 0 || block >= layout_.num_blocks) {
    CLEAVE_KV_MISUSE("KV pool: register of block {} (the pool has {})", block, layout_.num_blocks);
    return;
  }
  const size_t b = static_cast<size_t>(block);
  if (s.refcount[b] <= 0) {
    CLEAVE_KV_MISUSE("KV pool: register of block {}, which nobody holds", block);
    return;
  }
  if (s.hashed[b]) {
    if (s.hash[b] != hash)
      CLEAVE_KV_MISUSE("KV pool: block {} already holds prefix {:016x}; cannot re-key it as {:016x}", block,
                       s.hash[b], hash);
    return;
  }
  if (!s.index.try_emplace(hash, block).second) return;  // another block is the canonical copy
  s.hashed[b] = 1;
  s.hash[b] = hash;
}

std::optional<BlockId> KvBlockPool::lookup(uint64_t hash) const {
  const auto it = state_->index.find(hash);
  if (it == state_->index.end()) return std::nullopt;
  return it->second;
}

void KvBlockPool::clear_prefix_cache() {
  State& s = *state_;
  while (s.lru_head >= 0) s.drop_cached(s.lru_head);
  // Blocks still in use lose their keys too: they are freed, not cached, when released.
  for (const auto& [hash, block] : s.index) {
    s.hashed[static_cast<size_t>(block)] = 0;
    s.hash[static_cast<size_t>(block)] = 0;
  }
  s.index.clear();
}

}  // namespace cleave
