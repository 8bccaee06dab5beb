// The contiguous single-sequence KV cache.
#include "cleave/engine/llama_model.h"

namespace cleave {

KvCache::KvCache(const ModelConfig& cfg, int64_t max_context)
    : n_layers_(cfg.n_layers),
      capacity_(max_context),
      kv_dim_(cfg.n_kv_heads * cfg.head_dim),
      layer_stride_(max_context * cfg.n_kv_heads * cfg.head_dim),
      k_(static_cast<size_t>(cfg.n_layers * layer_stride_), 0.0f),
      v_(static_cast<size_t>(cfg.n_layers * layer_stride_), 0.0f) {}

float* KvCache::k(int64_t layer, int64_t pos) {
  return k_.data() + layer * layer_stride_ + pos * kv_dim_;
}
float* KvCache::v(int64_t layer, int64_t pos) {
  return v_.data() + layer * layer_stride_ + pos * kv_dim_;
}
const float* KvCache::k(int64_t layer, int64_t pos) const {
  return k_.data() + layer * layer_stride_ + pos * kv_dim_;
}
const float* KvCache::v(int64_t layer, int64_t pos) const {
  return v_.data() + layer * layer_stride_ + pos * kv_dim_;
}

}  // namespace cleave
