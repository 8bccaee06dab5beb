// Errors of the HTTP frontend as OpenAI error objects with the right status (400 malformed JSON
// and bad fields, 401 API keys, 404 path and model, 405, 413, 429, 503), malformed HTTP, header
// timeouts, mangled bodies that must never crash the server, /health, and /metrics as
// Prometheus text with the vLLM-named series.
#include <gtest/gtest.h>

#include <random>
#include <regex>

#include "http_test_util.h"

namespace cleave::router::testing_http {
namespace {

class HttpErrorsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    HttpServerOptions o;
    o.max_body_bytes = 8192;
    o.header_timeout = std::chrono::milliseconds(300);
    o.api_keys = {"sk-first", "sk-second"};
    router_ = RouterUnderTest::start(o).release();
    ASSERT_NE(router_, nullptr);
  }
  static void TearDownTestSuite() {
    delete router_;
    remove_router_synth_dir();
  }
  void SetUp() override {
    if (!router_) GTEST_SKIP() << "router did not start";
    router_->dispatcher->set_ready(true);
    router_->dispatcher->set_queue_limit(1024);
  }
  static std::vector<std::pair<std::string, std::string>> auth(const std::string& key = "sk-second") {
    return {{"Authorization", "Bearer " + key}};
  }
  static json small_request() {
    return {{"prompt", "hi"}, {"max_tokens", 2}, {"temperature", 0}, {"ignore_eos", true}};
  }

  static RouterUnderTest* router_;
};
RouterUnderTest* HttpErrorsTest::router_ = nullptr;

TEST_F(HttpErrorsTest, MalformedJsonAndBadFieldsAre400) {
  TestClient c(router_->port());
  auto r = c.request("POST", "/v1/completions", "{\"prompt\": \"x\",", auth());
  json e = expect_error(r, 400, "invalid_request_error");
  EXPECT_NE(e["message"].get<std::string>().find("not valid JSON"), std::string::npos) << e;
  r = c.request("POST", "/v1/completions", "[1, 2]", auth());
  expect_error(r, 400, "invalid_request_error");
  r = c.post_json("/v1/completions", {{"prompt", "x"}, {"temperature", -1}}, auth());
  EXPECT_EQ(expect_error(r, 400, "invalid_request_error")["param"], "temperature");
  r = c.post_json("/v1/completions", {{"prompt", "x"}, {"frobnicate", 1}}, auth());
  EXPECT_EQ(expect_error(r, 400, "invalid_request_error")["param"], "frobnicate");
  r = c.post_json("/v1/completions", {{"prompt", json::array({100000})}}, auth());
  expect_error(r, 400, "invalid_request_error");
  r = c.request("POST", "/v1/chat/completions", "", auth());
  expect_error(r, 400, "invalid_request_error");
  EXPECT_TRUE(r.keep_alive);
  EXPECT_EQ(router_->dispatcher->submitted(), 0);
}

TEST_F(HttpErrorsTest, ApiKeysGuardTheV1RoutesOnly) {
  TestClient c(router_->port());
  auto r = c.post_json("/v1/completions", small_request());
  EXPECT_EQ(expect_error(r, 401, "invalid_request_error")["code"], "invalid_api_key");
  r = c.post_json("/v1/completions", small_request(), auth("sk-wrong"));
  EXPECT_EQ(expect_error(r, 401, "invalid_request_error")["code"], "invalid_api_key");
  r = c.post_json("/v1/completions", small_request(), {{"Authorization", "Basic c2stZmlyc3Q="}});
  expect_error(r, 401, "invalid_request_error");
  r = c.request("GET", "/v1/models", "", {{"Authorization", "Bearer sk-firs"}});
  expect_error(r, 401, "invalid_request_error");
  r = c.post_json("/v1/completions", small_request(), auth("sk-first"));
  EXPECT_EQ(r.status, 200) << r.body;
  r = c.post_json("/v1/completions", small_request(), {{"Authorization", "bearer  sk-second"}});
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(c.request("GET", "/health").status, 200);
  EXPECT_EQ(c.request("GET", "/metrics").status, 200);
  router_->expect_engine_idle();
}

