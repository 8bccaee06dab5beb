// Perplexity of a token sequence, computed as llama.cpp's llama-perplexity computes it:
//
// The tokens are cut into non-overlapping windows of `ctx` tokens (tokens[i*ctx, (i+1)*ctx) for
// i < tokens.size() / ctx; a remainder shorter than a window is left out). Each window runs from
// position 0 in a fresh KV cache, in forward calls of at most `batch` tokens; when `bos_id` >= 0
// the window's first token is replaced by BOS (as llama.cpp does for models that add BOS). The
// first half of the window (ctx / 2 positions) is context only: the tokens at positions
// ctx/2 + 1 .. ctx - 1 are scored, each by the log-softmax (in double) of the logits at the
// position before it. PPL = exp(mean negative log-likelihood over every scored token); its
// uncertainty is llama.cpp's: PPL * sqrt(var(nll) / (count - 1)).
//
// Errors: InvalidArgument for ctx < 4, batch < 1, a ctx larger than the model's context, a bos_id
// or token outside the vocabulary, or fewer tokens than one window (the message gives both
// counts). The model's KV pool for one window is allocated per call.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "cleave/common/status.h"
#include "cleave/engine/llama_model.h"

namespace cleave {

struct PerplexityOptions {
  int64_t ctx = 512;
  int64_t batch = 0;     // tokens per forward call; 0: ctx
  int32_t bos_id = -1;   // >= 0: each window starts with this token
};

struct PerplexityResult {
  int64_t windows = 0;
  int64_t scored_tokens = 0;
  double nll = 0;          // summed negative log-likelihood (nats)
  double ppl = 0;
  double ppl_error = 0;    // standard error of ppl
};

// Called after each window with the running figures (windows done so far).
using PerplexityProgress = std::function<void(const PerplexityResult& so_far, int64_t windows_total)>;

Result<PerplexityResult> compute_perplexity(LlamaModel& model, std::span<const int32_t> tokens,
                                            const PerplexityOptions& opts,
                                            const PerplexityProgress& progress = {});

}  // namespace cleave
