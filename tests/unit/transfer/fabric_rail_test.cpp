// FabricRail's own logic driven through the fault-injecting fake port (fake_rail_port.h): no
// provider. Most tests leave the rail's thread off and make progress themselves, so that what
// is in flight at each step is decided by the test, not by a scheduler.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <map>
#include <cstring>
#include <set>
#include <thread>

#include "transfer/fabric_rail.h"
#include "fake_rail_port.h"

namespace cleave::transfer {
namespace {

using namespace std::chrono_literals;
using fake::FakeFabric;
using fake::FakeOp;
using fake::Outcome;

constexpr uint64_t kEngineId = 0xe0e0;
constexpr uint64_t kLen = 4096;

uint64_t next_key(void*) {
  static std::atomic<uint64_t> key{1};
  return key.fetch_add(1);
}

struct Batch {
  std::shared_ptr<TransferState> state;
  std::vector<RailWork> work;
};

class FabricRailTest : public ::testing::Test {
 protected:
  void SetUp() override { metrics_.init("fake", 1); }

  std::unique_ptr<FabricRail> make_rail(TransferSettings s = {}) {
    if (s.completion_timeout_ms == TransferSettings{}.completion_timeout_ms) {
      s.completion_timeout_ms = 10000;  // far beyond any test unless a test says otherwise
    }
    auto rail = std::make_unique<FabricRail>(
        0, std::make_unique<fake::FakePort>(fabric_), s, &metrics_, true,
        [this](const Notice& n) {
          std::lock_guard<std::mutex> lock(notices_mu_);
          notices_.push_back(n);
        });
    Status st = rail->open(kEngineId, &next_key, nullptr);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return rail;
  }

  std::shared_ptr<PeerRecord> add_peer(FabricRail& rail, const std::string& name,
                                       uint64_t engine_id) {
    auto peer = std::make_shared<PeerRecord>();
    peer->id = engine_id;
    peer->engine_id = engine_id;
    Status st = rail.insert_peer(peer, name);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return peer;
  }

  // `writes` slices of kLen bytes to remote addresses base, base + kLen, ...
  Batch make_batch(const std::shared_ptr<PeerRecord>& peer, size_t writes, uint64_t base,
                   std::optional<uint64_t> tag = std::nullopt) {
    Batch b;
    b.state = std::make_shared<TransferState>();
    b.state->metrics = &metrics_;
    b.state->peer = peer;
    b.state->notify_tag = tag;
    b.state->bytes = writes * kLen;
    b.state->writes_left.store(static_cast<int64_t>(writes));
    for (size_t i = 0; i < writes; ++i) {
      RailWork w;
      w.kind = RailWork::Kind::kWrite;
      w.transfer = b.state;
      w.local = source_;
      w.len = kLen;
      w.remote_addr = base + i * kLen;
      w.key = 77;
      b.work.push_back(std::move(w));
    }
    return b;
  }

  // A notice with `tag` to `peer`, to be posted once `after` (if any) has completed.
  Batch make_notice(const std::shared_ptr<PeerRecord>& peer, uint64_t tag,
                    const std::shared_ptr<TransferState>& after) {
    Batch b;
    b.state = std::make_shared<TransferState>();
    b.state->metrics = &metrics_;
    b.state->peer = peer;
    b.state->notify_tag = tag;
    if (after) b.state->predecessors.push_back(after);
    RailWork w;
    w.kind = RailWork::Kind::kNotice;
    w.transfer = b.state;
    b.work.push_back(std::move(w));
    return b;
  }

  // Progress until `done` holds or `limit` passes; false on the limit.
  static bool drive(FabricRail& rail, const std::function<bool()>& done,
                    std::chrono::milliseconds limit = 20s) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
      if (Clock::now() > deadline) return false;
      if (rail.try_progress() <= 0) std::this_thread::sleep_for(100us);
    }
    return true;
  }

  static Status status_of(const std::shared_ptr<TransferState>& t) {
    std::lock_guard<std::mutex> lock(t->mu);
    return t->status;
  }

  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    return fabric_->events;
  }

  std::shared_ptr<FakeFabric> fabric_ = std::make_shared<FakeFabric>();
  MetricsCounters metrics_;
  std::mutex notices_mu_;
  std::vector<Notice> notices_;
  char source_[kLen] = {};
};

