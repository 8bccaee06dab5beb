// Not named *_test.cpp: tests/worker.cmake registers it.
// Late KV writes are fenced: a decode worker gives each reservation a memory key of its own and
// revokes it when the reservation ends (here: Release, and the lease running out), before its
// blocks can go to another request (or, worker.kv_fence hold, holds its blocks past the lease:
// LateWriteHoldTest). A Prefill that still writes with the stale destination
// then fails with an error, the decode worker holds no block, and a fresh request gives the
// undisturbed tokens. Over tcp;ofi_rxm and shm on 127.0.0.1, with real worker processes.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "cleave/worker/proto_convert.h"
#include "cleave/worker/worker_client.h"
#include "worker_test_fixture.h"

namespace cleave {
namespace {

using namespace std::chrono_literals;
using namespace worker_testing;
namespace fs = std::filesystem;

class LateWriteFenceTest : public WorkerProcessTest {
 protected:
  // A bound on the stale write's failure: shm does not answer a refused write, so the writer
  // gives up after the transfer engine's completion timeout.
  virtual std::vector<std::string> settings() const { return {"transfer.completion_timeout_ms=1000"}; }
  const std::vector<int32_t> kPrompt = {1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409,
                                        410, 411, 412, 413, 414, 415, 416, 417, 418, 419, 420};

  void SetUp() override {
    if (!fs::exists(stories_path())) GTEST_SKIP() << stories_path() << " is absent";
    auto procs = start_workers({{"prefill", stories_path(), settings()},
                                {"decode", stories_path(), settings()}});
    ASSERT_TRUE(procs[0] && procs[1]);
    prefill_proc_ = std::move(procs[0]);
    decode_proc_ = std::move(procs[1]);
    prefill_ = connect(*prefill_proc_);
    decode_ = connect(*decode_proc_);
    ASSERT_TRUE(prefill_ && decode_);
    dispatcher_ = ready_dispatcher(pair_options(*prefill_proc_, *decode_proc_));
    ASSERT_TRUE(dispatcher_);
    warm_up();
    // The handshake can outlast the bound once more on a loaded machine (seen in a full ctest
    // run): the reference then gets one more try after the pair's back-off.
    auto first = attempt(1);
    if (first.ok()) {
      reference_ = *first;
    } else {
      std::this_thread::sleep_for(2500ms);
      reference_ = run(2);
    }
    ASSERT_EQ(reference_.size(), 12u);
  }

  // The pair's first transfer sets up its connection. Over tcp;ofi_rxm that is a handshake,
  // during which writes are refused (-FI_EAGAIN), and a loaded machine (ctest -j2 beside the e2e
  // tests) once stretched it past this fixture's 1 s bound, failing the reference run. So one
  // request of another prompt goes first, whatever its outcome; if it failed, the pair's
  // back-off and any block it left held (LateWriteHoldTest) run out before the reference.
  void warm_up() {
    Collected c;
    router::DispatchRequest req{{1, 300, 301, 302, 303}, greedy(2, 0, true)};
    req.request_id = 900;
    if (!router::run_request(*dispatcher_, std::move(req), collect_into(c)).ok())
      std::this_thread::sleep_for(2500ms);
  }

  Result<std::vector<int32_t>> attempt(RequestId id) {
    Collected c;
    router::DispatchRequest req{kPrompt, greedy(12, 0, true)};
    req.request_id = id;
    auto out = router::run_request(*dispatcher_, std::move(req), collect_into(c));
    if (!out.ok()) return out.status();
    return c.tokens;
  }

  std::vector<int32_t> run(RequestId id) {
    auto out = attempt(id);
    EXPECT_TRUE(out.ok()) << out.status().to_string();
    return out.ok() ? *out : std::vector<int32_t>{};
  }

  // A Prefill that writes into `dest` after its reservation ended.
  Status stale_prefill(RequestId id, const v1::KvDestination& dest) {
    v1::PrefillRequest req;
    req.set_request_id(id);
    req.mutable_prompt_tokens()->Assign(kPrompt.begin(), kPrompt.end());
    to_proto(greedy(12, 0, true), req.mutable_params());
    *req.mutable_destination() = dest;
    return prefill_->prefill(req).status();
  }

  // The checks after a stale Prefill: it failed, nothing is held, and the next request (whose
  // blocks are those the stale one wrote into) gives the reference tokens.
  void expect_fenced(const Status& stale) {
    EXPECT_FALSE(stale.ok()) << "a Prefill into an ended reservation succeeded";
    std::printf("the stale Prefill ended with: %s\n", stale.to_string().c_str());
    EXPECT_TRUE(drains(*decode_, 10s));
    EXPECT_TRUE(drains(*prefill_, 10s));
    EXPECT_EQ(run(100), reference_);
    EXPECT_EQ(run(101), reference_);
    EXPECT_TRUE(drains(*decode_, 10s));
    EXPECT_TRUE(drains(*prefill_, 10s));
  }

