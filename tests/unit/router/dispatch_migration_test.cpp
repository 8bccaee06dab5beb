// Migration of started streams (dispatcher.h): a stream whose worker stops mid-stream moves to
// another worker with the tokens it delivered as resume tokens, and the observer gets exactly
// the tokens and text of an undisturbed run (greedy and seeded, unified and disaggregated), the
// usage of the whole request, and nothing but a pause. router.max_migrations bounds it (0: the
// error of old), cancellation during a migration frees every block, and
// cleave:migrations_total counts each outcome.
#include <gtest/gtest.h>

#include "dispatch_test_util.h"

namespace cleave::router {
namespace {

using namespace testing_dispatch;

class DispatchMigrationTest : public SlowModelTest {
 protected:
  static std::vector<int32_t> prompt(int len) {
    std::mt19937 rng(static_cast<uint32_t>(len));
    return testing_engine::random_prompt(rng, *ref_->tok, 512, len);
  }
  // Long enough to be mid-stream when a worker is stopped, with penalties so that the sampler
  // must see the resumed tokens as generated ones.
  static SamplingParams greedy_long() {
    SamplingParams p = long_run(240);
    p.repetition_penalty = 1.1f;
    p.presence_penalty = 0.3f;
    return p;
  }
  static SamplingParams seeded_long() {
    SamplingParams p = greedy_long();
    p.temperature = 0.9f;
    p.top_p = 0.95f;
    p.seed = 4242;
    p.logprobs = 1;
    return p;
  }


  // The index of the worker whose engine runs a request (-1 when none is seen within 10 s).
  static int running_on(const std::vector<TestWorker*>& workers) {
    int found = -1;
    (void)eventually([&] {
      for (size_t i = 0; i < workers.size(); ++i) {
        auto l = workers[i]->client->load();
        if (l.ok() && l->running() >= 1) {
          found = static_cast<int>(i);
          return true;
        }
      }
      return false;
    });
    return found;
  }

  static double metric(const metrics::MetricsRegistry& r, const std::string& series) {
    const std::string text = r.render();
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return 0;
    return std::stod(text.substr(at + series.size() + 2));
  }

  static DispatcherOptions unified(std::vector<std::string> workers) {
    DispatcherOptions o = test_options();
    o.unified.workers = std::move(workers);
    o.unified.policy = DispatchPolicyKind::kRoundRobin;
    return o;
  }
  static DispatcherOptions disaggregated(std::vector<std::string> prefill,
                                         std::vector<std::string> decode) {
    DispatcherOptions o = test_options();
    o.mode = DispatchMode::kDisaggregated;
    o.prefill.workers = std::move(prefill);
    o.decode.workers = std::move(decode);
    o.decode.policy = DispatchPolicyKind::kRoundRobin;
    o.lease = 3000ms;
    return o;
  }

  // Stops the worker running `s` once it has delivered `after` tokens (its index in
  // `workers`); the stream must still end with the reference's tokens, text, logprobs and
  // usage.
  static int stop_mid_stream_and_expect(Submitted& s, const std::vector<TestWorker*>& workers,
                                        size_t after, const GenerationResult& want,
                                        const std::string& what) {
    EXPECT_TRUE(s.observer->wait_tokens(after)) << what;
    const int victim = running_on(workers);
    EXPECT_GE(victim, 0) << what << ": no worker runs the request";
    if (victim < 0) return victim;
    const size_t before = s.observer->tokens().size();
    workers[static_cast<size_t>(victim)]->server->shutdown();
    EXPECT_TRUE(s.observer->wait_end(30s)) << what << ": the stream hangs";
    EXPECT_LT(before, want.tokens.size()) << what << ": the request ended before the stop";
    expect_same_as(*s.observer, want, what);
    return victim;
  }

};

TEST_F(DispatchMigrationTest, UnifiedStreamsSurviveTheirWorkerGreedyAndSeeded) {
  TestWorker a = start_worker(worker_config("unified", slow_model_path()));
  TestWorker b = start_worker(worker_config("unified", slow_model_path()));
  TestWorker c = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(a.server && b.server && c.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = unified({a.address, b.address, c.address});
  o.metrics = &registry;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 3; }));
  std::vector<TestWorker*> alive = {&a, &b, &c};

