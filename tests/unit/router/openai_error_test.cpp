// OpenAI error objects: status, type, param, code and the JSON body of every helper.
#include "cleave/router/openai_error.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace cleave::openai {
namespace {

using nlohmann::json;

// The body parsed back: exactly {"error":{message,type,param,code}}.
json body_of(const ApiError& e) {
  const json j = json::parse(e.to_json());
  EXPECT_EQ(j.size(), 1u);
  EXPECT_TRUE(j.contains("error"));
  EXPECT_EQ(j["error"].size(), 4u);
  EXPECT_TRUE(j["error"]["message"].is_string());
  EXPECT_EQ(j["error"]["type"], e.type);
  return j["error"];
}

TEST(OpenAiErrorTest, InvalidRequestHasParamAndNullCode) {
  const ApiError e = invalid_request("bad temperature", "temperature");
  EXPECT_EQ(e.http_status, 400);
  const json b = body_of(e);
  EXPECT_EQ(b["type"], "invalid_request_error");
  EXPECT_EQ(b["param"], "temperature");
  EXPECT_TRUE(b["code"].is_null());
  const json none = body_of(invalid_request("x"));
  EXPECT_TRUE(none["param"].is_null());
}

TEST(OpenAiErrorTest, MalformedJsonIs400) {
  const ApiError e = malformed_json("parse error at line 1, column 2");
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
  EXPECT_NE(e.message.find("not valid JSON"), std::string::npos);
  EXPECT_NE(e.message.find("line 1, column 2"), std::string::npos);
}

TEST(OpenAiErrorTest, ContextLengthExceededGivesBothNumbers) {
  const ApiError chat = context_length_exceeded(Endpoint::kChatCompletions, 4096, 4000, 200);
  EXPECT_EQ(chat.http_status, 400);
  EXPECT_EQ(chat.type, "invalid_request_error");
  EXPECT_EQ(chat.code, "context_length_exceeded");
  EXPECT_EQ(chat.param, "messages");
  EXPECT_EQ(chat.message,
            "This model's maximum context length is 4096 tokens. However, you requested 4200 "
            "tokens (4000 in the messages, 200 in the completion). Please reduce the length of "
            "the messages or completion.");
  const ApiError comp = context_length_exceeded(Endpoint::kCompletions, 512, 500, 100);
  EXPECT_EQ(comp.param, "prompt");
  EXPECT_EQ(comp.message,
            "This model's maximum context length is 512 tokens. However, you requested 600 "
            "tokens (500 in your prompt; 100 for the completion). Please reduce your prompt; or "
            "completion length.");
  const ApiError only_prompt = context_length_exceeded(Endpoint::kChatCompletions, 512, 700, {});
  EXPECT_EQ(only_prompt.message,
            "This model's maximum context length is 512 tokens. However, your messages resulted "
            "in 700 tokens. Please reduce the length of the messages.");
  EXPECT_EQ(body_of(only_prompt)["code"], "context_length_exceeded");
}

TEST(OpenAiErrorTest, StatusCodesMatchTheOpenAiClientExceptions) {
  // openai-python: 401 AuthenticationError, 404 NotFoundError, 429 RateLimitError,
  // >= 500 InternalServerError.
  const ApiError missing = invalid_api_key(true);
  EXPECT_EQ(missing.http_status, 401);
  EXPECT_EQ(missing.code, "invalid_api_key");
  EXPECT_NE(missing.message.find("didn't provide an API key"), std::string::npos);
  EXPECT_EQ(invalid_api_key(false).message, "Incorrect API key provided.");

  const ApiError model = model_not_found("gpt-9");
  EXPECT_EQ(model.http_status, 404);
  EXPECT_EQ(model.type, "invalid_request_error");
  EXPECT_EQ(model.code, "model_not_found");
  EXPECT_EQ(model.param, "model");
  EXPECT_EQ(model.message, "The model `gpt-9` does not exist.");

  const ApiError route = unknown_route("POST", "/v1/foo");
  EXPECT_EQ(route.http_status, 404);
  EXPECT_EQ(route.message, "Invalid URL (POST /v1/foo)");
  EXPECT_EQ(method_not_allowed("GET", "/v1/completions").http_status, 405);

  const ApiError big = body_too_large(1 << 20);
  EXPECT_EQ(big.http_status, 413);
  EXPECT_EQ(big.code, "request_too_large");
  EXPECT_NE(big.message.find("1048576"), std::string::npos);

  const ApiError queue = queue_full(256);
  EXPECT_EQ(queue.http_status, 429);
  EXPECT_EQ(queue.type, "rate_limit_error");
  EXPECT_EQ(queue.code, "queue_full");
  EXPECT_NE(queue.message.find("256"), std::string::npos);

  const ApiError busy = no_worker_available("all decode workers are down");
  EXPECT_EQ(busy.http_status, 503);
  EXPECT_EQ(busy.type, "server_error");
  EXPECT_EQ(busy.code, "service_unavailable");
  EXPECT_NE(busy.message.find("all decode workers are down"), std::string::npos);

  const ApiError internal = internal_error("boom");
  EXPECT_EQ(internal.http_status, 500);
  EXPECT_EQ(internal.type, "server_error");
  for (const ApiError& e : {missing, model, route, big, queue, busy, internal}) body_of(e);
}

TEST(OpenAiErrorTest, FromStatusMapsEveryCode) {
  struct Case {
    Status status;
    int http;
    std::string type;
  };
  const Case cases[] = {
      {InvalidArgument("template raised: System role not supported"), 400,
       "invalid_request_error"},
      {OutOfRange("x"), 400, "invalid_request_error"},
      {FailedPrecondition("x"), 400, "invalid_request_error"},
      {Unauthenticated("x"), 401, "invalid_request_error"},
      {PermissionDenied("x"), 403, "invalid_request_error"},
      {NotFound("x"), 404, "invalid_request_error"},
      {ResourceExhausted("x"), 429, "rate_limit_error"},
      {Unavailable("x"), 503, "server_error"},
      {DeadlineExceeded("x"), 504, "server_error"},
      {Internal("x"), 500, "server_error"},
      {DataLoss("x"), 500, "server_error"},
      {Status::Ok(), 500, "server_error"},
  };
  for (const Case& c : cases) {
    const ApiError e = from_status(c.status);
    EXPECT_EQ(e.http_status, c.http) << c.status.to_string();
    EXPECT_EQ(e.type, c.type) << c.status.to_string();
    if (!c.status.ok()) {
      EXPECT_EQ(e.message, c.status.message());
    }
  }
}

TEST(OpenAiErrorTest, MessagesWithOddTextStayValidJson) {
  const ApiError e = invalid_request("bad \"value\"\n\x01 \xFF", "we\"ird");
  const json b = body_of(e);
  EXPECT_EQ(b["param"], "we\"ird");
  EXPECT_EQ(b["message"].get<std::string>(), "bad \"value\"\n\x01 \xEF\xBF\xBD");
}

}  // namespace
}  // namespace cleave::openai
