// POST /v1/chat/completions request bodies.
#include <fmt/format.h>

#include "request_fields.h"

namespace cleave::openai {
namespace {

using detail::Check;
using detail::json;

// content: a string, or an array of {"type": "text", "text": ...} parts joined with "\n" (as
// vLLM joins text parts for string-content templates).
Check read_content(const json& v, const std::string& param, std::string* out) {
  if (v.is_string()) {
    *out = v.get<std::string>();
    return std::nullopt;
  }
  if (!v.is_array()) return detail::type_error(param, "a string or an array of content parts", v);
  out->clear();
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string part_param = fmt::format("{}[{}]", param, i);
    const json& part = v[i];
    if (!part.is_object()) return detail::type_error(part_param, "a content part object", part);
    const auto type = part.find("type");
    if (type == part.end() || type->is_null()) {
      return invalid_request(fmt::format("Missing required parameter: '{}.type'.", part_param),
                             part_param + ".type");
    }
    if (!type->is_string()) return detail::type_error(part_param + ".type", "a string", *type);
    if (*type != "text") {
      return detail::unsupported(part_param + ".type", *type,
                                 "only text content parts are supported");
    }
    std::string text;
    bool have_text = false;
    for (const auto& [key, value] : part.items()) {
      if (key == "type") continue;
      if (key == "text") {
        CLEAVE_OPENAI_CHECK(detail::read_string(value, part_param + ".text", &text));
        have_text = true;
      } else {
        return detail::unknown_field(part_param + "." + key);
      }
    }
    if (!have_text) {
      return invalid_request(fmt::format("Missing required parameter: '{}.text'.", part_param),
                             part_param + ".text");
    }
    if (i > 0) out->push_back('\n');
    out->append(text);
  }
  return std::nullopt;
}

// Message fields that carry nothing this server uses: accepted when null or empty, so that a
// client can send back the assistant message object it received.
bool is_empty_value(const json& v) {
  return v.is_null() || ((v.is_array() || v.is_object() || v.is_string()) && v.empty());
}

Check read_message(const json& v, size_t index, ChatMessage* out) {
  const std::string param = fmt::format("messages[{}]", index);
  if (!v.is_object()) return detail::type_error(param, "a message object", v);
  const auto role = v.find("role");
  if (role == v.end() || role->is_null()) {
    return invalid_request(fmt::format("Missing required parameter: '{}.role'.", param),
                           param + ".role");
  }
  CLEAVE_OPENAI_CHECK(detail::read_string(*role, param + ".role", &out->role));
  if (out->role == "developer") out->role = "system";  // OpenAI's newer name for it
  if (out->role != "system" && out->role != "user" && out->role != "assistant" &&
      out->role != "tool") {
    return detail::range_error(param + ".role", *role,
                               "must be one of 'system', 'developer', 'user', 'assistant', "
                               "'tool'");
  }
  bool have_content = false;
  for (const auto& [key, value] : v.items()) {
    const std::string field = param + "." + key;
    if (key == "role") continue;
    if (key == "content") {
      if (value.is_null()) continue;
      std::string text;
      CLEAVE_OPENAI_CHECK(read_content(value, field, &text));
      out->content = std::move(text);
      have_content = true;
    } else if (key == "name") {
      if (!value.is_null()) CLEAVE_OPENAI_CHECK(detail::read_string(value, field, &out->name));
    } else if (key == "tool_call_id") {
      if (!value.is_null())
        CLEAVE_OPENAI_CHECK(detail::read_string(value, field, &out->tool_call_id));
    } else if (key == "tool_calls" || key == "function_call" || key == "refusal" ||
               key == "annotations" || key == "audio" || key == "reasoning_content") {
      if (!is_empty_value(value)) {
        return detail::unsupported(field, value, key == "tool_calls" || key == "function_call"
                                                     ? "tool calling is not supported"
                                                     : std::string_view{});
      }
    } else {
      return detail::unknown_field(field);
    }
  }
  if (!have_content && out->role != "assistant") {
    return invalid_request(
        fmt::format("Missing required parameter: '{}.content' (a {} message needs content).",
                    param, out->role),
        param + ".content");
  }
  return std::nullopt;
}

Check read_messages(const json& v, const RequestLimits& limits, std::vector<ChatMessage>* out) {
  if (!v.is_array()) return detail::type_error("messages", "an array of messages", v);
  if (v.empty()) return invalid_request("'messages' must not be empty.", "messages");
  if (v.size() > limits.max_messages) {
    return detail::range_error("messages", json(v.size()),
                               fmt::format("a request may hold at most {} messages",
                                           limits.max_messages));
  }
  out->assign(v.size(), ChatMessage{});
  for (size_t i = 0; i < v.size(); ++i) CLEAVE_OPENAI_CHECK(read_message(v[i], i, &(*out)[i]));
  return std::nullopt;
}

// Tool-calling fields: accepted only when they ask for no tool call, since tool calls could
// be neither rendered into the prompt reliably nor parsed out of the output.
Check read_tool_field(const std::string& key, const json& v, bool* handled) {
  *handled = true;
  if (key == "tools" || key == "functions") {
    if (!v.is_array()) return detail::type_error(key, "an array", v);
    if (!v.empty()) return detail::unsupported(key, v, "tool calling is not supported");
    return std::nullopt;
  }
  if (key == "tool_choice" || key == "function_call") {
    if (v == "none" || v == "auto") return std::nullopt;  // with no tools, both mean none
    return detail::unsupported(key, v, "tool calling is not supported");
  }
  if (key == "parallel_tool_calls") {
    bool b = false;
    return detail::read_bool(v, key, &b);
  }
  if (key == "modalities") {
    if (v.is_array() && v.size() == 1 && v[0] == "text") return std::nullopt;
    return detail::unsupported(key, v, "only [\"text\"] is supported");
  }
  if (key == "audio" || key == "prediction" || key == "reasoning_effort" ||
      key == "web_search_options") {
    return detail::unsupported(key, v);  // null was skipped already
  }
  *handled = false;
  return std::nullopt;
}

Check parse_into(const json& doc, const RequestLimits& limits, ChatCompletionRequest* r) {
  detail::CommonFields common{.sampling = &r->sampling,
                              .n = &r->n,
                              .stream = &r->stream,
                              .stream_options = &r->stream_options,
                              .user = &r->user,
                              .model = &r->model};
  bool have_messages = false;
  bool logprobs = false;
  std::optional<int32_t> top_logprobs;
  for (const auto& [key, value] : doc.items()) {
    if (value.is_null()) continue;
    bool handled = false;
    CLEAVE_OPENAI_CHECK(detail::parse_common_field(key, value, limits, &common, &handled));
    if (handled) continue;
    CLEAVE_OPENAI_CHECK(read_tool_field(key, value, &handled));
    if (handled) continue;
    if (key == "messages") {
      CLEAVE_OPENAI_CHECK(read_messages(value, limits, &r->messages));
      have_messages = true;
    } else if (key == "logprobs") {
      CLEAVE_OPENAI_CHECK(detail::read_bool(value, key, &logprobs));
    } else if (key == "top_logprobs") {
      int32_t t = 0;
      CLEAVE_OPENAI_CHECK(detail::read_int32(value, key, 0, limits.max_logprobs, &t));
      top_logprobs = t;
    } else if (key == "add_generation_prompt") {
      CLEAVE_OPENAI_CHECK(detail::read_bool(value, key, &r->add_generation_prompt));
    } else if (key == "continue_final_message") {
      CLEAVE_OPENAI_CHECK(detail::read_bool(value, key, &r->continue_final_message));
    } else if (key == "chat_template_kwargs") {
      if (!value.is_object()) return detail::type_error(key, "an object", value);
      r->chat_template_kwargs_json = value.dump(-1, ' ', false, json::error_handler_t::replace);
    } else {
      return detail::unknown_field(key);
    }
  }
  if (!have_messages) {
    return invalid_request("Missing required parameter: 'messages'.", "messages");
  }
  CLEAVE_OPENAI_CHECK(detail::finish_common(common));
  if (top_logprobs && *top_logprobs > 0 && !logprobs) {
    return invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs");
  }
  r->sampling.params.logprobs = logprobs ? top_logprobs.value_or(0) : -1;
  if (r->continue_final_message && r->add_generation_prompt) {
    return invalid_request(
        "'continue_final_message' and 'add_generation_prompt' cannot both be true (set "
        "add_generation_prompt to false to continue the final message).",
        "continue_final_message");
  }
  if (r->continue_final_message && r->messages.back().role != "assistant") {
    return invalid_request(
        "'continue_final_message' needs the last message to be an assistant message.",
        "continue_final_message");
  }
  return std::nullopt;
}

}  // namespace

ApiResult<ChatCompletionRequest> parse_chat_completion_request(std::string_view body,
                                                               const RequestLimits& limits) {
  auto doc = detail::parse_body(body, limits.max_json_depth);
  if (!doc.ok()) return doc.error();
  ChatCompletionRequest r;
  if (auto err = parse_into(*doc, limits, &r)) return std::move(*err);
  return r;
}

}  // namespace cleave::openai
