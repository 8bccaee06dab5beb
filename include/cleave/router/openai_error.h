// OpenAI error objects: what the router answers instead of a completion, before any stream has
// opened, or as the last event of a stream that fails after it opened.
//
// Body: {"error":{"message":...,"type":...,"param":...,"code":...}} (param and code null when
// empty). The HTTP status is what the official `openai` client turns into its typed exceptions:
//   400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError,
//   422 UnprocessableEntityError, 429 RateLimitError, >= 500 InternalServerError; other codes
//   (413) an APIStatusError. The type/code strings follow the OpenAI API's own:
//   type "invalid_request_error" for every client mistake (400/401/404/413),
//   "rate_limit_error" (429), "server_error" (500/503/504).
//
// Thread-safety: plain values; the functions are pure.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "cleave/common/status.h"

namespace cleave::openai {

enum class Endpoint : uint8_t {
  kCompletions,      // POST /v1/completions
  kChatCompletions,  // POST /v1/chat/completions
};

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the request field at fault ("temperature", "messages[2].role"); "" = null
  std::string code;   // machine-readable reason ("context_length_exceeded"); "" = null

  // {"error":{"message","type","param","code"}}
  std::string to_json() const;
};

// A value or the ApiError that answers the request instead.
template <typename T>
class [[nodiscard]] ApiResult {
 public:
  ApiResult(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  ApiResult(ApiError error) : v_(std::move(error)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const ApiError& error() const { return std::get<ApiError>(v_); }

 private:
  std::variant<T, ApiError> v_;
};

// 400 invalid_request_error.
ApiError invalid_request(std::string message, std::string param = {}, std::string code = {});

// 400: the body is not JSON (`detail` says where), or not a JSON object.
ApiError malformed_json(std::string_view detail);

// 400 code "context_length_exceeded", param "messages" (chat) or "prompt" (completions), with
// the message OpenAI and vLLM give:
//   completion_tokens set: "This model's maximum context length is N tokens. However, you
//     requested M tokens (P in the messages, C in the completion). Please reduce the length of
//     the messages or completion."   (completions: "P in your prompt; C for the completion")
//   completion_tokens absent (the prompt alone leaves no room): "This model's maximum context
//     length is N tokens. However, your messages resulted in P tokens. Please reduce the length
//     of the messages."   (completions: "your prompt resulted in")
ApiError context_length_exceeded(Endpoint endpoint, int64_t max_model_len, int64_t prompt_tokens,
                                 std::optional<int64_t> completion_tokens);

// 401 code "invalid_api_key": `missing` when there was no bearer token at all.
ApiError invalid_api_key(bool missing);

// 404 code "model_not_found", param "model".
ApiError model_not_found(std::string_view model);

// 404 for a path the router does not serve (OpenAI: "Invalid URL (POST /v1/foo)").
ApiError unknown_route(std::string_view method, std::string_view path);

// 405 for a known path with the wrong method.
ApiError method_not_allowed(std::string_view method, std::string_view path);

// 413 code "request_too_large".
ApiError body_too_large(uint64_t limit_bytes);

// 429 type "rate_limit_error", code "queue_full": the router's queue holds `limit` requests.
ApiError queue_full(int64_t limit);

// 503 type "server_error", code "service_unavailable": no worker can take the request.
ApiError no_worker_available(std::string_view detail);

// 500 type "server_error".
ApiError internal_error(std::string_view detail);

// The one Status -> HTTP conversion: InvalidArgument / OutOfRange / FailedPrecondition 400,
// Unauthenticated 401, PermissionDenied 403, NotFound 404, ResourceExhausted 429,
// Unavailable 503, DeadlineExceeded 504, everything else 500. The message is the Status's.
ApiError from_status(const Status& status);

}  // namespace cleave::openai
