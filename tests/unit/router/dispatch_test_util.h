// Shared harness of the dispatcher tests: real in-process workers (WorkerServer on 127.0.0.1),
// an observer that records a request's events, reference runs with Generator, and polling of
// the workers' load until every block is back.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../worker/engine_test_util.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/dispatcher.h"
#include "cleave/worker/proto_convert.h"
#include "cleave/worker/worker_client.h"
#include "cleave/worker/worker_service.h"

namespace cleave::router::testing_dispatch {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// A synthetic model slow enough (about a millisecond per token on one thread) that a long
// generation is still running when a test stops its worker or cancels it. Written once.
inline std::string slow_model_path() {
  static const std::string path = [] {
    const fs::path dir = fs::temp_directory_path() / fmt::format("cleave-dispatch-test-{}", ::getpid());
    fs::create_directories(dir);
    const std::string p = (dir / "slow.gguf").string();
    SynthOptions o;
    o.layers = 4;
    o.dim = 256;
    o.heads = 8;
    o.kv_heads = 4;
    o.ffn = 768;
    o.vocab = 512;
    o.context = 1024;
    o.seed = 11;
    const Status st = write_synth_model(o, p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return p;
  }();
  return path;
}

inline void remove_test_models() {
  std::error_code ec;
  fs::remove_all(fs::temp_directory_path() / fmt::format("cleave-dispatch-test-{}", ::getpid()), ec);
  testing_engine::remove_synth_dir();
}

// The model files go when the test program ends (not per suite: synth_path() and
// slow_model_path() write theirs once per process).
class RemoveTestModels final : public ::testing::Environment {
 public:
  void TearDown() override { remove_test_models(); }
};
inline ::testing::Environment* const kRemoveTestModels =
    ::testing::AddGlobalTestEnvironment(new RemoveTestModels);

inline WorkerConfig worker_config(const std::string& role, const std::string& model_path,
                            const std::string& provider = "tcp;ofi_rxm",
                            const std::string& listen = "127.0.0.1:0") {
  WorkerConfig c;
  c.model.path = model_path;
  c.engine.threads = 1;
  c.engine.block_size = 16;
  c.engine.kv_blocks = 128;
  c.engine.max_tokens_per_step = 256;
  c.transfer.provider = provider;
  c.transfer.node = provider == "shm" ? "" : "127.0.0.1";
  c.transfer.completion_timeout_ms = 2000;
  c.worker.role = role;
  c.worker.listen = listen;
  c.worker.id = role + "-" + listen;
  c.worker.lease_ms = 5000;
  return c;
}

struct TestWorker {
  std::unique_ptr<WorkerServer> server;
  std::unique_ptr<WorkerClient> client;  // for GetLoad
  std::string address;
};

// Empty `server` with the reason in `why` when it cannot start (e.g. no such provider here).
inline TestWorker start_worker(const WorkerConfig& c, std::string* why = nullptr) {
  TestWorker w;
  auto s = WorkerServer::start(c);
  if (!s.ok()) {
    if (why) *why = s.status().to_string();
    else ADD_FAILURE() << s.status().to_string();
    return w;
  }
  w.server = std::move(*s);
  w.address = w.server->address();
  auto client = WorkerClient::connect(w.address);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  if (client.ok()) w.client = std::move(*client);
  return w;
}

// A port nothing listens on now (bound, read, closed).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Polls GetLoad until every block is back and nothing runs (the engine publishes its stats
// after each step), then checks it.
inline void expect_blocks_back(WorkerClient& client, const std::string& what) {
  v1::LoadReport r;
  for (int i = 0; i < 500; ++i) {
    auto l = client.load();
    ASSERT_TRUE(l.ok()) << what << ": " << l.status().to_string();
    r = *l;
    if (r.blocks_used() == 0 && r.running() == 0 && r.waiting() == 0 && r.reservations() == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(r.blocks_used(), 0) << what;
  EXPECT_EQ(r.blocks_pinned(), 0) << what;
  EXPECT_EQ(r.blocks_reserved(), 0) << what;
  EXPECT_EQ(r.reservations(), 0) << what;
  EXPECT_EQ(r.running(), 0) << what;
  EXPECT_EQ(r.waiting(), 0) << what;
}

// Records one request's events; checks that nothing follows the end.
class CollectingObserver final : public RequestObserver {
 public:
  void on_event(const v1::TokenEvent& ev) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_FALSE(ended_) << "an event after the end of the request";
    ++events_;
    if (ev.has_token()) {
      tokens_.push_back(ev.token());
      logprobs_.push_back(ev.logprob());
    }
    text_ += ev.text();
    if (ev.finished()) {
      ended_ = true;
      finished_ = true;
      finish_reason_ = ev.finish_reason();
      usage_ = ev.usage();
    }
    cv_.notify_all();
  }
  void on_error(const Status& error, bool started) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_FALSE(ended_) << "an error after the end of the request: " << error.to_string();
    EXPECT_EQ(started, events_ > 0) << error.to_string();
    ended_ = true;
    error_ = error;
    error_started_ = started;
    cv_.notify_all();
  }

  // Waits for the end (finished event or error).
  bool wait_end(std::chrono::milliseconds timeout = 20s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return ended_; });
  }
  bool wait_tokens(size_t n, std::chrono::milliseconds timeout = 20s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return tokens_.size() >= n || ended_; }) &&
           tokens_.size() >= n;
  }

  bool ended() { std::lock_guard<std::mutex> l(mu_); return ended_; }
  bool finished() { std::lock_guard<std::mutex> l(mu_); return finished_; }
  int events() { std::lock_guard<std::mutex> l(mu_); return events_; }
  std::vector<int32_t> tokens() { std::lock_guard<std::mutex> l(mu_); return tokens_; }
  std::vector<float> logprobs() { std::lock_guard<std::mutex> l(mu_); return logprobs_; }
  std::string text() { std::lock_guard<std::mutex> l(mu_); return text_; }
  std::string finish_reason() { std::lock_guard<std::mutex> l(mu_); return finish_reason_; }
  v1::Usage usage() { std::lock_guard<std::mutex> l(mu_); return usage_; }
  Status error() { std::lock_guard<std::mutex> l(mu_); return error_; }
  bool error_started() { std::lock_guard<std::mutex> l(mu_); return error_started_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool ended_ = false;
  bool finished_ = false;
  int events_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<float> logprobs_;
  std::string text_;
  std::string finish_reason_;
  v1::Usage usage_;
  Status error_;
  bool error_started_ = false;
};

