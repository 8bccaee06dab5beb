// Migration through the public APIs: the HTTP API's SSE stream and the gRPC API's Generate
// stream of a request whose unified worker stops mid-stream go on, through the real
// dispatcher, on the other worker; the client gets the text of an undisturbed run (greedy over
// HTTP, seeded over gRPC), a finish reason and no error: a pause, nothing else.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>

#include "cleave/router/grpc_server.h"
#include "cleave/v1/inference.grpc.pb.h"
#include "dispatch_test_util.h"
#include "http_test_util.h"

namespace cleave::router {
namespace {

using namespace testing_dispatch;
using testing_http::TestClient;
using json = nlohmann::json;

class MigrationApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto* w : {&a_, &b_}) {
      *w = start_worker(worker_config("unified", slow_model_path()));
      ASSERT_TRUE(w->server);
    }
    model_ = testing_engine::ModelUnderTest::load(slow_model_path());
    ASSERT_TRUE(model_.file);
    DispatcherOptions o = test_options();
    o.unified.workers = {a_.address, b_.address};
    o.unified.policy = DispatchPolicyKind::kRoundRobin;
    o.metrics = &registry_;
    auto d = make_dispatcher(o);
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    dispatcher_ = std::move(*d);
    ASSERT_TRUE(eventually([&] { return dispatcher_->pools()[0].workers_ready == 2; }));
    auto tmpl = chat_template_or_fallback(model_.file->tokenizer().chat_template);
    ASSERT_TRUE(tmpl.ok()) << tmpl.status().to_string();
    FrontendOptions fo;
    fo.served_model_names = {"slow"};
    auto frontend = RouterFrontend::create(fo, model_.tok, std::move(*tmpl), *dispatcher_,
                                           registry_);
    ASSERT_TRUE(frontend.ok()) << frontend.status().to_string();
    frontend_ = std::move(*frontend);
    HttpServerOptions ho;
    ho.host = "127.0.0.1";
    ho.port = 0;
    auto http = HttpServer::start(ho, *frontend_);
    ASSERT_TRUE(http.ok()) << http.status().to_string();
    http_ = std::move(*http);
    GrpcServerOptions go;
    go.host = "127.0.0.1";
    go.port = 0;
    auto grpc_server = GrpcServer::start(go, *frontend_);
    ASSERT_TRUE(grpc_server.ok()) << grpc_server.status().to_string();
    grpc_ = std::move(*grpc_server);
  }

  void TearDown() override {
    if (grpc_) grpc_->stop();
    if (http_) http_->stop();
    grpc_.reset();
    http_.reset();
    frontend_.reset();
    if (dispatcher_) dispatcher_->shutdown();
  }

  double resumed() const {
    const std::string text = registry_.render();
    const std::string series = "\ncleave:migrations_total{outcome=\"resumed\"} ";
    const size_t at = text.find(series);
    return at == std::string::npos ? 0 : std::stod(text.substr(at + series.size()));
  }

  // Waits until neither worker reports a running request (a finished request may still be
  // counted for a moment after its stream ended).
  bool workers_idle() {
    return eventually([&] {
      for (TestWorker* w : {&a_, &b_}) {
        auto l = w->client->load();
        if (!l.ok() || l->running() != 0) return false;
      }
      return true;
    });
  }

  // While `running` has not ended: once some of its tokens are out (its client has received
  // ten pieces when `count_received`, else 40 ms after the worker reported it running) and most
  // are still to come, stops the worker running it, once; the worker stopped, or nullptr.
  template <typename Future>
  TestWorker* stop_the_worker_running_it(Future& running, bool count_received) {
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until &&
           running.wait_for(0ms) != std::future_status::ready) {
      if (count_received && received_.load() < 10) {
        std::this_thread::sleep_for(1ms);
        continue;
      }
      for (TestWorker* w : {&a_, &b_}) {
        auto l = w->client->load();
        if (l.ok() && l->running() >= 1) {
          if (!count_received) std::this_thread::sleep_for(40ms);  // some tokens out
          w->server->shutdown();
          stopped_at_ = received_.load();
          return w;
        }
      }
      std::this_thread::sleep_for(1ms);
    }
    return nullptr;
  }

  std::atomic<int64_t> received_{0};  // pieces the running stream's client has received
  int64_t stopped_at_ = 0;            // received_ when the worker was stopped
  TestWorker a_, b_;
  testing_engine::ModelUnderTest model_;
  metrics::MetricsRegistry registry_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<RouterFrontend> frontend_;
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<GrpcServer> grpc_;
};

