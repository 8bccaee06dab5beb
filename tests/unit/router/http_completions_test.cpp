// POST /v1/completions through the HTTP frontend, a real dispatcher and engine: non-streaming
// and streaming text equal to what Generator produces alone for the same tokens and seed,
// usage, n > 1 and several prompts merged with the right choice indexes, echo, token id
// prompts, logprobs, context-length errors, and keep-alive reuse of one connection.
#include <gtest/gtest.h>

#include "http_test_util.h"

namespace cleave::router::testing_http {
namespace {

class HttpCompletionsTest : public ::testing::Test {
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

  static std::vector<int32_t> tokens_of(const std::string& text) {
    const Tokenizer& tok = *router_->model.tok;
    return tok.encode(text, {.add_bos = tok.spec().add_bos, .parse_special = true});
  }
  static GenerationResult alone(const std::vector<int32_t>& prompt, SamplingParams p) {
    return testing_engine::generate_alone(*model_, *router_->model.tok, prompt, p);
  }
  static SamplingParams greedy(int max_tokens) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    return p;
  }

  static RouterUnderTest* router_;
  static LlamaModel* model_;
};
RouterUnderTest* HttpCompletionsTest::router_ = nullptr;
LlamaModel* HttpCompletionsTest::model_ = nullptr;

TEST_F(HttpCompletionsTest, NonStreamingTextAndUsageMatchTheEngineAlone) {
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/completions", {{"model", "synth-router"},
                                                 {"prompt", "Once upon a time"},
                                                 {"max_tokens", 12},
                                                 {"temperature", 0},
                                                 {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.header("content-type"), "application/json");
  const json j = r.json_body();
  const auto prompt = tokens_of("Once upon a time");
  const auto want = alone(prompt, greedy(12));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "synth-router");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  ASSERT_EQ(want.tokens.size(), 12u);
  EXPECT_FALSE(want.text.empty());
  EXPECT_EQ(j["choices"][0]["text"], want.text);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["usage"]["total_tokens"], prompt.size() + 12);
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, StreamingChunksConcatenateToTheSameTextWithUsage) {
  TestClient c(router_->port());
  const json body = {{"prompt", "The little dog"},       {"max_tokens", 10},
                     {"temperature", 0},                 {"ignore_eos", true},
                     {"stream", true},                   {"stream_options", {{"include_usage", true}}}};
  const auto r = c.post_json("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.header("content-type"), "text/event-stream; charset=utf-8");
  EXPECT_EQ(r.header("transfer-encoding"), "chunked");
  bool done = false;
  const auto chunks = sse_chunks(r.body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(chunks.size(), 2u);
  const json& usage_chunk = chunks.back();
  EXPECT_TRUE(usage_chunk["choices"].empty());
  const auto prompt = tokens_of("The little dog");
  EXPECT_EQ(usage_chunk["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 10);
  for (size_t i = 0; i + 1 < chunks.size(); ++i) EXPECT_EQ(chunks[i]["object"], "text_completion");
  const auto merged = merge_stream(chunks, /*chat=*/false);
  ASSERT_EQ(merged.size(), 1u);
  EXPECT_EQ(merged.at(0).text, alone(prompt, greedy(10)).text);
  EXPECT_EQ(merged.at(0).finish_reason, "length");
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, SeededSamplingIsReproducibleAndChoiceZeroKeepsTheSeed) {
  TestClient c(router_->port());
  const json body = {{"prompt", "A cat"}, {"max_tokens", 16}, {"seed", 42}, {"temperature", 1.0},
                     {"ignore_eos", true}};
  const auto a = c.post_json("/v1/completions", body);
  const auto b = c.post_json("/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.body;
  ASSERT_EQ(b.status, 200) << b.body;
  const std::string text = a.json_body()["choices"][0]["text"];
  EXPECT_EQ(b.json_body()["choices"][0]["text"], text);
  SamplingParams p;
  p.temperature = 1.0f;
  p.max_tokens = 16;
  p.ignore_eos = true;
  p.seed = 42;
  EXPECT_EQ(text, alone(tokens_of("A cat"), p).text);

  json multi = body;
  multi["n"] = 3;
  const auto m = c.post_json("/v1/completions", multi);
  ASSERT_EQ(m.status, 200) << m.body;
  const json j = m.json_body();
  ASSERT_EQ(j["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(j["choices"][i]["index"], i);
  EXPECT_EQ(j["choices"][0]["text"], text);
  EXPECT_NE(j["choices"][1]["text"], j["choices"][2]["text"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], tokens_of("A cat").size());  // once per prompt
  EXPECT_EQ(j["usage"]["completion_tokens"], 48);
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, SeveralPromptsAndChoicesMergeWithTheirIndexes) {
  const std::vector<std::string> prompts = {"One day", "In the park there was"};
  const json body = {{"prompt", prompts}, {"n", 2}, {"max_tokens", 6}, {"temperature", 0},
                     {"ignore_eos", true}};
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.json_body();
  ASSERT_EQ(j["choices"].size(), 4u);
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::string want = alone(tokens_of(prompts[p]), greedy(6)).text;
    for (int i = 0; i < 2; ++i) {
      const json& ch = j["choices"][p * 2 + static_cast<size_t>(i)];
      EXPECT_EQ(ch["index"], p * 2 + static_cast<size_t>(i));
      EXPECT_EQ(ch["text"], want) << "prompt " << p << " choice " << i;  // greedy: all alike
    }
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], tokens_of(prompts[0]).size() + tokens_of(prompts[1]).size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 24);

  json streamed = body;
  streamed["stream"] = true;
  const auto s = c.post_json("/v1/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  bool done = false;
  const auto merged = merge_stream(sse_chunks(s.body, &done), false);
  EXPECT_TRUE(done);
  ASSERT_EQ(merged.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(merged.at(i).text, j["choices"][i]["text"]) << "choice " << i;
    EXPECT_EQ(merged.at(i).finish_reason, "length");
  }
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, TokenIdPromptsEchoAndLogprobs) {
  const auto prompt = tokens_of("Hello there");
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/completions", {{"prompt", prompt},
                                                 {"echo", true},
                                                 {"max_tokens", 5},
                                                 {"temperature", 0},
                                                 {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  const std::string text = r.json_body()["choices"][0]["text"];
  const std::string generated = alone(prompt, greedy(5)).text;
  EXPECT_EQ(text, router_->model.tok->decode(prompt) + generated);

  const auto lp = c.post_json("/v1/completions", {{"prompt", prompt},
                                                  {"logprobs", 3},
                                                  {"max_tokens", 5},
                                                  {"temperature", 0},
                                                  {"ignore_eos", true}});
  ASSERT_EQ(lp.status, 200) << lp.body;
  const json l = lp.json_body()["choices"][0]["logprobs"];
  ASSERT_TRUE(l.is_object()) << lp.body;
  ASSERT_EQ(l["tokens"].size(), 5u);
  ASSERT_EQ(l["token_logprobs"].size(), 5u);
  ASSERT_EQ(l["top_logprobs"].size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_LE(l["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_GE(l["top_logprobs"][i].size(), 1u);
    EXPECT_LE(l["top_logprobs"][i].size(), 4u);
  }
  // Greedy: the chosen token is the most likely one, so its logprob is the top one.
  for (size_t i = 0; i < 5; ++i) {
    double best = -1e9;
    for (const auto& [k, v] : l["top_logprobs"][i].items()) best = std::max(best, v.get<double>());
    EXPECT_DOUBLE_EQ(l["token_logprobs"][i].get<double>(), best);
  }
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, ContextLengthAndEmptyPromptsAreRejectedBeforeDispatch) {
  const int64_t before = router_->dispatcher->submitted();
  TestClient c(router_->port());
  const auto r = c.post_json("/v1/completions", {{"prompt", "abc"}, {"max_tokens", 9000}});
  const json e = expect_error(r, 400, "invalid_request_error");
  EXPECT_EQ(e["code"], "context_length_exceeded");
  EXPECT_EQ(e["param"], "prompt");
  EXPECT_NE(e["message"].get<std::string>().find("8192"), std::string::npos) << e;
  EXPECT_NE(e["message"].get<std::string>().find("9000"), std::string::npos) << e;

  const std::vector<int32_t> long_prompt(8192, 65);
  const auto l = c.post_json("/v1/completions", {{"prompt", long_prompt}});
  EXPECT_EQ(expect_error(l, 400, "invalid_request_error")["code"], "context_length_exceeded");
  EXPECT_EQ(router_->dispatcher->submitted(), before);
  // The connection survives errors.
  EXPECT_EQ(c.request("GET", "/v1/models").status, 200);
}

TEST_F(HttpCompletionsTest, KeepAliveServesManyRequestsOnOneConnection) {
  TestClient c(router_->port());
  const json plain = {{"prompt", "x"}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}};
  json streamed = plain;
  streamed["stream"] = true;
  for (int round = 0; round < 3; ++round) {
    const auto a = c.post_json("/v1/completions", plain);
    ASSERT_EQ(a.status, 200) << a.body;
    EXPECT_TRUE(a.keep_alive);
    const auto s = c.post_json("/v1/completions", streamed);
    ASSERT_EQ(s.status, 200) << s.body;
    EXPECT_TRUE(s.keep_alive);
    bool done = false;
    sse_chunks(s.body, &done);
    EXPECT_TRUE(done);
    const auto m = c.request("GET", "/v1/models");
    ASSERT_EQ(m.status, 200) << m.body;
    const json models = m.json_body();
    ASSERT_EQ(models["data"].size(), 2u);
    EXPECT_EQ(models["data"][0]["id"], "synth-router");
    EXPECT_EQ(models["data"][0]["max_model_len"], 8192);
    EXPECT_EQ(router_->server->connections(), 1);
  }
  // The alias is served too; another name is not.
  const auto alias = c.post_json("/v1/completions", {{"model", "synth-alias"}, {"prompt", "x"},
                                                     {"max_tokens", 1}});
  EXPECT_EQ(alias.status, 200) << alias.body;
  EXPECT_EQ(alias.json_body()["model"], "synth-router");
  EXPECT_EQ(c.request("GET", "/v1/models/synth-alias").json_body()["id"], "synth-alias");
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, PipelinedRequestsAndHttp10Streams) {
  const std::string body =
      json{{"prompt", "Hi"}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}}.dump();
  const std::string one = fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{}", body.size(), body);
  {
    // Two requests in one write: two answers, in order, on the same connection.
    TestClient c(router_->port());
    ASSERT_TRUE(c.send_raw(one + one));
    const auto a = c.read_response();
    const auto b = c.read_response();
    ASSERT_EQ(a.status, 200) << a.body;
    ASSERT_EQ(b.status, 200) << b.body;
    EXPECT_EQ(a.json_body()["choices"][0]["text"], b.json_body()["choices"][0]["text"]);
  }
  {
    // HTTP/1.0 has no chunked encoding: the stream is the raw events, ended by closing.
    const std::string sbody = json{{"prompt", "Hi"}, {"max_tokens", 4}, {"temperature", 0},
                                   {"ignore_eos", true}, {"stream", true}}
                                  .dump();
    TestClient c(router_->port());
    ASSERT_TRUE(c.send_raw(fmt::format(
        "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{}", sbody.size(), sbody)));
    std::string all;
    ASSERT_TRUE(c.wait_closed(&all));
    const size_t head_end = all.find("\r\n\r\n");
    ASSERT_NE(head_end, std::string::npos) << all;
    const std::string head = all.substr(0, head_end);
    EXPECT_EQ(head.find("chunked"), std::string::npos) << head;
    EXPECT_NE(head.find("Connection: close"), std::string::npos) << head;
    bool done = false;
    const auto merged = merge_stream(sse_chunks(all.substr(head_end + 4), &done), false);
    EXPECT_TRUE(done);
    ASSERT_EQ(merged.size(), 1u);
    EXPECT_EQ(merged.at(0).text, alone(tokens_of("Hi"), greedy(4)).text);
  }
  router_->expect_engine_idle();
}

TEST_F(HttpCompletionsTest, FrontendFromTheModelFileTakesItsNameAndContext) {
  metrics::MetricsRegistry registry;
  auto f = RouterFrontend::create_from_model_file(router_synth_path(), {}, *router_->dispatcher,
                                                  registry);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->model_name(), "synth-router");
  EXPECT_EQ((*f)->max_model_len(), 8192);
  auto prepared = (*f)->prepare_completion(R"({"prompt": "Hi", "n": 2})");
  ASSERT_TRUE(prepared.ok()) << prepared.error().to_json();
  ASSERT_EQ(prepared->dispatches.size(), 2u);
  EXPECT_EQ(prepared->dispatches[0].params.max_tokens, 16);  // OpenAI's default
  EXPECT_NE(prepared->dispatches[0].params.seed, prepared->dispatches[1].params.seed);
  EXPECT_EQ(prepared->dispatches[0].prompt, tokens_of("Hi"));
  // Without a seed every request gets its own.
  auto again = (*f)->prepare_completion(R"({"prompt": "Hi"})");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->dispatches[0].params.seed, prepared->dispatches[0].params.seed);
  EXPECT_FALSE(RouterFrontend::create_from_model_file("/nonexistent.gguf", {}, *router_->dispatcher,
                                                      registry)
                   .ok());
}

}  // namespace
}  // namespace cleave::router::testing_http
