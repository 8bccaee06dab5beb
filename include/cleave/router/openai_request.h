// Typed, validated OpenAI requests: POST /v1/completions and POST /v1/chat/completions bodies.
//
// parse_*_request takes the raw body and returns the request or the 400 that answers it
// (ApiError with `param` naming the field, e.g. "temperature", "messages[1].content[0].type",
// and a message naming the field and the value). Rules:
//   - The body must be a JSON object, nested at most RequestLimits::max_json_depth deep.
//   - Unknown top-level fields are rejected ("Unrecognized request argument supplied: foo",
//     param "foo"), as the OpenAI API does. OpenAI fields this server does not implement are
//     accepted only with a value that asks for nothing (null, false, {}, [], "none"...), else
//     400 "... is not supported"; e.g. `suffix`, `tools`, `logit_bias`, `response_format`
//     json modes, `best_of` != n, `echo` with `logprobs` when streaming.
//   - null means "absent" for every optional field; a field with value null asks for nothing
//     and is ignored even when unknown.
//   - Integers may be written as integral floats (16.0); booleans are never numbers.
//   - Ranges (as vLLM): temperature >= 0, top_p in (0, 1], top_k -1 / 0 (off) or >= 1,
//     min_p in [0, 1], presence/frequency_penalty in [-2, 2], repetition_penalty > 0,
//     max_tokens / max_completion_tokens >= 1 (0 with echo: score the prompt only), min_tokens >= 0 and <= max_tokens, n in
//     [1, max_n], logprobs (completions) and top_logprobs (chat) in [0, max_logprobs], at most
//     max_stop stop strings, stop_token_ids and prompt token ids in [0, vocab_size).
//   - vLLM's extra fields are accepted: top_k, min_p, repetition_penalty, stop_token_ids,
//     ignore_eos, min_tokens; chat also add_generation_prompt, continue_final_message,
//     chat_template_kwargs.
// Limits that need the tokenized prompt (context length, the default max_tokens) are applied
// afterwards by resolve_sampling_params.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/request/sampling_params.h"
#include "cleave/router/openai_error.h"

namespace cleave::openai {

struct RequestLimits {
  int32_t max_n = 16;                   // choices per prompt
  int32_t max_logprobs = kMaxLogprobs;  // logprobs / top_logprobs
  size_t max_stop = kMaxStopStrings;
  size_t max_stop_token_ids = 256;
  size_t max_prompts = 64;              // prompts in one completions request
  size_t max_messages = 4096;
  int32_t vocab_size = 0;               // > 0: token ids must be below it
  int max_json_depth = 64;
};

struct StreamOptions {
  bool include_usage = false;  // a last chunk with empty choices and the usage
};

// The generation fields both endpoints share, validated. `params` holds everything but
// max_tokens and seed, which resolve_sampling_params fills in once the prompt length is known.
struct SamplingFields {
  SamplingParams params;
  std::optional<int32_t> max_tokens;  // max_completion_tokens when given, else max_tokens
  std::optional<uint64_t> seed;       // negative seeds are taken modulo 2^64
};

// One prompt of a completions request: text to tokenize, or token ids to use as they are.
struct Prompt {
  bool is_token_ids = false;
  std::string text;
  std::vector<int32_t> token_ids;  // not empty when is_token_ids
};

struct CompletionRequest {
  std::string model;            // "" when absent: the server's default model
  std::vector<Prompt> prompts;  // at least one; choice index = prompt index * n + i
  int32_t n = 1;
  bool echo = false;            // the prompt's text precedes each choice's text; with logprobs,
                                // the prompt's tokens and logprobs (sampling.params
                                // .prompt_logprobs = logprobs) precede the generated ones
  bool echo_only = false;       // max_tokens 0 with echo: the prompt alone, nothing generated
  bool stream = false;
  StreamOptions stream_options;
  std::string user;
  SamplingFields sampling;      // params.logprobs: the `logprobs` field (-1: null)
};

struct ChatMessage {
  std::string role;                    // "system", "user", "assistant" or "tool"
                                       // ("developer" is taken as "system")
  std::optional<std::string> content;  // text parts joined with "\n"; nullopt only for an
                                       // assistant message sent with content null
  std::string name;                    // "" when absent
  std::string tool_call_id;            // "" when absent (role "tool")
};

struct ChatCompletionRequest {
  std::string model;
  std::vector<ChatMessage> messages;  // at least one
  int32_t n = 1;
  bool stream = false;
  StreamOptions stream_options;
  std::string user;
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  std::string chat_template_kwargs_json;  // "" or the serialized JSON object the client sent
  SamplingFields sampling;  // params.logprobs: top_logprobs (0 when absent) if logprobs is
                            // true, else -1
};

ApiResult<CompletionRequest> parse_completion_request(std::string_view body,
                                                      const RequestLimits& limits = {});
ApiResult<ChatCompletionRequest> parse_chat_completion_request(std::string_view body,
                                                               const RequestLimits& limits = {});

// The SamplingParams for one prompt of `prompt_tokens` tokens on a model with `max_model_len`
// positions:
//   - 400 context_length_exceeded when the prompt leaves no room for one token, or when an
//     explicit max_tokens does not fit (prompt_tokens + max_tokens > max_model_len);
//   - without max_tokens: completions 16 (OpenAI's default), chat all the room left, either
//     capped at the room left;
//   - 400 (param "min_tokens") when min_tokens exceeds the resulting max_tokens;
//   - seed: the request's, else `default_seed` (the router assigns one to every request, so
//     that a request can resume on another worker with the same text);
//   - finally SamplingParams::validate(vocab_size) when vocab_size > 0.
ApiResult<SamplingParams> resolve_sampling_params(const SamplingFields& fields, Endpoint endpoint,
                                                  int64_t prompt_tokens, int64_t max_model_len,
                                                  int32_t vocab_size, uint64_t default_seed);

// The seed of choice `index` of a request with n > 1: the request seed for index 0, a fixed
// mix of (seed, index) for the others, so that choices differ and each stays reproducible.
uint64_t choice_seed(uint64_t request_seed, int32_t index);

}  // namespace cleave::openai
