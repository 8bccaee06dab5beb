#include "cleave/kvcache/kv_block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <ctime>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define CLEAVE_KV_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CLEAVE_KV_TEST_SANITIZED 1
#endif
#endif

namespace cleave {
namespace {

KvLayout small_layout(int64_t num_blocks, int64_t block_size = 4) {
  KvLayout l;
  l.block_size = block_size;
  l.n_layers = 2;
  l.n_kv_heads = 1;
  l.head_dim = 2;
  l.num_blocks = num_blocks;
  return l;
}

std::unique_ptr<KvBlockPool> make_pool(int64_t num_blocks, int64_t block_size = 4) {
  auto pool = KvBlockPool::create(small_layout(num_blocks, block_size));
  EXPECT_TRUE(pool.ok()) << pool.status().to_string();
  return std::move(pool).value();
}

std::vector<BlockId> alloc(KvBlockPool& pool, int64_t n) {
  std::vector<BlockId> out;
  Status s = pool.allocate(n, out);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

void expect_counters(const KvBlockPool& pool, int64_t free, int64_t cached, int64_t used) {
  EXPECT_EQ(pool.free_blocks(), free);
  EXPECT_EQ(pool.cached_blocks(), cached);
  EXPECT_EQ(pool.used_blocks(), used);
  EXPECT_EQ(pool.free_blocks() + pool.cached_blocks() + pool.used_blocks(), pool.total_blocks());
}

TEST(KvBlockPoolTest, CreateMapsAlignedZeroedBuffer) {
  auto pool = make_pool(10);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->data()) % (2u << 20), 0u);
  EXPECT_EQ(pool->size_bytes(), 2u * 10 * pool->layout().block_bytes());
  EXPECT_EQ(pool->layout().block_bytes(), 2u * 4 * 2 * 4);
  for (uint64_t i = 0; i < pool->size_bytes(); ++i) ASSERT_EQ(pool->data()[i], std::byte{0}) << i;
  // K and V of each (layer, block) are adjacent; units are layer-major.
  EXPECT_EQ(pool->v(0, 0), pool->k(0, 0) + 4 * 2);
  EXPECT_EQ(reinterpret_cast<std::byte*>(pool->k(1, 3)), pool->data() + (10 + 3) * pool->layout().block_bytes());
  pool->v(1, 9)[7] = 1.5f;  // the last float of the buffer is writable
  EXPECT_EQ(pool->v(1, 9)[7], 1.5f);
  expect_counters(*pool, 10, 0, 0);
  EXPECT_EQ(pool->evictions(), 0u);
}

TEST(KvBlockPoolTest, CreateRejectsBadLayout) {
  KvLayout l = small_layout(0);
  auto r = KvBlockPool::create(l);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("at least one block"), std::string::npos) << r.status().message();

  l = small_layout(4);
  l.head_dim = int64_t{1} << 40;
  r = KvBlockPool::create(l);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(KvBlockPoolTest, CreateReportsMemoryItCannotHave) {
  // 2^30 blocks x 1024 layers x 8 KiB = 2^53 bytes: valid, but beyond any address space.
  KvLayout l;
  l.block_size = 16;
  l.n_layers = 1024;
  l.n_kv_heads = 1;
  l.head_dim = 64;
  l.num_blocks = int64_t{1} << 30;
  ASSERT_EQ(l.validate(), "");
  auto r = KvBlockPool::create(l);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("9007199254740992 bytes"), std::string::npos) << r.status().message();
}

