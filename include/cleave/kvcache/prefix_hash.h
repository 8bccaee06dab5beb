// Hash chains over full KV blocks for the prefix cache: the key of block i of a sequence names
// every token from position 0 through the end of block i.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace cleave {

// Seed of the chain (the "parent" of block 0). A model fingerprint may be mixed in so that two
// models never share keys.
inline constexpr uint64_t kPrefixHashSeed = 0x9e3779b97f4a7c15ull;

// H(parent, tokens): deterministic on every platform (no std::hash; computed on integer values,
// not bytes), so two workers agree on keys. Well mixed (xxh64-style rounds and avalanche); for a
// fixed `tokens`, distinct parents always give distinct keys. The length of `tokens` is hashed.
uint64_t hash_block(uint64_t parent, std::span<const int32_t> tokens);
// Keys of every full block of `tokens` (tokens.size() / block_size of them; a trailing partial
// block has none): key_0 = H(seed, block 0), key_i = H(key_{i-1}, block i). Empty when
// block_size < 1.
std::vector<uint64_t> hash_full_blocks(std::span<const int32_t> tokens, int64_t block_size,
                                       uint64_t seed = kPrefixHashSeed);

// The seed of a worker's prefix-cache hash chains: kPrefixHashSeed with the model fingerprint
// mixed in (hash_block(kPrefixHashSeed, the fingerprint's bytes as ids)), so that two models
// never share keys while every worker (and a router) derives the same keys for one model.
uint64_t prefix_hash_seed_for_model(std::string_view model_fingerprint);

}  // namespace cleave