// One submitted request and what its observer collected.
struct Submitted {
  std::shared_ptr<CollectingObserver> observer = std::make_shared<CollectingObserver>();
  std::shared_ptr<DispatchHandle> handle;
};

inline Submitted submit(Dispatcher& d, const std::vector<int32_t>& prompt, const SamplingParams& p) {
  Submitted s;
  auto h = d.submit(DispatchRequest{prompt, p, {}}, s.observer);
  EXPECT_TRUE(h.ok()) << h.status().to_string();
  if (h.ok()) s.handle = *h;
  return s;
}

inline SamplingParams greedy(int32_t max_tokens, int32_t logprobs = -1) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.logprobs = logprobs;
  return p;
}

// A generation that runs until max_tokens (no end-of-text), for the slow model.
inline SamplingParams long_run(int32_t max_tokens) {
  SamplingParams p = greedy(max_tokens);
  p.ignore_eos = true;
  return p;
}

// Quick settings for tests: probes every 100 ms.
inline DispatcherOptions test_options() {
  DispatcherOptions o;
  o.health_interval = 100ms;
  o.timeouts.probe = 1000ms;
  o.timeouts.first_token = 20000ms;
  o.timeouts.stream_idle = 10000ms;
  o.policy_seed = 42;
  return o;
}

inline void expect_same_as(CollectingObserver& got, const GenerationResult& want,
                           const std::string& what) {
  ASSERT_TRUE(got.finished()) << what << ": " << got.error().to_string();
  EXPECT_EQ(got.tokens(), want.tokens) << what;
  EXPECT_EQ(got.text(), want.text) << what;
  EXPECT_EQ(got.finish_reason(), std::string(finish_reason_name(want.finish_reason))) << what;
  EXPECT_EQ(got.usage().completion_tokens(), static_cast<int64_t>(want.tokens.size())) << what;
  if (!want.logprobs.empty()) {
    const std::vector<float> lp = got.logprobs();
    ASSERT_EQ(lp.size(), want.logprobs.size()) << what;
    for (size_t i = 0; i < lp.size(); ++i) EXPECT_EQ(lp[i], want.logprobs[i].logprob) << what;
  }
}

// Polls `pred` every 10 ms until it holds or `timeout` passes.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

// A test suite with the model at Path() loaded once: its tokenizer, and Generator's output for
// a prompt alone, the reference a dispatched request must equal.
template <std::string (*Path)()>
class ModelSuiteTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ref_ = new testing_engine::ModelUnderTest(testing_engine::ModelUnderTest::load(Path()));
  }
  static void TearDownTestSuite() {
    delete ref_;
    ref_ = nullptr;
  }
  static GenerationResult reference(const std::vector<int32_t>& prompt, const SamplingParams& p) {
    auto model = ref_->model(1);
    return testing_engine::generate_alone(*model, *ref_->tok, prompt, p);
  }
  static inline testing_engine::ModelUnderTest* ref_ = nullptr;
};

using ReferenceModelTest = ModelSuiteTest<testing_engine::synth_path>;
using SlowModelTest = ModelSuiteTest<slow_model_path>;

}  // namespace cleave::router::testing_dispatch
