#include "cleave/model/model_config.h"

#include <cmath>

#include "fmt/format.h"

namespace cleave {
namespace {
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxDim = 1 << 17;
constexpr int64_t kMaxFfn = 1 << 20;
constexpr int64_t kMaxVocab = 1 << 22;
constexpr int64_t kMaxContext = 1 << 24;
}  // namespace

std::string ModelConfig::validate() const {
  if (arch != "llama" && arch != "mistral" && arch != "qwen2")
    return fmt::format("architecture '{}' is not supported (llama, mistral, qwen2 are)", arch);
  auto in_range = [](int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  if (!in_range(n_layers, 1, kMaxLayers))
    return fmt::format("layer count {} is out of range (1..{})", n_layers, kMaxLayers);
  if (!in_range(dim, 1, kMaxDim)) return fmt::format("embedding size {} is out of range (1..{})", dim, kMaxDim);
  if (!in_range(n_heads, 1, dim)) return fmt::format("head count {} is out of range (1..{})", n_heads, dim);
  if (!in_range(n_kv_heads, 1, n_heads))
    return fmt::format("KV head count {} is out of range (1..{})", n_kv_heads, n_heads);
  if (n_heads % n_kv_heads != 0)
    return fmt::format("head count {} is not a multiple of the KV head count {}", n_heads, n_kv_heads);
  if (!in_range(head_dim, 2, 4096) || head_dim % 2 != 0)
    return fmt::format("head size {} must be even and in 2..4096", head_dim);
  if (head_dim * n_heads > 4 * kMaxDim)
    return fmt::format("heads × head size {} × {} is absurd", n_heads, head_dim);
  if (!in_range(ffn_dim, 1, kMaxFfn)) return fmt::format("FFN size {} is out of range (1..{})", ffn_dim, kMaxFfn);
  if (!in_range(vocab_size, 1, kMaxVocab))
    return fmt::format("vocabulary size {} is out of range (1..{})", vocab_size, kMaxVocab);
  if (!in_range(context_length, 1, kMaxContext))
    return fmt::format("context length {} is out of range (1..{})", context_length, kMaxContext);
  if (!(rms_eps > 0.0f && rms_eps < 1.0f)) return fmt::format("RMS norm epsilon {} must be in (0, 1)", rms_eps);
  if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta))
    return fmt::format("RoPE theta {} must be positive", rope_theta);
  if (rope_scaling.type != RopeScaling::Type::kNone) {
    if (!(rope_scaling.factor >= 1.0f) || !std::isfinite(rope_scaling.factor))
      return fmt::format("RoPE scaling factor {} must be at least 1", rope_scaling.factor);
    if (rope_scaling.type == RopeScaling::Type::kLlama3) {
      if (!(rope_scaling.low_freq_factor > 0.0f) ||
          !(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor))
        return fmt::format("Llama-3 RoPE scaling needs 0 < low_freq_factor ({}) < "
                           "high_freq_factor ({})", rope_scaling.low_freq_factor,
                           rope_scaling.high_freq_factor);
      if (!in_range(rope_scaling.original_context, 1, kMaxContext))
        return fmt::format("Llama-3 RoPE original context {} is out of range",
                           rope_scaling.original_context);
    }
  }
  return {};
}

}  // namespace cleave