  const auto p = prompt(12);
  const GenerationResult greedy_ref = reference(p, greedy_long());
  Submitted g = submit(**d, p, greedy_long());
  const int first = stop_mid_stream_and_expect(g, alive, 30, greedy_ref, "greedy");
  ASSERT_GE(first, 0);
  alive.erase(alive.begin() + first);

  const GenerationResult seeded_ref = reference(p, seeded_long());
  Submitted s = submit(**d, p, seeded_long());
  const int second = stop_mid_stream_and_expect(s, alive, 45, seeded_ref, "seeded");
  ASSERT_GE(second, 0);
  alive.erase(alive.begin() + second);

  expect_blocks_back(*alive[0]->client, "the surviving worker");
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"resumed\"}"), 2);
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"completed\"}"), 2);
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"refused\"}"), 0);
}

TEST_F(DispatchMigrationTest, DisaggregatedStreamsSurviveTheirDecodeWorker) {
  std::string why;
  TestWorker d0 = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!d0.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker d1 = start_worker(worker_config("decode", slow_model_path()));
  TestWorker d2 = start_worker(worker_config("decode", slow_model_path()));
  TestWorker pre = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(d1.server && d2.server && pre.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = disaggregated({pre.address}, {d0.address, d1.address, d2.address});
  o.metrics = &registry;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[1].workers_ready == 3; }));
  std::vector<TestWorker*> alive = {&d0, &d1, &d2};

  // 40 prompt tokens + 30 resumed: the migration's prefill covers several KV blocks and the
  // new decode worker's reservation holds them all.
  const auto p = prompt(40);
  const GenerationResult greedy_ref = reference(p, greedy_long());
  Submitted g = submit(**d, p, greedy_long());
  const int first = stop_mid_stream_and_expect(g, alive, 30, greedy_ref, "greedy");
  ASSERT_GE(first, 0);
  alive.erase(alive.begin() + first);
  EXPECT_EQ(g.observer->usage().prompt_tokens(), static_cast<int64_t>(p.size()));

  const GenerationResult seeded_ref = reference(p, seeded_long());
  Submitted s = submit(**d, p, seeded_long());
  const int second = stop_mid_stream_and_expect(s, alive, 17, seeded_ref, "seeded");
  ASSERT_GE(second, 0);
  alive.erase(alive.begin() + second);

  expect_blocks_back(*pre.client, "prefill");
  expect_blocks_back(*alive[0]->client, "the surviving decode worker");
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"resumed\"}"), 2);
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"completed\"}"), 2);
}

TEST_F(DispatchMigrationTest, NoMigrationsMeansTheErrorOfOld) {
  TestWorker a = start_worker(worker_config("unified", slow_model_path()));
  TestWorker b = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(a.server && b.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = unified({a.address, b.address});
  o.max_migrations = 0;
  o.metrics = &registry;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 2; }));
  Submitted s = submit(**d, prompt(6), greedy_long());
  ASSERT_TRUE(s.observer->wait_tokens(5));
  const int victim = running_on({&a, &b});
  ASSERT_GE(victim, 0);
  (victim == 0 ? a : b).server->shutdown();
  ASSERT_TRUE(s.observer->wait_end(10s)) << "the stream hangs";
  EXPECT_FALSE(s.observer->finished());
  EXPECT_TRUE(s.observer->error_started());
  EXPECT_EQ(s.observer->error().code(), StatusCode::kUnavailable) << s.observer->error().to_string();
  EXPECT_NE(s.observer->error().message().find("router.max_migrations is 0"), std::string::npos)
      << s.observer->error().to_string();
  expect_blocks_back(*(victim == 0 ? b : a).client, "the other worker (never used)");
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"resumed\"}"), 0);
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"refused\"}"), 1);
}

