// Non-streaming response bodies, parsed back: completion, chat.completion, logprobs in both
// OpenAI shapes, usage, the model list, ids.
#include "cleave/router/openai_response.h"

#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace cleave::openai {
namespace {

using nlohmann::json;

std::vector<std::string> keys(const json& j) {
  std::vector<std::string> k;
  for (const auto& [key, v] : j.items()) k.push_back(key);
  return k;
}

LogprobToken token(std::string text, float lp, std::vector<LogprobAlternative> top) {
  return LogprobToken{std::move(text), lp, std::move(top)};
}

TEST(OpenAiResponseTest, CompletionShape) {
  std::vector<ChoiceOutput> choices(2);
  choices[0] = {0, "Once upon a time", FinishReason::kLength, std::nullopt};
  choices[1] = {1, "He said \"hi\"\n", FinishReason::kStop, std::nullopt};
  const Usage usage{.prompt_tokens = 5, .completion_tokens = 9, .cached_tokens = 2};
  const json j = json::parse(completion_response_json("cmpl-1", 1700000000, "stories", choices,
                                                      usage));
  EXPECT_EQ(keys(j), (std::vector<std::string>{"choices", "created", "id", "model", "object",
                                               "usage"}));
  EXPECT_EQ(j["id"], "cmpl-1");
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "stories");
  ASSERT_EQ(j["choices"].size(), 2u);
  const json& c1 = j["choices"][1];
  EXPECT_EQ(keys(c1), (std::vector<std::string>{"finish_reason", "index", "logprobs", "text"}));
  EXPECT_EQ(c1["index"], 1);
  EXPECT_EQ(c1["text"], "He said \"hi\"\n");
  EXPECT_TRUE(c1["logprobs"].is_null());
  EXPECT_EQ(c1["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"], json::parse(R"({"prompt_tokens":5,"completion_tokens":9,)"
                                    R"("total_tokens":14,"prompt_tokens_details":)"
                                    R"({"cached_tokens":2}})"));
}

TEST(OpenAiResponseTest, ChatShape) {
  std::vector<ChoiceOutput> choices = {{0, "Hello there", FinishReason::kStop, std::nullopt}};
  const json j = json::parse(
      chat_completion_response_json("chatcmpl-x", 1, "m", choices, Usage{3, 2, 0}));
  EXPECT_EQ(j["object"], "chat.completion");
  const json& c = j["choices"][0];
  EXPECT_EQ(keys(c), (std::vector<std::string>{"finish_reason", "index", "logprobs", "message"}));
  EXPECT_EQ(c["message"], json::parse(R"({"role":"assistant","content":"Hello there"})"));
  EXPECT_TRUE(c["logprobs"].is_null());
  EXPECT_EQ(j["usage"]["total_tokens"], 5);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

TEST(OpenAiResponseTest, OddTextStaysValidJson) {
  const std::string odd = std::string("q\"b\\s\x01\x1f\n\t", 10) + "\xE2\x82" + " ok \xF0\x9F\x98\x80";
  std::vector<ChoiceOutput> choices = {{0, odd, FinishReason::kStop, std::nullopt}};
  const json j = json::parse(chat_completion_response_json("id", 1, "m\"odel", choices, Usage{}));
  EXPECT_EQ(j["model"], "m\"odel");
  EXPECT_EQ(j["choices"][0]["message"]["content"],
            std::string("q\"b\\s\x01\x1f\n\t", 10) + "\xEF\xBF\xBD ok \xF0\x9F\x98\x80");
}

TEST(OpenAiResponseTest, CompletionLogprobsShape) {
  std::vector<ChoiceOutput> choices(1);
  choices[0].text = "Once upon";
  choices[0].finish_reason = FinishReason::kLength;
  choices[0].logprobs = std::vector<LogprobToken>{
      token("Once", -0.5f, {{"Once", -0.5f}, {"One", -1.25f}}),
      token(" upon", -2.0f, {{" a", -0.75f}, {" a", -0.8f}, {" the", -1.5f}}),  // chosen not top
  };
  const json j = json::parse(completion_response_json("c", 1, "m", choices, Usage{}));
  const json& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(keys(lp), (std::vector<std::string>{"text_offset", "token_logprobs", "tokens",
                                                "top_logprobs"}));
  EXPECT_EQ(lp["tokens"], json::parse(R"(["Once"," upon"])"));
  EXPECT_EQ(lp["token_logprobs"], json::parse("[-0.5,-2.0]"));
  EXPECT_EQ(lp["text_offset"], json::parse("[0,4]"));
  EXPECT_EQ(lp["top_logprobs"][0], json::parse(R"({"Once":-0.5,"One":-1.25})"));
  // Duplicate texts keep the more likely; the chosen token is added after the top N.
  EXPECT_EQ(lp["top_logprobs"][1], json::parse(R"({" a":-0.75," the":-1.5," upon":-2.0})"));
}

TEST(OpenAiResponseTest, ChatLogprobsShape) {
  std::vector<ChoiceOutput> choices(1);
  choices[0].text = "Hi\xC3\xA9";
  choices[0].finish_reason = FinishReason::kStop;
  choices[0].logprobs = std::vector<LogprobToken>{
      token("Hi", -0.125f, {{"Hi", -0.125f}, {"Hello", -3.0f}}),
      token("\xC3", -1.0f, {}),  // a byte-fallback piece: half of "é"
      token("\xA9", -0.0f, {}),
  };
  const json j = json::parse(chat_completion_response_json("c", 1, "m", choices, Usage{}));
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u);
  EXPECT_EQ(keys(content[0]), (std::vector<std::string>{"bytes", "logprob", "token",
                                                        "top_logprobs"}));
  EXPECT_EQ(content[0]["token"], "Hi");
  EXPECT_EQ(content[0]["logprob"], -0.125);
  EXPECT_EQ(content[0]["bytes"], json::parse("[72,105]"));
  EXPECT_EQ(content[0]["top_logprobs"],
            json::parse(R"([{"token":"Hi","logprob":-0.125,"bytes":[72,105]},)"
                        R"({"token":"Hello","logprob":-3.0,"bytes":[72,101,108,108,111]}])"));
  // The token text of a partial sequence is repaired; its bytes are the raw ones.
  EXPECT_EQ(content[1]["token"], "\xEF\xBF\xBD");
  EXPECT_EQ(content[1]["bytes"], json::parse("[195]"));
  EXPECT_EQ(content[2]["bytes"], json::parse("[169]"));
  EXPECT_EQ(content[1]["top_logprobs"], json::array());
}

