#include "cleave/kvcache/kv_layout.h"

#include <optional>
#include <vector>

#include "fmt/format.h"

namespace cleave {

namespace {

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "; " : "") + parts[i];
  return out;
}

}  // namespace

KvLayout KvLayout::for_model(const ModelConfig& cfg, int64_t block_size, int64_t num_blocks,
                             DType dtype) {
  KvLayout l;
  l.dtype = dtype;
  l.block_size = block_size;
  l.n_layers = cfg.n_layers;
  l.n_kv_heads = cfg.n_kv_heads;
  l.head_dim = cfg.head_dim;
  l.num_blocks = num_blocks;
  return l;
}

int64_t KvLayout::blocks_for_budget(const ModelConfig& cfg, int64_t block_size,
                                    uint64_t budget_bytes, DType dtype) {
  KvLayout l = for_model(cfg, block_size, 1, dtype);
  const uint64_t per_block = l.block_bytes() * static_cast<uint64_t>(l.n_layers);
  return per_block == 0 ? 0 : static_cast<int64_t>(budget_bytes / per_block);
}

uint64_t KvLayout::block_bytes() const {
  return 2ull * static_cast<uint64_t>(block_size) * static_cast<uint64_t>(kv_dim()) *
         static_cast<uint64_t>(dtype_info(dtype).block_bytes);
}

std::string KvLayout::validate() const {
  if (version != kVersion) return fmt::format("KV layout version {} (this build speaks {})", version, kVersion);
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return fmt::format("KV dtype {} is not supported (f32, f16 and bf16 are)", dtype_name(dtype));
  if (block_size < 1 || block_size > 4096) return fmt::format("block size {} is out of range [1, 4096]", block_size);
  if (n_layers < 1 || n_kv_heads < 1 || head_dim < 1)
    return fmt::format("bad KV geometry: {} layers, {} KV heads, head dim {}", n_layers, n_kv_heads, head_dim);
  constexpr int64_t kMaxDim = int64_t{1} << 20;
  if (n_layers > kMaxDim || n_kv_heads > kMaxDim || head_dim > kMaxDim)
    return fmt::format("bad KV geometry: {} layers, {} KV heads, head dim {} (each at most {})", n_layers,
                       n_kv_heads, head_dim, kMaxDim);
  if (num_blocks < 1) return fmt::format("the KV pool needs at least one block (got {})", num_blocks);
  if (num_blocks > (int64_t{1} << 30)) return fmt::format("{} blocks is absurd (at most 2^30)", num_blocks);
  // Every factor is bounded above, so this product cannot overflow 128 bits.
  const unsigned __int128 bytes = static_cast<unsigned __int128>(2) * static_cast<uint64_t>(block_size) *
                                  static_cast<uint64_t>(n_kv_heads) * static_cast<uint64_t>(head_dim) *
                                  static_cast<uint64_t>(dtype_info(dtype).block_bytes) *
                                  static_cast<uint64_t>(n_layers) * static_cast<uint64_t>(num_blocks);
  if (bytes > (static_cast<unsigned __int128>(1) << 56))
    return fmt::format("a KV pool of {} blocks x {} layers x {} tokens x {} KV heads x head dim {} is "
                       "over 2^56 bytes",
                       num_blocks, n_layers, block_size, n_kv_heads, head_dim);
  return {};
}

std::string KvLayout::incompatibility(const KvLayout& o) const {
  std::vector<std::string> diffs;
  if (version != o.version) diffs.push_back(fmt::format("layout version {} vs {}", version, o.version));
  if (dtype != o.dtype) diffs.push_back(fmt::format("dtype {} vs {}", dtype_name(dtype), dtype_name(o.dtype)));
  if (block_size != o.block_size) diffs.push_back(fmt::format("block size {} vs {}", block_size, o.block_size));
  if (n_layers != o.n_layers) diffs.push_back(fmt::format("layers {} vs {}", n_layers, o.n_layers));
  if (n_kv_heads != o.n_kv_heads) diffs.push_back(fmt::format("KV heads {} vs {}", n_kv_heads, o.n_kv_heads));
  if (head_dim != o.head_dim) diffs.push_back(fmt::format("head dim {} vs {}", head_dim, o.head_dim));
  return join(diffs);
}

std::string pairing_mismatch(std::string_view local_fingerprint, const KvLayout& local,
                             std::string_view remote_fingerprint, const KvLayout& remote) {
  std::vector<std::string> diffs;
  auto differs = [&](std::string_view field, const auto& a, const auto& b) {
    diffs.push_back(fmt::format("{} differs (prefill {}, decode {})", field, a, b));
  };
  if (local_fingerprint != remote_fingerprint) {
    differs("model fingerprint", local_fingerprint.empty() ? "<none>" : local_fingerprint,
            remote_fingerprint.empty() ? "<none>" : remote_fingerprint);
  }
  if (local.version != remote.version) differs("layout version", local.version, remote.version);
  if (local.dtype != remote.dtype) differs("dtype", dtype_name(local.dtype), dtype_name(remote.dtype));
  if (local.block_size != remote.block_size) differs("block_size", local.block_size, remote.block_size);
  if (local.n_layers != remote.n_layers) differs("n_layers", local.n_layers, remote.n_layers);
  if (local.n_kv_heads != remote.n_kv_heads) differs("n_kv_heads", local.n_kv_heads, remote.n_kv_heads);
  if (local.head_dim != remote.head_dim) differs("head_dim", local.head_dim, remote.head_dim);
  return join(diffs);
}

std::string pairing_mismatch(std::string_view local_fingerprint, const KvLayout& local,
                             std::string_view remote_fingerprint, const KvLayout& remote,
                             std::string_view remote_dtype) {
  KvLayout named = remote;
  const std::optional<DType> dtype = parse_dtype(remote_dtype);
  named.dtype = dtype.value_or(local.dtype);
  std::string rest = pairing_mismatch(local_fingerprint, local, remote_fingerprint, named);
  if (dtype) return rest;
  std::string unknown =
      fmt::format("dtype differs (prefill {}, decode '{}')", dtype_name(local.dtype), remote_dtype);
  return rest.empty() ? unknown : unknown + "; " + rest;
}

std::string KvLayout::to_string() const {
  return fmt::format("v{} {} block {} x {} layers x {} KV heads x head dim {}, {} blocks ({} bytes)",
                     version, dtype_name(dtype), block_size, n_layers, n_kv_heads, head_dim,
                     num_blocks, total_bytes());
}

}  // namespace cleave