TEST_F(FabricRailTest, NoticeIsPostedOnlyAfterEveryWriteOfItsBatchCompleted) {
  fabric_->hold_completions = true;
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(peer, 10, 0x10000, 42);
  auto t = b.state;
  rail->enqueue(std::move(b.work));
  for (int i = 0; i < 20; ++i) rail->try_progress();
  EXPECT_EQ(fabric_->accepted_count(), 10u);  // all writes, no notice
  for (int step = 0; step < 9; ++step) {
    fabric_->release(1);
    for (int i = 0; i < 5; ++i) rail->try_progress();
    EXPECT_EQ(fabric_->accepted_count(), 10u) << "a notice went out after " << step + 1
                                              << " of 10 writes completed";
  }
  EXPECT_FALSE(t->is_done());
  fabric_->release(1);
  ASSERT_TRUE(drive(*rail, [&] { return fabric_->accepted_count() == 11; }));
  fabric_->release();
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  EXPECT_TRUE(status_of(t).ok()) << status_of(t).to_string();

  std::vector<std::string> ev = events();
  auto send = std::find(ev.begin(), ev.end(), "send A notice");
  ASSERT_NE(send, ev.end());
  EXPECT_EQ(std::count_if(ev.begin(), send, [](const std::string& e) {
              return e.rfind("done A ", 0) == 0;
            }), 10);
  std::lock_guard<std::mutex> lock(fabric_->mu);
  const FakeOp& notice = fabric_->accepted.back();
  ASSERT_EQ(notice.kind, FakeOp::Kind::kSend);
  NoticeWire wire;
  ASSERT_EQ(notice.payload.size(), sizeof(wire));
  std::memcpy(&wire, notice.payload.data(), sizeof(wire));
  EXPECT_EQ(wire.magic, kNoticeMagic);
  EXPECT_EQ(wire.from_engine, kEngineId);
  EXPECT_EQ(wire.tag, 42u);
  for (const FakeOp& op : fabric_->accepted) {
    if (op.kind == FakeOp::Kind::kWrite) {
      EXPECT_TRUE(op.flags & FI_DELIVERY_COMPLETE);
    }
  }
}

// The kinds of the accepted posts in order: w a write, W a wake-up, N a notice.
std::string accepted_kinds(FakeFabric& f) {
  std::lock_guard<std::mutex> lock(f.mu);
  std::string k;
  for (const FakeOp& op : f.accepted) {
    if (op.kind == FakeOp::Kind::kWrite) {
      k += 'w';
      continue;
    }
    NoticeWire wire;
    EXPECT_EQ(op.payload.size(), sizeof(wire));
    std::memcpy(&wire, op.payload.data(), std::min(op.payload.size(), sizeof(wire)));
    k += wire.magic == kWakeMagic ? 'W' : wire.magic == kNoticeMagic ? 'N' : '?';
  }
  return k;
}

// A peer whose provider counts no incoming writes (tcp: no FI_RMA_EVENT) would sleep in
// fi_cq_sread while our writes arrive; a wake-up goes ahead of the writes, at most one per half
// hot window, and is only a hint (it is no part of any transfer, and no notice).
TEST_F(FabricRailTest, WakeUpGoesAheadOfWritesWhereIncomingWritesAreNotCounted) {
  fabric_->remote_write_counter = false;
  TransferSettings s;
  s.idle_poll_us = 200000;  // a half window of 100 ms: the test decides when it has passed
  auto rail = make_rail(s);
  auto peer = add_peer(*rail, "A", 0xa);
  auto kinds = [&] { return accepted_kinds(*fabric_); };
  Batch first = make_batch(peer, 3, 0x10000, 7);
  rail->enqueue(std::move(first.work));
  ASSERT_TRUE(drive(*rail, [&] { return first.state->is_done(); }));
  EXPECT_TRUE(status_of(first.state).ok()) << status_of(first.state).to_string();
  Batch second = make_batch(peer, 2, 0x20000);
  rail->enqueue(std::move(second.work));
  ASSERT_TRUE(drive(*rail, [&] { return second.state->is_done(); }));
  EXPECT_EQ(kinds(), "WwwwNww");  // one wake-up, ahead of the first write; none within 100 ms
  std::this_thread::sleep_for(110ms);
  Batch third = make_batch(peer, 1, 0x30000);
  rail->enqueue(std::move(third.work));
  ASSERT_TRUE(drive(*rail, [&] { return third.state->is_done(); }));
  EXPECT_EQ(kinds(), "WwwwNwwWw");
  std::lock_guard<std::mutex> lock(notices_mu_);
  EXPECT_TRUE(notices_.empty());  // our own rail received nothing
}

TEST_F(FabricRailTest, NoWakeUpsWhereThePeerCountsIncomingWritesOrNobodyPollsHot) {
  for (bool counter : {true, false}) {
    fabric_ = std::make_shared<FakeFabric>();
    fabric_->remote_write_counter = counter;
    TransferSettings s;
    s.idle_poll_us = counter ? 2000 : 0;
    auto rail = make_rail(s);
    auto peer = add_peer(*rail, "A", 0xa);
    Batch b = make_batch(peer, 4, 0x10000);
    rail->enqueue(std::move(b.work));
    ASSERT_TRUE(drive(*rail, [&] { return b.state->is_done(); }));
    std::lock_guard<std::mutex> lock(fabric_->mu);
    EXPECT_EQ(fabric_->accepted.size(), 4u) << "counter=" << counter;
    for (const FakeOp& op : fabric_->accepted) EXPECT_EQ(op.kind, FakeOp::Kind::kWrite);
  }
}

TEST_F(FabricRailTest, NotifyWaitsForAnEarlierBatchToThePeer) {
  fabric_->hold_completions = true;
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch data = make_batch(peer, 3, 0);
  Batch n = make_notice(peer, 7, data.state);
  auto notice = n.state;
  rail->enqueue(std::move(data.work));
  rail->enqueue(std::move(n.work));
  for (int i = 0; i < 20; ++i) rail->try_progress();
  EXPECT_EQ(fabric_->accepted_count(), 3u);
  fabric_->release(2);
  for (int i = 0; i < 20; ++i) rail->try_progress();
  EXPECT_EQ(fabric_->accepted_count(), 3u);
  fabric_->release();
  ASSERT_TRUE(drive(*rail, [&] { return fabric_->accepted_count() == 4; }));
  fabric_->release();
  ASSERT_TRUE(drive(*rail, [&] { return notice->is_done(); }));
  EXPECT_TRUE(status_of(data.state).ok());
  EXPECT_TRUE(status_of(notice).ok()) << status_of(notice).to_string();
}