TEST_F(HttpErrorsTest, UnknownPathsModelsAndMethods) {
  TestClient c(router_->port());
  auto r = c.request("GET", "/v1/engines", "", auth());
  expect_error(r, 404, "invalid_request_error");
  r = c.request("GET", "/nope");
  expect_error(r, 404, "invalid_request_error");
  json body = small_request();
  body["model"] = "not-served";
  r = c.post_json("/v1/completions", body, auth());
  json e = expect_error(r, 404, "invalid_request_error");
  EXPECT_EQ(e["code"], "model_not_found");
  EXPECT_EQ(e["param"], "model");
  r = c.request("GET", "/v1/models/not-served", "", auth());
  EXPECT_EQ(expect_error(r, 404, "invalid_request_error")["code"], "model_not_found");
  r = c.request("GET", "/v1/completions", "", auth());
  expect_error(r, 405, "invalid_request_error");
  EXPECT_EQ(r.header("allow"), "POST");
  r = c.request("DELETE", "/health");
  expect_error(r, 405, "invalid_request_error");
  r = c.request("BREW", "/v1/chat/completions", "", auth());
  expect_error(r, 405, "invalid_request_error");
  EXPECT_EQ(c.request("GET", "/health").status, 200);  // still on the same connection
}

// HEAD is answered on every GET route with the GET reply's headers and no body, and errors to
// HEAD (401, 404, 405) carry no body either: on one keep-alive connection, each next GET must
// read a whole, intact response (a stray body would be parsed as its status line).
TEST_F(HttpErrorsTest, HeadRepliesCarryNoBody) {
  TestClient c(router_->port());
  const auto expect_next_get_intact = [&](const std::string& after) {
    const auto g = c.request("GET", "/health");
    EXPECT_EQ(g.status, 200) << "after HEAD " << after << ": " << g.body;
    EXPECT_EQ(g.json_body().value("status", ""), "ok") << "after HEAD " << after << ": " << g.body;
  };
  const auto metrics_get = c.request("GET", "/metrics");
  ASSERT_EQ(metrics_get.status, 200);
  for (const std::string target : {"/metrics", "/health", "/v1/models", "/v1/models/synth-router"}) {
    const auto h = c.head(target, auth());
    EXPECT_EQ(h.status, 200) << target;
    EXPECT_TRUE(h.body.empty()) << target;
    EXPECT_TRUE(h.keep_alive) << target;
    EXPECT_FALSE(h.header("content-length").empty()) << target;
    if (target == "/metrics") {
      EXPECT_EQ(h.header("content-type"), metrics_get.header("content-type"));
    }
    expect_next_get_intact(target);
  }
  const auto models_get = c.request("GET", "/v1/models", "", auth());
  EXPECT_EQ(c.head("/v1/models", auth()).header("content-length"),
            std::to_string(models_get.body.size()));
  expect_next_get_intact("/v1/models (length)");

  struct Case { std::string target; bool with_key; int status; };
  for (const Case& k : {Case{"/v1/completions", true, 405}, Case{"/v1/chat/completions", true, 405},
                        Case{"/nope", true, 404}, Case{"/v1/models/not-served", true, 404},
                        Case{"/v1/models", false, 401}}) {
    const auto h = k.with_key ? c.head(k.target, auth()) : c.head(k.target);
    EXPECT_EQ(h.status, k.status) << k.target;
    EXPECT_TRUE(h.body.empty()) << k.target;
    expect_next_get_intact(k.target);
  }
  EXPECT_EQ(c.head("/v1/completions", auth()).header("allow"), "POST");
  expect_next_get_intact("/v1/completions (allow)");
  const auto del = c.request("DELETE", "/metrics");
  EXPECT_EQ(del.status, 405);
  EXPECT_EQ(del.header("allow"), "GET, HEAD");
}

