// The pieces of `cleave bench sweep` that need no server: SLO attainment (failures count
// against it), re-timing a trace's arrivals to a rate, the refusal of a sweep without SLOs, and
// points known already taken in place of runs.
#include <gtest/gtest.h>

#include "cleave/bench/sweep.h"

namespace cleave::bench {
namespace {

TEST(Sweep, AttainmentCountsFailuresAgainstTheSlo) {
  RequestRecord fast, slow, failed;
  fast.success = slow.success = true;
  fast.ttft_s = 0.1;
  slow.ttft_s = 0.9;
  failed.error = "HTTP 429";
  GoodputSlo slo;
  slo.ttft_ms = 500;
  EXPECT_DOUBLE_EQ(slo_attainment({fast, fast, slow, failed}, slo), 0.5);
  EXPECT_DOUBLE_EQ(slo_attainment({fast}, slo), 1.0);
  EXPECT_DOUBLE_EQ(slo_attainment({}, slo), 0.0);
}

TEST(Sweep, RetimesOwnArrivalsToTheRate) {
  Workload w;
  for (double t : {0.0, 2.0, 4.0, 8.0}) {
    WorkloadRequest r;
    r.arrival_s = t;
    w.requests.push_back(r);
  }
  w.requests.push_back(WorkloadRequest{});  // drawn arrivals stay drawn
  retime_arrivals(&w, /*rate=*/3.0);       // own rate: 3 gaps over 8 s
  EXPECT_DOUBLE_EQ(*w.requests[3].arrival_s, 1.0);
  EXPECT_DOUBLE_EQ(*w.requests[1].arrival_s, 0.25);
  EXPECT_FALSE(w.requests[4].arrival_s.has_value());
}

TEST(Sweep, RunsAtHighRatesGetMoreRequests) {
  WorkloadOptions o;
  o.num_prompts = 10;
  o.random_input_len = 4;
  o.random_output_len = 2;
  EXPECT_EQ(workload_for_rate(o, 0, 100.0, 0, 1000).value().requests.size(), 10u);   // fixed
  EXPECT_EQ(workload_for_rate(o, 0, 1.0, 3.0, 1000).value().requests.size(), 10u);   // at least
  EXPECT_EQ(workload_for_rate(o, 0, 20.0, 3.0, 1000).value().requests.size(), 60u);  // 3 s of it
  EXPECT_EQ(workload_for_rate(o, 0, 1e6, 3.0, 200).value().requests.size(), 200u);   // capped
  // Each step draws other prompts.
  EXPECT_NE(workload_for_rate(o, 0, 1, 0, 0).value().requests[0].prompt,
            workload_for_rate(o, 1, 1, 0, 0).value().requests[0].prompt);
}

TEST(Sweep, NeedsAnSloAndSaneOptions) {
  ServeBenchOptions o;
  o.model = "m";
  SweepOptions s;
  const auto never = [](int, double) -> Result<Workload> { return Internal("must not be called"); };
  auto r = run_sweep(o, s, never);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--goodput"), std::string::npos);
  o.goodput.ttft_ms = 100;
  s.attainment = 1.5;
  EXPECT_FALSE(run_sweep(o, s, never).ok());
  s.attainment = 0.9;
  s.rates = {1, -2};
  EXPECT_NE(run_sweep(o, s, never).status().message().find("-2"), std::string::npos);
}

TEST(Sweep, TakesKnownPointsInsteadOfRunningThem) {
  ServeBenchOptions o;
  o.model = "m";
  o.goodput.ttft_ms = 100;
  SweepOptions s;
  s.start_rate = 1;
  s.max_runs = 3;
  for (double rate : {4.0, 1.0, 2.0}) {
    SweepPoint p;
    p.rate = rate;
    p.passed = rate < 3;
    p.attainment = p.passed ? 1 : 0.5;
    s.known.push_back(p);
  }
  const auto never = [](int, double) -> Result<Workload> { return Internal("must not be called"); };
  auto r = run_sweep(o, s, never);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->points.size(), 3u);  // 1 passes, 2 passes, 4 fails: the search's own order
  EXPECT_EQ(r->points[0].rate, 1.0);
  EXPECT_EQ(r->points[2].rate, 4.0);
  EXPECT_EQ(r->best_rate, 2.0);
  // A rate asked for twice is run the second time.
  s.known.resize(1);
  s.rates = {4.0, 4.0};
  EXPECT_NE(run_sweep(o, s, never).status().message().find("must not be called"), std::string::npos);
}

}  // namespace
}  // namespace cleave::bench