TEST(KvBlockPoolTest, PrefersLowestContiguousRunThenLowestIds) {
  auto pool = make_pool(16);
  EXPECT_EQ(alloc(*pool, 4), (std::vector<BlockId>{0, 1, 2, 3}));
  EXPECT_EQ(alloc(*pool, 4), (std::vector<BlockId>{4, 5, 6, 7}));
  const auto c = alloc(*pool, 4);
  EXPECT_EQ(c, (std::vector<BlockId>{8, 9, 10, 11}));
  pool->release(std::vector<BlockId>{0, 1, 2, 3});
  pool->release(c);
  // Free: 0-3 and 8-15. A run of 6 exists only at 8.
  EXPECT_EQ(alloc(*pool, 6), (std::vector<BlockId>{8, 9, 10, 11, 12, 13}));
  // The lowest run long enough wins, not the best fit.
  EXPECT_EQ(alloc(*pool, 2), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(alloc(*pool, 1), (std::vector<BlockId>{2}));
  // Free: 3, 14, 15. No run of 3: the lowest ids.
  EXPECT_EQ(alloc(*pool, 3), (std::vector<BlockId>{3, 14, 15}));
  expect_counters(*pool, 0, 0, 16);
}

// Free ids first (a run when there is one, else the lowest), cached blocks evicted only for
// what is missing (least recently released first), and runs that form again as blocks return.
TEST(KvBlockPoolTest, FragmentedPoolTakesLowestFreeIdsBeforeEvictingThenRunsAgain) {
  auto pool = make_pool(8);
  ASSERT_EQ(alloc(*pool, 8).size(), 8u);
  pool->register_full_block(2, 102);
  pool->register_full_block(3, 103);
  pool->release(std::vector<BlockId>{2, 3});  // last to first: 3 is the older cached block
  pool->release(std::vector<BlockId>{0});
  pool->release(std::vector<BlockId>{5});
  expect_counters(*pool, 2, 2, 4);
  // No run of 2 among the free ids {0, 5}: the lowest free ids, and nothing evicted.
  EXPECT_EQ(alloc(*pool, 2), (std::vector<BlockId>{0, 5}));
  EXPECT_EQ(pool->evictions(), 0u);
  EXPECT_EQ(pool->lookup(102), BlockId{2});
  // Nothing free: the least recently released cached block goes.
  EXPECT_EQ(alloc(*pool, 1), (std::vector<BlockId>{3}));
  EXPECT_EQ(pool->evictions(), 1u);
  EXPECT_FALSE(pool->lookup(103).has_value());
  EXPECT_EQ(pool->lookup(102), BlockId{2});
  // Blocks back at 3, 4, 5 (and 7): the run of 3 at 3 is taken whole.
  pool->release(std::vector<BlockId>{3, 4, 5, 7});
  expect_counters(*pool, 4, 1, 3);
  EXPECT_EQ(alloc(*pool, 3), (std::vector<BlockId>{3, 4, 5}));
  // Two needed, one free (7): exactly one eviction (2), then the lowest ids.
  EXPECT_EQ(alloc(*pool, 2), (std::vector<BlockId>{2, 7}));
  EXPECT_EQ(pool->evictions(), 2u);
  expect_counters(*pool, 0, 0, 8);
}

TEST(KvBlockPoolTest, AllocateAppendsAndHandlesZeroAndNegative) {
  auto pool = make_pool(8);
  std::vector<BlockId> out{42};
  ASSERT_TRUE(pool->allocate(2, out).ok());
  EXPECT_EQ(out, (std::vector<BlockId>{42, 0, 1}));
  ASSERT_TRUE(pool->allocate(0, out).ok());
  EXPECT_EQ(out.size(), 3u);
  Status s = pool->allocate(-1, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out.size(), 3u);
  expect_counters(*pool, 6, 0, 2);
}

TEST(KvBlockPoolTest, ExhaustionTakesNothing) {
  auto pool = make_pool(8);
  auto a = alloc(*pool, 3);
  auto b = alloc(*pool, 3);
  pool->register_full_block(b[0], 100);
  pool->register_full_block(b[1], 101);
  pool->release(b);  // b[0], b[1] cached, b[2] free
  expect_counters(*pool, 3, 2, 3);
  EXPECT_TRUE(pool->can_allocate(5));
  EXPECT_FALSE(pool->can_allocate(6));
  std::vector<BlockId> out{7};
  Status s = pool->allocate(6, out);
  ASSERT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("6 blocks requested"), std::string::npos) << s.message();
  EXPECT_EQ(out, std::vector<BlockId>{7});
  expect_counters(*pool, 3, 2, 3);
  EXPECT_EQ(pool->evictions(), 0u);
  EXPECT_EQ(pool->lookup(100), b[0]);
  EXPECT_EQ(pool->lookup(101), b[1]);
  // Exactly enough: evicts both cached blocks and takes every free one.
  auto all = alloc(*pool, 5);
  EXPECT_EQ(all, (std::vector<BlockId>{3, 4, 5, 6, 7}));
  EXPECT_EQ(pool->evictions(), 2u);
  EXPECT_FALSE(pool->lookup(100).has_value());
  expect_counters(*pool, 0, 0, 8);
}

