// An xxh64-style hash over 32-bit token ids, written for this purpose. It operates on integer
// values (never on bytes in memory), so it is the same on every platform and byte order; the
// prefill and decode workers of a pair rely on that.
//
// Every step is a bijection of the running state (xor/add of a constant, rotation, multiplication
// by an odd constant), and so is the final avalanche: for a fixed block of tokens, distinct
// parents always give distinct keys.
#include "cleave/kvcache/prefix_hash.h"

#include <cstddef>

namespace cleave {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ull;

constexpr uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

constexpr uint64_t lane_round(uint64_t lane) { return rotl(lane * kPrime2, 31) * kPrime1; }

constexpr uint64_t avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

}  // namespace

uint64_t hash_block(uint64_t parent, std::span<const int32_t> tokens) {
  // The length enters the initial state so that spans of different lengths never alias.
  uint64_t h = avalanche(parent ^ kPrime5) + kPrime5 + static_cast<uint64_t>(tokens.size()) * kPrime3;
  size_t i = 0;
  for (; i + 2 <= tokens.size(); i += 2) {
    const uint64_t lane = static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) |
                          (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h ^= lane_round(lane);
    h = rotl(h, 27) * kPrime1 + kPrime4;
  }
  if (i < tokens.size()) {
    h ^= static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) * kPrime1;
    h = rotl(h, 23) * kPrime2 + kPrime3;
  }
  return avalanche(h);
}

std::vector<uint64_t> hash_full_blocks(std::span<const int32_t> tokens, int64_t block_size,
                                       uint64_t seed) {
  std::vector<uint64_t> keys;
  if (block_size < 1) return keys;
  const size_t bs = static_cast<size_t>(block_size);
  const size_t n = tokens.size() / bs;
  keys.reserve(n);
  uint64_t parent = seed;
  for (size_t b = 0; b < n; ++b) {
    parent = hash_block(parent, tokens.subspan(b * bs, bs));
    keys.push_back(parent);
  }
  return keys;
}

uint64_t prefix_hash_seed_for_model(std::string_view model_fingerprint) {
  std::vector<int32_t> ids(model_fingerprint.begin(), model_fingerprint.end());
  return hash_block(kPrefixHashSeed, ids);
}

}  // namespace cleave
