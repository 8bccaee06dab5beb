// Server-sent events for streamed completions: one `data: {json}\n\n` event per chunk, then
// `data: [DONE]\n\n`.
//
// Chunk shapes (OpenAI's):
//   completions: {"id","object":"text_completion","created","model",
//                 "choices":[{"index","text","logprobs","finish_reason"}]}
//   chat:        {"id","object":"chat.completion.chunk","created","model",
//                 "choices":[{"index","delta":{"role"?,"content"?},"logprobs","finish_reason"}]}
//   usage (stream_options.include_usage, after the last content chunk):
//                 {"id","object",…,"choices":[],"usage":{…}}
//   error (a stream that fails after it opened): {"error":{"message","type","param","code"}}
//     — the openai client raises it as an APIError — then [DONE].
// A chat choice's first chunk carries "role":"assistant" together with its first text, so the
// first event a client sees holds the first token (TTFT means the first token). The finish
// reason rides on the choice's last content chunk; a finish with no text left to send gives a
// chunk with "delta":{} (chat) or "text":"" (completions).
//
// Speed: the constant head of every chunk (id, object, created, model) is serialized once per
// stream; a chunk appends that head, the index, the JSON-escaped text and a constant tail to
// the caller's buffer. No allocation once the buffer has grown (logprobs aside), no locks.
//
// Thread-safety: a StreamEncoder belongs to one stream and is used by one thread at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/request/request.h"
#include "cleave/router/openai_error.h"
#include "cleave/router/openai_response.h"

namespace cleave::openai {

inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// Appends `data: ` + json + `\n\n`. `json` must be one line (JsonWriter output always is).
void append_sse_event(std::string& out, std::string_view json);
// Appends the error event of a stream that fails after it opened (follow with kSseDone).
void append_sse_error(std::string& out, const ApiError& error);

class StreamEncoder {
 public:
  // `num_choices`: choices in the response (n times the number of prompts); `logprobs`: the
  // request asked for logprobs, so every content chunk carries a "logprobs" object.
  StreamEncoder(Endpoint endpoint, std::string_view id, int64_t created, std::string_view model,
                int32_t num_choices, bool logprobs);

  // Appends one chunk of choice `index` (0 <= index < num_choices) with `text` (may be empty)
  // and the logprobs of the tokens that produced it, and `finish` when this is the choice's
  // last chunk. Completions logprobs' text_offset counts from the start of the choice's text
  // as streamed so far (an echoed prompt included).
  void append_chunk(std::string& out, int32_t index, std::string_view text,
                    std::span<const LogprobToken> logprobs = {},
                    std::optional<FinishReason> finish = std::nullopt);

  // The usage chunk (choices empty).
  void append_usage(std::string& out, const Usage& usage) const;

  // Whether choice `index` has had a chunk (chat: its role was sent).
  bool started(int32_t index) const;

  Endpoint endpoint() const { return endpoint_; }

 private:
  Endpoint endpoint_;
  bool logprobs_;
  std::string chunk_head_;  // data: {"id":…,"object":…,"created":…,"model":…,"choices":[{"index":
  std::string usage_head_;  // data: {"id":…,"object":…,"created":…,"model":…,"choices":[],"usage":
  std::vector<uint8_t> started_;
  std::vector<int64_t> text_offset_;  // completions with logprobs: code points sent per choice
};

}  // namespace cleave::openai