TEST_F(MigrationApiTest, HttpStreamOfAStoppedWorkerGoesOnWithTheSameText) {
  const json body = {{"model", "slow"},       {"prompt", "Once upon a time"},
                     {"max_tokens", 700},     {"temperature", 0},
                     {"ignore_eos", true},    {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  const auto stream_text = [&](std::string* finish, int64_t* completion_tokens) {
    TestClient c(http_->port(), 60s);
    const auto r = c.post_json("/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    bool done = false;
    const auto chunks = testing_http::sse_chunks(r.body, &done);
    EXPECT_TRUE(done) << "no [DONE]";
    for (const auto& ch : chunks) {
      EXPECT_FALSE(ch.contains("error")) << ch.dump();
      if (ch.contains("usage") && ch["usage"].is_object()) {
        *completion_tokens = ch["usage"]["completion_tokens"].get<int64_t>();
      }
    }
    const auto merged = testing_http::merge_stream(chunks, false);
    *finish = merged.empty() ? "" : merged.begin()->second.finish_reason;
    return merged.empty() ? std::string() : merged.begin()->second.text;
  };
  std::string ref_finish, finish;
  int64_t ref_tokens = 0, tokens = 0;
  const std::string reference = stream_text(&ref_finish, &ref_tokens);
  ASSERT_EQ(ref_finish, "length");
  ASSERT_EQ(ref_tokens, 700);
  ASSERT_FALSE(reference.empty());

  ASSERT_TRUE(workers_idle());
  auto running = std::async(std::launch::async, [&] { return stream_text(&finish, &tokens); });
  ASSERT_NE(stop_the_worker_running_it(running, false), nullptr) << "no worker was seen running it";
  ASSERT_EQ(running.wait_for(30s), std::future_status::ready) << "the stream hangs";
  const std::string text = running.get();
  EXPECT_EQ(resumed(), 1) << "the request ended before its worker stopped";
  EXPECT_EQ(text, reference);
  EXPECT_EQ(finish, "length");
  EXPECT_EQ(tokens, 700) << "the usage counts the whole request";
}

TEST_F(MigrationApiTest, GrpcStreamOfAStoppedWorkerGoesOnWithTheSameSeededText) {
  auto channel = grpc::CreateChannel(fmt::format("127.0.0.1:{}", grpc_->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Inference::NewStub(channel);
  v1::GenerateTextRequest req;
  req.add_prompts()->set_text("Once upon a time");
  req.set_max_tokens(700);
  req.set_temperature(0.9);
  req.set_seed(31337);
  req.set_ignore_eos(true);
  struct Result {
    grpc::Status status;
    std::string text;
    std::vector<int32_t> ids;
    std::string finish;
    int64_t completion_tokens = 0;
  };
  const auto generate = [&](bool count) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 60s);
    Result r;
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateTextResponse msg;
    while (reader->Read(&msg)) {
      if (count) ++received_;
      for (const auto& d : msg.choices()) {
        r.text += d.text();
        r.ids.insert(r.ids.end(), d.token_ids().begin(), d.token_ids().end());
        if (!d.finish_reason().empty()) r.finish = d.finish_reason();
      }
      if (msg.has_usage()) r.completion_tokens = msg.usage().completion_tokens();
    }
    r.status = reader->Finish();
    return r;
  };
  const Result reference = generate(false);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_EQ(reference.finish, "length");
  ASSERT_FALSE(reference.text.empty());

  ASSERT_TRUE(workers_idle());
  received_ = 0;
  auto running = std::async(std::launch::async, [&] { return generate(true); });
  ASSERT_NE(stop_the_worker_running_it(running, true), nullptr) << "no worker was seen running it";
  ASSERT_EQ(running.wait_for(30s), std::future_status::ready) << "the stream hangs";
  const Result got = running.get();
  EXPECT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_LT(stopped_at_, 700) << "the request ended before its worker stopped";
  EXPECT_EQ(resumed(), 1) << "the request ended before its worker stopped";
  EXPECT_EQ(got.text, reference.text);
  EXPECT_EQ(got.ids, reference.ids);
  EXPECT_EQ(got.finish, "length");
  EXPECT_EQ(got.completion_tokens, 700);
}

}  // namespace
}  // namespace cleave::router
