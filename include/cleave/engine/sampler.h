// Token sampling. Stateless by design: the random draw for a token is a pure function of
// (seed, position), so a request can resume on another worker and continue with exactly the
// text it would have produced (DESIGN.md "Resumable sampling").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cleave/common/status.h"

namespace cleave {

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy (argmax; ties go to the lowest id)
  int32_t top_k = 0;         // 0 or <0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  uint64_t seed = 0;
  float repetition_penalty = 1.0f;  // 1: off (as HF/vLLM: logit / p if > 0 else logit * p)
  float presence_penalty = 0.0f;    // OpenAI semantics, over generated tokens
  float frequency_penalty = 0.0f;
  int32_t logprobs = -1;            // -1: none; N >= 0: the chosen token's logprob + top N
  std::vector<std::string> stop;    // stop strings (not included in the output)
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;           // EOS and stop tokens are suppressed before this many

  // InvalidArgument naming the field when a value is out of range.
  Status validate(int32_t vocab_size) const;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0;                 // of the chosen token under the unmodified distribution
  std::vector<TokenLogprob> top;     // top-N alternatives (when params.logprobs > 0)
};

// Samples one token from `logits` (modified in place: penalties, temperature).
// `prompt_tokens` and `generated` feed the penalties (repetition over both; presence and
// frequency over generated only). `position` is the index of the token being sampled in the
// sequence; with `seed` it fixes the random draw. `n_generated` gates min_tokens.
// `suppress` lists ids that must not be chosen (EOS before min_tokens).
SampleResult sample_token(std::span<float> logits, const SamplingParams& params,
                          std::span<const int32_t> prompt_tokens,
                          std::span<const int32_t> generated, uint64_t position,
                          std::span<const int32_t> suppress = {});

// The uniform draw in [0, 1) used for (seed, position): a counter-based hash, no state.
double sampling_uniform(uint64_t seed, uint64_t position);

// Finds stop strings in streamed text. push() returns how much of the text so far is safe to
// emit (cannot be the start of a stop string) and whether a stop string matched; on a match the
// text is cut before it.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  struct Update {
    std::string emit;   // text now safe to send
    bool stopped = false;
    std::string matched;  // the stop string that matched
  };
  Update push(std::string_view text);
  // End of generation: whatever is held back is emitted.
  std::string flush();

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

}  // namespace cleave
