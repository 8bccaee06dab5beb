// The layout of a worker's KV pool. It is part of the prefill/decode handshake: two workers pair
// only when their layouts are compatible (same version, dtype, block size and geometry).
//
// Memory: one buffer of num_blocks blocks per layer. The unit is (layer, block): K of the block's
// block_size tokens ([block_size, n_kv_heads, head_dim]) immediately followed by its V (same
// shape), contiguous. Units are laid out layer-major:
//   offset(layer, block) = (layer * num_blocks + block) * block_bytes()
// so a run of consecutive block ids of one layer is one contiguous range (one RDMA write).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "cleave/model/dtype.h"
#include "cleave/model/model_config.h"

namespace cleave {

using BlockId = int32_t;

struct KvLayout {
  static constexpr int32_t kVersion = 1;
  int32_t version = kVersion;
  DType dtype = DType::kF32;   // element type of K and V: f32, f16 or bf16 (engine.kv_dtype)
  int64_t block_size = 16;     // tokens per block
  int64_t n_layers = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;      // per layer

  // Layout for `cfg` with `num_blocks` blocks of `block_size` tokens of `dtype`.
  static KvLayout for_model(const ModelConfig& cfg, int64_t block_size, int64_t num_blocks,
                            DType dtype = DType::kF32);
  // Blocks that fit in `budget_bytes` (0 if none).
  static int64_t blocks_for_budget(const ModelConfig& cfg, int64_t block_size,
                                   uint64_t budget_bytes, DType dtype = DType::kF32);

  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  // Bytes of one (layer, block) unit: K and V of block_size tokens.
  uint64_t block_bytes() const;
  uint64_t offset(int64_t layer, BlockId block) const {
    return (static_cast<uint64_t>(layer) * static_cast<uint64_t>(num_blocks) +
            static_cast<uint64_t>(block)) * block_bytes();
  }
  uint64_t total_bytes() const { return static_cast<uint64_t>(n_layers) * num_blocks * block_bytes(); }
  // Empty when valid, else what is wrong.
  std::string validate() const;
  // Empty when a prefill worker with layout `other` may write into this one (num_blocks may
  // differ), else a message naming every field that differs, with both values.
  std::string incompatibility(const KvLayout& other) const;
  std::string to_string() const;
};

// The pairing check of the prefill/decode handshake. Empty when a prefill worker with
// (local_fingerprint, local) may write into a decode worker with (remote_fingerprint, remote),
// else one message naming every field that differs with both values, e.g. "model fingerprint
// differs (prefill 1a2b..., decode 9f8e...); block_size differs (prefill 16, decode 32)". An
// empty fingerprint reads "<none>". num_blocks may differ.
std::string pairing_mismatch(std::string_view local_fingerprint, const KvLayout& local,
                             std::string_view remote_fingerprint, const KvLayout& remote);
// The same check against a layout as a control-plane message carries it, its dtype a name
// (`remote_dtype`; remote.dtype is not read): a name this build does not know (parse_dtype) is
// a difference too, named first as sent ("dtype differs (prefill f32, decode 'f8')"), so that a
// layout this build cannot represent is still refused with what differs.
std::string pairing_mismatch(std::string_view local_fingerprint, const KvLayout& local,
                             std::string_view remote_fingerprint, const KvLayout& remote,
                             std::string_view remote_dtype);

}  // namespace cleave
