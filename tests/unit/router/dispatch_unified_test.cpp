// The dispatcher over a pool of real unified workers (WorkerServer in-process on 127.0.0.1):
// readiness from health probes, tokens equal to Generator's, retries on another worker before
// the first token, a stream whose worker stops, cancellation, stage deadlines, the queue limit,
// and discovery through a DNS name.
#include <gtest/gtest.h>

#include "dispatch_test_util.h"

namespace cleave::router {
namespace {

using namespace testing_dispatch;
using testing_engine::synth_path;

class DispatchUnifiedTest : public ReferenceModelTest {
 protected:
  static std::vector<std::vector<int32_t>> prompts(int n) {
    std::mt19937 rng(77);
    const int64_t lens[] = {1, 9, 16, 33, 70, 4};
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(testing_engine::random_prompt(rng, *ref_->tok, 512, lens[i % std::size(lens)]));
    }
    return out;
  }
};

TEST_F(DispatchUnifiedTest, NotReadyUntilAWorkerIsHealthy) {
  const int port = free_port();
  DispatcherOptions o = test_options();
  o.unified.workers = {fmt::format("127.0.0.1:{}", port)};
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  std::this_thread::sleep_for(300ms);  // a few probe rounds against nothing
  EXPECT_FALSE((*d)->ready());
  EXPECT_FALSE((*d)->wait_ready(100ms));
  auto pools = (*d)->pools();
  ASSERT_EQ(pools.size(), 1u);
  EXPECT_EQ(pools[0].name, "unified");
  EXPECT_EQ(pools[0].workers_known, 1);
  EXPECT_EQ(pools[0].workers_ready, 0);
  EXPECT_TRUE((*d)->model_info().model_fingerprint().empty());
  auto refused = (*d)->submit(DispatchRequest{{1, 2, 3}, greedy(4), {}},
                              std::make_shared<CollectingObserver>());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("no unified worker"), std::string::npos)
      << refused.status().message();

  // The worker comes up at that address: the next probes find it.
  TestWorker w = start_worker(
      worker_config("unified", synth_path(), "tcp;ofi_rxm", fmt::format("127.0.0.1:{}", port)));
  ASSERT_TRUE(w.server);
  ASSERT_TRUE((*d)->wait_ready(10s));
  const v1::WorkerInfo info = (*d)->model_info();
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.max_context(), 512);
  const auto p = prompts(2)[1];
  Submitted s = submit(**d, p, greedy(10));
  ASSERT_TRUE(s.observer->wait_end());
  expect_same_as(*s.observer, reference(p, greedy(10)), "after the worker came up");
  EXPECT_EQ(s.observer->usage().prompt_tokens(), static_cast<int64_t>(p.size()));

  // Empty prompts are refused before any worker is asked.
  auto empty = (*d)->submit(DispatchRequest{{}, greedy(4), {}}, std::make_shared<CollectingObserver>());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  // A request the worker refuses is not retried: the observer hears the worker's error.
  SamplingParams bad = greedy(4);
  bad.top_p = 0;
  Submitted b = submit(**d, p, bad);
  ASSERT_TRUE(b.observer->wait_end());
  EXPECT_EQ(b.observer->error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.observer->error().message().find("top_p"), std::string::npos);
  EXPECT_FALSE(b.observer->error_started());
  (*d)->shutdown();
  EXPECT_FALSE((*d)->ready());
  EXPECT_EQ((*d)->submit(DispatchRequest{p, greedy(2), {}}, std::make_shared<CollectingObserver>())
                .status()
                .code(),
            StatusCode::kUnavailable);
}

