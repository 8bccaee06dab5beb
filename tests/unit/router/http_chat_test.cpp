// POST /v1/chat/completions through the HTTP frontend and a real engine: the chat template's
// rendering becomes the prompt (fallback template, a custom one with chat_template_kwargs,
// continue_final_message), non-streaming and streaming answers equal Generator's for those
// tokens, the first chunk carries the role, logprobs, and a template's raise_exception is a
// 400 with its own message.
#include <gtest/gtest.h>

#include "http_test_util.h"

namespace cleave::router::testing_http {
namespace {

constexpr const char* kStrictTemplate =
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}";

class HttpChatTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    router_ = RouterUnderTest::start().release();
    ASSERT_NE(router_, nullptr);
    model_ = router_->model.model().release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete router_;
    remove_router_synth_dir();
  }
  void SetUp() override {
    if (!router_) GTEST_SKIP() << "router did not start";
  }

  static const Tokenizer& tok() { return *router_->model.tok; }
  // What the router sends for `messages` with the fallback template.
  static std::vector<int32_t> fallback_prompt(const json& messages, bool generation_prompt = true) {
    ChatTemplateInputs in;
    in.messages = nlohmann::ordered_json::parse(messages.dump());
    in.add_generation_prompt = generation_prompt;
    auto text = fallback_chat_template().apply(in);
    EXPECT_TRUE(text.ok()) << text.status().to_string();
    return tok().encode(*text, {.add_bos = tok().spec().add_bos, .parse_special = true});
  }
  static GenerationResult alone(const std::vector<int32_t>& prompt, int max_tokens) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    return testing_engine::generate_alone(*model_, tok(), prompt, p);
  }

  static RouterUnderTest* router_;
  static LlamaModel* model_;
};
RouterUnderTest* HttpChatTest::router_ = nullptr;
LlamaModel* HttpChatTest::model_ = nullptr;

TEST_F(HttpChatTest, NonStreamingAnswerIsTheEnginesOnTheRenderedPrompt) {
  const json messages = json::array({{{"role", "system"}, {"content", "Be brief."}},
                                     {{"role", "user"}, {"content", "Tell me a story"}}});
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/chat/completions", {{"messages", messages},
                                                      {"max_completion_tokens", 9},
                                                      {"temperature", 0},
                                                      {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.json_body();
  const auto prompt = fallback_prompt(messages);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], alone(prompt, 9).text);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 9);
  router_->expect_engine_idle();
}

