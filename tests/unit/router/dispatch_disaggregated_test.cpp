// The dispatcher over real prefill and decode workers (WorkerServer in-process, the KV moving
// through the transfer engine over tcp;ofi_rxm or shm on loopback): Reserve -> Prefill ->
// Decode gives Generator's tokens, a request ending with its first token releases its
// reservation, a decode worker that stops mid-stream ends the stream with an error, a dead
// decode worker is avoided by retrying on another, cancellation frees the blocks of both, and
// a pair that cannot pair is never used.
#include <gtest/gtest.h>

#include "dispatch_test_util.h"

namespace cleave::router {
namespace {

using namespace testing_dispatch;
using testing_engine::synth_path;

class DispatchDisaggregatedTest : public ReferenceModelTest {
 protected:
  static std::vector<std::vector<int32_t>> prompts(int n) {
    std::mt19937 rng(91);
    const int64_t lens[] = {3, 16, 17, 50, 1, 95, 33, 8};
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(testing_engine::random_prompt(rng, *ref_->tok, 512, lens[i % std::size(lens)]));
    }
    return out;
  }
  static DispatcherOptions disaggregated(std::vector<std::string> prefill,
                                         std::vector<std::string> decode) {
    DispatcherOptions o = test_options();
    o.mode = DispatchMode::kDisaggregated;
    o.prefill.workers = std::move(prefill);
    o.decode.workers = std::move(decode);
    o.lease = 3000ms;
    return o;
  }
};

// Both orders of the stages: the Decode opened right after Reserve (early_decode, its first
// token in the KV's notice) and the Decode opened after the Prefill's answer.
class DispatchPairTest : public DispatchDisaggregatedTest,
                         public ::testing::WithParamInterface<std::tuple<const char*, bool>> {};

TEST_P(DispatchPairTest, PrefillPlusDecodeGiveGeneratorsTokens) {
  const std::string provider = std::get<0>(GetParam());
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", synth_path(), provider), &why);
  if (!decode.server) GTEST_SKIP() << provider << " unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", synth_path(), provider));
  ASSERT_TRUE(prefill.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = disaggregated({prefill.address}, {decode.address});
  o.metrics = &registry;
  o.early_decode = std::get<1>(GetParam());
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE((*d)->wait_ready(10s));
  const auto pools = (*d)->pools();
  ASSERT_EQ(pools.size(), 2u);
  EXPECT_EQ(pools[0].name, "prefill");
  EXPECT_EQ(pools[1].name, "decode");
  EXPECT_EQ((*d)->model_info().role(), "decode");

  const auto ps = prompts(8);
  auto params = [](size_t i) {
    // One request ends with its first token (max_tokens 1): its reservation is released.
    return greedy(i == 4 ? 1 : 10, i == 5 ? 2 : -1);
  };
  std::vector<Submitted> runs;
  for (size_t i = 0; i < ps.size(); ++i) runs.push_back(submit(**d, ps[i], params(i)));
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end()) << i;
    expect_same_as(*runs[i].observer, reference(ps[i], params(i)),
                   fmt::format("{} prompt {}", provider, i));
    EXPECT_EQ(runs[i].observer->usage().prompt_tokens(), static_cast<int64_t>(ps[i].size()));
  }
  expect_blocks_back(*prefill.client, "prefill");
  expect_blocks_back(*decode.client, "decode");
  const std::string m = registry.render();
  EXPECT_NE(m.find("cleave:kv_handoff_tail_seconds_count 7"), std::string::npos) << m;
  EXPECT_NE(m.find("cleave:kv_transfer_seconds_count 7"), std::string::npos) << m;
  EXPECT_EQ(m.find("cleave:kv_transfer_seconds_sum 0\n"), std::string::npos) << m;
  EXPECT_EQ(m.find("cleave:kv_transfer_bytes_total 0\n"), std::string::npos) << m;
}

TEST_F(DispatchDisaggregatedTest, RepeatedPromptReportsThePrefillsCachedTokens) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", synth_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", synth_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated({prefill.address}, {decode.address}));
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  const auto p = prompts(6)[5];  // 95 tokens: 5 full blocks of 16
  ASSERT_EQ(p.size(), 95u);
  Submitted first = submit(**d, p, greedy(6));
  ASSERT_TRUE(first.observer->wait_end());
  expect_same_as(*first.observer, reference(p, greedy(6)), "first run");
  EXPECT_EQ(first.observer->usage().cached_prompt_tokens(), 0);
  ASSERT_TRUE(eventually([&] { return prefill.client->load()->blocks_cached() >= 5; }))
      << prefill.client->load()->ShortDebugString();
  // The same prompt again: the prefill worker's prefix cache serves its full blocks, and the
  // finished event's usage (which comes from the decode worker) says how many.
  Submitted again = submit(**d, p, greedy(6));
  ASSERT_TRUE(again.observer->wait_end());
  expect_same_as(*again.observer, reference(p, greedy(6)), "repeated prompt");
  EXPECT_EQ(again.observer->usage().cached_prompt_tokens(), 80)
      << "the prefill worker's answer must carry first.usage.cached_prompt_tokens on a handoff";
  expect_blocks_back(*prefill.client, "prefill");
  expect_blocks_back(*decode.client, "decode");
}

