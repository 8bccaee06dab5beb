// POST /v1/chat/completions bodies: messages, content parts, logprobs, template switches, tool
// fields, and every 400 with its exact param.
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cleave/router/openai_request.h"

namespace cleave::openai {
namespace {

ChatCompletionRequest parse_ok(const std::string& body, const RequestLimits& limits = {}) {
  auto r = parse_chat_completion_request(body, limits);
  EXPECT_TRUE(r.ok()) << body << " -> " << (r.ok() ? "" : r.error().message);
  return r.ok() ? std::move(r).value() : ChatCompletionRequest{};
}

void expect_400(const std::string& body, const std::string& param, const std::string& text = {},
                const RequestLimits& limits = {}) {
  auto r = parse_chat_completion_request(body, limits);
  ASSERT_FALSE(r.ok()) << body << " was accepted";
  const ApiError& e = r.error();
  EXPECT_EQ(e.http_status, 400) << body;
  EXPECT_EQ(e.type, "invalid_request_error") << body;
  EXPECT_EQ(e.param, param) << body << " -> " << e.message;
  EXPECT_NE(e.message.find(text), std::string::npos)
      << body << " -> " << e.message << " (wanted: " << text << ")";
}

const char* kUser = R"({"role":"user","content":"Hello"})";

std::string with(const std::string& fields) {
  return std::string(R"({"model":"m","messages":[)") + kUser + "]" +
         (fields.empty() ? "" : "," + fields) + "}";
}

std::string messages(const std::string& list) {
  return R"({"model":"m","messages":)" + list + "}";
}

TEST(ChatRequestTest, MinimalRequest) {
  const ChatCompletionRequest r = parse_ok(with(""));
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "Hello");
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.stream);
  EXPECT_TRUE(r.add_generation_prompt);
  EXPECT_FALSE(r.continue_final_message);
  EXPECT_EQ(r.chat_template_kwargs_json, "");
  EXPECT_EQ(r.sampling.params.logprobs, -1);
  EXPECT_FALSE(r.sampling.max_tokens.has_value());
}

TEST(ChatRequestTest, RolesAndContent) {
  const ChatCompletionRequest r = parse_ok(messages(R"([
    {"role":"system","content":"Be brief."},
    {"role":"developer","content":"Dev note."},
    {"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":"two"}],
     "name":"alice"},
    {"role":"assistant","content":null,"tool_calls":[],"refusal":null,"function_call":null,
     "audio":null,"annotations":[]},
    {"role":"tool","content":"42","tool_call_id":"call_1"},
    {"role":"user","content":[]}
  ])"));
  ASSERT_EQ(r.messages.size(), 6u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].role, "system");  // developer is the newer name of system
  EXPECT_EQ(r.messages[2].content, "part one\ntwo");
  EXPECT_EQ(r.messages[2].name, "alice");
  EXPECT_EQ(r.messages[3].role, "assistant");
  EXPECT_FALSE(r.messages[3].content.has_value());
  EXPECT_EQ(r.messages[4].role, "tool");
  EXPECT_EQ(r.messages[4].tool_call_id, "call_1");
  EXPECT_EQ(r.messages[5].content, "");
  // An assistant message without content at all is accepted too.
  EXPECT_FALSE(parse_ok(messages(R"([{"role":"assistant"}])")).messages[0].content.has_value());
}

TEST(ChatRequestTest, BadMessages) {
  expect_400(R"({"model":"m"})", "messages", "Missing required parameter: 'messages'.");
  expect_400(messages("[]"), "messages", "must not be empty");
  expect_400(messages(R"("hi")"), "messages", "expected an array of messages");
  expect_400(messages(R"(["hi"])"), "messages[0]", "expected a message object");
  expect_400(messages(R"([{"content":"x"}])"), "messages[0].role",
             "Missing required parameter: 'messages[0].role'.");
  expect_400(messages(R"([{"role":5,"content":"x"}])"), "messages[0].role", "expected a string");
  expect_400(messages(R"([{"role":"user","content":"a"},{"role":"robot","content":"x"}])"),
             "messages[1].role", R"("robot")");
  expect_400(messages(R"([{"role":"function","content":"x"}])"), "messages[0].role", "one of");
  expect_400(messages(R"([{"role":"user"}])"), "messages[0].content",
             "a user message needs content");
  expect_400(messages(R"([{"role":"system","content":null}])"), "messages[0].content",
             "Missing required parameter");
  expect_400(messages(R"([{"role":"user","content":5}])"), "messages[0].content",
             "a string or an array of content parts");
  expect_400(messages(R"([{"role":"user","content":"x","foo":1}])"), "messages[0].foo",
             "Unrecognized request argument supplied: messages[0].foo");
  expect_400(messages(R"([{"role":"user","content":"x","name":5}])"), "messages[0].name",
             "expected a string");
  expect_400(messages(R"([{"role":"tool","content":"x","tool_call_id":1}])"),
             "messages[0].tool_call_id", "expected a string");
  expect_400(messages(R"([{"role":"assistant","content":"x","tool_calls":[{"id":"c"}]}])"),
             "messages[0].tool_calls", "tool calling is not supported");
  expect_400(messages(R"([{"role":"assistant","content":"x","refusal":"no"}])"),
             "messages[0].refusal", "not supported");
  RequestLimits few;
  few.max_messages = 1;
  expect_400(messages(std::string("[") + kUser + "," + kUser + "]"), "messages",
             "at most 1 messages", few);
}

