// Token sampling. Stateless by design: the random draw for a token is a pure function of
// (seed, position), so a request can resume on another worker and continue with exactly the
// text it would have produced (DESIGN.md "Resumable sampling").
//
// Order of operations (as vLLM applies them), in sample_token:
//   1. logprobs (when requested) from log_softmax of the RAW logits: before penalties,
//      suppression and temperature. This is vLLM's default ("raw_logprobs") and what OpenAI
//      reports: the model's own distribution, independent of the sampling knobs.
//   2. penalties: repetition over prompt + generated (HF/vLLM: logit / p if logit > 0, else
//      logit * p), then frequency and presence over generated only (OpenAI:
//      logit -= frequency * count + presence * (count > 0)). Each distinct token once.
//   3. suppressed ids -> -inf.
//   4. temperature < 1e-5 (vLLM's epsilon; 0 in practice): argmax, ties to the lowest id.
//      Otherwise logits /= temperature.
//   5. top-k, then top-p (keep the smallest prefix, in the order below, whose probability mass
//      reaches top_p; at least one token), then min-p (keep p >= min_p * p_max).
//   6. inverse CDF over the kept tokens, renormalised, with u = sampling_uniform(seed, position),
//      walking them in a fixed order: logit descending, ties by id ascending.
// Sorting is partial and incremental (top candidates are selected with nth_element in growing
// chunks), so a small top_k or a peaked distribution costs O(V), not O(V log V).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/request/sampling_params.h"

namespace cleave {

// SamplingParams, kMaxLogprobs, kMaxStopStrings and kGreedyTemperature: request/sampling_params.h.

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

struct SampleResult {
  int32_t token = 0;
  // Log-probability of the chosen token under the raw (unmodified) distribution; filled when
  // params.logprobs >= 0, else 0.
  float logprob = 0;
  // The params.logprobs most likely tokens under the raw distribution, most likely first
  // (ties by id ascending); empty when params.logprobs <= 0.
  std::vector<TokenLogprob> top;
};

// Samples one token from `logits` (modified in place by penalties and suppression; temperature
// is applied to a scratch copy, so `logits` ends as the penalised, unscaled logits).
// `prompt_tokens` and `generated` feed the penalties (repetition over both; presence and
// frequency over generated only); ids outside [0, logits.size()) are ignored. `position` is the
// index of the token being sampled in the sequence; with `params.seed` it fixes the random
// draw. `suppress` lists ids that must not be chosen (see tokens_to_suppress). NaN logits are
// never chosen. If every logit is -inf or NaN the result is token 0 (callers validate params so
// that suppression never covers the whole vocabulary). `logits` must not be empty.
// Thread-safe: scratch memory is thread_local and reused between calls.
SampleResult sample_token(std::span<float> logits, const SamplingParams& params,
                          std::span<const int32_t> prompt_tokens,
                          std::span<const int32_t> generated, uint64_t position,
                          std::span<const int32_t> suppress = {});

// The log-probability of `token` under log_softmax(logits) (in double, NaN logits left out),
// with the `top_n` most likely ids (ties by id ascending, at most kMaxLogprobs), as sample_token
// reports them: what prompt log-probabilities and perplexity are made of. `token` must be in
// [0, logits.size()).
SampleResult token_logprob(std::span<const float> logits, int32_t token, int32_t top_n);

// The uniform draw in [0, 1) used for (seed, position): a counter-based hash, no state.
//   h = fmix(fmix(seed ^ 0xA0761D6478BD642F) ^ fmix(position + 0x9E3779B97F4A7C15))
//   u = (h >> 11) * 2^-53
// where fmix is splitmix64's finaliser. This is a wire contract between workers: changing it
// changes the text of resumed requests.
double sampling_uniform(uint64_t seed, uint64_t position);

// Ids to pass as `suppress` to sample_token when `n_generated` tokens have been generated:
// before min_tokens, the EOS ids (unless ignore_eos) and stop_token_ids (as vLLM).
std::vector<int32_t> tokens_to_suppress(const SamplingParams& params,
                                        std::span<const int32_t> eos_token_ids,
                                        int32_t n_generated);

// Whether `token`, the n_generated-th generated token (1-based count including it), ends
// generation: an EOS id (unless ignore_eos) or one of stop_token_ids, once n_generated >=
// min_tokens. max_tokens is the caller's loop bound, not checked here.
bool is_stop_token(int32_t token, const SamplingParams& params,
                   std::span<const int32_t> eos_token_ids, int32_t n_generated);

// Finds stop strings in streamed text. push() returns how much of the text so far is safe to
// emit (cannot be the start of a stop string) and whether a stop string matched; on a match the
// text is cut before it, and the stop string is not emitted. Matches spanning several pushes
// are found. When several stop strings occur, the one that completes first (earliest end)
// wins, then the one that starts first (the longer one); this is where streaming generation
// would have stopped. After a stop every push returns nothing and stopped = true. Empty stop
// strings are ignored. Text is treated as bytes; hold-back is cut only where a stop string's
// prefix starts, which for valid UTF-8 stops is a code point boundary.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  struct Update {
    std::string emit;   // text now safe to send
    bool stopped = false;
    std::string matched;  // the stop string that matched
  };
  Update push(std::string_view text);
  // End of generation: whatever is held back is emitted (nothing after a stop).
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace cleave