// The notice is latency: the decode worker starts when it arrives. A notice whose batch is
// done goes out from the submitting thread itself (no progress pass, the rail's thread off),
// and one that waits for a batch goes out in the very pass that completes the batch.
TEST_F(FabricRailTest, NoticeGoesOutFromTheSubmitterOrInThePassThatEndsItsBatch) {
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch done = make_batch(peer, 2, 0);
  auto done_state = done.state;
  rail->enqueue(std::move(done.work));
  ASSERT_TRUE(drive(*rail, [&] { return done_state->is_done(); }));
  Batch b1 = make_notice(peer, 1, done_state);
  auto n1 = b1.state;
  rail->enqueue(std::move(b1.work));
  EXPECT_EQ(fabric_->accepted_count(), 3u) << "the notice waited for a progress pass";

  fabric_->hold_completions = true;
  Batch pending = make_batch(peer, 2, 1 << 20);
  auto pending_state = pending.state;
  rail->enqueue(std::move(pending.work));
  Batch b2 = make_notice(peer, 2, pending_state);
  auto n2 = b2.state;
  rail->enqueue(std::move(b2.work));
  rail->try_progress();  // reads n1's completion
  EXPECT_EQ(fabric_->accepted_count(), 5u);  // + the two writes, no notice yet
  fabric_->release();
  rail->try_progress();  // reads the writes' completions: the notice goes out in this pass
  EXPECT_TRUE(pending_state->is_done());
  EXPECT_EQ(fabric_->accepted_count(), 6u) << "the notice waited for another pass";
  fabric_->hold_completions = false;
  fabric_->release();
  ASSERT_TRUE(drive(*rail, [&] { return n1->is_done() && n2->is_done(); }));
  EXPECT_TRUE(status_of(n1).ok() && status_of(n2).ok());
}

TEST_F(FabricRailTest, EagainStormEveryPostRefusedSevenTimesThenAccepted) {
  fabric_->refuse_each_post = 7;
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(peer, 40, 0, 5);
  auto t = b.state;
  rail->enqueue(std::move(b.work));
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  EXPECT_TRUE(status_of(t).ok()) << status_of(t).to_string();
  std::lock_guard<std::mutex> lock(fabric_->mu);
  EXPECT_EQ(fabric_->accepted.size(), 41u);
  EXPECT_EQ(fabric_->refusals, 7u * 41u);
  std::set<uint64_t> addrs;
  for (const FakeOp& op : fabric_->accepted) {
    if (op.kind == FakeOp::Kind::kWrite) {
      EXPECT_TRUE(addrs.insert(op.remote_addr).second);
    }
  }
  EXPECT_EQ(addrs.size(), 40u) << "every slice posted exactly once";
}

TEST_F(FabricRailTest, FullProviderQueueIsAnsweredByReadingCompletions) {
  fabric_->queue_entries = 3;  // the provider says 1024 but takes only 3 at a time
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(peer, 100, 0);
  auto t = b.state;
  rail->enqueue(std::move(b.work));
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  EXPECT_TRUE(status_of(t).ok()) << status_of(t).to_string();
  std::lock_guard<std::mutex> lock(fabric_->mu);
  EXPECT_EQ(fabric_->accepted.size(), 100u);
  EXPECT_GT(fabric_->refusals, 0u);
  EXPECT_LE(fabric_->max_writes_in_flight, 3u);
}

// A refusal with writes in flight is not asked again until one of them completes: each pass
// would be refused again (and shm refuses behind its lock). With nothing in flight the rail
// keeps asking every pass, since nothing of its own would ever reopen the gate.
TEST_F(FabricRailTest, RefusedPeerIsAskedAgainOnlyOnceOneOfItsWritesCompleted) {
  fabric_->queue_entries = 4;
  fabric_->hold_completions = true;
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(peer, 10, 0);
  auto t = b.state;
  rail->enqueue(std::move(b.work));
  for (int i = 0; i < 50; ++i) rail->try_progress();
  {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    EXPECT_EQ(fabric_->accepted.size(), 4u);
    EXPECT_EQ(fabric_->refusals, 1u) << "asked again while none of its writes completed";
  }
  fabric_->release(1);
  for (int i = 0; i < 50; ++i) rail->try_progress();
  {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    EXPECT_EQ(fabric_->accepted.size(), 5u) << "the freed entry was not used";
    EXPECT_EQ(fabric_->refusals, 2u);
  }
  fabric_->hold_completions = false;
  fabric_->release();
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  EXPECT_TRUE(status_of(t).ok()) << status_of(t).to_string();
  EXPECT_EQ(fabric_->accepted_count(), 10u);
}

TEST_F(FabricRailTest, RefusalWithNothingInFlightIsRetriedEveryPass) {
  fabric_->refuse_each_post = 5;
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(peer, 1, 0);
  auto t = b.state;
  rail->enqueue(std::move(b.work));
  for (int i = 0; i < 3; ++i) rail->try_progress();
  {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    EXPECT_GE(fabric_->refusals, 3u) << "a refused post with nothing in flight was not retried";
  }
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  EXPECT_TRUE(status_of(t).ok()) << status_of(t).to_string();
}

