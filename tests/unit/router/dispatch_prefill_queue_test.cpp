// Room on a prefill worker (DispatcherOptions::prefill_queue_tokens) over real prefill and
// decode workers: requests beyond it wait at the router before their Reserve, so the decode
// worker holds reservations only for prefills that run, and they complete with the tokens of
// each alone; a request that waits past timeouts.prefill fails RESOURCE_EXHAUSTED naming the
// setting; the room counts other routers' prefills on the worker (its LoadReport); a queued
// request that is cancelled, or whose dispatcher shuts down, ends at once;
// every block comes back and the queue gauge ends at 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "dispatch_test_util.h"

namespace cleave::router {
namespace {

using namespace testing_dispatch;

// Each prompt run again alone (one at a time) gives the tokens it gave among the others.
void expect_each_alone_the_same(Dispatcher& d, const std::vector<std::vector<int32_t>>& ps,
                                std::vector<Submitted>& runs) {
  for (size_t i = 0; i < ps.size(); ++i) {
    Submitted alone = submit(d, ps[i], greedy(4));
    ASSERT_TRUE(alone.observer->wait_end(60s)) << i;
    ASSERT_TRUE(alone.observer->finished()) << alone.observer->error().to_string();
    EXPECT_EQ(runs[i].observer->tokens(), alone.observer->tokens()) << "prompt " << i;
  }
}

// The value of an unlabelled sample in a Prometheus rendering (-1 when absent).
double sample(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = ("\n" + text).find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size() - 1));
}

// The most one figure of a worker's LoadReport reached while this lives (polled every 5 ms).
class MostSeen {
 public:
  MostSeen(WorkerClient& client, int64_t (v1::LoadReport::*figure)() const)
      : thread_([this, &client, figure] {
          while (!done_.load()) {
            if (auto l = client.load(); l.ok()) most_ = std::max(most_, ((*l).*figure)());
            std::this_thread::sleep_for(5ms);
          }
        }) {}
  ~MostSeen() { stop(); }
  // Stops polling; the most seen.
  int64_t stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
    return most_;
  }

 private:
  std::atomic<bool> done_{false};
  int64_t most_ = 0;  // the polling thread's; read once it has ended
  std::thread thread_;
};

class DispatchPrefillQueueTest : public SlowModelTest {
 protected:
  static std::vector<std::vector<int32_t>> prompts(int n, int64_t len) {
    std::mt19937 rng(static_cast<uint32_t>(len));
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < n; ++i) out.push_back(testing_engine::random_prompt(rng, *ref_->tok, 512, len));
    return out;
  }
  void SetUp() override { start_workers(512); }
  // A decode worker with `decode_blocks` KV blocks of 16 tokens and a prefill worker.
  void start_workers(int64_t decode_blocks) {
    prefill_ = {};
    decode_ = {};
    std::string why;
    WorkerConfig dc = worker_config("decode", slow_model_path());
    dc.engine.kv_blocks = decode_blocks;
    decode_ = start_worker(dc, &why);
    if (!decode_.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
    prefill_ = start_worker(worker_config("prefill", slow_model_path()));
    ASSERT_TRUE(prefill_.server);
  }
  DispatcherOptions options(int64_t room) {
    DispatcherOptions o = test_options();
    o.mode = DispatchMode::kDisaggregated;
    o.prefill.workers = {prefill_.address};
    o.decode.workers = {decode_.address};
    // Long enough to outlast a stall of the whole machine (a full ctest -j2 run once logged
    // nothing from either worker for 4 s, beside e2e_serve_worker_failure): these tests are
    // about the router's queue, not about leases.
    o.lease = 10000ms;
    o.prefill_queue_tokens = room;
    o.metrics = &registry_;
    return o;
  }

  TestWorker decode_;
  TestWorker prefill_;
  metrics::MetricsRegistry registry_;
};

