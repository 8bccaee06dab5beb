// The CPU backend's attention scratch: after reserve_attention(), attention() calls within the
// limits allocate nothing (this binary counts every operator new while a call runs, on every
// thread), whatever the KV dtype, and V rows of an f16/bf16 pool converted in pieces of a long
// KV block give the bits of short blocks.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <vector>

#include "cleave/common/thread_pool.h"
#include "cleave/engine/backend.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};

void* counted_alloc(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) {
  return counted_alloc(n);
}
void* operator new[](std::size_t n) {
  return counted_alloc(n);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}

namespace cleave {
namespace {

constexpr int64_t kHeads = 8, kKvHeads = 2, kHeadDim = 64, kKvDim = kKvHeads * kHeadDim;
constexpr int64_t kContext = 300;

// One sequence of kContext tokens whose K/V (random, the same for every block size) sit in a
// pool of `block_size`-token blocks, its block table in reverse order.
struct Pool {
  Pool(Backend& be, DType dtype, int64_t block_size) {
    kv.block_size = block_size;
    kv.num_blocks = (kContext + block_size - 1) / block_size;
    kv.kv_dim = kKvDim;
    kv.dtype = dtype;
    kv.element_bytes = dtype == DType::kF32 ? 4 : 2;
    bytes.assign(static_cast<size_t>(kv.num_blocks * kv.unit_bytes()), std::byte{0});
    kv.base = bytes.data();
    table.resize(static_cast<size_t>(kv.num_blocks));
    std::iota(table.rbegin(), table.rend(), BlockId{0});
    std::mt19937 rng(5);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> k(kContext * kKvDim), v(k.size());
    for (float& x : k) x = dist(rng);
    for (float& x : v) x = dist(rng);
    std::vector<int64_t> positions(kContext), slots(kContext);
    std::iota(positions.begin(), positions.end(), int64_t{0});
    for (int64_t p = 0; p < kContext; ++p)
      slots[p] = table[static_cast<size_t>(p / block_size)] * block_size + p % block_size;
    const TokenBatch b = batch(positions, slots);
    be.write_kv({.batch = &b, .k = k.data(), .v = v.data(), .kv = kv, .layer = 0});
  }

  // The tokens at `positions` of the sequence (kv_slots unused by attention).
  TokenBatch batch(const std::vector<int64_t>& positions, const std::vector<int64_t>& slots = {}) {
    seq.assign(positions.size(), 0);
    return {.n_tokens = static_cast<int64_t>(positions.size()),
            .positions = positions.data(),
            .kv_slots = slots.empty() ? nullptr : slots.data(),
            .seq = seq.data(),
            .seq_blocks = &seq_start,
            .block_ids = table.data(),
            .n_seqs = 1,
            .n_block_ids = static_cast<int64_t>(table.size())};
  }

  PagedKv kv;
  std::vector<std::byte> bytes;
  std::vector<BlockId> table;
  std::vector<int32_t> seq;
  int64_t seq_start = 0;
};

// Each token's query rows, drawn from its position (the same alone or in any batch).
std::vector<float> queries(const std::vector<int64_t>& positions) {
  std::vector<float> q;
  for (int64_t p : positions) {
    std::mt19937 rng(static_cast<uint32_t>(p));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (int64_t i = 0; i < kHeads * kHeadDim; ++i) q.push_back(dist(rng));
  }
  return q;
}

// Attention of `positions` over the pool; `allocations` gets the operator new calls it made.
std::vector<float> attend(Backend& be, Pool& pool, const std::vector<int64_t>& positions,
                          int64_t* allocations = nullptr) {
  const TokenBatch b = pool.batch(positions);
  const std::vector<float> q = queries(positions);
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  const AttentionArgs a{.batch = &b,
                        .q = q.data(),
                        .out = out.data(),
                        .kv = pool.kv,
                        .layer = 0,
                        .n_heads = kHeads,
                        .n_kv_heads = kKvHeads,
                        .head_dim = kHeadDim};
  g_allocations = 0;
  g_counting = true;
  be.attention(a);
  g_counting = false;
  if (allocations != nullptr) *allocations = g_allocations.load();
  return out;
}

std::vector<int64_t> range(int64_t first, int64_t end) {
  std::vector<int64_t> p(static_cast<size_t>(end - first));
  std::iota(p.begin(), p.end(), first);
  return p;
}

const AttentionLimits kLimits{
    .max_context = kContext, .max_tokens = 64, .n_heads = kHeads, .head_dim = kHeadDim};

TEST(AttentionScratch, CallsWithinTheLimitsAllocateNothingAfterReserve) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    ThreadPool threads(2);
    auto be = make_cpu_backend(threads);
    be->reserve_attention(kLimits);
    Pool pool(*be, dtype, 128);  // blocks longer than the converted pieces
    for (const auto& positions :
         {range(236, 300), range(0, 64), range(299, 300), range(0, 1), range(100, 117)}) {
      int64_t allocations = -1;
      attend(*be, pool, positions, &allocations);
      EXPECT_EQ(allocations, 0) << "a batch of " << positions.size() << " tokens from position "
                                << positions[0];
    }
  }
}

TEST(AttentionScratch, CallsPastTheLimitsGrowTheScratchAndKeepTheBits) {
  ThreadPool threads(2);
  auto small = make_cpu_backend(threads);
  small->reserve_attention({.max_context = 8, .max_tokens = 1, .n_heads = 1, .head_dim = 8});
  auto fitted = make_cpu_backend(threads);
  fitted->reserve_attention(kLimits);
  Pool pool(*fitted, DType::kF16, 32);
  for (const auto& positions : {range(236, 300), range(299, 300)}) {
    const auto want = attend(*fitted, pool, positions);
    const auto got = attend(*small, pool, positions);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  }
}

TEST(AttentionScratch, LongKvBlocksConvertedInPiecesGiveTheBitsOfShortBlocks) {
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    ThreadPool threads(2);
    auto be = make_cpu_backend(threads);
    be->reserve_attention(kLimits);
    Pool short_blocks(*be, dtype, 16), long_blocks(*be, dtype, 160);  // 160: pieces 64, 64, 32
    for (const auto& positions :
         {range(236, 300), range(150, 170), range(299, 300), range(63, 64), range(200, 201)}) {
      const auto want = attend(*be, short_blocks, positions);
      const auto got = attend(*be, long_blocks, positions);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
          << "tokens from position " << positions[0];
      for (float x : got) ASSERT_FALSE(std::isnan(x)) << "an output left unwritten";
    }
    // A prompt block (query blocks, converted V pieces) gives each token's bits alone (the
    // decode path).
    const std::vector<int64_t> block = range(236, 300);
    const auto together = attend(*be, long_blocks, block);
    const int64_t width = kHeads * kHeadDim;
    for (size_t i = 0; i < block.size(); ++i) {
      const auto alone = attend(*be, long_blocks, {block[i]});
      ASSERT_EQ(std::memcmp(alone.data(), together.data() + i * width, width * sizeof(float)), 0)
          << "position " << block[i] << " alone and in the block";
    }
  }
}

}  // namespace
}  // namespace cleave