INSTANTIATE_TEST_SUITE_P(Providers, DispatchPairTest,
                         ::testing::Combine(::testing::Values("tcp;ofi_rxm", "shm"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::string(std::get<0>(info.param)) == "shm"
                                                  ? "shm"
                                                  : "tcp") +
                                  (std::get<1>(info.param) ? "_early" : "_after_prefill");
                         });

TEST_F(DispatchDisaggregatedTest, DecodeWorkerStoppingMidStreamEndsTheStreamWithAnError) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated({prefill.address}, {decode.address}));
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  Submitted s = submit(**d, {1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56},
                       long_run(1000));
  ASSERT_TRUE(s.observer->wait_tokens(4));
  const auto t0 = std::chrono::steady_clock::now();
  decode.server->shutdown();
  ASSERT_TRUE(s.observer->wait_end(10s)) << "the stream hangs";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
  EXPECT_FALSE(s.observer->finished());
  EXPECT_TRUE(s.observer->error_started());
  EXPECT_EQ(s.observer->error().code(), StatusCode::kUnavailable) << s.observer->error().to_string();
  expect_blocks_back(*prefill.client, "prefill");
  EXPECT_FALSE((*d)->ready());
}

TEST_F(DispatchDisaggregatedTest, ADeadDecodeWorkerIsAvoidedByRetrying) {
  std::string why;
  TestWorker dead = start_worker(worker_config("decode", synth_path()), &why);
  if (!dead.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker decode = start_worker(worker_config("decode", synth_path()));
  TestWorker prefill = start_worker(worker_config("prefill", synth_path()));
  ASSERT_TRUE(decode.server && prefill.server);
  DispatcherOptions o = disaggregated({prefill.address}, {dead.address, decode.address});
  o.decode.policy = DispatchPolicyKind::kRoundRobin;
  o.health_interval = 60s;  // only the first round: the dead worker still looks ready
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[1].workers_ready == 2; }));
  dead.server->shutdown();
  const auto ps = prompts(4);
  std::vector<Submitted> runs;
  for (const auto& p : ps) runs.push_back(submit(**d, p, greedy(6)));
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end()) << i;
    expect_same_as(*runs[i].observer, reference(ps[i], greedy(6)), fmt::format("prompt {}", i));
  }
  EXPECT_EQ((*d)->pools()[1].workers_ready, 1);
  expect_blocks_back(*prefill.client, "prefill");
  expect_blocks_back(*decode.client, "decode");
}

// A prefill that reaches its prompt after the decode worker's lease has ended (here: a lease
// shorter than the prefill) is the prefill worker's lateness, not a fault: nobody is marked
// failed, the request ends with RESOURCE_EXHAUSTED (try later), and every block comes back.
TEST_F(DispatchDisaggregatedTest, ALeaseThatEndsBeforeThePrefillWroteBlamesNoWorker) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(prefill.server);
  DispatcherOptions o = disaggregated({prefill.address}, {decode.address});
  o.lease = 5ms;  // over before the first layer of a 900-token prompt is computed
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  std::mt19937 rng(5);
  const auto prompt = testing_engine::random_prompt(rng, *ref_->tok, 512, 900);
  Submitted s = submit(**d, prompt, greedy(4));
  ASSERT_TRUE(s.observer->wait_end(30s)) << "the request hangs";
  EXPECT_FALSE(s.observer->finished());
  EXPECT_EQ(s.observer->error().code(), StatusCode::kResourceExhausted)
      << s.observer->error().to_string();
  EXPECT_NE(s.observer->error().message().find("lease"), std::string::npos)
      << s.observer->error().to_string();
  const auto pools = (*d)->pools();
  EXPECT_EQ(pools[0].workers_ready, 1) << "the prefill worker was marked failed";
  EXPECT_EQ(pools[1].workers_ready, 1) << "the decode worker was marked failed";
  expect_blocks_back(*prefill.client, "prefill");
  expect_blocks_back(*decode.client, "decode");
}

