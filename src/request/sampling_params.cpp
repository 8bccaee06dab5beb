// SamplingParams::validate: the range of every field.
#include "cleave/request/sampling_params.h"

#include <cmath>

#include <fmt/format.h>

namespace cleave {
namespace {

Status field_error(std::string_view field, std::string_view rule, std::string_view got) {
  return InvalidArgument(fmt::format("sampling parameter '{}' {} (got {})", field, rule, got));
}

Status check_range(std::string_view field, float value, float lo, float hi) {
  if (!std::isfinite(value) || value < lo || value > hi) {
    return field_error(field, fmt::format("must be in [{}, {}]", lo, hi), fmt::format("{}", value));
  }
  return Status::Ok();
}

}  // namespace

Status SamplingParams::validate(int32_t vocab_size) const {
  if (vocab_size <= 0) {
    return InvalidArgument(fmt::format("sampling: vocabulary size must be positive (got {})",
                                       vocab_size));
  }
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    return field_error("temperature", "must be finite and >= 0", fmt::format("{}", temperature));
  }
  if (!std::isfinite(top_p) || top_p <= 0.0f || top_p > 1.0f) {
    return field_error("top_p", "must be in (0, 1]", fmt::format("{}", top_p));
  }
  if (top_k < -1) {
    return field_error("top_k", "must be -1 or 0 (off) or >= 1", fmt::format("{}", top_k));
  }
  CLEAVE_RETURN_IF_ERROR(check_range("min_p", min_p, 0.0f, 1.0f));
  CLEAVE_RETURN_IF_ERROR(check_range("presence_penalty", presence_penalty, -2.0f, 2.0f));
  CLEAVE_RETURN_IF_ERROR(check_range("frequency_penalty", frequency_penalty, -2.0f, 2.0f));
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0f) {
    return field_error("repetition_penalty", "must be finite and > 0",
                       fmt::format("{}", repetition_penalty));
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return field_error("logprobs", fmt::format("must be in [0, {}] (or -1: none)", kMaxLogprobs),
                       fmt::format("{}", logprobs));
  }
  if (prompt_logprobs < -1 || prompt_logprobs > kMaxLogprobs) {
    return field_error("prompt_logprobs",
                       fmt::format("must be in [0, {}] (or -1: none)", kMaxLogprobs),
                       fmt::format("{}", prompt_logprobs));
  }
  if (max_tokens < 1) {
    return field_error("max_tokens", "must be >= 1", fmt::format("{}", max_tokens));
  }
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return field_error("min_tokens", fmt::format("must be in [0, max_tokens = {}]", max_tokens),
                       fmt::format("{}", min_tokens));
  }
  if (stop.size() > kMaxStopStrings) {
    return field_error("stop", fmt::format("allows at most {} strings", kMaxStopStrings),
                       fmt::format("{}", stop.size()));
  }
  for (size_t i = 0; i < stop.size(); ++i) {
    if (stop[i].empty()) {
      return InvalidArgument(fmt::format("sampling parameter 'stop' entry {} is empty", i));
    }
  }
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    const int32_t id = stop_token_ids[i];
    if (id < 0 || id >= vocab_size) {
      return InvalidArgument(fmt::format(
          "sampling parameter 'stop_token_ids' entry {} is {}, outside the vocabulary [0, {})",
          i, id, vocab_size));
    }
  }
  return Status::Ok();
}

}  // namespace cleave