TEST(OpenAiResponseTest, LogprobsInfinityIsReportedAsMinus9999) {
  std::string out;
  const std::vector<LogprobToken> t = {
      token("a", -std::numeric_limits<float>::infinity(), {})};
  append_chat_logprobs_json(out, t);
  EXPECT_EQ(json::parse(out)["content"][0]["logprob"], -9999.0);
}

TEST(OpenAiResponseTest, CompletionTextOffsetsCountCodePoints) {
  std::string out;
  const std::vector<LogprobToken> t = {token("h\xC3\xA9", -1, {}), token("\xF0\x9F\x98\x80", -1, {}),
                                       token("x", -1, {})};
  append_completion_logprobs_json(out, t, 10);
  EXPECT_EQ(json::parse(out)["text_offset"], json::parse("[10,12,13]"));
}

TEST(OpenAiResponseTest, FinishReasons) {
  EXPECT_EQ(finish_reason_text(FinishReason::kStop), "stop");
  EXPECT_EQ(finish_reason_text(FinishReason::kLength), "length");
  EXPECT_EQ(finish_reason_text(FinishReason::kCancelled), "abort");
}

TEST(OpenAiResponseTest, ModelList) {
  const std::vector<ModelCard> models = {{"stories260K", 1700000000, "cleave", 512},
                                         {"other", 5, "me", 0}};
  const json j = json::parse(models_response_json(models));
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][0], json::parse(R"({"id":"stories260K","object":"model",)"
                                      R"("created":1700000000,"owned_by":"cleave",)"
                                      R"("root":"stories260K","parent":null,)"
                                      R"("max_model_len":512})"));
  EXPECT_FALSE(j["data"][1].contains("max_model_len"));
  EXPECT_EQ(json::parse(models_response_json({}))["data"], json::array());
}

TEST(OpenAiResponseTest, RequestIdsAreUniqueAndPrefixed) {
  std::set<std::string> ids;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = random_request_id("chatcmpl-");
    ASSERT_EQ(id.size(), 9u + 32u);
    ASSERT_EQ(id.rfind("chatcmpl-", 0), 0u);
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef", 9), std::string::npos);
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 1000u);
  EXPECT_NE(random_seed(), random_seed());
}

}  // namespace
}  // namespace cleave::openai
