// WorkerPools' readiness from probes: a ready worker whose probes only time out (busy, not
// gone) stays in its pool until probe_failures such probes in a row; a probe that fails
// otherwise, or an RPC failing UNAVAILABLE, takes it out at once; a good probe resets the count.
// A failed KV transfer takes a (prefill, decode) pair out of use for a back-off, not a worker.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "cleave/control/proto_convert.h"
#include "cleave/kvcache/kv_layout.h"
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

// Two prefill and two decode workers, all paired.
class PairBackoffTest : public ::testing::Test {
 protected:
  static ProbeResult probe(const std::string& id, const std::string& role) {
    ProbeResult r;
    r.load.set_blocks_total(100);
    r.info_fetched = true;
    r.info.set_worker_id(id);
    r.info.set_role(role);
    r.info.set_pid(42);
    r.info.set_max_context(512);
    r.info.set_model_fingerprint("m");
    r.info.set_transfer_provider("tcp;ofi_rxm");
    KvLayout l;
    l.n_layers = 2;
    l.n_kv_heads = 1;
    l.head_dim = 8;
    l.num_blocks = 100;
    to_proto(l, r.info.mutable_kv_layout());
    return r;
  }

  void SetUp() override {
    options_.mode = DispatchMode::kDisaggregated;
    options_.prefill.workers = {"127.0.0.1:1", "127.0.0.1:2"};
    options_.decode.workers = {"127.0.0.1:3", "127.0.0.1:4"};
    options_.prefill.policy = DispatchPolicyKind::kRoundRobin;
    options_.decode.policy = DispatchPolicyKind::kRoundRobin;
    pools_ = std::make_unique<WorkerPools>(options_);
    pools_->set_members(PoolRole::kPrefill, options_.prefill.workers);
    pools_->set_members(PoolRole::kDecode, options_.decode.workers);
    for (auto& [w, info] : pools_->probe_targets()) {
      const bool prefill = w->role == PoolRole::kPrefill;
      pools_->apply_probe(w, probe(w->address, prefill ? "prefill" : "decode"));
      (prefill ? prefill_ : decode_).push_back(w);
    }
    ASSERT_EQ(prefill_.size(), 2u);
    ASSERT_EQ(decode_.size(), 2u);
    ASSERT_TRUE(pools_->ready()) << pools_->readiness().to_string();
  }

  // The (prefill, decode) addresses of `n` choices for a request that tried `excluded`.
  std::set<std::pair<std::string, std::string>> chosen(int n, std::vector<uint64_t> excluded = {}) {
    std::set<std::pair<std::string, std::string>> out;
    for (int i = 0; i < n; ++i) {
      auto a = pools_->choose(std::vector<int32_t>{1, 2, 3}, excluded, 3, nullptr);
      EXPECT_TRUE(a.ok()) << a.status().to_string();
      if (a.ok()) out.insert({a->prefill->address, a->decode->address});
    }
    return out;
  }

  DispatcherOptions options_;
  std::unique_ptr<WorkerPools> pools_;
  std::vector<std::shared_ptr<WorkerEndpoint>> prefill_, decode_;
};

TEST_F(PairBackoffTest, AFailedTransferAvoidsThePairNotTheWorkers) {
  const auto p0 = prefill_[0], d0 = decode_[0];
  // Round robin: with p1 excluded, p0 goes with d0 and d1 in turn.
  EXPECT_EQ(chosen(4, {prefill_[1]->key}).size(), 2u);
  pools_->mark_pair_failed(p0, d0, Aborted("KV transfer failed"));
  EXPECT_TRUE(pools_->ready());
  // Both workers still serve, with their other partners.
  const auto with_p0 = chosen(8, {prefill_[1]->key});
  EXPECT_EQ(with_p0, (std::set<std::pair<std::string, std::string>>{
                         {p0->address, decode_[1]->address}}));
  const auto with_d0 = chosen(8, {decode_[1]->key});
  EXPECT_EQ(with_d0, (std::set<std::pair<std::string, std::string>>{
                         {prefill_[1]->address, d0->address}}));
}

TEST_F(PairBackoffTest, TheFailedPairServesWhenNothingElseCan) {
  const auto p0 = prefill_[0], d0 = decode_[0];
  pools_->mark_pair_failed(p0, d0, Aborted("KV transfer failed"));
  // This request already failed on the other prefill and decode workers.
  const auto pairs = chosen(4, {prefill_[1]->key, decode_[1]->key});
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(*pairs.begin(), std::make_pair(p0->address, d0->address));
}

TEST_F(PairBackoffTest, TheBackoffEndsAndDoublesWhileFailuresFollow) {
  const auto p0 = prefill_[0], d0 = decode_[0];
  const std::pair<std::string, std::string> failed{p0->address, d0->address};
  pools_->mark_pair_failed(p0, d0, Aborted("KV transfer failed"));
  EXPECT_EQ(chosen(4, {prefill_[1]->key}).count(failed), 0u);
  std::this_thread::sleep_for(WorkerPools::kPairBackoffMin + std::chrono::milliseconds(50));
  EXPECT_EQ(chosen(4, {prefill_[1]->key}).count(failed), 1u) << "still avoided after its back-off";
  // A second failure soon after: twice as long.
  pools_->mark_pair_failed(p0, d0, Aborted("KV transfer failed"));
  std::this_thread::sleep_for(WorkerPools::kPairBackoffMin + std::chrono::milliseconds(50));
  EXPECT_EQ(chosen(4, {prefill_[1]->key}).count(failed), 0u) << "the second back-off was not longer";
}

}  // namespace
}  // namespace cleave::router
