// The KV pool's free-run index (src/kvcache/free_run_index.h) on its own: the lowest run long
// enough, padding that never counts as free, runs across the tree's halves, idempotent marks,
// and random marks checked against a plain scan.
#include "kvcache/free_run_index.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace cleave::kvcache_detail {
namespace {

// The lowest start of `len` free ids in a row, by scanning; -1 when none.
int64_t scan_run(const std::vector<bool>& free, int64_t len) {
  int64_t run = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(free.size()); ++i) {
    run = free[static_cast<size_t>(i)] ? run + 1 : 0;
    if (run == len) return i - len + 1;
  }
  return -1;
}

int64_t scan_longest(const std::vector<bool>& free) {
  int64_t run = 0, best = 0;
  for (bool f : free) {
    run = f ? run + 1 : 0;
    best = std::max(best, run);
  }
  return best;
}

TEST(FreeRunIndexTest, StartsAllFreeOrAllTaken) {
  FreeRunIndex all(10, true);
  EXPECT_EQ(all.size(), 10);
  EXPECT_EQ(all.free_count(), 10);
  EXPECT_EQ(all.longest_run(), 10);
  EXPECT_EQ(all.find_run(10), 0);
  EXPECT_EQ(all.find_run(11), -1);  // the padding up to 16 is never free
  EXPECT_EQ(all.first_free(), 0);
  FreeRunIndex none(10, false);
  EXPECT_EQ(none.free_count(), 0);
  EXPECT_EQ(none.longest_run(), 0);
  EXPECT_EQ(none.first_free(), -1);
  EXPECT_EQ(none.find_run(1), -1);
  FreeRunIndex one(1, true);
  EXPECT_EQ(one.find_run(1), 0);
  EXPECT_EQ(one.find_run(2), -1);
}

TEST(FreeRunIndexTest, FindsTheLowestRunLongEnoughNotTheBestFit) {
  FreeRunIndex idx(16, false);
  // Free: 1-3 (3), 6-10 (5), 12-13 (2).
  for (int64_t id : {1, 2, 3, 6, 7, 8, 9, 10, 12, 13}) idx.set_free(id, true);
  EXPECT_EQ(idx.free_count(), 10);
  EXPECT_EQ(idx.longest_run(), 5);
  EXPECT_EQ(idx.first_free(), 1);
  EXPECT_EQ(idx.find_run(1), 1);
  EXPECT_EQ(idx.find_run(2), 1);  // lowest, though 12-13 fits exactly
  EXPECT_EQ(idx.find_run(3), 1);
  EXPECT_EQ(idx.find_run(4), 6);
  EXPECT_EQ(idx.find_run(5), 6);
  EXPECT_EQ(idx.find_run(6), -1);
  // A run that straddles the middle of the tree (7 | 8).
  FreeRunIndex mid(16, false);
  for (int64_t id = 5; id <= 11; ++id) mid.set_free(id, true);
  EXPECT_EQ(mid.find_run(7), 5);
  EXPECT_EQ(mid.longest_run(), 7);
}

TEST(FreeRunIndexTest, MarksAreIdempotentAndFragmentationIsTracked) {
  FreeRunIndex idx(12, true);
  idx.set_free(4, false);
  idx.set_free(4, false);  // no-op
  EXPECT_EQ(idx.free_count(), 11);
  idx.set_free(5, true);  // already free: no-op
  EXPECT_EQ(idx.free_count(), 11);
  EXPECT_FALSE(idx.is_free(4));
  EXPECT_TRUE(idx.is_free(5));
  // Checkerboard: every other id taken, so no run of 2 is left though half the ids are free.
  for (int64_t id = 0; id < 12; id += 2) idx.set_free(id, false);
  EXPECT_EQ(idx.free_count(), 6);
  EXPECT_EQ(idx.longest_run(), 1);
  EXPECT_EQ(idx.find_run(2), -1);
  EXPECT_EQ(idx.first_free(), 1);
  // Freeing 2 joins 1-3.
  idx.set_free(2, true);
  EXPECT_EQ(idx.find_run(3), 1);
  EXPECT_EQ(idx.find_run(4), -1);
}

TEST(FreeRunIndexTest, RandomMarksMatchAScan) {
  std::mt19937 rng(1234);
  for (int64_t n : {1, 2, 3, 7, 8, 33, 100, 257}) {
    FreeRunIndex idx(n, rng() % 2 == 0);
    std::vector<bool> free(static_cast<size_t>(n), idx.is_free(0));
    for (int op = 0; op < 2000; ++op) {
      const int64_t id = static_cast<int64_t>(rng() % static_cast<uint32_t>(n));
      const bool f = rng() % 2 == 0;
      idx.set_free(id, f);
      free[static_cast<size_t>(id)] = f;
      const int64_t len = 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(n));
      ASSERT_EQ(idx.find_run(len), scan_run(free, len)) << "n " << n << " op " << op << " len " << len;
      ASSERT_EQ(idx.longest_run(), scan_longest(free)) << "n " << n << " op " << op;
    }
    int64_t count = 0;
    for (bool f : free) count += f ? 1 : 0;
    EXPECT_EQ(idx.free_count(), count);
  }
}

}  // namespace
}  // namespace cleave::kvcache_detail
