// The Llama-family forward pass (Llama 2/3, Mistral, Qwen2) on a compute backend.
//
// Thread-safety: a LlamaModel is used by one engine thread at a time; the weights are
// read-only and may be shared by several models. Compute parallelism lives inside the backend
// (the thread pool). Batch invariance: a sequence's logits never depend on how its tokens were
// chunked or what else ran with them (see cpu_kernels.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/common/thread_pool.h"
#include "cleave/engine/backend.h"
#include "cleave/model/model_file.h"

namespace cleave {

struct EngineOptions {
  int threads = 0;             // compute threads; 0 = one per online CPU
  int64_t max_context = 0;     // 0 = the model's context_length
  // Most tokens run through one layer at a time; forward() splits longer inputs into chunks of
  // this size (scratch memory is sized for it). Logits do not depend on it (batch invariance).
  int64_t max_batch_tokens = 256;
};

// KV cache of one sequence, contiguous: for each layer, K and V of [max_context, n_kv_heads,
// head_dim] floats. (The paged, multi-sequence cache comes with src/kvcache.)
class KvCache {
 public:
  // Zero-filled; capacity is max_context positions.
  KvCache(const ModelConfig& cfg, int64_t max_context);
  int64_t n_layers() const { return n_layers_; }
  int64_t capacity() const { return capacity_; }
  // K / V of `layer` at `pos`: kv_dim() floats; positions of a layer are contiguous.
  float* k(int64_t layer, int64_t pos);
  float* v(int64_t layer, int64_t pos);
  const float* k(int64_t layer, int64_t pos) const;
  const float* v(int64_t layer, int64_t pos) const;
  int64_t kv_dim() const { return kv_dim_; }

 private:
  int64_t n_layers_, capacity_, kv_dim_, layer_stride_;
  std::vector<float> k_, v_;
};

class LlamaModel {
 public:
  // Checks the model's tensors and builds the forward pass. `model` must outlive the result.
  static Result<std::unique_ptr<LlamaModel>> create(std::shared_ptr<const ModelFile> model,
                                                    const EngineOptions& opts);
  ~LlamaModel();

  const ModelConfig& config() const;
  int64_t max_context() const;
  ThreadPool& pool();
  Backend& backend();
  // A KV cache sized for this model (max_context positions).
  KvCache make_cache() const;

  // Runs `tokens` at positions [start_pos, start_pos + tokens.size()) of the sequence whose KV
  // is in `cache` (positions < start_pos must already be there). Writes the logits of the last
  // token (vocab_size floats) to `logits`. OutOfRange when the context would overflow (the
  // cache's capacity or max_context), InvalidArgument for an empty input, a token id outside
  // the vocabulary, a too-small `logits` or a cache of another model's geometry.
  // No allocation after the first call.
  [[nodiscard]] Status forward(std::span<const int32_t> tokens, int64_t start_pos, KvCache& cache,
                 std::span<float> logits);

  // Bytes of weights read per decode step, for bandwidth floors: every tensor the step reads
  // once, as stored in the file (layer matrices, norms, biases, final norm, output matrix --
  // the token embedding itself when tied); the one embedding row looked up is excluded.
  uint64_t weight_bytes_per_token() const;

 private:
  struct Impl;
  explicit LlamaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cleave
