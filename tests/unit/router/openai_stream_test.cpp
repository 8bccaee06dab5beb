// SSE chunks: framing, chunk shapes for both endpoints, role + first token in the first chat
// chunk, finish reason on the last content chunk, usage chunk, logprobs, escaping, and a
// stream's chunks concatenating to the non-streaming text.
#include "cleave/router/openai_stream.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace cleave::openai {
namespace {

using nlohmann::json;

// Splits SSE text into its events' data; checks the framing of each event.
std::vector<std::string> sse_data(const std::string& text) {
  std::vector<std::string> data;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = text.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event at " << pos;
    if (end == std::string::npos) break;
    const std::string event = text.substr(pos, end - pos);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    EXPECT_EQ(event.find('\n'), std::string::npos) << "event spans lines: " << event;
    data.push_back(event.substr(6));
    pos = end + 2;
  }
  return data;
}

std::vector<json> chunks(const std::string& text) {
  std::vector<json> out;
  for (const std::string& d : sse_data(text)) {
    if (d == "[DONE]") continue;
    out.push_back(json::parse(d));
  }
  return out;
}

std::vector<std::string> keys(const json& j) {
  std::vector<std::string> k;
  for (const auto& [key, v] : j.items()) k.push_back(key);
  return k;
}

TEST(OpenAiStreamTest, SseFraming) {
  std::string out;
  append_sse_event(out, R"({"a":1})");
  out += kSseDone;
  EXPECT_EQ(out, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
  std::string err;
  append_sse_error(err, queue_full(8));
  const auto data = sse_data(err);
  ASSERT_EQ(data.size(), 1u);
  const json e = json::parse(data[0]);
  EXPECT_EQ(e["error"]["code"], "queue_full");
  EXPECT_EQ(e["error"]["type"], "rate_limit_error");
}

TEST(OpenAiStreamTest, ChatChunks) {
  StreamEncoder enc(Endpoint::kChatCompletions, "chatcmpl-7", 1700000001, "stories", 1, false);
  std::string out;
  enc.append_chunk(out, 0, "Once");
  EXPECT_TRUE(enc.started(0));
  enc.append_chunk(out, 0, " upon");
  enc.append_chunk(out, 0, " a time", {}, FinishReason::kLength);
  enc.append_usage(out, Usage{4, 3, 1});
  out += kSseDone;
  const auto data = sse_data(out);
  ASSERT_EQ(data.size(), 5u);
  EXPECT_EQ(data.back(), "[DONE]");
  const auto c = chunks(out);
  for (const json& j : c) {
    EXPECT_EQ(j["id"], "chatcmpl-7");
    EXPECT_EQ(j["object"], "chat.completion.chunk");
    EXPECT_EQ(j["created"], 1700000001);
    EXPECT_EQ(j["model"], "stories");
  }
  EXPECT_EQ(keys(c[0]), (std::vector<std::string>{"choices", "created", "id", "model", "object"}));
  ASSERT_EQ(c[0]["choices"].size(), 1u);
  const json& first = c[0]["choices"][0];
  EXPECT_EQ(keys(first), (std::vector<std::string>{"delta", "finish_reason", "index", "logprobs"}));
  // The first event carries the role and the first token together.
  EXPECT_EQ(first["delta"], json::parse(R"({"role":"assistant","content":"Once"})"));
  EXPECT_TRUE(first["finish_reason"].is_null());
  EXPECT_TRUE(first["logprobs"].is_null());
  EXPECT_EQ(c[1]["choices"][0]["delta"], json::parse(R"({"content":" upon"})"));
  // The finish reason rides on the last content chunk.
  EXPECT_EQ(c[2]["choices"][0]["delta"], json::parse(R"({"content":" a time"})"));
  EXPECT_EQ(c[2]["choices"][0]["finish_reason"], "length");
  // Usage chunk: empty choices.
  EXPECT_EQ(c[3]["choices"], json::array());
  EXPECT_EQ(c[3]["usage"], json::parse(R"({"prompt_tokens":4,"completion_tokens":3,)"
                                       R"("total_tokens":7,"prompt_tokens_details":)"
                                       R"({"cached_tokens":1}})"));
}

TEST(OpenAiStreamTest, ChatFinishWithoutTextAndImmediateFinish) {
  StreamEncoder enc(Endpoint::kChatCompletions, "id", 1, "m", 2, false);
  std::string out;
  enc.append_chunk(out, 0, "Hi");
  enc.append_chunk(out, 0, "", {}, FinishReason::kStop);  // EOS: nothing left to send
  enc.append_chunk(out, 1, "", {}, FinishReason::kStop);  // first token was EOS
  const auto c = chunks(out);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[1]["choices"][0]["delta"], json::object());
  EXPECT_EQ(c[1]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(c[2]["choices"][0]["index"], 1);
  EXPECT_EQ(c[2]["choices"][0]["delta"], json::parse(R"({"role":"assistant","content":""})"));
  EXPECT_EQ(c[2]["choices"][0]["finish_reason"], "stop");
}

TEST(OpenAiStreamTest, ChoicesEachSendTheirRoleOnce) {
  StreamEncoder enc(Endpoint::kChatCompletions, "id", 1, "m", 3, false);
  std::string out;
  const int order[] = {2, 0, 2, 1, 0, 1};
  for (int i : order) enc.append_chunk(out, i, "x");
  const auto c = chunks(out);
  ASSERT_EQ(c.size(), 6u);
  int roles[3] = {0, 0, 0};
  for (size_t k = 0; k < c.size(); ++k) {
    const json& ch = c[k]["choices"][0];
    EXPECT_EQ(ch["index"], order[k]);
    if (ch["delta"].contains("role")) ++roles[order[k]];
  }
  EXPECT_EQ(roles[0], 1);
  EXPECT_EQ(roles[1], 1);
  EXPECT_EQ(roles[2], 1);
  EXPECT_TRUE(c[0]["choices"][0]["delta"].contains("role"));
  EXPECT_FALSE(c[2]["choices"][0]["delta"].contains("role"));
}

TEST(OpenAiStreamTest, CompletionChunks) {
  StreamEncoder enc(Endpoint::kCompletions, "cmpl-1", 5, "m", 1, false);
  std::string out;
  enc.append_chunk(out, 0, "Once");
  enc.append_chunk(out, 0, "", {}, FinishReason::kStop);
  enc.append_usage(out, Usage{1, 2, 0});
  const auto c = chunks(out);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0]["object"], "text_completion");
  const json& ch = c[0]["choices"][0];
  EXPECT_EQ(keys(ch), (std::vector<std::string>{"finish_reason", "index", "logprobs", "text"}));
  EXPECT_EQ(ch["text"], "Once");
  EXPECT_TRUE(ch["logprobs"].is_null());
  EXPECT_TRUE(ch["finish_reason"].is_null());
  EXPECT_EQ(c[1]["choices"][0]["text"], "");
  EXPECT_EQ(c[1]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(c[2]["object"], "text_completion");
  EXPECT_EQ(c[2]["choices"], json::array());
  EXPECT_EQ(c[2]["usage"]["total_tokens"], 3);
}