TEST_F(HttpErrorsTest, OversizedBodiesAre413) {
  {
    TestClient c(router_->port());
    json body = small_request();
    body["prompt"] = std::string(9000, 'a');
    const auto r = c.post_json("/v1/completions", body, auth());
    EXPECT_EQ(expect_error(r, 413, "invalid_request_error")["code"], "request_too_large");
    EXPECT_FALSE(r.keep_alive);
  }
  {
    // Announced by Content-Length with Expect: 100-continue: refused before the body is sent.
    TestClient c(router_->port());
    ASSERT_TRUE(c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                           "sk-first\r\nContent-Length: 100000000\r\nExpect: 100-continue\r\n\r\n"));
    const auto r = c.read_response();
    EXPECT_EQ(r.status, 413) << r.body;
  }
  {
    // Chunked bodies count too.
    TestClient c(router_->port());
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-first"
                      "\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 3; ++i) req += "1000\r\n" + std::string(4096, ' ') + "\r\n";
    req += "0\r\n\r\n";
    ASSERT_TRUE(c.send_raw(req));
    EXPECT_EQ(c.read_response().status, 413);
  }
  TestClient c(router_->port());
  EXPECT_EQ(c.request("GET", "/health").status, 200);
}

TEST_F(HttpErrorsTest, QueueFullIs429AndNoWorkerIs503) {
  TestClient c(router_->port());
  router_->dispatcher->set_queue_limit(0);
  auto r = c.post_json("/v1/completions", small_request(), auth());
  EXPECT_NE(expect_error(r, 429, "rate_limit_error")["message"].get<std::string>().find("queue"),
            std::string::npos);
  json stream = small_request();
  stream["stream"] = true;
  r = c.post_json("/v1/completions", stream, auth());  // no stream opens: a plain 429
  expect_error(r, 429, "rate_limit_error");
  EXPECT_NE(r.header("content-type").find("application/json"), std::string::npos);

  router_->dispatcher->set_queue_limit(1024);
  router_->dispatcher->set_ready(false);
  r = c.request("GET", "/health");
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_EQ(r.json_body()["status"], "unavailable");
  r = c.post_json("/v1/chat/completions",
                  {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}}, auth());
  EXPECT_EQ(expect_error(r, 503, "server_error")["code"], "service_unavailable");
  router_->dispatcher->set_ready(true);
  r = c.request("GET", "/health");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json_body()["pools"][0]["name"], "unified");
  router_->expect_engine_idle();
}

TEST_F(HttpErrorsTest, MalformedHttpAndSlowHeadersCloseTheConnection) {
  {
    TestClient c(router_->port());
    ASSERT_TRUE(c.send_raw("THIS IS NOT HTTP\r\n\r\n"));
    const auto r = c.read_response();
    expect_error(r, 400, "invalid_request_error");
    EXPECT_TRUE(c.wait_closed());
  }
  {
    TestClient c(router_->port());
    ASSERT_TRUE(c.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n"));  // never finished
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(c.wait_closed(nullptr, std::chrono::seconds(5)));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  }
  {
    TestClient c(router_->port());
    ASSERT_TRUE(c.send_raw("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " +
                           std::string(70 * 1024, 'b') + "\r\n\r\n"));
    EXPECT_EQ(c.read_response().status, 431);
  }
  TestClient c(router_->port());
  EXPECT_EQ(c.request("GET", "/health").status, 200);
}

TEST_F(HttpErrorsTest, MangledBodiesNeverCrashTheServer) {
  const std::string valid = json{{"prompt", "abc"}, {"max_tokens", 2}, {"temperature", 0.5},
                                 {"stop", {"x"}}, {"n", 2}, {"logprobs", 1}, {"seed", 3}}
                                .dump();
  const std::string valid_chat =
      json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
           {"max_tokens", 2}, {"stream", true}}
          .dump();
  std::mt19937 rng(1234);
  TestClient c(router_->port());
  int answered = 0;
  for (int i = 0; i < 150; ++i) {
    std::string body = i % 2 ? valid : valid_chat;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits && !body.empty(); ++k) {
      const size_t at = rng() % body.size();
      switch (rng() % 4) {
        case 0: body[at] = static_cast<char>(rng() % 256); break;
        case 1: body.erase(at, 1 + rng() % 8); break;
        case 2: body.insert(at, 1, "{}[]\",:0-e\\"[rng() % 11]); break;
        case 3: body.resize(at); break;
      }
    }
    const auto r = c.request("POST", i % 2 ? "/v1/completions" : "/v1/chat/completions", body,
                             auth());
    if (r.status == 0) {  // the connection was closed on us: reconnect and go on
      ASSERT_TRUE(c.connect());
      continue;
    }
    ++answered;
    EXPECT_TRUE(r.status == 200 || r.status == 400 || r.status == 404) << r.status << " " << r.body;
  }
  EXPECT_GT(answered, 140);
  EXPECT_EQ(c.request("GET", "/health").status, 200);
  router_->expect_engine_idle();
}