TEST(KvBlockPoolTest, EvictsLeastRecentlyReleasedFirst) {
  auto pool = make_pool(4);
  const BlockId a = alloc(*pool, 1)[0], b = alloc(*pool, 1)[0], c = alloc(*pool, 1)[0],
                d = alloc(*pool, 1)[0];
  pool->register_full_block(a, 1);
  pool->register_full_block(b, 2);
  pool->register_full_block(c, 3);
  pool->register_full_block(d, 4);
  for (BlockId x : {a, c, b, d}) pool->release(std::span<const BlockId>(&x, 1));
  expect_counters(*pool, 0, 4, 0);
  // The prefix survives release.
  EXPECT_EQ(pool->lookup(3), c);

  EXPECT_EQ(alloc(*pool, 1), std::vector<BlockId>{a});
  EXPECT_EQ(pool->evictions(), 1u);
  EXPECT_FALSE(pool->lookup(1).has_value());
  EXPECT_EQ(pool->lookup(2), b);

  // Acquiring d pulls it out of the LRU: the next evictions are c then b, never d.
  ASSERT_EQ(pool->lookup(4), d);
  pool->acquire(d);
  EXPECT_EQ(pool->refcount(d), 1);
  expect_counters(*pool, 0, 2, 2);
  EXPECT_EQ(alloc(*pool, 1), std::vector<BlockId>{c});
  EXPECT_FALSE(pool->lookup(3).has_value());
  EXPECT_EQ(alloc(*pool, 1), std::vector<BlockId>{b});
  EXPECT_EQ(pool->evictions(), 3u);
  EXPECT_EQ(pool->lookup(4), d);
  std::vector<BlockId> out;
  EXPECT_EQ(pool->allocate(1, out).code(), StatusCode::kResourceExhausted);
  // Released again, d is the most recent (and only) cached block.
  pool->release(std::vector<BlockId>{d});
  expect_counters(*pool, 0, 1, 3);
  EXPECT_EQ(alloc(*pool, 1), std::vector<BlockId>{d});
  EXPECT_EQ(pool->evictions(), 4u);
}

TEST(KvBlockPoolTest, ReleaseOfATableEvictsItsTailFirst) {
  auto pool = make_pool(3);
  auto table = alloc(*pool, 3);
  for (size_t i = 0; i < 3; ++i) pool->register_full_block(table[i], 10 + i);
  pool->release(table);
  EXPECT_EQ(alloc(*pool, 1), std::vector<BlockId>{table[2]});
  EXPECT_EQ(pool->lookup(10), table[0]);
  EXPECT_EQ(pool->lookup(11), table[1]);
  EXPECT_EQ(alloc(*pool, 1), std::vector<BlockId>{table[1]});
  EXPECT_EQ(pool->lookup(10), table[0]);
}

TEST(KvBlockPoolTest, SharedBlockSurvivesOneRelease) {
  auto pool = make_pool(4);
  const BlockId x = alloc(*pool, 1)[0];
  pool->register_full_block(x, 77);
  pool->acquire(x);
  EXPECT_EQ(pool->refcount(x), 2);
  pool->release(std::vector<BlockId>{x});
  EXPECT_EQ(pool->refcount(x), 1);
  expect_counters(*pool, 3, 0, 1);
  EXPECT_EQ(pool->lookup(77), x);
  // A block listed twice in one release drops two references.
  pool->acquire(x);
  pool->release(std::vector<BlockId>{x, x});
  EXPECT_EQ(pool->refcount(x), 0);
  expect_counters(*pool, 3, 1, 0);
  EXPECT_EQ(pool->lookup(77), x);
}