TEST_F(HttpChatTest, StreamingFirstChunkCarriesTheRoleAndTheTextMatches) {
  const json messages = json::array({{{"role", "user"}, {"content", "Hi!"}}});
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/chat/completions",
                             {{"messages", messages}, {"max_tokens", 8}, {"temperature", 0},
                              {"ignore_eos", true}, {"n", 2}, {"stream", true},
                              {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  bool done = false;
  const auto chunks = sse_chunks(r.body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(chunks.size(), 3u);
  std::map<int, bool> seen;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    const json& ch = chunks[i];
    EXPECT_EQ(ch["object"], "chat.completion.chunk");
    ASSERT_EQ(ch["choices"].size(), 1u);
    const int index = ch["choices"][0]["index"];
    const json& delta = ch["choices"][0]["delta"];
    if (!seen[index]) {
      EXPECT_EQ(delta.value("role", ""), "assistant") << ch;  // a choice's first chunk
      seen[index] = true;
    } else {
      EXPECT_FALSE(delta.contains("role")) << ch;
    }
  }
  const auto prompt = fallback_prompt(messages);
  const auto merged = merge_stream(chunks, /*chat=*/true);
  ASSERT_EQ(merged.size(), 2u);
  const std::string want = alone(prompt, 8).text;
  EXPECT_EQ(merged.at(0).text, want);
  EXPECT_EQ(merged.at(1).text, want);  // greedy: both choices alike
  EXPECT_EQ(merged.at(0).finish_reason, "length");
  EXPECT_EQ(chunks.back()["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(chunks.back()["usage"]["completion_tokens"], 16);
  router_->expect_engine_idle();
}

TEST_F(HttpChatTest, ContinueFinalMessageAndLogprobs) {
  const json messages = json::array({{{"role", "user"}, {"content", "Start a story"}},
                                     {{"role", "assistant"}, {"content", "Once upon"}}});
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/chat/completions",
                             {{"messages", messages}, {"max_tokens", 4}, {"temperature", 0},
                              {"ignore_eos", true}, {"add_generation_prompt", false},
                              {"continue_final_message", true}, {"logprobs", true},
                              {"top_logprobs", 2}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.json_body();
  // The fallback renders "...assistant: Once upon\n\n"; the prompt stops after "Once upon".
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::parse(messages.dump());
  in.add_generation_prompt = false;
  std::string text = *fallback_chat_template().apply(in);
  text.resize(text.rfind("Once upon") + 9);
  const auto prompt = tok().encode(text, {.add_bos = tok().spec().add_bos, .parse_special = true});
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["choices"][0]["message"]["content"], alone(prompt, 4).text);
  const json& lp = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 4u) << j;
  for (const auto& t : lp) {
    EXPECT_TRUE(t["token"].is_string());
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_EQ(t["top_logprobs"][0]["logprob"], t["logprob"]);  // greedy picks the top one
  }
  router_->expect_engine_idle();
}

TEST_F(HttpChatTest, CustomTemplateRendersKwargsAndRaisesAs400) {
  auto strict = RouterUnderTest::start({}, std::string(kStrictTemplate));
  ASSERT_NE(strict, nullptr);
  TestClient c(strict->port());

  const auto bad = c.post_json("/v1/chat/completions",
                               {{"messages", json::array({{{"role", "system"}, {"content", "x"}},
                                                          {{"role", "user"}, {"content", "y"}}})}});
  const json e = expect_error(bad, 400, "invalid_request_error");
  EXPECT_EQ(e["message"], "System role not supported");
  EXPECT_EQ(strict->dispatcher->submitted(), 0);

  const json messages = json::array({{{"role", "user"}, {"content", "Hello"}}});
  const auto ok = c.post_json("/v1/chat/completions",
                              {{"messages", messages}, {"max_tokens", 3}, {"temperature", 0},
                               {"ignore_eos", true},
                               {"chat_template_kwargs", {{"greeting", "<|begin_of_text|>Hi. "}}}});
  ASSERT_EQ(ok.status, 200) << ok.body;
  // A model template writes its own BOS (here through the kwarg): no BOS is added.
  const auto prompt = tok().encode("<|begin_of_text|>Hi. [user] Hello\n[assistant]",
                                   {.add_bos = false, .parse_special = true});
  ASSERT_GE(prompt.size(), 2u);
  EXPECT_EQ(prompt[0], tok().bos_id());
  EXPECT_EQ(ok.json_body()["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(ok.json_body()["choices"][0]["message"]["content"], alone(prompt, 3).text);
  strict->expect_engine_idle();
}

TEST_F(HttpChatTest, InvalidMessagesAreAnsweredWithTheirParam) {
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/chat/completions",
                             {{"messages", json::array({{{"role", "wizard"}, {"content", "x"}}})}});
  EXPECT_EQ(expect_error(r, 400, "invalid_request_error")["param"], "messages[0].role");
  const auto m = c.post_json("/v1/chat/completions",
                             {{"model", "gpt-4"}, {"messages", json::array({{{"role", "user"}, {"content", "x"}}})}});
  EXPECT_EQ(expect_error(m, 404, "invalid_request_error")["code"], "model_not_found");
  const auto big = c.post_json("/v1/chat/completions",
                               {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})},
                                {"max_tokens", 100000}});
  EXPECT_EQ(expect_error(big, 400, "invalid_request_error")["code"], "context_length_exceeded");
}

}  // namespace
}  // namespace cleave::router::testing_http