TEST_F(DispatchMigrationTest, MaxMigrationsBoundsTheMoves) {
  TestWorker a = start_worker(worker_config("unified", slow_model_path()));
  TestWorker b = start_worker(worker_config("unified", slow_model_path()));
  TestWorker c = start_worker(worker_config("unified", slow_model_path()));
  ASSERT_TRUE(a.server && b.server && c.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = unified({a.address, b.address, c.address});
  o.max_migrations = 1;
  o.metrics = &registry;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[0].workers_ready == 3; }));
  std::vector<TestWorker*> alive = {&a, &b, &c};
  SamplingParams p = long_run(600);
  Submitted s = submit(**d, prompt(8), p);
  ASSERT_TRUE(s.observer->wait_tokens(10));
  int victim = running_on(alive);
  ASSERT_GE(victim, 0);
  alive[static_cast<size_t>(victim)]->server->shutdown();
  alive.erase(alive.begin() + victim);
  // Migrated once: it goes on elsewhere; the second stop ends it.
  ASSERT_TRUE(eventually([&] {
    return metric(registry, "cleave:migrations_total{outcome=\"resumed\"}") == 1;
  }));
  const size_t moved_at = s.observer->tokens().size();
  ASSERT_TRUE(s.observer->wait_tokens(moved_at + 10)) << s.observer->error().to_string();
  victim = running_on(alive);
  ASSERT_GE(victim, 0);
  alive[static_cast<size_t>(victim)]->server->shutdown();
  alive.erase(alive.begin() + victim);
  ASSERT_TRUE(s.observer->wait_end(10s)) << "the stream hangs";
  EXPECT_FALSE(s.observer->finished());
  EXPECT_TRUE(s.observer->error_started());
  EXPECT_EQ(s.observer->error().code(), StatusCode::kUnavailable) << s.observer->error().to_string();
  EXPECT_NE(s.observer->error().message().find("1 migrations made"), std::string::npos)
      << s.observer->error().to_string();
  // What it delivered until then is the reference's beginning, nothing twice.
  const GenerationResult want = reference(prompt(8), p);
  const auto got = s.observer->tokens();
  ASSERT_LT(got.size(), want.tokens.size());
  EXPECT_EQ(got, std::vector<int32_t>(want.tokens.begin(), want.tokens.begin() + got.size()));
  expect_blocks_back(*alive[0]->client, "the worker never used");
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"refused\"}"), 1);
  EXPECT_EQ(metric(registry, "cleave:migrations_total{outcome=\"completed\"}"), 0);
}

TEST_F(DispatchMigrationTest, CancelDuringAMigrationFreesEveryBlock) {
  std::string why;
  TestWorker d0 = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!d0.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker d1 = start_worker(worker_config("decode", slow_model_path()));
  TestWorker d2 = start_worker(worker_config("decode", slow_model_path()));
  TestWorker pre = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(d1.server && d2.server && pre.server);
  metrics::MetricsRegistry registry;
  DispatcherOptions o = disaggregated({pre.address}, {d0.address, d1.address, d2.address});
  o.metrics = &registry;
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(eventually([&] { return (*d)->pools()[1].workers_ready == 3; }));
  std::vector<TestWorker*> alive = {&d0, &d1, &d2};
  const std::string resumed = "cleave:migrations_total{outcome=\"resumed\"}";
  // Round 0 cancels as soon as the migration has begun (its Reserve or Prefill in flight),
  // round 1 once the migrated stream delivers again.
  for (int round = 0; round < 2; ++round) {
    Submitted s = submit(**d, prompt(50), long_run(900));
    ASSERT_TRUE(s.observer->wait_tokens(8));
    const int victim = running_on(alive);
    ASSERT_GE(victim, 0);
    const double before = metric(registry, resumed);
    alive[static_cast<size_t>(victim)]->server->shutdown();
    alive.erase(alive.begin() + victim);
    ASSERT_TRUE(eventually([&] { return metric(registry, resumed) == before + 1; }));
    if (round == 1) {
      const size_t n = s.observer->tokens().size();
      ASSERT_TRUE(s.observer->wait_tokens(n + 3)) << s.observer->error().to_string();
    }
    s.handle->cancel();
    const int events = s.observer->events();
    for (TestWorker* w : alive) {
      expect_blocks_back(*w->client, fmt::format("round {}: a surviving decode worker", round));
    }
    expect_blocks_back(*pre.client, fmt::format("round {}: prefill", round));
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(s.observer->events(), events) << "events after cancel() returned";
    EXPECT_FALSE(s.observer->ended());
  }
}

TEST(DispatchMigrationOptionsTest, NegativeMaxMigrationsIsRefused) {
  DispatcherOptions o = test_options();
  o.unified.workers = {"127.0.0.1:1"};
  EXPECT_TRUE(validate_dispatcher_options(o).ok());
  EXPECT_EQ(DispatcherOptions{}.max_migrations, 2);
  o.max_migrations = 0;
  EXPECT_TRUE(validate_dispatcher_options(o).ok());
  o.max_migrations = -1;
  const Status st = validate_dispatcher_options(o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_migrations"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace cleave::router