TEST(KvBlockPoolTest, UnhashedBlocksGoBackToFree) {
  auto pool = make_pool(4);
  auto b = alloc(*pool, 2);
  pool->release(b);
  expect_counters(*pool, 4, 0, 0);
  EXPECT_EQ(alloc(*pool, 4), (std::vector<BlockId>{0, 1, 2, 3}));
}

TEST(KvBlockPoolTest, FirstRegistrationOfAHashStaysCanonical) {
  auto pool = make_pool(4);
  auto b = alloc(*pool, 2);
  pool->register_full_block(b[0], 5);
  pool->register_full_block(b[1], 5);  // the same prefix computed twice
  EXPECT_EQ(pool->lookup(5), b[0]);
  pool->register_full_block(b[0], 5);  // again with the same key: no-op
  pool->release(std::vector<BlockId>{b[1]});
  expect_counters(*pool, 3, 0, 1);  // the duplicate is freed, not cached
  pool->release(std::vector<BlockId>{b[0]});
  expect_counters(*pool, 3, 1, 0);
  EXPECT_EQ(pool->lookup(5), b[0]);
}

TEST(KvBlockPoolTest, ClearPrefixCacheFreesCachedAndForgetsKeys) {
  auto pool = make_pool(4);
  auto b = alloc(*pool, 3);
  pool->register_full_block(b[0], 1);
  pool->register_full_block(b[1], 2);
  pool->release(std::vector<BlockId>{b[0]});
  expect_counters(*pool, 1, 1, 2);
  pool->clear_prefix_cache();
  expect_counters(*pool, 2, 0, 2);
  EXPECT_FALSE(pool->lookup(1).has_value());
  EXPECT_FALSE(pool->lookup(2).has_value());
  EXPECT_EQ(pool->evictions(), 0u);
  // b[1] lost its key: freed on release. It may be registered under a new key before that.
  pool->release(std::vector<BlockId>{b[1], b[2]});
  expect_counters(*pool, 4, 0, 0);
}

TEST(KvBlockPoolTest, MisuseNeverCorruptsCounters) {
  auto pool = make_pool(4);
  auto b = alloc(*pool, 1);
  pool->register_full_block(b[0], 9);
#ifdef NDEBUG
  pool->release(std::vector<BlockId>{3});   // free block
  pool->release(std::vector<BlockId>{-1});  // out of range
  pool->release(std::vector<BlockId>{4});
  pool->acquire(2);                         // free block
  pool->acquire(17);
  pool->register_full_block(3, 11);         // nobody holds it
  pool->register_full_block(b[0], 12);      // re-keying
  EXPECT_EQ(pool->refcount(99), 0);
  expect_counters(*pool, 3, 0, 1);
  EXPECT_EQ(pool->lookup(9), b[0]);
  EXPECT_FALSE(pool->lookup(11).has_value());
  EXPECT_FALSE(pool->lookup(12).has_value());
  pool->release(b);
  expect_counters(*pool, 3, 1, 0);
  pool->release(b);  // a cached block nobody holds
  pool->acquire(b[0]);  // fine: cached
  expect_counters(*pool, 3, 0, 1);
#else
  // The message itself goes to the log (stdout before init_logging); the assertion names the pool.
  EXPECT_DEATH(pool->release(std::vector<BlockId>{3}), "KvBlockPool misuse");
  EXPECT_DEATH(pool->acquire(2), "KvBlockPool misuse");
  EXPECT_DEATH(pool->acquire(17), "KvBlockPool misuse");
  EXPECT_DEATH(pool->register_full_block(b[0], 12), "KvBlockPool misuse");
  expect_counters(*pool, 3, 0, 1);
#endif
}

// ---- randomized comparison against a simple model of the states ----

class ReferencePool {
 public:
  explicit ReferencePool(int n) : rc_(n, 0), hash_(n) {}