TEST_F(FabricRailTest, NeverMoreThanTheTxDepthInFlightNorThreeQuartersToOnePeer) {
  fabric_->hold_completions = true;
  TransferSettings s;
  s.max_inflight_per_rail = 8;  // <= 16: no entries kept back for notices
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  auto b = add_peer(*rail, "B", 0xb);
  Batch ba = make_batch(a, 100, 0);
  Batch bb = make_batch(b, 100, 1ull << 30);
  auto ta = ba.state, tb = bb.state;
  rail->enqueue(std::move(ba.work));
  rail->enqueue(std::move(bb.work));
  for (int round = 0; round < 2000 && !(ta->is_done() && tb->is_done()); ++round) {
    for (int i = 0; i < 3; ++i) rail->try_progress();
    {
      std::lock_guard<std::mutex> lock(fabric_->mu);
      ASSERT_LE(fabric_->writes_in_flight, 8u) << "round " << round;
      if (round == 0) {
        EXPECT_EQ(fabric_->writes_in_flight, 8u) << "the depth was not used";
      }
    }
    fabric_->release(3);
  }
  ASSERT_TRUE(ta->is_done() && tb->is_done());
  EXPECT_TRUE(status_of(ta).ok() && status_of(tb).ok());
  std::lock_guard<std::mutex> lock(fabric_->mu);
  EXPECT_EQ(fabric_->accepted.size(), 200u);
  EXPECT_EQ(fabric_->max_writes_in_flight, 8u);
  ASSERT_EQ(fabric_->peer_writes_in_flight_max.size(), 2u);
  EXPECT_EQ(fabric_->peer_writes_in_flight_max[0], 6u);  // 3/4 of 8
  EXPECT_EQ(fabric_->peer_writes_in_flight_max[1], 6u);
}

TEST_F(FabricRailTest, CompletionErrorFailsItsBatchNamingTheWriteAndSendsNoNotice) {
  const uint64_t bad = 0x10000 + 3 * kLen;
  fabric_->outcome = [&](const FakeOp& op) {
    return op.kind == FakeOp::Kind::kWrite && op.remote_addr == bad ? Outcome::error(FI_EACCES)
                                                                    : Outcome::complete();
  };
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(peer, 8, 0x10000, 9);
  auto t = b.state;
  rail->enqueue(std::move(b.work));
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  Status st = status_of(t);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  const std::string msg = st.message();
  EXPECT_NE(msg.find("RMA write of 4096 bytes to remote address 0x13000"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("peer 000000000000000a"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rail 0 (fake)"), std::string::npos) << msg;
  EXPECT_NE(msg.find(fi_strerror(FI_EACCES)), std::string::npos) << msg;
  EXPECT_NE(msg.find("fake provider error"), std::string::npos) << msg;
  for (int i = 0; i < 20; ++i) rail->try_progress();
  for (const std::string& e : events()) EXPECT_NE(e, "send A notice") << "notice after a failure";
  EXPECT_EQ(metrics_.snapshot().errors[static_cast<size_t>(TransferErrorKind::kCompletionError)],
            1u);
  // Not a connection error: the peer stays usable.
  EXPECT_FALSE(peer->unreachable.load());
  fabric_->outcome = nullptr;
  Batch again = make_batch(peer, 2, 0x10000);
  auto t2 = again.state;
  rail->enqueue(std::move(again.work));
  ASSERT_TRUE(drive(*rail, [&] { return t2->is_done(); }));
  EXPECT_TRUE(status_of(t2).ok()) << status_of(t2).to_string();
}

TEST_F(FabricRailTest, ConnectionErrorMarksThePeerDeadAndLaterWorkToItFailsUnposted) {
  fabric_->outcome = [&](const FakeOp& op) {
    return op.peer == "A" ? Outcome::error(FI_ECONNRESET) : Outcome::complete();
  };
  auto rail = make_rail();
  auto a = add_peer(*rail, "A", 0xa);
  auto b = add_peer(*rail, "B", 0xb);
  Batch first = make_batch(a, 1, 0);
  auto t1 = first.state;
  rail->enqueue(std::move(first.work));
  ASSERT_TRUE(drive(*rail, [&] { return t1->is_done(); }));
  EXPECT_EQ(status_of(t1).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(a->unreachable.load());
  const size_t posted = fabric_->accepted_count();

  Batch later = make_batch(a, 4, 0);
  Batch other = make_batch(b, 4, 0);
  auto tl = later.state, to = other.state;
  const auto start = Clock::now();
  rail->enqueue(std::move(later.work));
  rail->enqueue(std::move(other.work));
  ASSERT_TRUE(drive(*rail, [&] { return tl->is_done() && to->is_done(); }));
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(status_of(tl).code(), StatusCode::kUnavailable);
  EXPECT_NE(status_of(tl).message().find("is unreachable"), std::string::npos);
  EXPECT_TRUE(status_of(to).ok()) << status_of(to).to_string();
  std::lock_guard<std::mutex> lock(fabric_->mu);
  EXPECT_EQ(fabric_->accepted.size(), posted + 4) << "only B's writes were posted";
  for (size_t i = posted; i < fabric_->accepted.size(); ++i) {
    EXPECT_EQ(fabric_->accepted[i].peer, "B");
  }
}

TEST_F(FabricRailTest, CompletionThatNeverComesFailsWithinTheBoundAndOtherPeersStillWork) {
  TransferSettings s;
  s.completion_timeout_ms = 150;
  fabric_->outcome = [&](const FakeOp& op) {
    return op.peer == "A" && op.remote_addr == 2 * kLen ? Outcome::never() : Outcome::complete();
  };
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  auto b = add_peer(*rail, "B", 0xb);
  Batch batch = make_batch(a, 4, 0, 1);
  auto t = batch.state;
  const auto start = Clock::now();
  rail->enqueue(std::move(batch.work));
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }, 30s));
  const auto took = Clock::now() - start;
  EXPECT_GE(took, 150ms);
  EXPECT_LE(took, 150ms + 2s);
  Status st = status_of(t);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("did not complete a write within 150 ms"), std::string::npos)
      << st.message();
  EXPECT_TRUE(a->unreachable.load());
  EXPECT_EQ(metrics_.snapshot().errors[static_cast<size_t>(TransferErrorKind::kTimeout)], 1u);

  const size_t posted = fabric_->accepted_count();
  Batch later = make_batch(a, 2, 0);
  Batch other = make_batch(b, 3, 0, 2);
  auto tl = later.state, to = other.state;
  const auto again = Clock::now();
  rail->enqueue(std::move(later.work));
  rail->enqueue(std::move(other.work));
  ASSERT_TRUE(drive(*rail, [&] { return tl->is_done() && to->is_done(); }));
  EXPECT_LT(Clock::now() - again, 2s);
  EXPECT_EQ(status_of(tl).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(status_of(to).ok()) << status_of(to).to_string();
  EXPECT_EQ(fabric_->accepted_count(), posted + 4);  // B's three writes and its notice
}

TEST_F(FabricRailTest, PostsRefusedForeverFailWithinTheBound) {
  TransferSettings s;
  s.completion_timeout_ms = 100;
  fabric_->refuse_each_post = INT_MAX;
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  Batch batch = make_batch(a, 3, 0);
  auto t = batch.state;
  const auto start = Clock::now();
  rail->enqueue(std::move(batch.work));
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }, 30s));
  const auto took = Clock::now() - start;
  EXPECT_GE(took, 100ms);
  EXPECT_LE(took, 100ms + 2s);
  Status st = status_of(t);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("could not post a write to peer 000000000000000a for 100 ms "
                              "(-FI_EAGAIN)"), std::string::npos) << st.message();
  EXPECT_TRUE(a->unreachable.load());
  EXPECT_EQ(fabric_->accepted_count(), 0u);
}