// Prefills that wait in their worker's queue (and compute) longer than the lease keep their
// reservations: the router renews the lease on the decode worker, then the write bound on the
// prefill worker, while each Prefill runs. Every request completes with the text it gets alone,
// no lease expires, and every block comes back.
TEST_F(DispatchDisaggregatedTest, QueuedPrefillsLongerThanTheLeaseKeepTheirReservations) {
  std::string why;
  WorkerConfig dc = worker_config("decode", slow_model_path());
  dc.engine.kv_blocks = 512;  // room for the eight reservations at once
  TestWorker decode = start_worker(dc, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(prefill.server);
  DispatcherOptions o = disaggregated({prefill.address}, {decode.address});
  metrics::MetricsRegistry registry;
  o.metrics = &registry;
  // Renewed every 200 ms, each renewal RPC bounded by 200 ms: the lease ends only when three
  // rounds in a row miss, which a loaded 2-core machine did with a 300 ms lease (100 ms RPCs).
  o.lease = 600ms;
  o.prefill_queue_tokens = 0;  // all eight reserve at once and queue at the prefill worker
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> ps;
  // About 190 ms of prefill each on this model (2 vCPU): the last one waits some 1.3 s.
  for (int i = 0; i < 8; ++i) ps.push_back(testing_engine::random_prompt(rng, *ref_->tok, 512, 900));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Submitted> runs;
  for (const auto& p : ps) runs.push_back(submit(**d, p, greedy(4)));
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(runs[i].observer->wait_end(60s)) << "request " << i << " hangs";
    ASSERT_TRUE(runs[i].observer->finished()) << i << ": " << runs[i].observer->error().to_string();
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  // The last prefill waited behind seven others: well past the 600 ms lease.
  ASSERT_GT(took, o.lease + o.lease / 2) << "the prefills were too quick to test renewal";
  const auto load = decode.client->load();
  ASSERT_TRUE(load.ok());
  EXPECT_GE(load->leases_renewed(), 1u);
  EXPECT_EQ(load->leases_expired(), 0u);
  const std::string text = registry.render();
  EXPECT_NE(text.find("cleave:router_lease_renewals_total{outcome=\"renewed\"}"),
            std::string::npos) << text;
  // Each alone (one at a time) gives the same tokens.
  for (size_t i = 0; i < ps.size(); ++i) {
    Submitted alone = submit(**d, ps[i], greedy(4));
    ASSERT_TRUE(alone.observer->wait_end(60s)) << i;
    ASSERT_TRUE(alone.observer->finished()) << alone.observer->error().to_string();
    EXPECT_EQ(runs[i].observer->tokens(), alone.observer->tokens()) << "prompt " << i;
  }
  expect_blocks_back(*prefill.client, "prefill");
  expect_blocks_back(*decode.client, "decode");
}

TEST_F(DispatchDisaggregatedTest, CancelDuringDecodeFreesBlocksOnBothWorkers) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated({prefill.address}, {decode.address}));
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->wait_ready(10s));
  std::vector<int32_t> prompt = {1};
  for (int i = 0; i < 40; ++i) prompt.push_back(20 + i);
  Submitted s = submit(**d, prompt, long_run(900));
  ASSERT_TRUE(s.observer->wait_tokens(3));
  s.handle->cancel();
  const int events = s.observer->events();
  expect_blocks_back(*decode.client, "decode after cancel");
  expect_blocks_back(*prefill.client, "prefill after cancel");
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(s.observer->events(), events);
  EXPECT_FALSE(s.observer->ended());
  EXPECT_GE(decode.client->load()->requests_cancelled(), 1u);
}

TEST_F(DispatchDisaggregatedTest, WorkersThatCannotPairAreNeverUsed) {
  std::string why;
  WorkerConfig dc = worker_config("decode", synth_path());
  dc.engine.block_size = 32;
  dc.engine.kv_blocks = 64;
  TestWorker decode = start_worker(dc, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", synth_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated({prefill.address}, {decode.address}));
  ASSERT_TRUE(d.ok());
  // Both are healthy, yet no pair is usable.
  ASSERT_TRUE(eventually([&] {
    const auto p = (*d)->pools();
    return p[0].workers_ready == 1 && p[1].workers_ready == 1;
  }));
  EXPECT_FALSE((*d)->ready());
  auto r = (*d)->submit(DispatchRequest{{1, 2, 3}, greedy(3), {}},
                        std::make_shared<CollectingObserver>());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("paired"), std::string::npos) << r.status().message();
  // A worker in the wrong pool is not ready either.
  auto wrong = make_dispatcher(disaggregated({decode.address}, {prefill.address}));
  ASSERT_TRUE(wrong.ok());
  std::this_thread::sleep_for(400ms);
  const auto p = (*wrong)->pools();
  EXPECT_EQ(p[0].workers_ready, 0);
  EXPECT_EQ(p[1].workers_ready, 0);
}

}  // namespace
}  // namespace cleave::router
