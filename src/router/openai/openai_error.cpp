// OpenAI error objects and the Status -> HTTP mapping.
#include "cleave/router/openai_error.h"

#include <fmt/format.h>

#include "cleave/router/json_writer.h"

namespace cleave::openai {
namespace {

ApiError make_error(int status, std::string message, std::string type, std::string param,
                    std::string code) {
  ApiError e;
  e.http_status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

}  // namespace

std::string ApiError::to_json() const {
  std::string out;
  out.reserve(96 + message.size());
  JsonWriter w(out);
  w.begin_object().key("error").begin_object();
  w.key("message").string(message);
  w.key("type").string(type);
  w.key("param").string_or_null(param);
  w.key("code").string_or_null(code);
  w.end_object().end_object();
  return out;
}

ApiError invalid_request(std::string message, std::string param, std::string code) {
  return make_error(400, std::move(message), "invalid_request_error", std::move(param),
                    std::move(code));
}

ApiError malformed_json(std::string_view detail) {
  return invalid_request(fmt::format("The request body is not valid JSON: {}", detail));
}

ApiError context_length_exceeded(Endpoint endpoint, int64_t max_model_len, int64_t prompt_tokens,
                                 std::optional<int64_t> completion_tokens) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  std::string message;
  if (completion_tokens) {
    message = chat ? fmt::format(
                         "This model's maximum context length is {} tokens. However, you "
                         "requested {} tokens ({} in the messages, {} in the completion). Please "
                         "reduce the length of the messages or completion.",
                         max_model_len, prompt_tokens + *completion_tokens, prompt_tokens,
                         *completion_tokens)
                   : fmt::format(
                         "This model's maximum context length is {} tokens. However, you "
                         "requested {} tokens ({} in your prompt; {} for the completion). Please "
                         "reduce your prompt; or completion length.",
                         max_model_len, prompt_tokens + *completion_tokens, prompt_tokens,
                         *completion_tokens);
  } else {
    message = fmt::format(
        "This model's maximum context length is {} tokens. However, your {} resulted in {} "
        "tokens. Please reduce the length of the {}.",
        max_model_len, chat ? "messages" : "prompt", prompt_tokens, chat ? "messages" : "prompt");
  }
  return invalid_request(std::move(message), chat ? "messages" : "prompt",
                         "context_length_exceeded");
}

ApiError invalid_api_key(bool missing) {
  return make_error(401,
                    missing ? "You didn't provide an API key. You need to provide your API key in "
                              "an Authorization header using Bearer auth (i.e. Authorization: "
                              "Bearer YOUR_KEY)."
                            : "Incorrect API key provided.",
                    "invalid_request_error", "", "invalid_api_key");
}

ApiError model_not_found(std::string_view model) {
  return make_error(404, fmt::format("The model `{}` does not exist.", model),
                    "invalid_request_error", "model", "model_not_found");
}

ApiError unknown_route(std::string_view method, std::string_view path) {
  return make_error(404, fmt::format("Invalid URL ({} {})", method, path),
                    "invalid_request_error", "", "");
}

ApiError method_not_allowed(std::string_view method, std::string_view path) {
  return make_error(405, fmt::format("Method {} is not allowed for {}", method, path),
                    "invalid_request_error", "", "method_not_allowed");
}

ApiError body_too_large(uint64_t limit_bytes) {
  return make_error(413,
                    fmt::format("The request body is larger than this server's limit of {} bytes.",
                                limit_bytes),
                    "invalid_request_error", "", "request_too_large");
}

ApiError queue_full(int64_t limit) {
  return make_error(429,
                    fmt::format("The server is at capacity: its queue holds {} requests. Please "
                                "retry later.",
                                limit),
                    "rate_limit_error", "", "queue_full");
}

ApiError no_worker_available(std::string_view detail) {
  return make_error(503, fmt::format("No worker is available to serve the request: {}", detail),
                    "server_error", "", "service_unavailable");
}

ApiError internal_error(std::string_view detail) {
  return make_error(500, fmt::format("The server had an error while processing your request: {}",
                                     detail),
                    "server_error", "", "");
}

ApiError from_status(const Status& status) {
  const std::string& m = status.message();
  switch (status.code()) {
    case StatusCode::kOk:
      return internal_error("an OK status was reported as an error");
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
      return invalid_request(m);
    case StatusCode::kUnauthenticated:
      return make_error(401, m, "invalid_request_error", "", "invalid_api_key");
    case StatusCode::kPermissionDenied:
      return make_error(403, m, "invalid_request_error", "", "");
    case StatusCode::kNotFound:
      return make_error(404, m, "invalid_request_error", "", "");
    case StatusCode::kResourceExhausted:
      return make_error(429, m, "rate_limit_error", "", "");
    case StatusCode::kUnavailable:
      return make_error(503, m, "server_error", "", "service_unavailable");
    case StatusCode::kDeadlineExceeded:
      return make_error(504, m, "server_error", "", "timeout");
    default:
      return make_error(500, m, "server_error", "", "");
  }
}

}  // namespace cleave::openai
