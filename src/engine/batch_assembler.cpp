// Validation of forward_batch() inputs and their layout into sub-batches.
#include "batch_assembler.h"

#include <algorithm>

#include "fmt/format.h"

namespace cleave::engine_detail {

void BatchAssembler::reserve(int64_t max_batch_tokens) {
  max_batch_ = max_batch_tokens;
  const auto n = static_cast<size_t>(max_batch_tokens);
  ids_.assign(n, 0);
  positions_.assign(n, 0);
  slots_.assign(n, 0);
  seq_.assign(n, 0);
  seq_blocks_.assign(n, 0);
  logit_rows_.reserve(2 * n);  // a token may go to its span and to the hook
  block_ids_.reserve(n * 64);
}

Status BatchAssembler::validate(std::span<const BatchSequence> batch, const KvLayout& pool,
                                const ModelConfig& cfg, int64_t max_context) {
  if (batch.empty()) return InvalidArgument("forward_batch: the batch has no sequences");
  if (pool.n_layers != cfg.n_layers || pool.n_kv_heads != cfg.n_kv_heads ||
      pool.head_dim != cfg.head_dim ||
      (pool.dtype != DType::kF32 && pool.dtype != DType::kF16 && pool.dtype != DType::kBF16)) {
    return InvalidArgument(fmt::format(
        "forward_batch: the KV pool's layout ({}) does not match the model ({} layers, {} KV "
        "heads, head dim {}, f32, f16 or bf16)",
        pool.to_string(), cfg.n_layers, cfg.n_kv_heads, cfg.head_dim));
  }
  for (size_t s = 0; s < batch.size(); ++s) {
    const BatchSequence& b = batch[s];
    const auto n = static_cast<int64_t>(b.tokens.size());
    if (n == 0) return InvalidArgument(fmt::format("forward_batch: sequence {} has no tokens", s));
    if (b.start_pos < 0 || b.start_pos + n > max_context) {
      return OutOfRange(fmt::format(
          "forward_batch: sequence {} runs positions [{}, {}), outside the context of {} tokens",
          s, b.start_pos, b.start_pos + n, max_context));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= cfg.vocab_size) {
        return InvalidArgument(fmt::format(
            "forward_batch: sequence {}: token id {} at index {} is outside the vocabulary (size {})",
            s, b.tokens[i], i, cfg.vocab_size));
      }
    }
    const int64_t need = (b.start_pos + n + pool.block_size - 1) / pool.block_size;
    if (static_cast<int64_t>(b.block_table.size()) < need) {
      return InvalidArgument(fmt::format(
          "forward_batch: sequence {}'s block table has {} blocks; positions [0, {}) need {} of {} "
          "tokens",
          s, b.block_table.size(), b.start_pos + n, need, pool.block_size));
    }
    for (int64_t i = 0; i < need; ++i) {
      if (b.block_table[i] < 0 || b.block_table[i] >= pool.num_blocks) {
        return InvalidArgument(fmt::format(
            "forward_batch: sequence {}: block id {} at table index {} is outside the pool of {} "
            "blocks",
            s, b.block_table[i], i, pool.num_blocks));
      }
    }
    if (!b.logits.empty() && static_cast<int64_t>(b.logits.size()) < cfg.vocab_size) {
      return InvalidArgument(fmt::format(
          "forward_batch: sequence {}'s logits buffer holds {} floats, the vocabulary has {}", s,
          b.logits.size(), cfg.vocab_size));
    }
  }
  return Status::Ok();
}

void BatchAssembler::begin(std::span<const BatchSequence> batch, int64_t block_size) {
  batch_ = batch;
  block_size_ = block_size;
  cursor_seq_ = 0;
  cursor_tok_ = 0;
  tokens_ = TokenBatch{};
}

bool BatchAssembler::next() {
  if (cursor_seq_ >= batch_.size()) return false;
  block_ids_.clear();
  logit_rows_.clear();
  int64_t row = 0;
  int32_t n_seqs = 0;
  while (row < max_batch_ && cursor_seq_ < batch_.size()) {
    const BatchSequence& b = batch_[cursor_seq_];
    const auto n = static_cast<int64_t>(b.tokens.size());
    const int64_t take = std::min(n - cursor_tok_, max_batch_ - row);
    const int64_t first_pos = b.start_pos + cursor_tok_;
    for (int64_t i = 0; i < take; ++i) {
      const int64_t pos = first_pos + i;
      const auto r = static_cast<size_t>(row + i);
      ids_[r] = b.tokens[static_cast<size_t>(cursor_tok_ + i)];
      positions_[r] = pos;
      slots_[r] = static_cast<int64_t>(b.block_table[static_cast<size_t>(pos / block_size_)]) *
                      block_size_ + pos % block_size_;
      seq_[r] = n_seqs;
      if (b.all_logits) {
        logit_rows_.push_back(LogitRow{.row = row + i, .logits = {}, .sequence = cursor_seq_,
                                       .index = cursor_tok_ + i});
      }
    }
    // The blocks this sub-batch's tokens of the sequence read: positions 0..last.
    const int64_t blocks = (first_pos + take - 1) / block_size_ + 1;
    seq_blocks_[static_cast<size_t>(n_seqs)] = static_cast<int64_t>(block_ids_.size());
    block_ids_.insert(block_ids_.end(), b.block_table.begin(), b.block_table.begin() + blocks);
    ++n_seqs;
    row += take;
    cursor_tok_ += take;
    if (cursor_tok_ == n) {
      if (!b.logits.empty()) logit_rows_.push_back(LogitRow{.row = row - 1, .logits = b.logits});
      ++cursor_seq_;
      cursor_tok_ = 0;
    }
  }
  tokens_ = TokenBatch{.n_tokens = row,
                       .positions = positions_.data(),
                       .kv_slots = slots_.data(),
                       .seq = seq_.data(),
                       .seq_blocks = seq_blocks_.data(),
                       .block_ids = block_ids_.data(),
                       .n_seqs = n_seqs,
                       .n_block_ids = static_cast<int64_t>(block_ids_.size())};
  return true;
}

}  // namespace cleave::engine_detail