TEST_F(FabricRailTest, ConnectionBasedProviderStartsTheConnectionWhenAPeerIsInserted) {
  fabric_->provider = "tcp;ofi_rxm";
  fabric_->refuse_each_post = 2;  // the provider is connecting: the hello waits for it
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  EXPECT_EQ(fabric_->accepted_count(), 0u);  // refused once at the insert
  ASSERT_TRUE(drive(*rail, [&] { return fabric_->accepted_count() == 1; }));
  EXPECT_EQ(accepted_kinds(*fabric_), "W");  // before any write was asked for
  {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    fabric_->refuse_each_post = 0;
  }
  Batch b = make_batch(peer, 2, 0x10000);
  rail->enqueue(std::move(b.work));
  ASSERT_TRUE(drive(*rail, [&] { return b.state->is_done(); }));
  EXPECT_TRUE(status_of(b.state).ok()) << status_of(b.state).to_string();
  EXPECT_EQ(accepted_kinds(*fabric_), "Www");

  // A provider without connections (shm) sends no hello.
  fabric_ = std::make_shared<FakeFabric>();
  fabric_->provider = "shm";
  auto shm = make_rail();
  auto other = add_peer(*shm, "B", 0xb);
  for (int i = 0; i < 10; ++i) shm->try_progress();
  EXPECT_EQ(fabric_->accepted_count(), 0u);
}

TEST_F(FabricRailTest, PeerProcessThatExitsFailsItsWritesInFlightLongBeforeTheBound) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  TransferSettings s;
  s.completion_timeout_ms = 60000;
  fabric_->outcome = [](const FakeOp&) { return Outcome::never(); };
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  a->same_host = true;
  a->pid = child;
  Batch batch = make_batch(a, 2, 0);
  auto t = batch.state;
  rail->enqueue(std::move(batch.work));
  for (int i = 0; i < 20; ++i) rail->try_progress();
  ASSERT_EQ(fabric_->accepted_count(), 2u);
  EXPECT_FALSE(t->is_done()) << "failed while its peer still lived";
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const auto start = Clock::now();
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }, 30s));
  EXPECT_LT(Clock::now() - start, 5s);
  Status st = status_of(t);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("exited with a write to it in flight"), std::string::npos)
      << st.message();
  EXPECT_TRUE(a->unreachable.load());
}

