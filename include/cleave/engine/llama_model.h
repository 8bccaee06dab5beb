// The Llama-family forward pass (Llama 2/3, Mistral, Qwen2) on a compute backend.
//
// Thread-safety: a LlamaModel is used by one engine thread at a time; the weights are
// read-only and may be shared by several models. Compute parallelism lives inside the backend
// (the thread pool). Batch invariance: a sequence's logits never depend on how its tokens were
// chunked or what else ran with them (see cpu_kernels.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/common/thread_pool.h"
#include "cleave/engine/backend.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/model/model_file.h"

namespace cleave {

struct EngineOptions {
  int threads = 0;             // compute threads; 0 = one per online CPU
  int64_t max_context = 0;     // 0 = the model's context_length
  // Most tokens run through one layer at a time; forward_batch() splits larger batches into
  // sub-batches of this size (scratch memory is sized for it). Logits do not depend on it.
  int64_t max_batch_tokens = 256;
  // The backend (engine.device): "cpu", "cuda" or "cuda:N" (backend.h make_backend). On a GPU
  // the weights are uploaded at create(); KV pools come from create_kv_pool().
  std::string device = "cpu";
};

// One sequence's share of a forward_batch() call.
struct BatchSequence {
  std::span<const int32_t> tokens;       // this step's tokens, positions [start_pos, start_pos + size)
  int64_t start_pos = 0;                 // K/V of positions < start_pos must already be in the pool
  std::span<const BlockId> block_table;  // KV blocks covering positions [0, start_pos + size):
                                         // position p lives in block_table[p / block_size] at
                                         // offset p % block_size (entries past that are ignored)
  std::span<float> logits;               // empty: no logits; else >= vocab_size floats that get
                                         // the logits of the LAST of `tokens`
  // Scoring (prompt log-probabilities, perplexity): the logits of EVERY one of `tokens` go to
  // ForwardHooks::on_token_logits (which must then be set), the last one's too.
  bool all_logits = false;
};

// Callbacks from inside forward_batch(), on the calling thread.
struct ForwardHooks {
  // Called once per layer, in layer order, as soon as that layer's K/V of every token of the
  // batch are in the pool (e.g. to start sending them to a decode worker). May be empty.
  std::function<void(int64_t layer)> on_layer_done;
  // For each token of a sequence with all_logits, in token order: `sequence` indexes the batch,
  // `index` the sequence's `tokens`; `logits` (vocab_size floats) is valid during the call only.
  // Bit-identical to the logits a last-token span would get (batch invariance).
  std::function<void(size_t sequence, int64_t index, std::span<const float> logits)>
      on_token_logits;
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
  // A KV pool of that layout whose storage is where the backend computes (device memory on
  // CUDA); forward_batch() refuses a pool in other memory. Errors: a bad layout, memory.
  Result<std::unique_ptr<KvBlockPool>> create_kv_pool(int64_t block_size, int64_t num_blocks,
                                                      DType kv_dtype = DType::kF32);
  // The KV pool layout this model reads and writes: `num_blocks` blocks of `block_size` tokens,
  // K/V stored as `kv_dtype` (f32, f16 or bf16; attention converts rows to f32 as it reads).
  KvLayout kv_layout(int64_t block_size, int64_t num_blocks, DType kv_dtype = DType::kF32) const;

  // Runs every sequence of `batch` one step: each sequence's tokens at its positions, all tokens
  // of all sequences together through each matmul, attention per (sequence, token, head) over
  // keys 0..pos read through the sequence's block table in key order. K/V of the new tokens are
  // written into `kv` at their (block, offset); logits are written where asked.
  //
  // Batch invariance: a sequence's logits and K/V are bit-identical whatever else is in the
  // batch, however its tokens are chunked over calls, whatever the block ids and max_batch_tokens.
  // Batches of more than max_batch_tokens tokens run as sub-batches (a sequence may straddle two).
  //
  // The caller guarantees that no two tokens of the batch write the same (block, offset) and that
  // no sequence's keys are overwritten by another's tokens (shared prefix blocks are read-only).
  // Errors (nothing is written when validation fails): InvalidArgument for an empty batch or
  // sequence, a token id outside the vocabulary, a block table too short for its positions, a
  // block id outside the pool, a logits span smaller than the vocabulary, all_logits without an
  // on_token_logits hook, or a pool whose layout
  // does not match the model; OutOfRange for positions outside [0, max_context).
  // No heap allocation after the first calls (scratch is reserved at create).
  [[nodiscard]] Status forward_batch(std::span<const BatchSequence> batch, KvBlockPool& kv,
                                     const ForwardHooks& hooks = {});

  // One sequence: forward_batch() of a batch of one, logits of the last token into `logits`.
  [[nodiscard]] Status forward(std::span<const int32_t> tokens, int64_t start_pos,
                               std::span<const BlockId> block_table, KvBlockPool& kv,
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
