// Perplexity over non-overlapping windows (see perplexity.h).
#include "cleave/engine/perplexity.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cleave/engine/sampler.h"
#include "fmt/format.h"

namespace cleave {

Result<PerplexityResult> compute_perplexity(LlamaModel& model, std::span<const int32_t> tokens,
                                            const PerplexityOptions& opts,
                                            const PerplexityProgress& progress) {
  const int64_t ctx = opts.ctx;
  const int64_t batch = opts.batch == 0 ? ctx : opts.batch;
  const int64_t vocab = model.config().vocab_size;
  if (ctx < 4) return InvalidArgument(fmt::format("perplexity: ctx {} must be at least 4", ctx));
  if (ctx > model.max_context()) {
    return InvalidArgument(fmt::format("perplexity: ctx {} exceeds the model's context of {} tokens",
                                       ctx, model.max_context()));
  }
  if (batch < 1) return InvalidArgument(fmt::format("perplexity: batch {} must be at least 1", batch));
  if (opts.bos_id >= vocab) {
    return InvalidArgument(
        fmt::format("perplexity: BOS id {} is outside the vocabulary of {}", opts.bos_id, vocab));
  }
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t windows = n / ctx;
  if (windows < 1) {
    return InvalidArgument(fmt::format(
        "perplexity: the text has {} tokens, fewer than one window of ctx = {} tokens", n, ctx));
  }
  for (int64_t i = 0; i < windows * ctx; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return InvalidArgument(fmt::format("perplexity: token {} at index {} is outside the vocabulary",
                                         tokens[i], i));
    }
  }

  constexpr int64_t kBlockSize = 16;
  const int64_t blocks = (ctx + kBlockSize - 1) / kBlockSize;
  CLEAVE_ASSIGN_OR_RETURN(auto kv, model.create_kv_pool(kBlockSize, blocks));
  std::vector<BlockId> table;
  CLEAVE_RETURN_IF_ERROR(kv->allocate(blocks, table));

  const int64_t first = ctx / 2;
  std::vector<int32_t> window(static_cast<size_t>(ctx));
  PerplexityResult r;
  double nll2 = 0;
  int64_t batch_start = 0;
  ForwardHooks hooks;
  hooks.on_token_logits = [&](size_t, int64_t index, std::span<const float> logits) {
    const int64_t pos = batch_start + index;
    if (pos < first || pos + 1 >= ctx) return;
    const double lp = token_logprob(logits, window[static_cast<size_t>(pos + 1)], 0).logprob;
    r.nll -= lp;
    nll2 += lp * lp;
    ++r.scored_tokens;
  };
  for (int64_t w = 0; w < windows; ++w) {
    std::copy_n(tokens.begin() + w * ctx, ctx, window.begin());
    if (opts.bos_id >= 0) window[0] = opts.bos_id;
    for (batch_start = 0; batch_start < ctx; batch_start += batch) {
      const int64_t len = std::min(batch, ctx - batch_start);
      // The first half is context only: its logits are not needed.
      const BatchSequence seq{
          .tokens = std::span<const int32_t>(window).subspan(static_cast<size_t>(batch_start),
                                                             static_cast<size_t>(len)),
          .start_pos = batch_start,
          .block_table = table,
          .logits = {},
          .all_logits = batch_start + len > first};
      CLEAVE_RETURN_IF_ERROR(model.forward_batch(std::span<const BatchSequence>(&seq, 1), *kv, hooks));
    }
    ++r.windows;
    const double mean = r.nll / static_cast<double>(r.scored_tokens);
    r.ppl = std::exp(mean);
    if (r.scored_tokens > 1) {
      const double var = nll2 / static_cast<double>(r.scored_tokens) - mean * mean;
      r.ppl_error = r.ppl * std::sqrt(std::max(0.0, var) / static_cast<double>(r.scored_tokens - 1));
    }
    if (progress) progress(r, windows);
  }
  return r;
}

}  // namespace cleave