TEST(ChatRequestTest, BadContentParts) {
  expect_400(messages(R"([{"role":"user","content":["x"]}])"), "messages[0].content[0]",
             "content part object");
  expect_400(messages(R"([{"role":"user","content":[{"text":"x"}]}])"),
             "messages[0].content[0].type", "Missing required parameter");
  expect_400(messages(R"([{"role":"user","content":[{"type":"text","text":"a"},)"
                      R"({"type":"image_url","image_url":{"url":"http://x"}}]}])"),
             "messages[0].content[1].type", "only text content parts");
  expect_400(messages(R"([{"role":"user","content":[{"type":1}]}])"),
             "messages[0].content[0].type", "expected a string");
  expect_400(messages(R"([{"role":"user","content":[{"type":"text"}]}])"),
             "messages[0].content[0].text", "Missing required parameter");
  expect_400(messages(R"([{"role":"user","content":[{"type":"text","text":5}]}])"),
             "messages[0].content[0].text", "expected a string");
  expect_400(messages(R"([{"role":"user","content":[{"type":"text","text":"a","x":1}]}])"),
             "messages[0].content[0].x", "Unrecognized request argument");
}

TEST(ChatRequestTest, Logprobs) {
  EXPECT_EQ(parse_ok(with(R"("logprobs":true,"top_logprobs":5)")).sampling.params.logprobs, 5);
  EXPECT_EQ(parse_ok(with(R"("logprobs":true)")).sampling.params.logprobs, 0);
  EXPECT_EQ(parse_ok(with(R"("logprobs":false)")).sampling.params.logprobs, -1);
  EXPECT_EQ(parse_ok(with(R"("logprobs":false,"top_logprobs":0)")).sampling.params.logprobs, -1);
  expect_400(with(R"("top_logprobs":3)"), "top_logprobs", "requires 'logprobs' to be true");
  expect_400(with(R"("logprobs":true,"top_logprobs":21)"), "top_logprobs", "[0, 20]");
  expect_400(with(R"("logprobs":true,"top_logprobs":-1)"), "top_logprobs", "-1");
  expect_400(with(R"("logprobs":5)"), "logprobs", "expected a boolean");
  RequestLimits small;
  small.max_logprobs = 2;
  expect_400(with(R"("logprobs":true,"top_logprobs":3)"), "top_logprobs", "[0, 2]", small);
}

TEST(ChatRequestTest, SharedSamplingFields) {
  const ChatCompletionRequest r = parse_ok(with(
      R"("max_completion_tokens":64,"max_tokens":10,"temperature":0,"top_p":0.5,"top_k":1,)"
      R"("min_p":0.1,"seed":7,"stop":"###","stop_token_ids":[3],"presence_penalty":1,)"
      R"("frequency_penalty":1,"repetition_penalty":1.2,"n":2,"ignore_eos":true,)"
      R"("min_tokens":2,"user":"bob","stream":true,"stream_options":{"include_usage":true})"));
  const SamplingParams& p = r.sampling.params;
  EXPECT_EQ(r.sampling.max_tokens, 64);
  EXPECT_EQ(p.temperature, 0.0f);
  EXPECT_FLOAT_EQ(p.top_p, 0.5f);
  EXPECT_EQ(p.top_k, 1);
  EXPECT_FLOAT_EQ(p.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, 7u);
  EXPECT_EQ(p.stop, (std::vector<std::string>{"###"}));
  EXPECT_EQ(p.stop_token_ids, (std::vector<int32_t>{3}));
  EXPECT_FLOAT_EQ(p.presence_penalty, 1.0f);
  EXPECT_FLOAT_EQ(p.frequency_penalty, 1.0f);
  EXPECT_FLOAT_EQ(p.repetition_penalty, 1.2f);
  EXPECT_EQ(r.n, 2);
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_EQ(p.min_tokens, 2);
  EXPECT_EQ(r.user, "bob");
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.stream_options.include_usage);
  expect_400(with(R"("temperature":-1)"), "temperature", "-1");
  expect_400(with(R"("stream_options":{"include_usage":true})"), "stream_options");
  expect_400(with(R"("max_completion_tokens":3,"min_tokens":4)"), "min_tokens", "4");
}

