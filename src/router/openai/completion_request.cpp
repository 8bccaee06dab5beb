// POST /v1/completions request bodies.
#include <fmt/format.h>

#include "request_fields.h"

namespace cleave::openai {
namespace {

using detail::Check;
using detail::json;

// prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids.
Check read_prompts(const json& v, const RequestLimits& limits, std::vector<Prompt>* out) {
  constexpr std::string_view kExpected =
      "a string, an array of strings, an array of token ids or an array of arrays of token ids";
  out->clear();
  if (v.is_string()) {
    out->push_back(Prompt{.is_token_ids = false, .text = v.get<std::string>(), .token_ids = {}});
    return std::nullopt;
  }
  if (!v.is_array()) return detail::type_error("prompt", kExpected, v);
  if (v.empty()) return invalid_request("'prompt' must not be an empty array.", "prompt");
  if (v[0].is_number()) {  // one prompt of token ids
    Prompt p{.is_token_ids = true, .text = {}, .token_ids = {}};
    CLEAVE_OPENAI_CHECK(detail::read_token_ids(v, "prompt", limits.vocab_size, &p.token_ids));
    out->push_back(std::move(p));
    return std::nullopt;
  }
  if (v.size() > limits.max_prompts) {
    return detail::range_error("prompt", json(v.size()),
                               fmt::format("a request may hold at most {} prompts",
                                           limits.max_prompts));
  }
  const bool strings = v[0].is_string();
  out->reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string param = fmt::format("prompt[{}]", i);
    if (strings) {
      if (!v[i].is_string()) return detail::type_error(param, "a string (like prompt[0])", v[i]);
      out->push_back(Prompt{.is_token_ids = false, .text = v[i].get<std::string>(),
                            .token_ids = {}});
      continue;
    }
    if (!v[i].is_array()) {
      return i == 0 ? detail::type_error("prompt", kExpected, v)
                    : detail::type_error(param, "an array of token ids (like prompt[0])", v[i]);
    }
    if (v[i].empty()) return invalid_request(fmt::format("'{}' must not be empty.", param), param);
    Prompt p{.is_token_ids = true, .text = {}, .token_ids = {}};
    CLEAVE_OPENAI_CHECK(detail::read_token_ids(v[i], param, limits.vocab_size, &p.token_ids));
    out->push_back(std::move(p));
  }
  return std::nullopt;
}

Check parse_into(const json& doc, const RequestLimits& limits, CompletionRequest* r) {
  detail::CommonFields common{.sampling = &r->sampling,
                              .n = &r->n,
                              .stream = &r->stream,
                              .stream_options = &r->stream_options,
                              .user = &r->user,
                              .model = &r->model};
  bool have_prompt = false;
  std::optional<int64_t> best_of;
  std::string zero_max_tokens;  // the field that asked for 0 tokens
  for (const auto& [key, value] : doc.items()) {
    if (value.is_null()) continue;
    // max_tokens 0 (with echo): the prompt alone is scored, nothing is generated (as vLLM).
    if ((key == "max_tokens" || key == "max_completion_tokens") && value.is_number_integer() &&
        value.get<int64_t>() == 0) {
      zero_max_tokens = key;
      continue;
    }
    bool handled = false;
    CLEAVE_OPENAI_CHECK(detail::parse_common_field(key, value, limits, &common, &handled));
    if (handled) continue;
    if (key == "prompt") {
      CLEAVE_OPENAI_CHECK(read_prompts(value, limits, &r->prompts));
      have_prompt = true;
    } else if (key == "echo") {
      CLEAVE_OPENAI_CHECK(detail::read_bool(value, key, &r->echo));
    } else if (key == "logprobs") {
      CLEAVE_OPENAI_CHECK(detail::read_int32(value, key, 0, limits.max_logprobs,
                                             &r->sampling.params.logprobs));
    } else if (key == "best_of") {
      int64_t b = 0;
      CLEAVE_OPENAI_CHECK(detail::read_int(value, key, 1, limits.max_n, &b));
      best_of = b;
    } else if (key == "suffix") {
      if (!value.is_string()) return detail::type_error(key, "a string", value);
      if (!value.get_ref<const std::string&>().empty()) return detail::unsupported(key, value);
    } else {
      return detail::unknown_field(key);
    }
  }
  if (!have_prompt) return invalid_request("Missing required parameter: 'prompt'.", "prompt");
  CLEAVE_OPENAI_CHECK(detail::finish_common(common));
  if (best_of && *best_of != r->n) {
    return detail::unsupported("best_of", json(*best_of),
                               fmt::format("only best_of equal to n ({}) is supported", r->n));
  }
  if (!zero_max_tokens.empty()) {
    if (!r->echo) {
      return invalid_request(
          fmt::format("Invalid value for '{}': 0 (must be >= 1; 0 only with echo, to score the "
                      "prompt alone).",
                      zero_max_tokens),
          zero_max_tokens);
    }
    if (r->sampling.max_tokens) {  // max_completion_tokens and max_tokens both given
      return invalid_request(
          fmt::format("'{}' 0 cannot be combined with a non-zero max_tokens.", zero_max_tokens),
          zero_max_tokens);
    }
    r->echo_only = true;
  }
  if (r->echo && r->sampling.params.logprobs >= 0) {
    if (r->stream) {
      return detail::unsupported("echo", json(true),
                                 "echo with logprobs is supported without streaming only");
    }
    r->sampling.params.prompt_logprobs = r->sampling.params.logprobs;
  }
  return std::nullopt;
}

}  // namespace

ApiResult<CompletionRequest> parse_completion_request(std::string_view body,
                                                      const RequestLimits& limits) {
  auto doc = detail::parse_body(body, limits.max_json_depth);
  if (!doc.ok()) return doc.error();
  CompletionRequest r;
  if (auto err = parse_into(*doc, limits, &r)) return std::move(*err);
  return r;
}

}  // namespace cleave::openai
