// Validation of a forward_batch() batch and its layout into sub-batches of at most
// max_batch_tokens tokens (engine-internal).
//
// The batch's tokens are taken in order (sequence 0's tokens, then sequence 1's, ...) and cut
// into consecutive sub-batches; a sequence may straddle two. For each sub-batch the assembler
// fills the TokenBatch index arrays the backend reads (positions, KV slots, sequence indices,
// block tables) and lists the tokens whose logits are wanted. Buffers are reserved once and
// reused, so steady-state calls do not allocate (block tables grow the flat id buffer only when
// a batch holds more blocks than any before).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/engine/backend.h"
#include "cleave/engine/llama_model.h"

namespace cleave::engine_detail {

// A token whose logits go to a sequence's logits span.
struct LogitRow {
  int64_t row = 0;            // row of the token in its sub-batch
  std::span<float> logits;    // where they go; empty: to ForwardHooks::on_token_logits
  size_t sequence = 0;        // for the hook: the sequence's index in the batch
  int64_t index = 0;          // and the token's index in its tokens
};

class BatchAssembler {
 public:
  void reserve(int64_t max_batch_tokens);

  // Checks every sequence of `batch` against the model (vocabulary, context) and the pool
  // (layout, block table length, block ids). The error names the sequence and the problem.
  static Status validate(std::span<const BatchSequence> batch, const KvLayout& pool_layout,
                         const ModelConfig& cfg, int64_t max_context);

  // Starts laying out `batch` (already validated) for a pool with `block_size`.
  void begin(std::span<const BatchSequence> batch, int64_t block_size);
  // Lays out the next sub-batch of up to max_batch_tokens tokens; false when none is left.
  bool next();
  // True when the current sub-batch is the batch's last.
  bool last() const { return cursor_seq_ >= batch_.size(); }

  // The current sub-batch.
  const TokenBatch& tokens() const { return tokens_; }
  std::span<const int32_t> token_ids() const {
    return {ids_.data(), static_cast<size_t>(tokens_.n_tokens)};
  }
  std::span<const LogitRow> logit_rows() const { return logit_rows_; }

 private:
  int64_t max_batch_ = 0;
  int64_t block_size_ = 1;
  std::span<const BatchSequence> batch_;
  size_t cursor_seq_ = 0;     // first sequence with tokens not yet laid out
  int64_t cursor_tok_ = 0;    // its first token not yet laid out

  TokenBatch tokens_;
  std::vector<int32_t> ids_;
  std::vector<int64_t> positions_, slots_, seq_blocks_;
  std::vector<int32_t> seq_;
  std::vector<BlockId> block_ids_;
  std::vector<LogitRow> logit_rows_;
};

}  // namespace cleave::engine_detail