TEST_F(HttpErrorsTest, MetricsAreValidPrometheusTextWithTheVllmNames) {
  TestClient c(router_->port());
  ASSERT_EQ(c.post_json("/v1/completions", small_request(), auth()).status, 200);
  ASSERT_EQ(c.post_json("/v1/completions", {{"prompt", "x"}, {"top_p", 7}}, auth()).status, 400);
  const auto r = c.request("GET", "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.header("content-type"), "text/plain; version=0.0.4; charset=utf-8");

  // Every line is a comment or `name{labels} value`; TYPE lines name each family once.
  const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? (-?[0-9.eE+-]+|NaN|\+Inf|-Inf)$)");
  const std::regex type_line(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram)$)");
  std::map<std::string, std::string> types;
  std::map<std::string, double> values;  // full series text -> value
  size_t pos = 0;
  const std::string& text = r.body;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty()) continue;
    std::smatch m;
    if (line.rfind("# HELP ", 0) == 0) continue;
    if (std::regex_match(line, m, type_line)) {
      EXPECT_EQ(types.count(m[1]), 0u) << "family typed twice: " << line;
      types[m[1]] = m[2];
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, m, sample)) << "not Prometheus text: " << line;
    const size_t space = line.rfind(' ');
    values[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  for (const char* name : {"cleave:num_requests_running", "cleave:num_requests_waiting",
                           "cleave:kv_cache_usage_perc"}) {
    EXPECT_EQ(types[name], "gauge") << name;
  }
  for (const char* name : {"cleave:time_to_first_token_seconds",
                           "cleave:time_per_output_token_seconds",
                           "cleave:e2e_request_latency_seconds",
                           "cleave:request_queue_time_seconds"}) {
    EXPECT_EQ(types[name], "histogram") << name;
  }
  for (const char* name : {"cleave:prompt_tokens_total", "cleave:generation_tokens_total",
                           "cleave:request_success_total", "cleave:http_requests_total"}) {
    EXPECT_EQ(types[name], "counter") << name;
  }
  EXPECT_GE(values["cleave:time_to_first_token_seconds_count"], 1);
  EXPECT_GE(values["cleave:e2e_request_latency_seconds_count"], 1);
  EXPECT_GE(values["cleave:generation_tokens_total"], 2);
  EXPECT_GE(values["cleave:request_success_total{finished_reason=\"length\"}"], 1);
  EXPECT_GE(values["cleave:http_requests_total{handler=\"/v1/completions\",status=\"200\"}"], 1);
  EXPECT_GE(values["cleave:http_requests_total{handler=\"/v1/completions\",status=\"400\"}"], 1);
  EXPECT_EQ(values.count("cleave:kv_cache_usage_perc{pool=\"unified\"}"), 1u);
  EXPECT_EQ(values["cleave:num_requests_running"], 0);
  EXPECT_EQ(values["cleave:num_requests_waiting"], 0);
  router_->expect_engine_idle();
}

}  // namespace
}  // namespace cleave::router::testing_http
