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
#include "cleave/model/model_file.h"

namespace cleave {

struct EngineOptions {
  int threads = 0;             // compute threads; 0 = one per online CPU
  int64_t max_context = 0;     // 0 = the model's context_length
};

// KV cache of one sequence, contiguous: for each layer, K and V of [max_context, n_kv_heads,
// head_dim] floats. (The paged, multi-sequence cache comes with src/kvcache.)
class KvCache {
 public:
  KvCache(const ModelConfig& cfg, int64_t max_context);
  int64_t capacity() const { return capacity_; }
  float* k(int64_t layer, int64_t pos);
  float* v(int64_t layer, int64_t pos);
  int64_t kv_dim() const { return kv_dim_; }

 private:
  int64_t capacity_, kv_dim_, layer_stride_;
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

  // Runs `tokens` at positions [start_pos, start_pos + tokens.size()) of the sequence whose KV
  // is in `cache` (positions < start_pos must already be there). Writes the logits of the last
  // token (vocab_size floats) to `logits`. OutOfRange when the context would overflow.
  Status forward(std::span<const int32_t> tokens, int64_t start_pos, KvCache& cache,
                 std::span<float> logits);

  // Bytes of weights read per decode step (every matrix once), for bandwidth floors.
  uint64_t weight_bytes_per_token() const;

 private:
  struct Impl;
  explicit LlamaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cleave