TEST_F(DispatchPrefillQueueTest, RequestsBeyondTheRoomWaitBeforeReservingDecodeKv) {
  // Room for one 900-token prompt: the four run one after the other.
  auto d = make_dispatcher(options(1000));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE((*d)->wait_ready(10s));
  const auto ps = prompts(4, 900);
  MostSeen reservations(*decode_.client, &v1::LoadReport::reservations);
  std::vector<Submitted> runs;
  for (const auto& p : ps) runs.push_back(submit(**d, p, greedy(4)));
  const std::string queued = registry_.render();
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end(60s)) << "request " << i << " hangs";
    ASSERT_TRUE(runs[i].observer->finished()) << i << ": " << runs[i].observer->error().to_string();
  }
  const int64_t most_reservations = reservations.stop();
  // The three behind the first waited at the router, not in the decode worker's pool.
  EXPECT_EQ(sample(queued, "cleave:router_prefill_queue_requests"), 3) << queued;
  // One prefill at a time; a second reservation can show only for the moment between the last
  // one's KV in place (the Prefill answered, the next request reserved) and the decode engine
  // taking it up. Without the room all four reserve at once.
  EXPECT_LE(most_reservations, 2) << "reservations were made for prefills that only queued";
  EXPECT_GE(most_reservations, 1);
  const std::string after = registry_.render();
  EXPECT_EQ(sample(after, "cleave:router_prefill_queue_requests"), 0) << after;
  EXPECT_EQ(sample(after, "cleave:router_prefill_queue_seconds_count"), 3) << after;
  expect_each_alone_the_same(**d, ps, runs);
  expect_blocks_back(*prefill_.client, "prefill");
  expect_blocks_back(*decode_.client, "decode");
}

TEST_F(DispatchPrefillQueueTest, TheRoomCountsTheOtherRoutersPrefills) {
  // Two routers over the same workers, room for one 900-token prompt: the second router's
  // request waits for the first router's prefill (known from the worker's LoadReport).
  auto a = make_dispatcher(options(1000));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  metrics::MetricsRegistry registry_b;
  DispatcherOptions ob = options(1000);
  ob.metrics = &registry_b;
  auto b = make_dispatcher(ob);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  ASSERT_TRUE((*a)->wait_ready(10s));
  ASSERT_TRUE((*b)->wait_ready(10s));
  const auto ps = prompts(2, 900);
  MostSeen tokens(*prefill_.client, &v1::LoadReport::prefill_tokens);
  std::vector<Submitted> runs;
  runs.push_back(submit(**a, ps[0], greedy(4)));
  // Router B's probes (every 100 ms) have seen the prefill in the worker's engine.
  ASSERT_TRUE(eventually([&] {
    const auto p = (*b)->pools();
    return !p.empty() && p[0].waiting + p[0].running > 0;
  }, 20s)) << "router B never saw the prefill in flight";
  runs.push_back(submit(**b, ps[1], greedy(4)));
  const std::string queued_b = registry_b.render();
  for (size_t i = 0; i < runs.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end(60s)) << "request " << i << " hangs";
    ASSERT_TRUE(runs[i].observer->finished()) << i << ": " << runs[i].observer->error().to_string();
  }
  const int64_t most_tokens = tokens.stop();
  EXPECT_EQ(sample(queued_b, "cleave:router_prefill_queue_requests"), 1) << queued_b;
  EXPECT_EQ(sample(registry_b.render(), "cleave:router_prefill_queue_seconds_count"), 1);
  // One prompt at a time on the worker: without the report both run at once (1800 tokens).
  EXPECT_EQ(most_tokens, static_cast<int64_t>(ps[0].size()));
  expect_each_alone_the_same(**a, ps, runs);
  expect_blocks_back(*prefill_.client, "prefill");
  expect_blocks_back(*decode_.client, "decode");
}

TEST_F(DispatchPrefillQueueTest, ARequestThatWaitsPastItsDeadlineFailsNamingTheSetting) {
  // Enough 1000-token prefills, one at a time, for three times the 3 s deadline's work, by the
  // time one of them takes here (a fixed count stops being enough when the engine gets faster).
  // The probe goes through a dispatcher of its own without a tight deadline: one cut short at the
  // worker in the middle of its KV transfer (under the sanitizers) would make the rail reconnect
  // and the decode worker look unready for a moment, another reason for the requests below.
  constexpr int kMostPrompts = 150;
  const auto all = prompts(kMostPrompts + 1, 1000);
  std::chrono::nanoseconds one{};
  {
    DispatcherOptions po = options(1000);
    po.metrics = nullptr;
    po.timeouts.prefill = 60000ms;
    auto probe_d = make_dispatcher(po);
    ASSERT_TRUE(probe_d.ok());
    ASSERT_TRUE((*probe_d)->wait_ready(10s));
    const auto p0 = std::chrono::steady_clock::now();
    Submitted probe = submit(**probe_d, all.back(), greedy(2));
    ASSERT_TRUE(probe.observer->wait_end(90s));
    ASSERT_TRUE(probe.observer->finished()) << probe.observer->error().to_string();
    one = std::chrono::steady_clock::now() - p0;
  }
  DispatcherOptions o = options(1000);
  o.timeouts.prefill = 3000ms;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  const int n = static_cast<int>(std::clamp<int64_t>(3 * o.timeouts.prefill / one + 2, 12, kMostPrompts));
  ASSERT_LT(n, kMostPrompts) << "one prefill took " << std::chrono::duration<double>(one).count()
                             << " s: too fast for this test's deadline";
  const std::vector<std::vector<int32_t>> ps(all.begin(), all.begin() + n);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Submitted> runs;
  for (const auto& p : ps) runs.push_back(submit(**d, p, greedy(2)));
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end(30s)) << "request " << i << " hangs";
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 3000ms + 2000ms) << "the waits outlived their deadline";
  // The first ones prefill (or, on a slow build, run out of time at the worker); the last
  // never had room.
  const Status last = runs.back().observer->error();
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted) << last.to_string();
  EXPECT_NE(last.message().find("no prefill worker had room"), std::string::npos) << last.to_string();
  EXPECT_NE(last.message().find("router.prefill_queue_tokens"), std::string::npos) << last.to_string();
  EXPECT_EQ(sample(registry_.render(), "cleave:router_prefill_queue_requests"), 0);
  expect_blocks_back(*prefill_.client, "prefill");
  expect_blocks_back(*decode_.client, "decode");
}

