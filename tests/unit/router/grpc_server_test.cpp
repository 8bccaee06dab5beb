// The public gRPC API (cleave.v1.Inference) over a real dispatcher and engine: Generate streams
// the same tokens, text, finish reasons and usage as the HTTP API for the same request and seed
// (completions and chat, n > 1, token id prompts, logprobs); errors are the HTTP API's as gRPC
// statuses with the error object's fields in the trailing metadata; API keys; a client that
// cancels mid-stream and a server that stops with calls in flight leave every KV block back in
// the pool; grpc.health.v1 follows the dispatcher's readiness; ListModels.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <future>
#include <map>
#include <thread>

#include "cleave/router/grpc_server.h"
#include "cleave/v1/inference.grpc.pb.h"
#include "http_test_util.h"

namespace cleave::router::testing_http {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

struct GrpcResult {
  grpc::Status status;
  std::vector<v1::GenerateTextResponse> messages;
  std::multimap<std::string, std::string> trailing;
  std::map<int, std::string> text;         // per choice, concatenated
  std::map<int, std::vector<int32_t>> ids;  // per choice
  std::map<int, std::string> finish;       // per choice
  std::map<int, int> logprobs;             // per choice: logprob entries
  v1::CompletionUsage usage;

  std::string trailer(const std::string& key) const {
    auto it = trailing.find(key);
    return it == trailing.end() ? std::string() : it->second;
  }
};

class GrpcClient {
 public:
  explicit GrpcClient(int port)
      : channel_(grpc::CreateChannel(fmt::format("127.0.0.1:{}", port),
                                     grpc::InsecureChannelCredentials())),
        stub_(v1::Inference::NewStub(channel_)) {}

  GrpcResult generate(const v1::GenerateTextRequest& req, const std::string& api_key = {}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    if (!api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + api_key);
    GrpcResult r;
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateTextResponse msg;
    while (reader->Read(&msg)) {
      for (const auto& d : msg.choices()) {
        r.text[d.index()] += d.text();
        auto& ids = r.ids[d.index()];
        ids.insert(ids.end(), d.token_ids().begin(), d.token_ids().end());
        if (!d.finish_reason().empty()) r.finish[d.index()] = d.finish_reason();
        r.logprobs[d.index()] += d.logprobs_size();
      }
      if (msg.has_usage()) r.usage = msg.usage();
      r.messages.push_back(msg);
    }
    r.status = reader->Finish();
    for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
      r.trailing.emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
    }
    return r;
  }

  v1::Inference::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> stub_;
};