// Runs the rail's own thread: only it reopens an endpoint.
TEST_F(FabricRailTest, DeadPeerReopensTheEndpointAndAnotherPeersLiveWritesArePostedAgain) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  TransferSettings s;
  s.completion_timeout_ms = 60000;  // nothing here may depend on the bound
  s.idle_poll_us = 0;
  fabric_->outcome = [](const FakeOp& op) {
    // On the first endpoint nothing completes; on its replacement everything does.
    return op.endpoint == 0 ? Outcome::never() : Outcome::complete();
  };
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  a->same_host = true;
  a->pid = child;
  auto b = add_peer(*rail, "B", 0xb);
  Batch ba = make_batch(a, 1, 0);
  Batch bb = make_batch(b, 2, 0, 3);
  auto ta = ba.state, tb = bb.state;
  rail->enqueue(std::move(ba.work));
  rail->enqueue(std::move(bb.work));
  ASSERT_EQ(fabric_->accepted_count(), 3u);
  rail->start();
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(ta->is_done() || tb->is_done());
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const auto deadline = Clock::now() + 20s;
  while (!(ta->is_done() && tb->is_done()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(ta->is_done() && tb->is_done());
  EXPECT_EQ(status_of(ta).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(status_of(tb).ok()) << status_of(tb).to_string();
  EXPECT_EQ(rail->reopens(), 1u);
  EXPECT_TRUE(rail->stop());
  std::lock_guard<std::mutex> lock(fabric_->mu);
  EXPECT_EQ(fabric_->endpoints_opened, 2);
  EXPECT_EQ(fabric_->endpoints_closed, 1);  // not shm: the old one is closed
  int b_reposted = 0, b_notices = 0;
  for (const FakeOp& op : fabric_->accepted) {
    EXPECT_FALSE(op.endpoint == 1 && op.peer == "A") << "posted again to the dead peer";
    if (op.endpoint == 1 && op.peer == "B") {
      ++(op.kind == FakeOp::Kind::kWrite ? b_reposted : b_notices);
    }
  }
  EXPECT_EQ(b_reposted, 2);
  EXPECT_EQ(b_notices, 1);
}

TEST_F(FabricRailTest, FailedReopenTakesTheRailOutOfServiceAndFailsItsWork) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  TransferSettings s;
  s.completion_timeout_ms = 60000;
  s.idle_poll_us = 0;
  fabric_->outcome = [](const FakeOp&) { return Outcome::never(); };
  fabric_->fail_open_after = 1;  // the replacement endpoint cannot be opened
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  a->same_host = true;
  a->pid = child;
  auto b = add_peer(*rail, "B", 0xb);
  Batch ba = make_batch(a, 1, 0);
  Batch bb = make_batch(b, 2, 0);
  auto ta = ba.state, tb = bb.state;
  rail->enqueue(std::move(ba.work));
  rail->enqueue(std::move(bb.work));
  ASSERT_EQ(fabric_->accepted_count(), 3u);
  rail->start();
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const auto deadline = Clock::now() + 20s;
  while (!(ta->is_done() && tb->is_done()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(ta->is_done() && tb->is_done());
  EXPECT_EQ(status_of(tb).code(), StatusCode::kUnavailable);
  EXPECT_NE(status_of(tb).message().find("rail 0 is out of service"), std::string::npos)
      << status_of(tb).message();
  auto c = std::make_shared<PeerRecord>();
  c->engine_id = 0xc;
  EXPECT_EQ(rail->insert_peer(c, "C").code(), StatusCode::kUnavailable);
  EXPECT_TRUE(rail->stop());
}

TEST_F(FabricRailTest, ShmEndpointWithADeadPeerIsKeptOpenForTheProcess) {
  fabric_->provider = "shm";
  std::shared_ptr<PeerRecord> a;  // the engine's peer records outlive its rails
  {
    auto rail = make_rail();
    a = add_peer(*rail, "A", 0xa);
    a->unreachable.store(true);
  }
  {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    EXPECT_EQ(fabric_->endpoints_opened, 1);
    EXPECT_EQ(fabric_->endpoints_closed, 0);
    EXPECT_EQ(fabric_->recvs_posted, static_cast<size_t>(RailStorage::kRecvSlots));
  }
  // The kept endpoint's receive buffers must still be there (ASan would see a write into freed
  // memory here).
  NoticeWire wire{kNoticeMagic, 1, 2, 0};
  EXPECT_TRUE(fabric_->deliver_message(std::string(reinterpret_cast<char*>(&wire), sizeof(wire))));

  auto other = std::make_shared<FakeFabric>();
  fabric_ = other;
  std::shared_ptr<PeerRecord> live;
  {
    auto rail = make_rail();
    live = add_peer(*rail, "A", 0xa);
  }
  std::lock_guard<std::mutex> lock(other->mu);
  EXPECT_EQ(other->endpoints_closed, 1) << "a live peer: the endpoint is closed";
}

TEST_F(FabricRailTest, IncomingNoticeIsHandedOverAndItsReceiveReposted) {
  auto rail = make_rail();
  NoticeWire wire{kNoticeMagic, 0xfeed, 99, 0};
  ASSERT_TRUE(fabric_->deliver_message(std::string(reinterpret_cast<char*>(&wire), sizeof(wire))));
  ASSERT_TRUE(fabric_->deliver_message("not a notice, just bytes"));
  ASSERT_TRUE(drive(*rail, [&] {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    return fabric_->recvs_posted == static_cast<size_t>(RailStorage::kRecvSlots);
  }));
  std::lock_guard<std::mutex> lock(notices_mu_);
  ASSERT_EQ(notices_.size(), 1u);
  EXPECT_EQ(notices_[0].from_engine, 0xfeedu);
  EXPECT_EQ(notices_[0].tag, 99u);
}

// A notice re-sent after its sender's endpoint was replaced keeps its id: the receiving rail
// hands it over once. Notices without an id (0) are never taken for copies.
TEST_F(FabricRailTest, ASecondCopyOfANoticeIsDroppedByItsId) {
  auto rail = make_rail();
  auto send = [&](uint64_t tag, uint64_t id) {
    NoticeWire wire{kNoticeMagic, 0xfeed, tag, id};
    return fabric_->deliver_message(std::string(reinterpret_cast<char*>(&wire), sizeof(wire)));
  };
  ASSERT_TRUE(send(1, 77));
  ASSERT_TRUE(send(2, 78));
  ASSERT_TRUE(send(1, 77));  // the copy
  ASSERT_TRUE(send(3, 0));
  ASSERT_TRUE(send(3, 0));
  ASSERT_TRUE(drive(*rail, [&] {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    return fabric_->recvs_posted == static_cast<size_t>(RailStorage::kRecvSlots);
  }));
  std::lock_guard<std::mutex> lock(notices_mu_);
  ASSERT_EQ(notices_.size(), 4u);
  EXPECT_EQ(notices_[0].tag, 1u);
  EXPECT_EQ(notices_[1].tag, 2u);
  EXPECT_EQ(notices_[2].tag, 3u);
  EXPECT_EQ(notices_[3].tag, 3u);
}

// A connection error of peer A (tcp: a write refused with a revoked key) rebuilds the
// endpoint: B's notice that was in flight, and B's notice that had completed just before, go
// out again on the new endpoint with their ids; B's batch succeeds; the old endpoint is closed.
TEST_F(FabricRailTest, ReopenAfterOnePeersFaultSendsTheOtherPeersNoticesAgain) {
  TransferSettings s;
  s.idle_poll_us = 0;
  fabric_->outcome = [](const FakeOp& op) {
    if (op.endpoint == 0 && op.peer == "A") return Outcome::error(FI_ECANCELED);
    // B's second notice never completes on the first endpoint.
    if (op.endpoint == 0 && op.peer == "B" && op.kind == FakeOp::Kind::kSend &&
        op.payload.find("\x02", 16) == 16) {
      return Outcome::never();
    }
    return Outcome::complete();
  };
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  auto b = add_peer(*rail, "B", 0xb);
  Batch b1 = make_batch(b, 1, 0, 1);
  auto t1 = b1.state;
  rail->enqueue(std::move(b1.work));
  ASSERT_TRUE(drive(*rail, [&] { return t1->is_done(); }));
  ASSERT_TRUE(status_of(t1).ok()) << status_of(t1).to_string();
  Batch b2 = make_batch(b, 1, 4096, 2);
  auto t2 = b2.state;
  rail->enqueue(std::move(b2.work));
  ASSERT_TRUE(drive(*rail, [&] { return t2->writes_left.load() == 0; }));
  Batch ba = make_batch(a, 1, 0);
  auto ta = ba.state;
  rail->enqueue(std::move(ba.work));
  rail->start();
  const auto deadline = Clock::now() + 20s;
  while (!(ta->is_done() && t2->is_done()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_TRUE(ta->is_done() && t2->is_done());
  EXPECT_EQ(status_of(ta).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(status_of(t2).ok()) << status_of(t2).to_string();
  EXPECT_TRUE(a->unreachable.load());
  EXPECT_FALSE(b->unreachable.load());
  EXPECT_EQ(rail->reopens(), 1u);
  EXPECT_TRUE(rail->stop());
  std::lock_guard<std::mutex> lock(fabric_->mu);
  EXPECT_EQ(fabric_->endpoints_closed, 1);
  std::map<uint64_t, std::set<uint64_t>> ids_by_tag[2];  // per endpoint: tag -> ids
  for (const FakeOp& op : fabric_->accepted) {
    if (op.kind != FakeOp::Kind::kSend || op.peer != "B") continue;
    NoticeWire wire;
    std::memcpy(&wire, op.payload.data(), sizeof(wire));
    if (wire.magic != kNoticeMagic || op.endpoint > 1) continue;
    EXPECT_NE(op.flags & FI_DELIVERY_COMPLETE, 0u) << "a notice without delivery-complete";
    ids_by_tag[op.endpoint][wire.tag].insert(wire.id);
  }
  ASSERT_EQ(ids_by_tag[0].size(), 2u);
  EXPECT_EQ(ids_by_tag[1], ids_by_tag[0]) << "both notices go again, with the same ids";
  for (const auto& [tag, ids] : ids_by_tag[0]) EXPECT_EQ(ids.size(), 1u);
}

// The watchdog tells a holder spinning inside the provider from one the host does not schedule
// by the holder's CPU time: a post that spins shows it, one that sleeps (as a thread an
// overloaded host leaves waiting) does not.
TEST_F(FabricRailTest, HolderCpuTimeTellsASpinningPostFromAWaitingOne) {
  std::atomic<bool> spin{false}, release{false}, inside{false};
  fabric_->outcome = [&](const FakeOp&) {
    inside = true;
    while (!release.load()) {
      if (!spin.load()) std::this_thread::sleep_for(1ms);
    }
    return Outcome::complete();
  };
  auto rail = make_rail();
  auto peer = add_peer(*rail, "A", 0xa);
  EXPECT_EQ(rail->holder_cpu_ns(), -1) << "nobody holds the lock";
  Batch b = make_batch(peer, 1, 0);
  auto t = b.state;
  std::thread submitter([&] { rail->enqueue(std::move(b.work)); });  // posts inline
  const auto until = Clock::now() + 10s;
  while (!inside.load() && Clock::now() < until) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(inside.load());
  EXPECT_GT(rail->busy_for(Clock::now()), Clock::duration::zero());
  const int64_t waiting_from = rail->holder_cpu_ns();
  ASSERT_GE(waiting_from, 0);
  std::this_thread::sleep_for(200ms);
  const int64_t waited = rail->holder_cpu_ns() - waiting_from;
  EXPECT_LT(waited, 50'000'000) << "a holder that sleeps used " << waited << " ns of CPU";
  EXPECT_FALSE(holding_looks_stuck(rail->busy_for(Clock::now()) + 1s, waited, 1000ms))
      << "waited for up to ten times the bound";

  spin = true;
  const int64_t spinning_from = rail->holder_cpu_ns();
  int64_t spun = 0;
  while (spun < 100'000'000 && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
    spun = rail->holder_cpu_ns() - spinning_from;
  }
  EXPECT_GE(spun, 100'000'000) << "the spinning holder's CPU time did not grow";
  EXPECT_TRUE(holding_looks_stuck(200ms, spun, 100ms));
  release = true;
  submitter.join();
  ASSERT_TRUE(drive(*rail, [&] { return t->is_done(); }));
  EXPECT_TRUE(status_of(t).ok()) << status_of(t).to_string();
  EXPECT_EQ(rail->holder_cpu_ns(), -1);
}

// Connecting (insert_peer) waits for a lock holder that the watchdog would not call stuck,
// here a post that sleeps three completion bounds inside the provider; it used to give up
// after one bound and tell the caller that the rail was stuck. A rail that is declared stuck
// meanwhile ends the wait at once.
TEST_F(FabricRailTest, InsertingAPeerWaitsForASlowHolderAndStopsWhenTheRailIsDeclaredStuck) {
  TransferSettings s;
  s.completion_timeout_ms = 100;
  std::atomic<bool> inside{false}, release{false};
  std::atomic<int> sleep_ms{300};
  fabric_->outcome = [&](const FakeOp&) {
    inside = true;
    const auto until = Clock::now() + std::chrono::milliseconds(sleep_ms.load());
    while (!release.load() && Clock::now() < until) std::this_thread::sleep_for(1ms);
    return Outcome::complete();
  };
  auto rail = make_rail(s);
  auto a = add_peer(*rail, "A", 0xa);
  Batch b = make_batch(a, 1, 0);
  std::thread submitter([&] { rail->enqueue(std::move(b.work)); });  // posts inline
  while (!inside.load()) std::this_thread::sleep_for(1ms);
  const auto t0 = Clock::now();
  auto other = std::make_shared<PeerRecord>();
  other->id = other->engine_id = 0xb;
  Status st = rail->insert_peer(other, "B");
  const auto waited = Clock::now() - t0;
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_GE(waited, 150ms) << "the insert did not wait for the holder";
  submitter.join();
  ASSERT_TRUE(drive(*rail, [&] { return b.state->is_done(); }));

  // A holder that never comes back: the watchdog declares the rail stuck.
  inside = false;
  sleep_ms = 60'000;
  Batch c = make_batch(a, 1, kLen);
  std::thread stuck_submitter([&] { rail->enqueue(std::move(c.work)); });
  while (!inside.load()) std::this_thread::sleep_for(1ms);
  auto third = std::make_shared<PeerRecord>();
  third->id = third->engine_id = 0xc;
  Status refused;
  const auto t1 = Clock::now();
  std::thread inserter([&] { refused = rail->insert_peer(third, "C"); });
  std::this_thread::sleep_for(50ms);
  rail->declare_stuck("declared stuck by the test");
  inserter.join();
  EXPECT_LT(Clock::now() - t1, 500ms) << "the insert kept waiting for a rail declared stuck";
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.to_string();
  release = true;
  stuck_submitter.join();
}

TEST(HoldingLooksStuck, SpinningPastTheBoundOrHeldTenTimesItOrUnknownCpu) {
  using std::chrono::milliseconds;
  constexpr auto kBound = milliseconds(1000);
  constexpr int64_t kMs = 1'000'000;
  EXPECT_FALSE(holding_looks_stuck(milliseconds(900), 900 * kMs, kBound)) << "within the bound";
  EXPECT_TRUE(holding_looks_stuck(milliseconds(1100), 500 * kMs, kBound)) << "spinning";
  EXPECT_FALSE(holding_looks_stuck(milliseconds(1100), 499 * kMs, kBound)) << "not scheduled";
  EXPECT_FALSE(holding_looks_stuck(milliseconds(9000), 10 * kMs, kBound)) << "not scheduled";
  EXPECT_TRUE(holding_looks_stuck(milliseconds(10001), 0, kBound)) << "blocked in the kernel";
  EXPECT_TRUE(holding_looks_stuck(milliseconds(1100), -1, kBound)) << "CPU time unknown";
}

}  // namespace
}  // namespace cleave::transfer
