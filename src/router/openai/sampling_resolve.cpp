// The final SamplingParams of a request once its prompt length is known.
#include <algorithm>

#include <fmt/format.h>

#include "cleave/router/openai_request.h"

namespace cleave::openai {
namespace {

constexpr int64_t kCompletionsDefaultMaxTokens = 16;  // OpenAI's and vLLM's default

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// "sampling parameter 'top_p' must ..." -> "top_p".
std::string param_of(const std::string& message) {
  const size_t open = message.find('\'');
  if (open == std::string::npos) return {};
  const size_t close = message.find('\'', open + 1);
  if (close == std::string::npos) return {};
  return message.substr(open + 1, close - open - 1);
}

}  // namespace

ApiResult<SamplingParams> resolve_sampling_params(const SamplingFields& fields, Endpoint endpoint,
                                                  int64_t prompt_tokens, int64_t max_model_len,
                                                  int32_t vocab_size, uint64_t default_seed) {
  if (prompt_tokens >= max_model_len) {
    return context_length_exceeded(endpoint, max_model_len, prompt_tokens, fields.max_tokens);
  }
  const int64_t room = max_model_len - prompt_tokens;
  int64_t max_tokens = 0;
  if (fields.max_tokens) {
    if (*fields.max_tokens > room) {
      return context_length_exceeded(endpoint, max_model_len, prompt_tokens, fields.max_tokens);
    }
    max_tokens = *fields.max_tokens;
  } else {
    max_tokens = endpoint == Endpoint::kCompletions ? std::min(kCompletionsDefaultMaxTokens, room)
                                                    : room;
  }
  SamplingParams params = fields.params;
  params.max_tokens = static_cast<int32_t>(std::min<int64_t>(max_tokens, INT32_MAX));
  if (params.min_tokens > params.max_tokens) {
    return invalid_request(
        fmt::format("Invalid value for 'min_tokens': {} (must not exceed max_tokens = {}{}).",
                    params.min_tokens, params.max_tokens,
                    fields.max_tokens ? "" : ", the default for this prompt"),
        "min_tokens");
  }
  params.seed = fields.seed.value_or(default_seed);
  if (vocab_size > 0) {
    if (Status s = params.validate(vocab_size); !s.ok()) {
      return invalid_request(s.message(), param_of(s.message()));
    }
  }
  return params;
}

uint64_t choice_seed(uint64_t request_seed, int32_t index) {
  if (index == 0) return request_seed;
  return mix64(request_seed ^ mix64(static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull));
}

}  // namespace cleave::openai