  std::unique_ptr<WorkerProcess> prefill_proc_, decode_proc_;
  std::unique_ptr<WorkerClient> prefill_, decode_;
  std::unique_ptr<router::Dispatcher> dispatcher_;
  std::vector<int32_t> reference_;
};

TEST_P(LateWriteFenceTest, PrefillIntoAReleasedReservationIsRefused) {
  auto dest = decode_->reserve(10, static_cast<int64_t>(kPrompt.size()), 30s);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  auto other = decode_->reserve(12, static_cast<int64_t>(kPrompt.size()), 30s);
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  EXPECT_NE(dest->region(), other->region()) << "a key per reservation (worker.kv_fence auto)";
  ASSERT_TRUE(decode_->release(12).ok());
  auto released = decode_->release(10);
  ASSERT_TRUE(released.ok() && *released);
  ASSERT_TRUE(drains(*decode_, 5s));
  expect_fenced(stale_prefill(10, *dest));
}

TEST_P(LateWriteFenceTest, PrefillIntoAnExpiredReservationIsRefused) {
  auto dest = decode_->reserve(11, static_cast<int64_t>(kPrompt.size()), 200ms);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  ASSERT_TRUE(drains(*decode_, 5s));  // the lease ran out
  auto load = decode_->load();
  ASSERT_TRUE(load.ok());
  EXPECT_EQ(load->leases_expired(), 1u);
  expect_fenced(stale_prefill(11, *dest));
}

INSTANTIATE_TEST_SUITE_P(Providers, LateWriteFenceTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         provider_name);

// worker.kv_fence hold, what efa and verbs get (their registration cache keeps a "revoked" key
// alive): the writer has the pool's one key, so a late write is not refused; instead the ended
// reservation's blocks stay held until a write posted within its lease can no longer land
// (lease deadline + completion timeout 1 s + 1 s), and only then go back to the pool. Meanwhile
// other requests run on other blocks and give the undisturbed tokens.
class LateWriteHoldTest : public LateWriteFenceTest {
 protected:
  std::vector<std::string> settings() const override {
    return {"transfer.completion_timeout_ms=1000", "worker.kv_fence=hold"};
  }
  static constexpr auto kHold = 2000ms;

  // Waits until the decode worker reports `n` held blocks.
  ::testing::AssertionResult holds(int64_t n) {
    const auto deadline = Clock::now() + 5s;
    std::string last;
    while (Clock::now() < deadline) {
      auto l = decode_->load();
      if (l.ok() && l->blocks_held() == n) return ::testing::AssertionSuccess();
      last = l.ok() ? l->ShortDebugString() : l.status().to_string();
      std::this_thread::sleep_for(10ms);
    }
    return ::testing::AssertionFailure() << "never " << n << " blocks held: " << last;
  }

  // After the stale Prefill: it ended (how does not matter: its writes went into held blocks),
  // fresh requests give the reference, and the held blocks come back no earlier than the hold
  // after `deadline_from` + `lease`.
  void expect_held_then_freed(const Status& stale, Clock::time_point deadline_from,
                              std::chrono::milliseconds lease, int64_t blocks) {
    std::printf("the stale Prefill ended with: %s\n", stale.to_string().c_str());
    EXPECT_EQ(run(100), reference_);
    EXPECT_EQ(run(101), reference_);
    auto l = decode_->load();
    ASSERT_TRUE(l.ok());
    if (Clock::now() < deadline_from + lease + kHold) {
      EXPECT_EQ(l->blocks_held(), blocks);
    }
    EXPECT_TRUE(drains(*decode_, 15s));
    const auto freed = Clock::now();
    EXPECT_GE(freed - deadline_from, lease + kHold) << "the held blocks came back too early";
    std::printf("held blocks back %lld ms after the reservation was asked for\n",
                static_cast<long long>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(freed - deadline_from).count()));
    EXPECT_TRUE(drains(*prefill_, 10s));
    EXPECT_EQ(run(102), reference_);
  }
};

TEST_P(LateWriteHoldTest, AReleasedReservationsBlocksAreHeldPastItsLease) {
  const auto asked = Clock::now();
  auto dest = decode_->reserve(10, static_cast<int64_t>(kPrompt.size()), 1s);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  auto other = decode_->reserve(12, static_cast<int64_t>(kPrompt.size()), 1s);
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  // Both writers were given the pool's one registration, not a key of their own.
  EXPECT_EQ(dest->region(), other->region());
  auto released = decode_->release(10);
  ASSERT_TRUE(released.ok() && *released);
  released = decode_->release(12);
  ASSERT_TRUE(released.ok() && *released);
  const int64_t n = dest->block_ids_size() + other->block_ids_size();
  ASSERT_TRUE(holds(n));
  expect_held_then_freed(stale_prefill(10, *dest), asked, 1s, n);
}

TEST_P(LateWriteHoldTest, AnExpiredReservationsBlocksAreHeldPastItsLease) {
  const auto asked = Clock::now();
  auto dest = decode_->reserve(11, static_cast<int64_t>(kPrompt.size()), 200ms);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  ASSERT_TRUE(holds(dest->block_ids_size()));  // the lease ran out; the blocks stay held
  auto load = decode_->load();
  ASSERT_TRUE(load.ok());
  EXPECT_EQ(load->leases_expired(), 1u);
  EXPECT_EQ(load->reservations(), 0);
  expect_held_then_freed(stale_prefill(11, *dest), asked, 200ms, dest->block_ids_size());
}

INSTANTIATE_TEST_SUITE_P(Providers, LateWriteHoldTest, ::testing::Values("tcp;ofi_rxm"),
                         provider_name);

}  // namespace
}  // namespace cleave
