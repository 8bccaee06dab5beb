#include "cleave/kvcache/prefix_hash.h"

#include <gtest/gtest.h>

#include <bit>
#include <random>
#include <unordered_set>
#include <vector>

namespace cleave {
namespace {

std::vector<int32_t> random_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 32000);
  return t;
}

TEST(PrefixHashTest, PinnedValues) {
  // Workers of a prefill/decode pair must agree on keys: these values may never change silently.
  const std::vector<int32_t> t{1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(hash_block(kPrefixHashSeed, t), 0x683aaa51652a6e50ull);
  EXPECT_EQ(hash_block(0, {}), 0xa258d6ec1fb5d95cull);
  const std::vector<int32_t> odd{-1, 31999, 0};
  EXPECT_EQ(hash_block(123, odd), 0x76ac30f273bc07baull);
}

TEST(PrefixHashTest, ChainIsDeterministicAndMatchesHashBlock) {
  const auto t = random_tokens(16 * 5 + 7, 1);
  const auto keys = hash_full_blocks(t, 16);
  ASSERT_EQ(keys.size(), 5u);  // the trailing partial block has no key
  EXPECT_EQ(keys, hash_full_blocks(t, 16));
  uint64_t parent = kPrefixHashSeed;
  for (size_t i = 0; i < keys.size(); ++i) {
    parent = hash_block(parent, std::span<const int32_t>(t).subspan(i * 16, 16));
    EXPECT_EQ(keys[i], parent) << i;
  }
  // A different seed changes every key.
  const auto other = hash_full_blocks(t, 16, 42);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_NE(keys[i], other[i]);
  EXPECT_TRUE(hash_full_blocks(t, 0).empty());
  EXPECT_TRUE(hash_full_blocks(std::span<const int32_t>(t).first(15), 16).empty());
}

TEST(PrefixHashTest, ChangeInBlockIChangesKeysFromIOn) {
  constexpr int64_t kBs = 16;
  constexpr size_t kBlocks = 8;
  const auto base = random_tokens(kBs * kBlocks, 2);
  const auto want = hash_full_blocks(base, kBs);
  for (size_t pos = 0; pos < base.size(); ++pos) {
    auto t = base;
    t[pos] += 1;
    const auto got = hash_full_blocks(t, kBs);
    const size_t block = pos / kBs;
    for (size_t i = 0; i < kBlocks; ++i) {
      if (i < block) EXPECT_EQ(got[i], want[i]) << "pos " << pos << " key " << i;
      else EXPECT_NE(got[i], want[i]) << "pos " << pos << " key " << i;
    }
  }
}

TEST(PrefixHashTest, OrderLengthAndSignMatter) {
  const std::vector<int32_t> ab{1, 2}, ba{2, 1}, a{1}, a0{1, 0}, zero{0}, none{};
  const std::vector<int32_t> neg{-1}, big{static_cast<int32_t>(0x7fffffff)};
  std::unordered_set<uint64_t> seen;
  for (const auto* t : {&ab, &ba, &a, &a0, &zero, &none, &neg, &big})
    EXPECT_TRUE(seen.insert(hash_block(kPrefixHashSeed, *t)).second);
  EXPECT_NE(hash_block(1, ab), hash_block(2, ab));
}

TEST(PrefixHashTest, NoCollisionsOverManyInputs) {
  std::unordered_set<uint64_t> seen;
  // Every single-token block and every pair of small tokens, under two parents.
  for (uint64_t parent : {kPrefixHashSeed, uint64_t{0}}) {
    for (int32_t x = 0; x < 200000; ++x) {
      const int32_t t[1] = {x};
      ASSERT_TRUE(seen.insert(hash_block(parent, t)).second) << x;
    }
    for (int32_t x = 0; x < 300; ++x)
      for (int32_t y = 0; y < 300; ++y) {
        const int32_t t[2] = {x, y};
        ASSERT_TRUE(seen.insert(hash_block(parent, t)).second) << x << "," << y;
      }
  }
  // Parents 0..N with one fixed block (a chain's parents are keys, but small ones must mix too).
  const std::vector<int32_t> block(16, 7);
  for (uint64_t p = 0; p < 100000; ++p) ASSERT_TRUE(seen.insert(hash_block(p + 1000000, block)).second);
}

TEST(PrefixHashTest, SingleBitFlipsAvalanche) {
  // Flipping one input bit (token or parent) flips about half of the 64 output bits.
  std::mt19937_64 rng(3);
  double total = 0;
  int n = 0, worst = 64;
  for (int trial = 0; trial < 2000; ++trial) {
    auto t = random_tokens(16, rng());
    const uint64_t parent = rng();
    const uint64_t h = hash_block(parent, t);
    const int which = static_cast<int>(rng() % 17);
    const int bit = static_cast<int>(rng() % (which == 16 ? 64 : 32));
    uint64_t h2;
    if (which == 16) {
      h2 = hash_block(parent ^ (uint64_t{1} << bit), t);
    } else {
      t[static_cast<size_t>(which)] ^= static_cast<int32_t>(uint32_t{1} << bit);
      h2 = hash_block(parent, t);
    }
    const int flipped = std::popcount(h ^ h2);
    total += flipped;
    worst = std::min(worst, flipped);
    ++n;
  }
  EXPECT_NEAR(total / n, 32.0, 1.0);
  EXPECT_GE(worst, 12);
}

TEST(PrefixHashTest, SeedForModelDependsOnTheFingerprintOnly) {
  // Same model fingerprint, same seed; different fingerprints, different seeds.
  EXPECT_EQ(prefix_hash_seed_for_model("abc"), prefix_hash_seed_for_model("abc"));
  EXPECT_NE(prefix_hash_seed_for_model("abc"), prefix_hash_seed_for_model("abd"));
}

}  // namespace
}  // namespace cleave
