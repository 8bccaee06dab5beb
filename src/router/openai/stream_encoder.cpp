// SSE chunks of streamed completions: a precomputed head per stream, the escaped text per chunk.
#include <cassert>

#include "cleave/router/json_writer.h"
#include "cleave/router/openai_stream.h"

namespace cleave::openai {
namespace {

constexpr std::string_view kSseEnd = "\n\n";

// The head every chunk of a stream repeats, up to and including `tail`.
std::string make_head(Endpoint endpoint, std::string_view id, int64_t created,
                      std::string_view model, std::string_view tail) {
  std::string head = "data: {\"id\":";
  append_json_string(head, id);
  head += ",\"object\":";
  head += endpoint == Endpoint::kChatCompletions ? "\"chat.completion.chunk\""
                                                 : "\"text_completion\"";
  head += ",\"created\":";
  append_json_int(head, created);
  head += ",\"model\":";
  append_json_string(head, model);
  head += tail;
  return head;
}

}  // namespace

void append_sse_event(std::string& out, std::string_view json) {
  out += "data: ";
  out += json;
  out += kSseEnd;
}

void append_sse_error(std::string& out, const ApiError& error) {
  append_sse_event(out, error.to_json());
}

StreamEncoder::StreamEncoder(Endpoint endpoint, std::string_view id, int64_t created,
                             std::string_view model, int32_t num_choices, bool logprobs)
    : endpoint_(endpoint),
      logprobs_(logprobs),
      chunk_head_(make_head(endpoint, id, created, model, ",\"choices\":[{\"index\":")),
      usage_head_(make_head(endpoint, id, created, model, ",\"choices\":[],\"usage\":")),
      started_(static_cast<size_t>(num_choices > 0 ? num_choices : 0), 0),
      text_offset_(logprobs && endpoint == Endpoint::kCompletions ? started_.size() : 0, 0) {}

bool StreamEncoder::started(int32_t index) const {
  return index >= 0 && static_cast<size_t>(index) < started_.size() && started_[index];
}

void StreamEncoder::append_chunk(std::string& out, int32_t index, std::string_view text,
                                 std::span<const LogprobToken> logprobs,
                                 std::optional<FinishReason> finish) {
  const bool tracked = index >= 0 && static_cast<size_t>(index) < started_.size();
  assert(tracked && "choice index out of range");
  const bool first = tracked ? !started_[index] : true;
  if (tracked) started_[index] = 1;

  out += chunk_head_;
  append_json_int(out, index);
  if (endpoint_ == Endpoint::kChatCompletions) {
    if (first) {
      out += ",\"delta\":{\"role\":\"assistant\",\"content\":\"";
      append_json_escaped(out, text);
      out += "\"}";
    } else if (!text.empty()) {
      out += ",\"delta\":{\"content\":\"";
      append_json_escaped(out, text);
      out += "\"}";
    } else {
      out += ",\"delta\":{}";
    }
    out += ",\"logprobs\":";
    if (logprobs_) append_chat_logprobs_json(out, logprobs);
    else out += "null";
  } else {
    out += ",\"text\":\"";
    append_json_escaped(out, text);
    out += "\",\"logprobs\":";
    if (logprobs_) {
      int64_t offset = tracked && !text_offset_.empty() ? text_offset_[index] : 0;
      append_completion_logprobs_json(out, logprobs, offset);
      if (tracked && !text_offset_.empty()) text_offset_[index] += utf8_code_points(text);
    } else {
      out += "null";
    }
  }
  out += ",\"finish_reason\":";
  if (finish) {
    out += '"';
    out += finish_reason_text(*finish);
    out += '"';
  } else {
    out += "null";
  }
  out += "}]}";
  out += kSseEnd;
}

void StreamEncoder::append_usage(std::string& out, const Usage& usage) const {
  out += usage_head_;
  append_usage_json(out, usage);
  out += '}';
  out += kSseEnd;
}

}  // namespace cleave::openai