  std::optional<std::vector<BlockId>> allocate(int n) {
    const int total = static_cast<int>(rc_.size());
    if (n > count_free() + static_cast<int>(lru_.size())) return std::nullopt;
    while (count_free() < n) {
      const BlockId v = lru_.front();
      lru_.pop_front();
      index_.erase(*hash_[v]);
      hash_[v].reset();
      ++evictions_;
    }
    std::vector<BlockId> out;
    for (int s = 0; s + n <= total && out.empty(); ++s) {
      bool run = true;
      for (int i = s; i < s + n && run; ++i) run = is_free(i);
      if (run)
        for (int i = s; i < s + n; ++i) out.push_back(i);
    }
    if (out.empty())  // no run long enough: the lowest free ids
      for (int j = 0; j < total && static_cast<int>(out.size()) < n; ++j)
        if (is_free(j)) out.push_back(j);
    for (BlockId b : out) rc_[b] = 1;
    return out;
  }
  void acquire(BlockId b) {
    if (rc_[b] == 0) lru_.erase(std::find(lru_.begin(), lru_.end(), b));
    ++rc_[b];
  }
  void release(const std::vector<BlockId>& blocks) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it)
      if (--rc_[*it] == 0 && hash_[*it]) lru_.push_back(*it);
  }
  void register_block(BlockId b, uint64_t h) {
    if (hash_[b] || index_.count(h)) return;
    hash_[b] = h;
    index_[h] = b;
  }
  void clear() {
    for (auto& [h, b] : index_) hash_[b].reset();
    index_.clear();
    lru_.clear();
  }
  std::optional<BlockId> lookup(uint64_t h) const {
    auto it = index_.find(h);
    return it == index_.end() ? std::nullopt : std::optional<BlockId>(it->second);
  }
  bool hashed(BlockId b) const { return hash_[b].has_value(); }
  int refcount(BlockId b) const { return rc_[b]; }
  int count_free() const {
    int n = 0;
    for (size_t i = 0; i < rc_.size(); ++i) n += is_free(static_cast<int>(i));
    return n;
  }
  int count_cached() const { return static_cast<int>(lru_.size()); }
  int count_used() const {
    return static_cast<int>(std::count_if(rc_.begin(), rc_.end(), [](int r) { return r > 0; }));
  }
  uint64_t evictions() const { return evictions_; }

 private:
  bool is_free(int b) const { return rc_[b] == 0 && !hash_[b]; }
  std::vector<int> rc_;
  std::vector<std::optional<uint64_t>> hash_;
  std::deque<BlockId> lru_;  // least recent first
  std::map<uint64_t, BlockId> index_;
  uint64_t evictions_ = 0;
};

