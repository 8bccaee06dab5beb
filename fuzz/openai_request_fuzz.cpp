// libFuzzer target: the OpenAI request parsers over arbitrary bytes must return a request or an
// ApiError, never crash, hang or leak; everything the router would write back (the error
// object, response bodies and stream chunks built from the parsed text) must be valid JSON.
// Seeds: small valid requests of both endpoints (see fuzz/README.md).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cleave/router/openai_protocol.h"

namespace {

using namespace cleave::openai;

void require_json(const std::string& text) {
  if (nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false).is_discarded())
    __builtin_trap();
}

void require_sse(const std::string& text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = text.find("\n\n", pos);
    if (end == std::string::npos || text.compare(pos, 6, "data: ") != 0) __builtin_trap();
    const std::string data = text.substr(pos + 6, end - pos - 6);
    if (data.find('\n') != std::string::npos) __builtin_trap();
    if (data != "[DONE]") require_json(data);
    pos = end + 2;
  }
}

// Echoes `text` back through every writer the router uses, as a model's output would be.
void write_back(Endpoint endpoint, std::string_view model, const std::string& text,
                const cleave::SamplingParams& params) {
  ChoiceOutput choice;
  choice.text = text;
  choice.finish_reason = cleave::FinishReason::kStop;
  if (params.logprobs >= 0) {
    LogprobToken t{text, -0.5f, {{text, -0.5f}, {text.substr(0, text.size() / 2), -1.0f}}};
    choice.logprobs = std::vector<LogprobToken>{t, t};
  }
  const ChoiceOutput choices[] = {choice};
  require_json(endpoint == Endpoint::kChatCompletions
                   ? chat_completion_response_json("id", 1, model, choices, Usage{1, 2, 0})
                   : completion_response_json("id", 1, model, choices, Usage{1, 2, 0}));
  StreamEncoder enc(endpoint, "id", 1, model, 1, params.logprobs >= 0);
  std::string out;
  enc.append_chunk(out, 0, text.substr(0, text.size() / 3),
                   choice.logprobs ? std::span<const LogprobToken>(*choice.logprobs)
                                   : std::span<const LogprobToken>{});
  enc.append_chunk(out, 0, text.substr(text.size() / 3), {}, cleave::FinishReason::kLength);
  enc.append_usage(out, Usage{});
  out += kSseDone;
  require_sse(out);
}

void resolve(const SamplingFields& fields, Endpoint endpoint) {
  for (int64_t prompt_tokens : {int64_t{0}, int64_t{100}, int64_t{4096}}) {
    auto r = resolve_sampling_params(fields, endpoint, prompt_tokens, 4096, 512, 7);
    if (!r.ok()) require_json(r.error().to_json());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);

  std::string literal;
  append_json_string(literal, body);
  require_json(literal);

  RequestLimits limits;
  limits.vocab_size = 512;
  auto completion = parse_completion_request(body, limits);
  if (completion.ok()) {
    resolve(completion->sampling, Endpoint::kCompletions);
    for (const Prompt& p : completion->prompts)
      write_back(Endpoint::kCompletions, completion->model, p.text, completion->sampling.params);
  } else {
    require_json(completion.error().to_json());
  }

  auto chat = parse_chat_completion_request(body, limits);
  if (chat.ok()) {
    resolve(chat->sampling, Endpoint::kChatCompletions);
    for (const ChatMessage& m : chat->messages)
      write_back(Endpoint::kChatCompletions, chat->model, m.content.value_or(""),
                 chat->sampling.params);
    if (!chat->chat_template_kwargs_json.empty()) require_json(chat->chat_template_kwargs_json);
  } else {
    require_json(chat.error().to_json());
  }
  return 0;
}