TEST_F(DispatchUnifiedTest, TwoWorkersGiveGeneratorsTokensAndShareTheLoad) {
  TestWorker a = start_worker(worker_config("unified", synth_path()));
  TestWorker b = start_worker(worker_config("unified", synth_path()));
  ASSERT_TRUE(a.server && b.server);
  DispatcherOptions o = test_options();
  o.unified.workers = {a.address, b.address};
  o.unified.policy = DispatchPolicyKind::kRoundRobin;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 2; }));

  const auto ps = prompts(8);
  std::vector<Submitted> runs;
  for (size_t i = 0; i < ps.size(); ++i) runs.push_back(submit(**d, ps[i], greedy(12, i == 3 ? 3 : -1)));
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end()) << i;
    expect_same_as(*runs[i].observer, reference(ps[i], greedy(12, i == 3 ? 3 : -1)),
                   fmt::format("prompt {}", i));
  }
  expect_blocks_back(*a.client, "worker a");
  expect_blocks_back(*b.client, "worker b");
  EXPECT_EQ(a.client->load()->requests_finished(), 4u);
  EXPECT_EQ(b.client->load()->requests_finished(), 4u);
}

TEST_F(DispatchUnifiedTest, RequestsWithoutTokensAreRetriedOnAnotherWorker) {
  TestWorker a = start_worker(worker_config("unified", synth_path()));
  TestWorker b = start_worker(worker_config("unified", synth_path()));
  ASSERT_TRUE(a.server && b.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = test_options();
  o.unified.workers = {a.address, b.address};
  o.unified.policy = DispatchPolicyKind::kRoundRobin;
  o.health_interval = 60s;  // only the first probe round: the dispatcher keeps believing in `a`
  o.metrics = &registry;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 2; }));
  a.server->shutdown();

  const auto ps = prompts(6);
  std::vector<Submitted> runs;
  for (const auto& p : ps) runs.push_back(submit(**d, p, greedy(8)));
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end()) << i;
    expect_same_as(*runs[i].observer, reference(ps[i], greedy(8)), fmt::format("prompt {}", i));
  }
  // `a` failed UNAVAILABLE and left the pool; every request ran on `b`.
  EXPECT_EQ((*d)->pools()[0].workers_ready, 1);
  EXPECT_EQ(b.client->load()->requests_finished(), 6u);
  const std::string m = registry.render();
  EXPECT_EQ(m.find("cleave:router_dispatch_retries_total 0\n"), std::string::npos) << m;
  EXPECT_NE(m.find("cleave:router_worker_failures_total"), std::string::npos) << m;

  // With no other worker left, a failure ends the request with the worker's error.
  b.server->shutdown();
  Submitted last = submit(**d, ps[1], greedy(4));
  ASSERT_TRUE(last.observer->wait_end(10s));
  EXPECT_EQ(last.observer->error().code(), StatusCode::kUnavailable)
      << last.observer->error().to_string();
  EXPECT_FALSE(last.observer->error_started());
  EXPECT_FALSE((*d)->ready());
}

TEST_F(DispatchUnifiedTest, AStreamWhoseWorkerStopsEndsWithAnError) {
  TestWorker w = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(w.server);
  DispatcherOptions o = test_options();
  o.unified.workers = {w.address};
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  Submitted s = submit(**d, {1, 5, 9, 13}, long_run(1000));
  ASSERT_TRUE(s.observer->wait_tokens(3));
  const auto t0 = std::chrono::steady_clock::now();
  w.server->shutdown();
  ASSERT_TRUE(s.observer->wait_end(10s)) << "the stream hangs";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  EXPECT_FALSE(s.observer->finished());
  EXPECT_TRUE(s.observer->error_started());
  EXPECT_EQ(s.observer->error().code(), StatusCode::kUnavailable) << s.observer->error().to_string();
  EXPECT_LT(s.observer->tokens().size(), 1000u);
}

TEST_F(DispatchUnifiedTest, CancelStopsTheEventsAndFreesTheBlocks) {
  TestWorker w = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(w.server);
  DispatcherOptions o = test_options();
  o.unified.workers = {w.address};
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  const uint64_t cancelled_before = w.client->load()->requests_cancelled();
  Submitted s = submit(**d, {1, 5, 9, 13, 17, 21}, long_run(1000));
  ASSERT_TRUE(s.observer->wait_tokens(2));
  s.handle->cancel();
  const int events = s.observer->events();
  s.handle->cancel();  // idempotent
  expect_blocks_back(*w.client, "after cancel");
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(s.observer->events(), events) << "events after cancel() returned";
  EXPECT_FALSE(s.observer->ended());
  EXPECT_EQ(w.client->load()->requests_cancelled(), cancelled_before + 1);
}