TEST(ChatRequestTest, TemplateSwitches) {
  const ChatCompletionRequest r = parse_ok(messages(
      R"([{"role":"user","content":"Hi"},{"role":"assistant","content":"Once upon"}],)"
      R"("add_generation_prompt":false,"continue_final_message":true,)"
      R"("chat_template_kwargs":{"enable_thinking":false,"x":[1,"é"]})"));
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_TRUE(r.continue_final_message);
  const auto kwargs = nlohmann::json::parse(r.chat_template_kwargs_json);
  EXPECT_EQ(kwargs["enable_thinking"], false);
  EXPECT_EQ(kwargs["x"][1], "é");
  expect_400(messages(R"([{"role":"assistant","content":"x"}],"continue_final_message":true)"),
             "continue_final_message", "cannot both be true");
  expect_400(with(R"("add_generation_prompt":false,"continue_final_message":true)"),
             "continue_final_message", "last message to be an assistant message");
  expect_400(with(R"("chat_template_kwargs":[])"), "chat_template_kwargs", "expected an object");
  expect_400(with(R"("add_generation_prompt":"no")"), "add_generation_prompt",
             "expected a boolean");
}

TEST(ChatRequestTest, ToolFieldsOnlyWhenTheyAskForNoToolCall) {
  EXPECT_TRUE(parse_chat_completion_request(
                  with(R"("tools":[],"tool_choice":"none","parallel_tool_calls":false)"))
                  .ok());
  EXPECT_TRUE(parse_chat_completion_request(with(R"("tool_choice":"auto","functions":[])")).ok());
  expect_400(with(R"("tools":[{"type":"function","function":{"name":"f"}}])"), "tools",
             "tool calling is not supported");
  expect_400(with(R"("tool_choice":"required")"), "tool_choice", "tool calling");
  expect_400(with(R"("tool_choice":{"type":"function","function":{"name":"f"}})"), "tool_choice",
             "tool calling");
  expect_400(with(R"("tools":{})"), "tools", "expected an array");
  expect_400(with(R"("functions":[{"name":"f"}])"), "functions", "tool calling");
  expect_400(with(R"("function_call":"f")"), "function_call", "tool calling");
  expect_400(with(R"("parallel_tool_calls":"yes")"), "parallel_tool_calls", "expected a boolean");
  EXPECT_TRUE(parse_chat_completion_request(with(R"("modalities":["text"])")).ok());
  expect_400(with(R"("modalities":["text","audio"])"), "modalities", "not supported");
  expect_400(with(R"("audio":{"voice":"x"})"), "audio", "not supported");
  expect_400(with(R"("reasoning_effort":"high")"), "reasoning_effort", "not supported");
  EXPECT_TRUE(parse_chat_completion_request(with(R"("audio":null,"reasoning_effort":null)")).ok());
}

TEST(ChatRequestTest, UnknownAndCompletionOnlyFields) {
  expect_400(with(R"("prompt":"x")"), "prompt", "Unrecognized request argument supplied: prompt");
  expect_400(with(R"("echo":true)"), "echo", "Unrecognized");
  expect_400(with(R"("suffix":"")"), "suffix", "Unrecognized");
  expect_400(with(R"("best_of":1)"), "best_of", "Unrecognized");
  expect_400(with(R"("foo":null,"bar":1)"), "bar", "Unrecognized request argument supplied: bar");
}

TEST(ChatRequestTest, MalformedBodies) {
  for (const std::string& body : {std::string(""), std::string("{\"messages\":[}"),
                                  std::string("{\"messages\":[{\"role\":\"user\","
                                              "\"content\":\"\xFF\"}]}")}) {
    auto r = parse_chat_completion_request(body);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().http_status, 400);
    EXPECT_NE(r.error().message.find("not valid JSON"), std::string::npos) << r.error().message;
  }
  auto r = parse_chat_completion_request("[]");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("must be a JSON object, but got an array"), std::string::npos);
}

}  // namespace
}  // namespace cleave::openai
