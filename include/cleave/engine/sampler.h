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

namespace cleave {

inline constexpr int32_t kMaxLogprobs = 20;     // as vLLM's default max_logprobs
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr float kGreedyTemperature = 1e-5f;  // temperature below this: argmax

struct SamplingParams {
  float temperature = 1.0f;  // < 1e-5 (use 0): greedy (argmax; ties go to the lowest id)
  int32_t top_k = 0;         // 0 or -1: off; >= vocab: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  uint64_t seed = 0;
  float repetition_penalty = 1.0f;  // 1: off (as HF/vLLM: logit / p if > 0 else logit * p)
  float presence_penalty = 0.0f;    // OpenAI semantics, over generated tokens
  float frequency_penalty = 0.0f;
  int32_t logprobs = -1;            // -1: none; N >= 0: the chosen token's logprob + top N
  // -1: none; N >= 0: each prompt token's logprob (given the tokens before it; none for the
  // first) and the top N at its position, as vLLM's prompt_logprobs (see prompt_token_logprobs).
  int32_t prompt_logprobs = -1;
  std::vector<std::string> stop;    // stop strings (not included in the output)
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;           // EOS and stop tokens are suppressed before this many

  // InvalidArgument naming the field when a value is out of range:
  //   temperature finite and >= 0; top_p in (0, 1]; top_k -1, 0 or >= 1; min_p in [0, 1];
  //   presence/frequency_penalty in [-2, 2]; repetition_penalty finite and > 0;
  //   logprobs and prompt_logprobs in [-1, 20]; max_tokens >= 1; 0 <= min_tokens <= max_tokens;
  //   at most 16 stop strings, none empty; stop_token_ids in [0, vocab_size).
  Status validate(int32_t vocab_size) const;
};

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