TEST_F(DispatchUnifiedTest, FirstTokenDeadlineTriesEachWorkerThenFails) {
  TestWorker a = start_worker(worker_config("unified", slow_model_path()));
  TestWorker b = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(a.server && b.server);
  DispatcherOptions o = test_options();
  o.unified.workers = {a.address, b.address};
  o.timeouts.first_token = 30ms;  // far less than the prefill of 900 tokens takes
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 2; }));
  std::vector<int32_t> prompt(900);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + static_cast<int32_t>(i % 500);
  const auto t0 = std::chrono::steady_clock::now();
  Submitted s = submit(**d, prompt, greedy(4));
  ASSERT_TRUE(s.observer->wait_end(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_EQ(s.observer->error().code(), StatusCode::kDeadlineExceeded)
      << s.observer->error().to_string();
  EXPECT_NE(s.observer->error().message().find("no first token within 30 ms"), std::string::npos)
      << s.observer->error().message();
  EXPECT_NE(s.observer->error().message().find("not retried"), std::string::npos)
      << s.observer->error().message();
  EXPECT_FALSE(s.observer->error_started());
  // Both workers were tried, and both were told to stop (GetLoad is published after each
  // engine step: wait for the cancellation to show, then for the blocks).
  EXPECT_TRUE(eventually([&] { return a.client->load()->requests_cancelled() == 1; }))
      << a.client->load()->ShortDebugString();
  EXPECT_TRUE(eventually([&] { return b.client->load()->requests_cancelled() == 1; }))
      << b.client->load()->ShortDebugString();
  expect_blocks_back(*a.client, "worker a");
  expect_blocks_back(*b.client, "worker b");
  EXPECT_EQ((*d)->pools()[0].workers_ready, 2);  // a slow worker is not a dead one
}

TEST_F(DispatchUnifiedTest, QueueLimitRefusesWithResourceExhausted) {
  TestWorker w = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(w.server);
  DispatcherOptions o = test_options();
  o.unified.workers = {w.address};
  o.queue_limit = 2;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  Submitted s1 = submit(**d, {1, 2, 3}, long_run(800));
  Submitted s2 = submit(**d, {1, 4, 5}, long_run(800));
  auto third = (*d)->submit(DispatchRequest{{1, 6}, greedy(2), {}},
                            std::make_shared<CollectingObserver>());
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("queue"), std::string::npos);
  s1.handle->cancel();
  s2.handle->cancel();
  // Once the cancelled requests have ended, there is room again.
  std::shared_ptr<CollectingObserver> obs;
  ASSERT_TRUE(eventually([&] {
    obs = std::make_shared<CollectingObserver>();
    return (*d)->submit(DispatchRequest{{1, 6}, greedy(2), {}}, obs).ok();
  }));
  ASSERT_TRUE(obs->wait_end());
  EXPECT_TRUE(obs->finished());
  expect_blocks_back(*w.client, "after the queue test");
}

// Cancels its own request from inside on_event once it has seen `cancel_after` tokens.
class SelfCancellingObserver final : public RequestObserver {
 public:
  explicit SelfCancellingObserver(size_t cancel_after) : cancel_after_(cancel_after) {}
  void set_handle(std::shared_ptr<DispatchHandle> h) {
    std::lock_guard<std::mutex> lock(mu_);
    handle_ = h;
  }
  void on_event(const v1::TokenEvent& ev) override {
    std::shared_ptr<DispatchHandle> h;
    {
      std::lock_guard<std::mutex> lock(mu_);
      EXPECT_FALSE(cancelled_) << "an event after cancel()";
      EXPECT_FALSE(ended_);
      if (ev.has_token()) ++tokens_;
      if (ev.finished()) ended_ = true;
      if (tokens_ >= cancel_after_ && !ev.finished() && handle_) {
        cancelled_ = true;
        h = handle_;
      }
    }
    if (h) h->cancel();  // from inside the callback
  }
  void on_error(const Status& error, bool) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_FALSE(cancelled_) << "an error after cancel(): " << error.to_string();
    ended_ = true;
    ADD_FAILURE() << error.to_string();
  }
  bool cancelled() { std::lock_guard<std::mutex> l(mu_); return cancelled_; }
  bool ended() { std::lock_guard<std::mutex> l(mu_); return ended_; }

 private:
  std::mutex mu_;
  size_t cancel_after_;
  std::shared_ptr<DispatchHandle> handle_;
  size_t tokens_ = 0;
  bool cancelled_ = false;
  bool ended_ = false;
};