// grpc.health.v1.Health/Check through the generic stub (no generated health stubs here): the
// request's field 1 is the service name, the response's field 1 the status (1 SERVING,
// 2 NOT_SERVING); -1 when the call fails.
int health_status(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  grpc::GenericStub stub(channel);
  std::string req;
  if (!service.empty()) {
    req.push_back(0x0a);
    req.push_back(static_cast<char>(service.size()));
    req += service;
  }
  grpc::Slice slice(req);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  if (!done.get_future().get().ok()) return -1;
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return bytes.size() >= 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

v1::GenerateTextRequest prompt_request(const std::string& text, int max_tokens) {
  v1::GenerateTextRequest r;
  r.add_prompts()->set_text(text);
  r.set_max_tokens(max_tokens);
  r.set_temperature(0);
  r.set_ignore_eos(true);
  return r;
}

class GrpcApiTest : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { remove_router_synth_dir(); }

  void start(std::vector<std::string> api_keys = {}) {
    router_ = RouterUnderTest::start();
    ASSERT_NE(router_, nullptr);
    GrpcServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.api_keys = std::move(api_keys);
    auto s = GrpcServer::start(o, *router_->frontend);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    grpc_ = std::move(*s);
    client_ = std::make_unique<GrpcClient>(grpc_->port());
  }

  void TearDown() override {
    client_.reset();
    if (grpc_) grpc_->stop();
    grpc_.reset();
    router_.reset();
  }

  // Waits (bounded) until the server has no call in flight.
  void expect_no_calls() {
    const auto until = std::chrono::steady_clock::now() + seconds(10);
    while (grpc_->active_calls() != 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    EXPECT_EQ(grpc_->active_calls(), 0);
  }

  std::unique_ptr<RouterUnderTest> router_;
  std::unique_ptr<GrpcServer> grpc_;
  std::unique_ptr<GrpcClient> client_;
};

TEST_F(GrpcApiTest, CompletionStreamsTheHttpApisTokensTextAndUsage) {
  start();
  TestClient http(router_->port());
  const auto h = http.post_json("/v1/completions", {{"prompt", "Once upon a time"},
                                                    {"max_tokens", 12},
                                                    {"temperature", 0},
                                                    {"ignore_eos", true}});
  ASSERT_EQ(h.status, 200) << h.body;
  const json j = h.json_body();

  const GrpcResult g = client_->generate(prompt_request("Once upon a time", 12));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  ASSERT_FALSE(g.messages.empty());
  // The first message carries the first token; every message names the call.
  ASSERT_GT(g.messages[0].choices_size(), 0);
  EXPECT_GT(g.messages[0].choices(0).token_ids_size(), 0);
  for (const auto& m : g.messages) {
    EXPECT_EQ(m.id(), g.messages[0].id());
    EXPECT_EQ(m.model(), "synth-router");
  }
  EXPECT_EQ(g.messages[0].id().rfind("cmpl-", 0), 0u);
  EXPECT_TRUE(g.messages.back().has_usage());
  EXPECT_EQ(g.text.at(0), j["choices"][0]["text"].get<std::string>());
  EXPECT_FALSE(g.text.at(0).empty());
  EXPECT_EQ(g.ids.at(0).size(), 12u);
  EXPECT_EQ(g.finish.at(0), "length");
  EXPECT_EQ(g.usage.prompt_tokens(), j["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_EQ(g.usage.completion_tokens(), 12);
  EXPECT_EQ(g.usage.total_tokens(), g.usage.prompt_tokens() + 12);

  // Token id prompts give the same tokens as the text they encode.
  v1::GenerateTextRequest by_ids = prompt_request("", 12);
  by_ids.clear_prompts();
  const Tokenizer& tok = *router_->model.tok;
  for (int32_t id : tok.encode("Once upon a time", {.add_bos = tok.spec().add_bos,
                                                    .parse_special = true})) {
    by_ids.add_prompts()->mutable_token_ids()->add_ids(id);
  }
  // One prompt of several ids, not several prompts of one id each.
  v1::GenerateTextRequest one;
  one.CopyFrom(by_ids);
  one.clear_prompts();
  auto* ids = one.add_prompts()->mutable_token_ids();
  for (const auto& p : by_ids.prompts()) ids->add_ids(p.token_ids().ids(0));
  const GrpcResult gi = client_->generate(one);
  ASSERT_TRUE(gi.status.ok()) << gi.status.error_message();
  EXPECT_EQ(gi.ids.at(0), g.ids.at(0));
  EXPECT_EQ(gi.text.at(0), g.text.at(0));
  router_->expect_engine_idle();
  expect_no_calls();
}

TEST_F(GrpcApiTest, SeededChatChoicesAndLogprobsMatchTheHttpApi) {
  start();
  TestClient http(router_->port());
  const json body = {{"messages", {{{"role", "user"}, {"content", "Tell me a story."}}}},
                     {"max_tokens", 10},
                     {"temperature", 0.9},
                     {"seed", 1234},
                     {"n", 2},
                     {"logprobs", true},
                     {"top_logprobs", 2}};
  const auto h = http.post_json("/v1/chat/completions", body);
  ASSERT_EQ(h.status, 200) << h.body;
  const json j = h.json_body();
  ASSERT_EQ(j["choices"].size(), 2u);

  v1::GenerateTextRequest r;
  auto* m = r.add_messages();
  m->set_role("user");
  m->set_content("Tell me a story.");
  r.set_max_tokens(10);
  r.set_temperature(0.9);
  r.set_seed(1234);
  r.set_n(2);
  r.set_logprobs(true);
  r.set_top_logprobs(2);
  const GrpcResult g = client_->generate(r);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.messages[0].id().rfind("chatcmpl-", 0), 0u);
  for (int i = 0; i < 2; ++i) {
    const json& c = j["choices"][i];
    EXPECT_EQ(g.text.at(i), c["message"]["content"].get<std::string>()) << "choice " << i;
    EXPECT_EQ(g.finish.at(i), c["finish_reason"].get<std::string>()) << "choice " << i;
    EXPECT_EQ(static_cast<size_t>(g.logprobs.at(i)), c["logprobs"]["content"].size());
    EXPECT_EQ(g.ids.at(i).size(), c["logprobs"]["content"].size());
  }
  EXPECT_NE(g.text.at(0), g.text.at(1));  // the choices' seeds differ
  EXPECT_EQ(g.usage.completion_tokens(), j["usage"]["completion_tokens"].get<int64_t>());
  for (const auto& msg : g.messages) {
    for (const auto& d : msg.choices()) {
      for (const auto& lp : d.logprobs()) EXPECT_EQ(lp.top_logprobs_size(), 2);
    }
  }
  router_->expect_engine_idle();
}

TEST_F(GrpcApiTest, BadRequestsGetTheHttpApisErrorsAsStatuses) {
  start();
  auto bad = prompt_request("hi", 4);
  bad.set_temperature(-1);
  GrpcResult g = client_->generate(bad);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(g.status.error_message().find("temperature"), std::string::npos)
      << g.status.error_message();
  EXPECT_EQ(g.trailer("cleave-error-param"), "temperature");
  EXPECT_EQ(g.trailer("cleave-error-type"), "invalid_request_error");
  EXPECT_TRUE(g.messages.empty());

  auto model = prompt_request("hi", 4);
  model.set_model("no-such-model");
  g = client_->generate(model);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(g.trailer("cleave-error-code"), "model_not_found");

  g = client_->generate(v1::GenerateTextRequest());
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(g.status.error_message().find("prompts"), std::string::npos);

  auto both = prompt_request("hi", 4);
  both.add_messages()->set_role("user");
  g = client_->generate(both);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  auto too_long = prompt_request("hi", 100000);
  g = client_->generate(too_long);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(g.trailer("cleave-error-code"), "context_length_exceeded");
  EXPECT_NE(g.status.error_message().find("maximum context length"), std::string::npos);

  auto kwargs = prompt_request("hi", 4);
  kwargs.clear_prompts();
  kwargs.add_messages()->set_role("user");
  kwargs.mutable_messages(0)->set_content("hi");
  kwargs.set_chat_template_kwargs_json("[1,2]");
  g = client_->generate(kwargs);
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  router_->dispatcher->set_queue_limit(0);
  g = client_->generate(prompt_request("hi", 4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  router_->dispatcher->set_queue_limit(1024);
  router_->dispatcher->set_ready(false);
  g = client_->generate(prompt_request("hi", 4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  router_->dispatcher->set_ready(true);

  const std::string metrics = router_->frontend->render_metrics();
  EXPECT_NE(metrics.find("cleave:grpc_requests_total{method=\"Generate\",code=\"INVALID_ARGUMENT\"}"),
            std::string::npos)
      << metrics;
  router_->expect_engine_idle();
  expect_no_calls();
}

TEST_F(GrpcApiTest, ApiKeysAreRequiredWhenConfigured) {
  start({"secret-1", "secret-2"});
  GrpcResult g = client_->generate(prompt_request("hi", 2));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  g = client_->generate(prompt_request("hi", 2), "wrong");
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(g.trailer("cleave-error-code"), "invalid_api_key");
  g = client_->generate(prompt_request("hi", 2), "secret-2");
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.usage.completion_tokens(), 2);

  grpc::ClientContext ctx;
  v1::ListModelsResponse models;
  EXPECT_EQ(client_->stub().ListModels(&ctx, {}, &models).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  grpc::ClientContext ok_ctx;
  ok_ctx.AddMetadata("authorization", "Bearer secret-1");
  ASSERT_TRUE(client_->stub().ListModels(&ok_ctx, {}, &models).ok());
  ASSERT_EQ(models.models_size(), 2);
  EXPECT_EQ(models.models(0).id(), "synth-router");
  EXPECT_EQ(models.models(1).id(), "synth-alias");
  EXPECT_GT(models.models(0).max_model_len(), 0);
}

TEST_F(GrpcApiTest, ClientCancelMidStreamFreesEveryBlock) {
  start();
  const uint64_t cancelled_before = router_->engine->stats().requests_cancelled;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    auto reader = client_->stub().Generate(&ctx, prompt_request("Once upon a time", 8000));
    v1::GenerateTextResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    ASSERT_GT(msg.choices_size(), 0);
    ctx.TryCancel();
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  router_->expect_engine_idle();
  EXPECT_EQ(router_->engine->stats().requests_cancelled, cancelled_before + 1);
  EXPECT_EQ(router_->dispatcher->in_flight(), 0);
  expect_no_calls();

  // A deadline that passes mid-stream does the same.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + milliseconds(300));
    auto reader = client_->stub().Generate(&ctx, prompt_request("Once upon a time", 8000));
    v1::GenerateTextResponse msg;
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  router_->expect_engine_idle();
  expect_no_calls();
}

TEST_F(GrpcApiTest, StoppingTheServerEndsCallsInFlight) {
  start();
  std::vector<std::thread> clients;
  std::atomic<int> first_seen{0};
  std::atomic<int> ended_with_error{0};
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&] {
      GrpcClient c(grpc_->port());
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
      auto reader = c.stub().Generate(&ctx, prompt_request("Once upon a time", 8000));
      v1::GenerateTextResponse msg;
      if (reader->Read(&msg)) first_seen.fetch_add(1);
      while (reader->Read(&msg)) {
      }
      if (!reader->Finish().ok()) ended_with_error.fetch_add(1);
    });
  }
  const auto until = std::chrono::steady_clock::now() + seconds(20);
  while (first_seen.load() < 4 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_EQ(first_seen.load(), 4);
  grpc_->stop();
  for (auto& t : clients) t.join();
  EXPECT_EQ(ended_with_error.load(), 4);
  router_->expect_engine_idle();
  EXPECT_EQ(router_->dispatcher->in_flight(), 0);
}

TEST_F(GrpcApiTest, HealthFollowsTheDispatchersReadiness) {
  start();
  constexpr int kServing = 1, kNotServing = 2;
  const auto wait_for = [&](int want) {
    const auto until = std::chrono::steady_clock::now() + seconds(10);
    while (health_status(client_->channel(), "") != want &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    EXPECT_EQ(health_status(client_->channel(), ""), want);
    EXPECT_EQ(health_status(client_->channel(), "cleave.v1.Inference"), want);
  };
  wait_for(kServing);
  router_->dispatcher->set_ready(false);
  wait_for(kNotServing);
  router_->dispatcher->set_ready(true);
  wait_for(kServing);
}

}  // namespace
}  // namespace cleave::router::testing_http