TEST(OpenAiStreamTest, LogprobsInChunks) {
  const std::vector<LogprobToken> once = {{"Once", -0.5f, {{"Once", -0.5f}, {"One", -2.0f}}}};
  const std::vector<LogprobToken> upon = {{" upon", -0.25f, {{" upon", -0.25f}}}};
  {
    StreamEncoder enc(Endpoint::kCompletions, "c", 1, "m", 1, true);
    std::string out;
    enc.append_chunk(out, 0, "h\xC3\xA9 ");  // echoed prompt: 3 code points, no logprobs
    enc.append_chunk(out, 0, "Once", once);
    enc.append_chunk(out, 0, " upon", upon, FinishReason::kLength);
    const auto c = chunks(out);
    ASSERT_EQ(c.size(), 3u);
    EXPECT_EQ(c[0]["choices"][0]["logprobs"]["tokens"], json::array());
    const json& lp1 = c[1]["choices"][0]["logprobs"];
    EXPECT_EQ(lp1["tokens"], json::parse(R"(["Once"])"));
    EXPECT_EQ(lp1["token_logprobs"], json::parse("[-0.5]"));
    EXPECT_EQ(lp1["top_logprobs"], json::parse(R"([{"Once":-0.5,"One":-2.0}])"));
    EXPECT_EQ(lp1["text_offset"], json::parse("[3]"));
    EXPECT_EQ(c[2]["choices"][0]["logprobs"]["text_offset"], json::parse("[7]"));
  }
  {
    StreamEncoder enc(Endpoint::kChatCompletions, "c", 1, "m", 1, true);
    std::string out;
    enc.append_chunk(out, 0, "Once", once);
    const auto c = chunks(out);
    const json& content = c[0]["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 1u);
    EXPECT_EQ(content[0]["token"], "Once");
    EXPECT_EQ(content[0]["logprob"], -0.5);
    EXPECT_EQ(content[0]["bytes"], json::parse("[79,110,99,101]"));
    EXPECT_EQ(content[0]["top_logprobs"].size(), 2u);
  }
}

TEST(OpenAiStreamTest, OddTextAndNamesStayValidJson) {
  StreamEncoder enc(Endpoint::kChatCompletions, "id\"\n", 1, "mo\\del\x01", 1, false);
  std::string out;
  const std::string odd("\"quoted\"\n\t\x00\x07 \\ \xFF\xC3 end", 22);
  enc.append_chunk(out, 0, odd);
  enc.append_usage(out, Usage{});
  const auto c = chunks(out);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0]["id"], "id\"\n");
  EXPECT_EQ(c[0]["model"], "mo\\del\x01");
  EXPECT_EQ(c[0]["choices"][0]["delta"]["content"],
            std::string("\"quoted\"\n\t\x00\x07 \\ \xEF\xBF\xBD\xEF\xBF\xBD end", 26));
  EXPECT_EQ(c[1]["model"], "mo\\del\x01");
}

