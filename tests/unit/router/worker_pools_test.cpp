// WorkerPools' readiness from probes: a ready worker whose probes only time out (busy, not
// gone) stays in its pool until probe_failures such probes in a row; a probe that fails
// otherwise, or an RPC failing UNAVAILABLE, takes it out at once; a good probe resets the count.
#include <gtest/gtest.h>

#include "router/dispatch/worker_pools.h"

namespace cleave::router {
namespace {

ProbeResult good_probe(bool with_info) {
  ProbeResult r;
  r.load.set_blocks_total(100);
  r.info_fetched = with_info;
  r.info.set_worker_id("u-1");
  r.info.set_role("unified");
  r.info.set_pid(42);
  r.info.set_max_context(512);
  r.info.mutable_kv_layout()->set_block_size(16);
  return r;
}

ProbeResult timed_out_probe() {
  ProbeResult r;
  r.health = DeadlineExceeded("worker 127.0.0.1:1: health check: Deadline Exceeded");
  r.load_status = DeadlineExceeded("worker 127.0.0.1:1: GetLoad: Deadline Exceeded");
  return r;
}

class WorkerPoolsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.mode = DispatchMode::kUnified;
    options_.unified.workers = {"127.0.0.1:1"};
    options_.probe_failures = 3;
    pools_ = std::make_unique<WorkerPools>(options_);
    pools_->set_members(PoolRole::kUnified, {"127.0.0.1:1"});
    auto targets = pools_->probe_targets();
    ASSERT_EQ(targets.size(), 1u);
    worker_ = targets[0].first;
    pools_->apply_probe(worker_, good_probe(true));
    ASSERT_TRUE(pools_->ready());
  }

  DispatcherOptions options_;
  std::unique_ptr<WorkerPools> pools_;
  std::shared_ptr<WorkerEndpoint> worker_;
};

TEST_F(WorkerPoolsTest, ABusyWorkerStaysUntilProbeFailuresTimeoutsInARow) {
  pools_->apply_probe(worker_, timed_out_probe());
  pools_->apply_probe(worker_, timed_out_probe());
  EXPECT_TRUE(pools_->ready()) << "two timed-out probes of three";
  // A good probe resets the count.
  pools_->apply_probe(worker_, good_probe(false));
  pools_->apply_probe(worker_, timed_out_probe());
  pools_->apply_probe(worker_, timed_out_probe());
  EXPECT_TRUE(pools_->ready());
  pools_->apply_probe(worker_, timed_out_probe());
  EXPECT_FALSE(pools_->ready()) << "the third in a row takes it out";
  EXPECT_FALSE(pools_->choose(std::vector<int32_t>{1, 2}, {}, 2, nullptr).ok());
  // Back with the next good probe.
  pools_->apply_probe(worker_, good_probe(false));
  EXPECT_TRUE(pools_->ready());
}

TEST_F(WorkerPoolsTest, OtherFailuresTakeTheWorkerOutAtOnce) {
  ProbeResult refused;
  refused.health = Unavailable("worker 127.0.0.1:1: health check: failed to connect");
  refused.load_status = Unavailable("worker 127.0.0.1:1: GetLoad: failed to connect");
  pools_->apply_probe(worker_, refused);
  EXPECT_FALSE(pools_->ready());
  pools_->apply_probe(worker_, good_probe(false));
  ASSERT_TRUE(pools_->ready());

  ProbeResult not_serving = good_probe(false);
  not_serving.health = Unavailable("worker 127.0.0.1:1: health check: NOT_SERVING");
  pools_->apply_probe(worker_, not_serving);
  EXPECT_FALSE(pools_->ready());
  pools_->apply_probe(worker_, good_probe(false));
  ASSERT_TRUE(pools_->ready());

  pools_->mark_failed(worker_, Unavailable("Decode: connection reset"));
  EXPECT_FALSE(pools_->ready());
}

TEST_F(WorkerPoolsTest, ATimedOutProbeDoesNotMakeAWorkerReady) {
  pools_->mark_failed(worker_, Unavailable("Generate: connection reset"));
  ASSERT_FALSE(pools_->ready());
  pools_->apply_probe(worker_, timed_out_probe());
  EXPECT_FALSE(pools_->ready());
}

}  // namespace
}  // namespace cleave::router
