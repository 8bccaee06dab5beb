// Non-streaming response bodies, usage and logprobs JSON.
#include <random>

#include "cleave/router/json_writer.h"
#include "cleave/router/openai_response.h"

namespace cleave::openai {
namespace {

void write_bytes(JsonWriter& w, std::string_view text) {
  w.begin_array();
  for (char c : text) w.integer(static_cast<unsigned char>(c));
  w.end_array();
}

void write_header(JsonWriter& w, std::string_view id, std::string_view object, int64_t created,
                  std::string_view model) {
  w.key("id").string(id);
  w.key("object").string(object);
  w.key("created").integer(created);
  w.key("model").string(model);
}

size_t response_reserve(std::span<const ChoiceOutput> choices) {
  size_t n = 256;
  for (const auto& c : choices) n += 128 + c.text.size() + c.text.size() / 8;
  return n;
}

void write_usage(JsonWriter& w, const Usage& usage) {
  w.begin_object();
  w.key("prompt_tokens").integer(usage.prompt_tokens);
  w.key("completion_tokens").integer(usage.completion_tokens);
  w.key("total_tokens").integer(usage.prompt_tokens + usage.completion_tokens);
  w.key("prompt_tokens_details").begin_object();
  w.key("cached_tokens").integer(usage.cached_tokens);
  w.end_object();
  w.end_object();
}

void write_completion_logprobs(JsonWriter& w, std::span<const LogprobToken> tokens,
                               int64_t text_offset) {
  w.begin_object();
  w.key("tokens").begin_array();
  for (const auto& t : tokens) w.string(t.token);
  w.end_array();
  w.key("token_logprobs").begin_array();
  for (const auto& t : tokens) {
    if (t.has_logprob) {
      w.logprob(t.logprob);
    } else {
      w.null();
    }
  }
  w.end_array();
  w.key("top_logprobs").begin_array();
  for (const auto& t : tokens) {
    if (!t.has_logprob) {
      w.null();
      continue;
    }
    // A JSON object keyed by text: two alternatives with the same text keep the first (the
    // more likely); the chosen token is added when it is not among the top N.
    w.begin_object();
    bool chosen_listed = false;
    for (size_t i = 0; i < t.top.size(); ++i) {
      bool dup = false;
      for (size_t j = 0; j < i && !dup; ++j) dup = t.top[j].token == t.top[i].token;
      if (dup) continue;
      chosen_listed |= t.top[i].token == t.token;
      w.key(t.top[i].token).logprob(t.top[i].logprob);
    }
    if (!chosen_listed) w.key(t.token).logprob(t.logprob);
    w.end_object();
  }
  w.end_array();
  w.key("text_offset").begin_array();
  for (const auto& t : tokens) {
    w.integer(text_offset);
    text_offset += utf8_code_points(t.token);
  }
  w.end_array();
  w.end_object();
}

void write_chat_logprobs(JsonWriter& w, std::span<const LogprobToken> tokens) {
  w.begin_object().key("content").begin_array();
  for (const auto& t : tokens) {
    w.begin_object();
    w.key("token").string(t.token);
    w.key("logprob").logprob(t.logprob);
    w.key("bytes");
    write_bytes(w, t.token);
    w.key("top_logprobs").begin_array();
    for (const auto& alt : t.top) {
      w.begin_object();
      w.key("token").string(alt.token);
      w.key("logprob").logprob(alt.logprob);
      w.key("bytes");
      write_bytes(w, alt.token);
      w.end_object();
    }
    w.end_array();
    w.end_object();
  }
  w.end_array().end_object();
}

}  // namespace

std::string_view finish_reason_text(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "abort";
  }
  return "stop";
}

std::string random_request_id(std::string_view prefix) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(prefix);
  id.reserve(prefix.size() + 32);
  for (int half = 0; half < 2; ++half) {
    uint64_t r = random_seed();
    for (int i = 0; i < 16; ++i, r >>= 4) id.push_back(kHex[r & 15]);
  }
  return id;
}

uint64_t random_seed() {
  thread_local std::mt19937_64 rng{[] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }()};
  return rng();
}

std::string completion_response_json(std::string_view id, int64_t created, std::string_view model,
                                     std::span<const ChoiceOutput> choices, const Usage& usage) {
  std::string out;
  out.reserve(response_reserve(choices));
  JsonWriter w(out);
  w.begin_object();
  write_header(w, id, "text_completion", created, model);
  w.key("choices").begin_array();
  for (const auto& c : choices) {
    w.begin_object();
    w.key("index").integer(c.index);
    w.key("text").string(c.text);
    w.key("logprobs");
    if (c.logprobs) {
      write_completion_logprobs(w, *c.logprobs, 0);
    } else {
      w.null();
    }
    w.key("finish_reason").string(finish_reason_text(c.finish_reason));
    w.end_object();
  }
  w.end_array();
  w.key("usage");
  write_usage(w, usage);
  w.end_object();
  return out;
}

std::string chat_completion_response_json(std::string_view id, int64_t created,
                                          std::string_view model,
                                          std::span<const ChoiceOutput> choices,
                                          const Usage& usage) {
  std::string out;
  out.reserve(response_reserve(choices));
  JsonWriter w(out);
  w.begin_object();
  write_header(w, id, "chat.completion", created, model);
  w.key("choices").begin_array();
  for (const auto& c : choices) {
    w.begin_object();
    w.key("index").integer(c.index);
    w.key("message").begin_object();
    w.key("role").string("assistant");
    w.key("content").string(c.text);
    w.end_object();
    w.key("logprobs");
    if (c.logprobs) {
      write_chat_logprobs(w, *c.logprobs);
    } else {
      w.null();
    }
    w.key("finish_reason").string(finish_reason_text(c.finish_reason));
    w.end_object();
  }
  w.end_array();
  w.key("usage");
  write_usage(w, usage);
  w.end_object();
  return out;
}

void append_usage_json(std::string& out, const Usage& usage) {
  JsonWriter w(out);
  write_usage(w, usage);
}

void append_completion_logprobs_json(std::string& out, std::span<const LogprobToken> tokens,
                                     int64_t text_offset) {
  JsonWriter w(out);
  write_completion_logprobs(w, tokens, text_offset);
}

void append_chat_logprobs_json(std::string& out, std::span<const LogprobToken> tokens) {
  JsonWriter w(out);
  write_chat_logprobs(w, tokens);
}

std::string models_response_json(std::span<const ModelCard> models) {
  std::string out;
  JsonWriter w(out);
  w.begin_object();
  w.key("object").string("list");
  w.key("data").begin_array();
  for (const auto& m : models) {
    w.begin_object();
    w.key("id").string(m.id);
    w.key("object").string("model");
    w.key("created").integer(m.created);
    w.key("owned_by").string(m.owned_by);
    w.key("root").string(m.id);
    w.key("parent").null();
    if (m.max_model_len > 0) w.key("max_model_len").integer(m.max_model_len);
    w.end_object();
  }
  w.end_array();
  w.end_object();
  return out;
}

}  // namespace cleave::openai