TEST_F(DispatchUnifiedTest, ManyConcurrentRequestsSomeCancelledAllBlocksBack) {
  TestWorker a = start_worker(worker_config("unified", synth_path()));
  TestWorker b = start_worker(worker_config("unified", synth_path()));
  ASSERT_TRUE(a.server && b.server);
  DispatcherOptions o = test_options();
  o.unified.workers = {a.address, b.address};
  o.unified.policy = DispatchPolicyKind::kLeastLoaded;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 2; }));
  const auto ps = prompts(12);
  constexpr int kRequests = 90;
  std::vector<Submitted> plain;
  std::vector<std::shared_ptr<SelfCancellingObserver>> self_cancelling;
  std::vector<Submitted> cancelled_outside;
  for (int i = 0; i < kRequests; ++i) {
    const auto& p = ps[static_cast<size_t>(i) % ps.size()];
    SamplingParams params = long_run(40);
    if (i % 3 == 0) {
      plain.push_back(submit(**d, p, greedy(20)));
    } else if (i % 3 == 1) {
      auto obs = std::make_shared<SelfCancellingObserver>(1 + static_cast<size_t>(i % 5));
      auto h = (*d)->submit(DispatchRequest{p, params, {}}, obs);
      ASSERT_TRUE(h.ok()) << h.status().to_string();
      obs->set_handle(*h);
      self_cancelling.push_back(obs);
    } else {
      cancelled_outside.push_back(submit(**d, p, params));
    }
  }
  // Cancel these from this thread, at whatever point each has reached (some before their
  // first token, some mid-stream, some finished).
  for (auto& s : cancelled_outside) s.handle->cancel();
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(plain[i].observer->wait_end()) << i;
    EXPECT_TRUE(plain[i].observer->finished()) << plain[i].observer->error().to_string();
  }
  for (size_t i = 0; i < 12 && i < plain.size(); ++i) {
    const auto& p = ps[(i * 3) % ps.size()];
    expect_same_as(*plain[i].observer, reference(p, greedy(20)), fmt::format("plain {}", i));
  }
  ASSERT_TRUE(eventually([&] {
    return (*d)->submit(DispatchRequest{{1, 2}, greedy(1), {}}, std::make_shared<CollectingObserver>()).ok();
  }));
  expect_blocks_back(*a.client, "worker a");
  expect_blocks_back(*b.client, "worker b");
  for (auto& o2 : self_cancelling) EXPECT_TRUE(o2->cancelled() || o2->ended());
  for (auto& s : cancelled_outside) {
    // Finished before the cancel, or silent after it.
    if (s.observer->ended()) {
      EXPECT_TRUE(s.observer->finished()) << s.observer->error().to_string();
    }
  }
}

TEST_F(DispatchUnifiedTest, DnsNameFindsTheWorkers) {
  TestWorker w = start_worker(worker_config("unified", synth_path()));
  ASSERT_TRUE(w.server);
  DispatcherOptions o = test_options();
  o.unified.dns_name = "localhost";
  o.unified.dns_port = w.server->port();
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s)) << "localhost:" << w.server->port() << " was not found";
  EXPECT_GE((*d)->pools()[0].workers_known, 1);
  Submitted s = submit(**d, {1, 7, 8}, greedy(5));
  ASSERT_TRUE(s.observer->wait_end());
  expect_same_as(*s.observer, reference({1, 7, 8}, greedy(5)), "via DNS");
}

}  // namespace
}  // namespace cleave::router