TEST(KvBlockPoolTest, RandomOperationsMatchReferenceModel) {
  constexpr int kBlocks = 48;
  constexpr uint64_t kHashes = 40;
  auto pool = make_pool(kBlocks);
  ReferencePool ref(kBlocks);
  std::mt19937_64 rng(12345);
  std::vector<std::vector<BlockId>> held;  // each entry holds one reference per listed block
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };

  for (int step = 0; step < 30000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    SCOPED_TRACE(::testing::Message() << "step " << step << " op " << op);
    if (op < 35) {
      const int n = static_cast<int>(rng() % 9);
      std::vector<BlockId> got;
      Status s = pool->allocate(n, got);
      auto want = ref.allocate(n);
      ASSERT_EQ(s.ok(), want.has_value()) << s.to_string();
      if (want) {
        ASSERT_EQ(got, *want);
        if (!got.empty()) held.push_back(got);
      } else {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted);
        ASSERT_TRUE(got.empty());
      }
    } else if (op < 65 && !held.empty()) {
      const size_t i = pick(held.size());
      std::vector<BlockId> blocks = std::move(held[i]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      if (rng() % 4 == 0 && blocks.size() > 1) {  // release a part, keep the rest
        const size_t cut = 1 + pick(blocks.size() - 1);
        held.emplace_back(blocks.begin() + static_cast<std::ptrdiff_t>(cut), blocks.end());
        blocks.resize(cut);
      }
      pool->release(blocks);
      ref.release(blocks);
    } else if (op < 80) {
      const uint64_t h = rng() % kHashes;
      const auto got = pool->lookup(h);
      ASSERT_EQ(got, ref.lookup(h));
      if (got) {
        pool->acquire(*got);
        ref.acquire(*got);
        held.push_back({*got});
      }
    } else if (op < 98 && !held.empty()) {
      const auto& blocks = held[pick(held.size())];
      const BlockId b = blocks[pick(blocks.size())];
      if (!ref.hashed(b)) {
        const uint64_t h = rng() % kHashes;
        pool->register_full_block(b, h);
        ref.register_block(b, h);
      }
    } else if (op >= 99) {
      pool->clear_prefix_cache();
      ref.clear();
    }

    ASSERT_EQ(pool->free_blocks(), ref.count_free());
    ASSERT_EQ(pool->cached_blocks(), ref.count_cached());
    ASSERT_EQ(pool->used_blocks(), ref.count_used());
    ASSERT_EQ(pool->free_blocks() + pool->cached_blocks() + pool->used_blocks(), kBlocks);
    ASSERT_EQ(pool->evictions(), ref.evictions());
    for (BlockId b = 0; b < kBlocks; ++b) ASSERT_EQ(pool->refcount(b), ref.refcount(b)) << "block " << b;
    for (uint64_t h = 0; h < kHashes; ++h) ASSERT_EQ(pool->lookup(h), ref.lookup(h)) << "hash " << h;
  }
  EXPECT_GT(pool->evictions(), 100u);  // the sequence exercised eviction
  for (const auto& blocks : held) pool->release(blocks);
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(pool->free_blocks() + pool->cached_blocks(), kBlocks);
}

TEST(KvBlockPoolTest, BigPoolIsFast) {
  constexpr int64_t kBlocks = 100000;
  KvLayout l;
  l.block_size = 16;
  l.n_layers = 1;
  l.n_kv_heads = 1;
  l.head_dim = 1;
  l.num_blocks = kBlocks;
  auto created = KvBlockPool::create(l);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  KvBlockPool& pool = **created;

  std::mt19937_64 rng(7);
  std::vector<BlockId> live;
  live.reserve(kBlocks);
  ASSERT_TRUE(pool.allocate(kBlocks * 9 / 10, live).ok());
  std::vector<BlockId> one;
  // CPU time of this thread: the build machine is shared, so wall time says little.
  const auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  const double t0 = cpu_seconds();
  int64_t ops = 0;
  for (int i = 0; i < 1000000; ++i) {
    // Release a random live block (fragmenting the free space), then allocate one; every 64th
    // step the block is registered so that it is cached (and later evicted).
    const size_t k = static_cast<size_t>(rng() % live.size());
    const BlockId victim = live[k];
    if (i % 64 == 0) pool.register_full_block(victim, static_cast<uint64_t>(i));
    live[k] = live.back();
    live.pop_back();
    pool.release(std::span<const BlockId>(&victim, 1));
    one.clear();
    ASSERT_TRUE(pool.allocate(1 + static_cast<int64_t>(i % 3 == 0), one).ok());
    live.insert(live.end(), one.begin(), one.end());
    if (live.size() > static_cast<size_t>(kBlocks * 95 / 100)) {
      pool.release(std::span<const BlockId>(live.data() + live.size() - 1, 1));
      live.pop_back();
      ++ops;
    }
    ops += 2;
  }
  const double secs = cpu_seconds() - t0;
  std::printf("%lld pool operations on %lld blocks in %.3f s CPU (%.0f ns each), %llu evictions\n",
              static_cast<long long>(ops), static_cast<long long>(kBlocks), secs, secs * 1e9 / ops,
              static_cast<unsigned long long>(pool.evictions()));
  EXPECT_EQ(pool.used_blocks(), static_cast<int64_t>(live.size()));
  EXPECT_EQ(pool.free_blocks() + pool.cached_blocks() + pool.used_blocks(), kBlocks);
#if defined(NDEBUG) && !defined(CLEAVE_KV_TEST_SANITIZED)
  EXPECT_LT(secs, 1.0);
#endif
}

}  // namespace
}  // namespace cleave
