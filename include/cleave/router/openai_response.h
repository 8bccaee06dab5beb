// Non-streaming OpenAI response bodies (text_completion, chat.completion, the model list) and
// the pieces the streaming encoder shares with them (usage, logprobs, finish reasons, ids).
//
// Shapes (OpenAI's field names):
//   completion: {"id":"cmpl-…","object":"text_completion","created":S,"model":M,
//                "choices":[{"index","text","logprobs","finish_reason"}],"usage":U}
//     logprobs: null, or {"tokens":[…],"token_logprobs":[…],"top_logprobs":[{text: lp}…],
//                         "text_offset":[…]}; top_logprobs holds the top N and the chosen token
//                         (so up to N+1 entries, as OpenAI and vLLM give).
//   chat:       {"id":"chatcmpl-…","object":"chat.completion","created":S,"model":M,
//                "choices":[{"index","message":{"role":"assistant","content"},"logprobs",
//                            "finish_reason"}],"usage":U}
//     logprobs: null, or {"content":[{"token","logprob","bytes":[…],
//                                     "top_logprobs":[{"token","logprob","bytes"}…]}…]}
//   usage:      {"prompt_tokens","completion_tokens","total_tokens",
//                "prompt_tokens_details":{"cached_tokens"}}
// All text goes through append_json_escaped: invalid UTF-8 becomes U+FFFD, never invalid JSON
// (a chat logprob's "bytes" keeps the raw bytes).
//
// Thread-safety: pure functions (random_request_id uses a thread_local generator).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/request/request.h"
#include "cleave/router/openai_error.h"

namespace cleave::openai {

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from the prefix cache
};

struct LogprobAlternative {
  std::string token;  // the token's text (its piece; may be a partial UTF-8 sequence)
  float logprob = 0;
};

// One generated token with its log-probability and the most likely alternatives (most likely
// first), all under the raw distribution (see sampler.h).
struct LogprobToken {
  std::string token;
  float logprob = 0;
  std::vector<LogprobAlternative> top;
  // false: no log-probability (an echoed prompt's first token): its token_logprobs and
  // top_logprobs entries are null (completions only).
  bool has_logprob = true;
};

// One finished choice of a non-streaming response.
struct ChoiceOutput {
  int32_t index = 0;
  std::string text;  // completions with echo: the prompt's text followed by the generated text
  FinishReason finish_reason = FinishReason::kLength;
  // Present when the request asked for logprobs (then "logprobs" is an object, else null).
  std::optional<std::vector<LogprobToken>> logprobs;
};

// "stop", "length"; a cancelled choice reports "abort" (vLLM's word; OpenAI has none).
std::string_view finish_reason_text(FinishReason reason);

// `prefix` + 32 random hex digits, e.g. random_request_id("chatcmpl-").
std::string random_request_id(std::string_view prefix);
// A random 64-bit value for requests that carry no seed (see resolve_sampling_params).
uint64_t random_seed();

std::string completion_response_json(std::string_view id, int64_t created, std::string_view model,
                                     std::span<const ChoiceOutput> choices, const Usage& usage);
std::string chat_completion_response_json(std::string_view id, int64_t created,
                                          std::string_view model,
                                          std::span<const ChoiceOutput> choices,
                                          const Usage& usage);

// Appends the usage object.
void append_usage_json(std::string& out, const Usage& usage);

// Appends the "logprobs" value of `tokens`: the completions object, whose text_offset values
// start at `text_offset` (code points, as Python's len()), or the chat {"content":[…]} object.
void append_completion_logprobs_json(std::string& out, std::span<const LogprobToken> tokens,
                                     int64_t text_offset);
void append_chat_logprobs_json(std::string& out, std::span<const LogprobToken> tokens);

struct ModelCard {
  std::string id;
  int64_t created = 0;
  std::string owned_by = "cleave";
  int64_t max_model_len = 0;  // 0: left out
};

// GET /v1/models: {"object":"list","data":[{"id","object":"model","created","owned_by",
// "root","parent":null,"max_model_len"}…]}
std::string models_response_json(std::span<const ModelCard> models);

}  // namespace cleave::openai
