// BlockLedger over a real KvBlockPool with a fake lease clock: reservations (errors, position
// order, counters), the one lease clock (deadlines, sparing, order), fences that run once and
// before the blocks can be reused on every way a reservation ends, pins, prefilled sequences
// waiting for a running slot, and admission that waits for reserved or pinned blocks instead of
// failing, failing only what can never fit.
#include "cleave/scheduler/block_ledger.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace cleave {
namespace {

using namespace std::chrono_literals;
using Clock = BlockLedger::Clock;

std::unique_ptr<KvBlockPool> make_pool(int64_t num_blocks, int64_t block_size = 4) {
  KvLayout l;
  l.block_size = block_size;
  l.n_layers = 1;
  l.n_kv_heads = 1;
  l.head_dim = 4;
  l.num_blocks = num_blocks;
  auto p = KvBlockPool::create(l);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? std::move(*p) : nullptr;
}

std::vector<int32_t> iota_tokens(int64_t n, int32_t first = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + static_cast<int32_t>(i);
  return t;
}

SchedulerOptions opts(int64_t budget, int64_t max_seqs = 64) {
  SchedulerOptions o;
  o.max_tokens_per_step = budget;
  o.max_num_seqs = max_seqs;
  return o;
}

// A lease clock the test moves by hand.
struct FakeClock {
  Clock::time_point t = Clock::time_point{} + 1000h;
  BlockLedger::NowFn fn() {
    return [this] { return t; };
  }
};

// Records each fence call and what the pool looked like then.
struct FenceLog {
  std::vector<std::pair<SequenceId, ReservationEnd>> calls;
  std::map<SequenceId, int64_t> used_at_fence;  // pool.used_blocks() when the fence ran
  ReservationFence fence(SequenceId id, const KvBlockPool& pool) {
    return [this, id, &pool](ReservationEnd how) {
      calls.emplace_back(id, how);
      used_at_fence[id] = pool.used_blocks();
    };
  }
};

// Completes the plan and appends `token` to each sequence whose chunk sampled.
void run_step(Scheduler& s, const StepPlan& plan, int32_t token = 7) {
  s.complete(plan);
  for (const auto& c : plan.chunks)
    if (c.samples) {
      ASSERT_TRUE(s.append_token(c.seq->id, token).ok());
    }
}

TEST(BlockLedgerTest, ReserveGivesBlocksInPositionOrderOrAClearError) {
  auto pool = make_pool(8);
  FakeClock clock;
  BlockLedger ledger(*pool, opts(64), clock.fn());
  FenceLog log;
  auto a = ledger.reserve(1, 10, 100ms, log.fence(1, *pool));  // 3 blocks of 4
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(*a, (std::vector<BlockId>{0, 1, 2}));
  EXPECT_TRUE(ledger.has_reservation(1));
  EXPECT_EQ(ledger.num_reservations(), 1);
  EXPECT_EQ(ledger.blocks_reserved(), 3);
  EXPECT_EQ(pool->used_blocks(), 3);

  EXPECT_EQ(ledger.reserve(2, 0, 100ms, log.fence(2, *pool)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.reserve(2, 4, 0ms, log.fence(2, *pool)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.reserve(1, 4, 100ms, log.fence(1, *pool)).status().code(),
            StatusCode::kAlreadyExists);
  const auto big = ledger.reserve(2, 21, 100ms, log.fence(2, *pool));  // 6 blocks, 5 left
  ASSERT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("6 KV blocks needed"), std::string::npos)
      << big.status().message();
  EXPECT_NE(big.status().message().find("3 reserved"), std::string::npos) << big.status().message();
  // A failed reserve takes nothing and never runs its fence.
  EXPECT_EQ(pool->used_blocks(), 3);
  EXPECT_EQ(ledger.blocks_reserved(), 3);
  EXPECT_TRUE(log.calls.empty());

  // An id with a sequence cannot be reserved either.
  ASSERT_TRUE(ledger.scheduler().add(5, iota_tokens(3)).ok());
  EXPECT_EQ(ledger.reserve(5, 4, 100ms, {}).status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(ledger.finish(5));

  EXPECT_TRUE(ledger.release_reservation(1));
  EXPECT_FALSE(ledger.release_reservation(1));
  EXPECT_EQ(ledger.counters().reservations_released, 1u);
  EXPECT_EQ(ledger.counters().leases_expired, 0u);
  EXPECT_EQ(ledger.blocks_reserved(), 0);
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_TRUE(ledger.idle());
}

TEST(BlockLedgerTest, OneLeaseClockExpiresInDeadlineOrderAndSparesWhatIsBeingConsumed) {
  auto pool = make_pool(16);
  FakeClock clock;
  BlockLedger ledger(*pool, opts(64), clock.fn());
  FenceLog log;
  EXPECT_FALSE(ledger.next_deadline().has_value());
  const Clock::time_point t0 = clock.t;
  ASSERT_TRUE(ledger.reserve(1, 4, 300ms, log.fence(1, *pool)).ok());
  ASSERT_TRUE(ledger.reserve(2, 4, 100ms, log.fence(2, *pool)).ok());
  ASSERT_TRUE(ledger.reserve(3, 4, 200ms, log.fence(3, *pool)).ok());
  ASSERT_TRUE(ledger.next_deadline().has_value());
  EXPECT_EQ(*ledger.next_deadline(), t0 + 100ms);

  clock.t = t0 + 99ms;
  EXPECT_TRUE(ledger.expire_leases().empty());
  EXPECT_EQ(ledger.num_reservations(), 3);

  // Exactly at the deadline it has ended; 2 and 3 are due, 3 is spared (its consumer is on
  // its way), in deadline order.
  clock.t = t0 + 200ms;
  EXPECT_EQ(ledger.expire_leases([](SequenceId id) { return id == 3; }),
            (std::vector<SequenceId>{2}));
  EXPECT_EQ(ledger.num_reservations(), 2);
  EXPECT_EQ(*ledger.next_deadline(), t0 + 200ms);  // 3, spared, is still due

  clock.t = t0 + 1s;
  EXPECT_EQ(ledger.expire_leases(), (std::vector<SequenceId>{3, 1}));
  EXPECT_FALSE(ledger.next_deadline().has_value());
  EXPECT_EQ(ledger.counters().leases_expired, 3u);
  EXPECT_EQ(ledger.counters().reservations_released, 0u);
  ASSERT_EQ(log.calls.size(), 3u);
  EXPECT_EQ(log.calls[0], std::make_pair(SequenceId{2}, ReservationEnd::kExpired));
  EXPECT_EQ(log.calls[1], std::make_pair(SequenceId{3}, ReservationEnd::kExpired));
  EXPECT_EQ(log.calls[2], std::make_pair(SequenceId{1}, ReservationEnd::kExpired));
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_FALSE(ledger.release_reservation(1));  // ended already
}

TEST(BlockLedgerTest, ARenewedLeaseRunsAgainFromNowAndNeverShortens) {
  auto pool = make_pool(8);
  FakeClock clock;
  BlockLedger ledger(*pool, opts(64), clock.fn());
  FenceLog log;
  const Clock::time_point t0 = clock.t;
  ASSERT_TRUE(ledger.reserve(1, 4, 100ms, log.fence(1, *pool)).ok());
  ASSERT_TRUE(ledger.reserve(2, 4, 500ms, log.fence(2, *pool)).ok());

  // Renewed at 90 ms for 100 ms: due at 190 ms, not at 100 ms.
  clock.t = t0 + 90ms;
  EXPECT_TRUE(ledger.renew_lease(1, 100ms));
  EXPECT_EQ(*ledger.next_deadline(), t0 + 190ms);
  clock.t = t0 + 150ms;
  EXPECT_TRUE(ledger.expire_leases().empty());
  // A renewal shorter than what is left keeps the later deadline.
  EXPECT_TRUE(ledger.renew_lease(2, 10ms));
  clock.t = t0 + 400ms;
  EXPECT_EQ(ledger.expire_leases(), (std::vector<SequenceId>{1}));
  EXPECT_EQ(ledger.num_reservations(), 1);

  // Nothing to renew once it has ended (expired, released, consumed), or for a lease under 1 ms.
  EXPECT_FALSE(ledger.renew_lease(1, 100ms));
  EXPECT_FALSE(ledger.renew_lease(2, 0ms));
  EXPECT_FALSE(ledger.renew_lease(9, 100ms));
  EXPECT_EQ(ledger.counters().leases_renewed, 2u);
  EXPECT_EQ(ledger.counters().leases_expired, 1u);
  clock.t = t0 + 500ms;
  EXPECT_EQ(ledger.expire_leases(), (std::vector<SequenceId>{2}));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(BlockLedgerTest, FenceRunsOnceBeforeTheBlocksCanBeReusedOnEveryEnd) {
  auto pool = make_pool(16);
  FakeClock clock;
  FenceLog log;
  {
    BlockLedger ledger(*pool, opts(64), clock.fn());
    ASSERT_TRUE(ledger.reserve(1, 8, 100ms, log.fence(1, *pool)).ok());   // released: 2 blocks
    ASSERT_TRUE(ledger.reserve(2, 8, 50ms, log.fence(2, *pool)).ok());    // expired
    ASSERT_TRUE(ledger.reserve(3, 8, 100ms, log.fence(3, *pool)).ok());   // consumed
    ASSERT_TRUE(ledger.reserve(4, 8, 100ms, log.fence(4, *pool)).ok());   // end_all
    ASSERT_TRUE(ledger.reserve(5, 8, 100ms, log.fence(5, *pool)).ok());   // destructor
    EXPECT_EQ(pool->used_blocks(), 10);

    ASSERT_TRUE(ledger.release_reservation(1));
    EXPECT_EQ(log.used_at_fence[1], 10);  // its blocks still held while the fence ran
    EXPECT_EQ(pool->used_blocks(), 8);

    clock.t += 60ms;
    ASSERT_EQ(ledger.expire_leases(), (std::vector<SequenceId>{2}));
    EXPECT_EQ(log.used_at_fence[2], 8);
    EXPECT_EQ(pool->used_blocks(), 6);

    // Consumed: the fence runs, and the blocks stay held, now by the running sequence.
    ASSERT_TRUE(ledger.add_prefilled(3, iota_tokens(8), 99).ok());
    EXPECT_EQ(log.used_at_fence[3], 6);
    EXPECT_EQ(pool->used_blocks(), 6);
    EXPECT_FALSE(ledger.has_reservation(3));
    ASSERT_NE(ledger.scheduler().find(3), nullptr);
    EXPECT_EQ(ledger.blocks_reserved(), 4);

    ledger.end_all();
    EXPECT_EQ(log.calls.size(), 5u);  // 4 and 5 ended with kShutdown
    EXPECT_EQ(ledger.num_reservations(), 0);
    EXPECT_EQ(pool->used_blocks(), 2);  // the running sequence's
    ASSERT_TRUE(ledger.reserve(6, 4, 100ms, log.fence(6, *pool)).ok());
  }  // the destructor ends 6 (kShutdown) and releases the sequence
  EXPECT_EQ(pool->used_blocks(), 0);
  std::map<SequenceId, std::vector<ReservationEnd>> by_id;
  for (const auto& [id, how] : log.calls) by_id[id].push_back(how);
  EXPECT_EQ(by_id[1], std::vector<ReservationEnd>{ReservationEnd::kReleased});
  EXPECT_EQ(by_id[2], std::vector<ReservationEnd>{ReservationEnd::kExpired});
  EXPECT_EQ(by_id[3], std::vector<ReservationEnd>{ReservationEnd::kConsumed});
  EXPECT_EQ(by_id[4], std::vector<ReservationEnd>{ReservationEnd::kShutdown});
  EXPECT_EQ(by_id[5], std::vector<ReservationEnd>{ReservationEnd::kShutdown});
  EXPECT_EQ(by_id[6], std::vector<ReservationEnd>{ReservationEnd::kShutdown});
  EXPECT_EQ(log.used_at_fence[6], 3);  // its block (and the sequence's 2) still held while fenced
}

TEST(BlockLedgerTest, AThrowingFenceStillGivesTheBlocksBack) {
  auto pool = make_pool(8);
  BlockLedger ledger(*pool, opts(64));
  ASSERT_TRUE(ledger.reserve(1, 8, 1s, [](ReservationEnd) { throw std::runtime_error("boom"); }).ok());
  EXPECT_TRUE(ledger.release_reservation(1));
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(ledger.blocks_reserved(), 0);
}

TEST(BlockLedgerTest, PinnedBlocksStayHeldUntilReleased) {
  auto pool = make_pool(16);
  BlockLedger ledger(*pool, opts(64));
  ASSERT_TRUE(ledger.scheduler().add(1, iota_tokens(10)).ok());
  StepPlan plan;
  ledger.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  run_step(ledger.scheduler(), plan);
  const std::vector<BlockId> table = ledger.scheduler().find(1)->block_table;
  ASSERT_EQ(table.size(), 3u);
  EXPECT_TRUE(ledger.finish(1, /*pin=*/true));
  EXPECT_EQ(ledger.scheduler().find(1), nullptr);
  EXPECT_TRUE(ledger.has_pinned(1));
  EXPECT_EQ(ledger.blocks_pinned(), 3);
  EXPECT_EQ(pool->used_blocks(), 3);
  for (BlockId b : table) EXPECT_EQ(pool->refcount(b), 1);
  EXPECT_FALSE(ledger.idle());
  EXPECT_FALSE(ledger.finish(1));  // no sequence any more
  EXPECT_TRUE(ledger.release_pinned(1));
  EXPECT_FALSE(ledger.release_pinned(1));
  EXPECT_EQ(ledger.blocks_pinned(), 0);
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_TRUE(ledger.idle());
  // Without pin, finish gives the blocks back at once.
  ASSERT_TRUE(ledger.scheduler().add(2, iota_tokens(5)).ok());
  ledger.schedule(plan);
  run_step(ledger.scheduler(), plan);
  EXPECT_TRUE(ledger.finish(2));
  EXPECT_FALSE(ledger.has_pinned(2));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(BlockLedgerTest, PrefilledSequencesWaitForARunningSlotInArrivalOrder) {
  auto pool = make_pool(16);
  BlockLedger ledger(*pool, opts(64, /*max_seqs=*/1));
  EXPECT_EQ(ledger.add_prefilled(9, iota_tokens(4), 1).code(), StatusCode::kFailedPrecondition);
  for (SequenceId id : {1, 2, 3}) ASSERT_TRUE(ledger.reserve(id, 6, 1s, {}).ok());  // 2 blocks each
  ASSERT_TRUE(ledger.add_prefilled(1, iota_tokens(6), 50).ok());
  ASSERT_TRUE(ledger.add_prefilled(2, iota_tokens(6), 51).ok());
  ASSERT_TRUE(ledger.add_prefilled(3, iota_tokens(6), 52).ok());
  EXPECT_EQ(ledger.scheduler().num_running(), 1);
  EXPECT_EQ(ledger.num_pending(), 2);
  EXPECT_EQ(ledger.blocks_pending(), 4);
  EXPECT_EQ(ledger.blocks_reserved(), 0);
  EXPECT_EQ(pool->used_blocks(), 6);
  EXPECT_EQ(ledger.reserve(2, 4, 1s, {}).status().code(), StatusCode::kAlreadyExists);

  std::vector<std::pair<SequenceId, Status>> failed;
  ledger.admit_pending(failed);  // no slot yet
  EXPECT_EQ(ledger.num_pending(), 2);
  // A pending one that ends gives its blocks back at once; the order of the others holds.
  EXPECT_TRUE(ledger.finish(2));
  EXPECT_EQ(ledger.blocks_pending(), 2);
  EXPECT_EQ(pool->used_blocks(), 4);
  EXPECT_TRUE(ledger.finish(1));
  ledger.admit_pending(failed);
  EXPECT_TRUE(failed.empty());
  EXPECT_EQ(ledger.num_pending(), 0);
  const Sequence* seq = ledger.scheduler().find(3);
  ASSERT_NE(seq, nullptr);
  EXPECT_EQ(seq->tokens.back(), 52);
  EXPECT_EQ(seq->num_computed_tokens, 6);
  EXPECT_TRUE(ledger.finish(3));
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_TRUE(ledger.idle());
}

TEST(BlockLedgerTest, AdmissionWaitsForReservedBlocksInsteadOfFailing) {
  auto pool = make_pool(8);
  FakeClock clock;
  BlockLedger ledger(*pool, opts(64), clock.fn());
  ASSERT_TRUE(ledger.reserve(1, 24, 100ms, {}).ok());  // 6 of 8 blocks
  ASSERT_TRUE(ledger.scheduler().add(2, iota_tokens(12)).ok());  // 3 blocks: fits only later
  StepPlan plan;
  for (int i = 0; i < 3; ++i) {  // nothing runs, and still it waits
    ledger.schedule(plan);
    EXPECT_TRUE(plan.empty());
    EXPECT_TRUE(plan.blocked);
    EXPECT_TRUE(plan.failed.empty());
  }
  EXPECT_EQ(ledger.scheduler().num_waiting(), 1);
  clock.t += 100ms;
  ASSERT_EQ(ledger.expire_leases(), (std::vector<SequenceId>{1}));
  ledger.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_FALSE(plan.blocked);
  EXPECT_EQ(plan.chunks[0].seq->id, 2u);
  EXPECT_EQ(plan.chunks[0].num_tokens, 12);
  run_step(ledger.scheduler(), plan);
  EXPECT_TRUE(ledger.finish(2));
  EXPECT_EQ(ledger.scheduler().counters().failed, 0u);
  EXPECT_EQ(pool->used_blocks(), 0);
}

// Where keys cannot be revoked (EFA, verbs) a released or expired reservation's blocks stay
// held until max(its end, its lease deadline) + the hold: a write posted before the writer's
// lease ended cannot land in a block another request owns by then. Consumed and shutdown
// reservations are not held; admission waits for held blocks as for reserved ones.
TEST(BlockLedgerTest, HeldBlocksComeBackOnlyWhenTheHoldAfterTheLeaseEnds) {
  auto pool = make_pool(8);
  FakeClock clock;
  FenceLog log;
  BlockLedger ledger(*pool, opts(64), clock.fn());
  ASSERT_TRUE(ledger.reserve(1, 8, 100ms, log.fence(1, *pool), 50ms).ok());  // released
  ASSERT_TRUE(ledger.reserve(2, 8, 30ms, log.fence(2, *pool), 50ms).ok());   // expires
  EXPECT_EQ(pool->used_blocks(), 4);

  clock.t += 10ms;
  ASSERT_TRUE(ledger.release_reservation(1));  // at 10 ms, its lease to 100 ms: held to 150 ms
  EXPECT_EQ(log.calls.size(), 1u);             // the fence ran at the end, as ever
  EXPECT_EQ(pool->used_blocks(), 4);
  EXPECT_EQ(ledger.blocks_held(), 2);
  EXPECT_EQ(ledger.blocks_reserved(), 2);
  EXPECT_EQ(ledger.blocks_coming_back(), 4);
  EXPECT_FALSE(ledger.idle());
  EXPECT_FALSE(ledger.has_reservation(1));
  EXPECT_FALSE(ledger.release_reservation(1));  // ended: nothing more under the id

  EXPECT_EQ(ledger.next_deadline(), clock.t - 10ms + 30ms);  // 2's lease

  clock.t += 25ms;  // 35 ms: 2 expires, held to 35 + 50 = 85 ms
  ASSERT_EQ(ledger.expire_leases(), (std::vector<SequenceId>{2}));
  EXPECT_EQ(ledger.blocks_held(), 4);
  EXPECT_EQ(pool->used_blocks(), 4);
  EXPECT_EQ(ledger.counters().reservations_held, 2u);
  EXPECT_EQ(ledger.next_deadline(), clock.t + 50ms);

  // A sequence that needs the held blocks waits for them instead of failing.
  ASSERT_TRUE(ledger.scheduler().add(4, iota_tokens(20)).ok());  // 5 blocks; 4 free now
  StepPlan plan;
  ledger.schedule(plan);
  EXPECT_TRUE(plan.empty());
  EXPECT_TRUE(plan.blocked);
  EXPECT_TRUE(plan.failed.empty());

  clock.t += 50ms;  // 85 ms: 2's hold ends, 1's (150 ms) has not
  EXPECT_TRUE(ledger.expire_leases().empty());
  EXPECT_EQ(ledger.blocks_held(), 2);
  EXPECT_EQ(pool->used_blocks(), 2);
  EXPECT_EQ(ledger.next_deadline(), clock.t - 85ms + 150ms);
  ledger.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].seq->id, 4u);
  run_step(ledger.scheduler(), plan);
  EXPECT_TRUE(ledger.finish(4));

  clock.t += 64ms;  // 149 ms
  (void)ledger.expire_leases();
  EXPECT_EQ(ledger.blocks_held(), 2);
  clock.t += 1ms;
  (void)ledger.expire_leases();
  EXPECT_EQ(ledger.blocks_held(), 0);
  EXPECT_EQ(ledger.next_deadline(), std::nullopt);
  EXPECT_TRUE(ledger.idle());
  EXPECT_EQ(pool->used_blocks(), 0);

  // Consumed: the KV is in place, the blocks go to the sequence, nothing is held.
  ASSERT_TRUE(ledger.reserve(3, 8, 100ms, log.fence(3, *pool), 50ms).ok());
  ASSERT_TRUE(ledger.add_prefilled(3, iota_tokens(8), 99).ok());
  EXPECT_EQ(ledger.blocks_held(), 0);
  EXPECT_TRUE(ledger.finish(3));
  EXPECT_EQ(pool->used_blocks(), 0);
  EXPECT_EQ(ledger.counters().reservations_held, 2u);

  // Shutdown holds nothing: end_all() gives every block back at once.
  ASSERT_TRUE(ledger.reserve(5, 8, 100ms, {}, 50ms).ok());
  ASSERT_TRUE(ledger.release_reservation(5));
  EXPECT_EQ(ledger.blocks_held(), 2);
  ledger.end_all();
  EXPECT_EQ(ledger.blocks_held(), 0);
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(BlockLedgerTest, TheOldestRunningSequenceWaitsForPinnedBlocksInsteadOfFailing) {
  auto pool = make_pool(6);
  BlockLedger ledger(*pool, opts(64));
  // A prefill that ended with 2 blocks pinned.
  ASSERT_TRUE(ledger.scheduler().add(1, iota_tokens(8)).ok());
  StepPlan plan;
  ledger.schedule(plan);
  run_step(ledger.scheduler(), plan);
  ASSERT_TRUE(ledger.finish(1, /*pin=*/true));
  // A sequence of 16 tokens (4 blocks) decodes until it needs a 5th block.
  ASSERT_TRUE(ledger.scheduler().add(2, iota_tokens(16, 100)).ok());
  ASSERT_TRUE(ledger.scheduler().add(3, iota_tokens(2, 200)).ok());  // waits behind it
  ledger.schedule(plan);
  ASSERT_EQ(plan.chunks.size(), 1u);
  run_step(ledger.scheduler(), plan);  // 17 tokens now: a 5th block is needed, none is free
  for (int i = 0; i < 3; ++i) {
    ledger.schedule(plan);
    EXPECT_TRUE(plan.empty());
    EXPECT_TRUE(plan.blocked);
    EXPECT_TRUE(plan.failed.empty());
    EXPECT_EQ(ledger.scheduler().num_waiting(), 1);  // nothing admitted meanwhile
  }
  ASSERT_NE(ledger.scheduler().find(2), nullptr);
  EXPECT_EQ(ledger.scheduler().find(2)->block_table.size(), 4u);  // kept what it had
  EXPECT_TRUE(ledger.release_pinned(1));
  ledger.schedule(plan);
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(plan.chunks[0].seq->id, 2u);
  EXPECT_EQ(plan.chunks[0].start_pos, 16);
  run_step(ledger.scheduler(), plan);
  EXPECT_TRUE(ledger.finish(2));
  EXPECT_TRUE(ledger.finish(3));
  EXPECT_EQ(ledger.scheduler().counters().failed, 0u);
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(BlockLedgerTest, FailsWhatCanNeverFitEvenWhileBlocksAreHeld) {
  auto pool = make_pool(6);
  BlockLedger ledger(*pool, opts(64));
  // A prefill of 4 tokens ends with its one (full, cached) block pinned.
  ASSERT_TRUE(ledger.scheduler().add(1, iota_tokens(4)).ok());
  StepPlan plan;
  ledger.schedule(plan);
  run_step(ledger.scheduler(), plan);
  ASSERT_TRUE(ledger.finish(1, /*pin=*/true));
  EXPECT_EQ(ledger.blocks_pinned(), 1);
  // A sequence of 20 tokens starting with the same 4 shares that block (5 blocks in all), then
  // decodes to 25 tokens: 7 blocks, more than the pool's 6, so waiting for the pin cannot help.
  ASSERT_TRUE(ledger.scheduler().add(2, iota_tokens(20)).ok());
  for (int i = 0; i < 5; ++i) {
    ledger.schedule(plan);
    ASSERT_EQ(plan.chunks.size(), 1u) << i;
    run_step(ledger.scheduler(), plan);
  }
  ASSERT_EQ(ledger.scheduler().find(2)->tokens.size(), 25u);
  EXPECT_EQ(ledger.scheduler().find(2)->num_cached_prompt_tokens, 4);
  EXPECT_EQ(pool->used_blocks(), 6);
  ledger.schedule(plan);
  ASSERT_EQ(plan.failed.size(), 1u);
  EXPECT_EQ(plan.failed[0].id, 2u);
  EXPECT_EQ(plan.failed[0].blocks_needed, 7);
  EXPECT_FALSE(plan.blocked);
  EXPECT_EQ(ledger.scheduler().counters().failed, 1u);
  EXPECT_EQ(pool->used_blocks(), 1);  // the pin
  EXPECT_TRUE(ledger.release_pinned(1));
  EXPECT_EQ(pool->used_blocks(), 0);
}

TEST(BlockLedgerTest, WithNothingHeldTheOldFailureStands) {
  // Nothing reserved or pinned: a sequence that does not fit alone fails as before.
  auto pool = make_pool(3);
  BlockLedger ledger(*pool, opts(256));
  ASSERT_TRUE(ledger.scheduler().add(1, iota_tokens(10)).ok());
  StepPlan plan;
  bool failed = false;
  for (int step = 0; step < 10 && !failed; ++step) {
    ledger.schedule(plan);
    EXPECT_FALSE(plan.blocked);
    failed = !plan.failed.empty();
    run_step(ledger.scheduler(), plan);
  }
  EXPECT_TRUE(failed);
  EXPECT_EQ(pool->used_blocks(), 0);
}

}  // namespace
}  // namespace cleave