TEST(OpenAiStreamTest, ChunksConcatenateToTheNonStreamingText) {
  const std::vector<std::string> pieces = {
      "Once", " upon", " a", " time,", " \"Lily\"", " said:\n", "\t\xE2\x80\x9CHi!\xE2\x80\x9D",
      " \\o/", " \xF0\x9F\x98\x80", "", " caf\xC3\xA9", std::string("\x01", 1), " end."};
  std::string full;
  for (const auto& p : pieces) full += p;
  for (Endpoint ep : {Endpoint::kChatCompletions, Endpoint::kCompletions}) {
    StreamEncoder enc(ep, "id", 1, "m", 2, false);
    std::string out;
    for (size_t i = 0; i < pieces.size(); ++i) {
      for (int32_t choice : {0, 1}) {
        const bool last = i + 1 == pieces.size();
        enc.append_chunk(out, choice, pieces[i], {},
                         last ? std::optional(FinishReason::kStop) : std::nullopt);
      }
    }
    out += kSseDone;
    std::string streamed[2];
    int finishes = 0;
    for (const json& c : chunks(out)) {
      const json& ch = c["choices"][0];
      const int idx = ch["index"].get<int>();
      if (ep == Endpoint::kChatCompletions) {
        if (ch["delta"].contains("content")) streamed[idx] += ch["delta"]["content"].get<std::string>();
      } else {
        streamed[idx] += ch["text"].get<std::string>();
      }
      if (!ch["finish_reason"].is_null()) ++finishes;
    }
    EXPECT_EQ(finishes, 2);
    std::vector<ChoiceOutput> choices = {{0, full, FinishReason::kStop, std::nullopt},
                                         {1, full, FinishReason::kStop, std::nullopt}};
    const json whole = json::parse(ep == Endpoint::kChatCompletions
                                       ? chat_completion_response_json("id", 1, "m", choices, {})
                                       : completion_response_json("id", 1, "m", choices, {}));
    for (int i = 0; i < 2; ++i) {
      const std::string text = ep == Endpoint::kChatCompletions
                                   ? whole["choices"][i]["message"]["content"].get<std::string>()
                                   : whole["choices"][i]["text"].get<std::string>();
      EXPECT_EQ(streamed[i], text);
      EXPECT_EQ(streamed[i], full);
    }
  }
}

TEST(OpenAiStreamTest, PerTokenPathReusesTheBuffer) {
  StreamEncoder enc(Endpoint::kChatCompletions, random_request_id("chatcmpl-"), 1, "m", 1, false);
  std::string out;
  out.reserve(4096);
  const char* data = out.data();
  const size_t capacity = out.capacity();
  for (int i = 0; i < 10000; ++i) {
    out.clear();
    enc.append_chunk(out, 0, i % 3 ? " token" : "\"q\"\n");
  }
  EXPECT_EQ(out.data(), data);
  EXPECT_EQ(out.capacity(), capacity);
}

}  // namespace
}  // namespace cleave::openai
