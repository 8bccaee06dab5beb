// The sampling parameters of one request: what the router resolves from an API request, sends
// over the control plane (v1::SamplingParams) and the engine samples with
// (engine/sampler.h). Plain data with one check; no dependency on the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
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

}  // namespace cleave