TEST_F(DispatchPrefillQueueTest, QueuedRequestsEndAtOnceOnCancelAndOnShutdown) {
  auto d = make_dispatcher(options(1000));
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  const auto ps = prompts(3, 900);
  Submitted first = submit(**d, ps[0], greedy(2));
  Submitted cancelled = submit(**d, ps[1], greedy(2));
  Submitted abandoned = submit(**d, ps[2], greedy(2));
  EXPECT_EQ(sample(registry_.render(), "cleave:router_prefill_queue_requests"), 2);
  cancelled.handle->cancel();
  EXPECT_EQ(sample(registry_.render(), "cleave:router_prefill_queue_requests"), 1)
      << "a cancelled request left the queue late";
  ASSERT_TRUE(first.observer->wait_end(60s));
  ASSERT_TRUE(first.observer->finished()) << first.observer->error().to_string();
  // The third got the room the cancelled one gave up; shut down while it runs or waits.
  (*d)->shutdown();
  ASSERT_TRUE(abandoned.observer->wait_end(10s)) << "shutdown left a queued request hanging";
  EXPECT_EQ(cancelled.observer->events(), 0);
  EXPECT_FALSE(cancelled.observer->ended());
  expect_blocks_back(*prefill_.client, "prefill");
  expect_blocks_back(*decode_.client, "decode");
}

TEST_F(DispatchPrefillQueueTest, AReserveRefusedForHeldBlocksWaitsForThemInsteadOfFailing) {
  // 48 blocks (768 tokens): one 500-token reservation (32 blocks) at a time fits.
  start_workers(48);
  if (!decode_.server) return;
  auto d = make_dispatcher(options(0));  // no prefill room: every request reserves at once
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[1].blocks_total == 48; }))
      << "the router has not probed the decode worker's pool";
  const auto ps = prompts(3, 500);
  std::vector<Submitted> runs;
  for (const auto& p : ps) runs.push_back(submit(**d, p, greedy(4)));
  // Needs more blocks than the pool has in all: refused at once, not kept waiting.
  Submitted too_big = submit(**d, prompts(1, 900)[0], greedy(4));
  ASSERT_TRUE(too_big.observer->wait_end(10s));
  EXPECT_EQ(too_big.observer->error().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.observer->error().message().find("in all"), std::string::npos)
      << too_big.observer->error().to_string();
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end(60s)) << "request " << i << " hangs";
    ASSERT_TRUE(runs[i].observer->finished()) << i << ": " << runs[i].observer->error().to_string();
  }
  const std::string m = registry_.render();
  EXPECT_GE(sample(m, "cleave:router_prefill_queue_seconds_count"), 2) << m;
  EXPECT_EQ(sample(m, "cleave:router_dispatch_retries_total"), 0) << "waits are no retries: " << m;
  expect_each_alone_the_same(**d, ps, runs);
  expect_blocks_back(*prefill_.client, "prefill");
  expect_blocks_back(*decode_.client, "decode");
}

TEST(DispatchPrefillQueueOptionsTest, ANegativeRoomIsRefusedNamingTheField) {
  DispatcherOptions o = test_options();
  o.mode = DispatchMode::kDisaggregated;
  o.prefill.workers = {"127.0.0.1:1"};
  o.decode.workers = {"127.0.0.1:2"};
  o.prefill_queue_tokens = -1;
  const Status s = validate_dispatcher_options(o);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prefill_queue_tokens"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace cleave::router
