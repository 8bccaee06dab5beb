// The decode worker's reservation table: notice tags (non-zero, unique, a stale entry
// replaced), mark_filled of unknown and expired tags, the one-Decode claim, every poll outcome,
// the engine telling it a lease ended (expire), the expected writer, remove, shutdown, and
// the listener.
#include "worker/service/reservation_table.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <unordered_set>
#include <vector>

namespace cleave::worker_service {
namespace {

using namespace std::chrono_literals;
using Outcome = ReservationTable::Outcome;
using Notice = ReservationTable::Notice;

// A notice with `tag` from engine `from` filled its reservation.
bool filled(ReservationTable& t, uint64_t tag, uint64_t from = 0) {
  return t.mark_filled(tag, from).outcome == Notice::kFilled;
}

TEST(ReservationTableTest, TagsAreNonZeroAndUniqueAndAStaleEntryIsReplaced) {
  ReservationTable t;
  std::unordered_set<uint64_t> tags;
  for (RequestId id = 1; id <= 2000; ++id) {
    const uint64_t tag = t.add(id, 10, 1s);
    EXPECT_NE(tag, 0u);
    EXPECT_TRUE(tags.insert(tag).second) << "tag repeated for request " << id;
  }
  EXPECT_EQ(t.size(), 2000);
  // The same id again: the old entry (and its tag) goes.
  const ReservationTable::Claim before = t.claim(7);
  ASSERT_EQ(before.outcome, Outcome::kFilled);
  const uint64_t fresh = t.add(7, 12, 2s);
  EXPECT_EQ(t.size(), 2000);
  EXPECT_FALSE(filled(t, before.tag));
  EXPECT_NE(fresh, before.tag);
  // The Decode that claimed the old one sees it ended.
  const auto old = t.poll(7, before, false);
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->outcome, Outcome::kReleased);
  const ReservationTable::Claim now = t.claim(7);
  ASSERT_EQ(now.outcome, Outcome::kFilled);
  EXPECT_EQ(now.tag, fresh);
  EXPECT_EQ(now.num_tokens, 12);
  EXPECT_EQ(now.lease, 2s);
}

TEST(ReservationTableTest, MarkFilledOfUnknownOrExpiredTagsIsRefused) {
  ReservationTable t;
  EXPECT_FALSE(filled(t, 0));
  EXPECT_FALSE(filled(t, 12345));
  const uint64_t a = t.add(1, 4, 1s);
  const ReservationTable::Claim c = t.claim(1);
  ASSERT_EQ(c.outcome, Outcome::kFilled);
  EXPECT_FALSE(t.expire(1, a + 1));  // another tag: not this reservation
  EXPECT_TRUE(t.expire(1, a));
  EXPECT_FALSE(filled(t, a));  // its blocks are gone: too late
  const auto taken = t.poll(1, c, false);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->outcome, Outcome::kExpired);
  EXPECT_EQ(t.size(), 0);
  // An unclaimed entry whose lease ends is dropped at once: nobody waits on it.
  const uint64_t b = t.add(2, 4, 1s);
  EXPECT_TRUE(t.expire(2, b));
  EXPECT_EQ(t.size(), 0);
  EXPECT_FALSE(filled(t, b));
  EXPECT_EQ(t.claim(2).outcome, Outcome::kNotFound);
  EXPECT_FALSE(t.expire(2, b));
}

// A reservation made for one prefill engine takes its notice from that engine only: the right
// tag from another engine is refused and leaves the entry waiting; 0 takes any engine's.
TEST(ReservationTableTest, ANoticeFromAnotherEngineThanTheExpectedWriterIsRefused) {
  ReservationTable t;
  const uint64_t a = t.add(1, 8, 1s, /*writer=*/0xabc);
  const auto c = t.claim(1);
  ASSERT_EQ(c.outcome, Outcome::kFilled);
  const auto wrong = t.mark_filled(a, 0xdef);
  EXPECT_EQ(wrong.outcome, Notice::kWrongWriter);
  EXPECT_EQ(wrong.id, 1u);
  EXPECT_EQ(wrong.expected, 0xabcu);
  EXPECT_FALSE(t.poll(1, c, false).has_value()) << "a refused notice must not fill it";
  EXPECT_TRUE(filled(t, a, 0xabc));
  const auto got = t.poll(1, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kFilled);
  const uint64_t b = t.add(2, 8, 1s);  // no expected writer
  EXPECT_TRUE(filled(t, b, 0x123));
  EXPECT_EQ(t.mark_filled(999, 0xabc).outcome, Notice::kUnknown);
  const uint64_t d = t.add(3, 8, 1s, 0xabc);
  ASSERT_EQ(t.claim(3).outcome, Outcome::kFilled);
  ASSERT_TRUE(t.expire(3, d));
  EXPECT_EQ(t.mark_filled(d, 0xabc).outcome, Notice::kExpired);
}

TEST(ReservationTableTest, OneDecodeClaimsAReservation) {
  ReservationTable t;
  EXPECT_EQ(t.claim(1).outcome, Outcome::kNotFound);
  t.add(1, 4, 1s);
  t.add(2, 4, 1s);
  EXPECT_EQ(t.claimed(), 0);
  const ReservationTable::Claim c = t.claim(1);
  EXPECT_EQ(c.outcome, Outcome::kFilled);
  EXPECT_EQ(t.claimed(), 1);  // LoadReport.decodes_waiting
  EXPECT_EQ(t.claim(1).outcome, Outcome::kBusy);
  EXPECT_FALSE(t.poll(1, c, false).has_value());  // still waiting
  EXPECT_EQ(t.claim(1).outcome, Outcome::kBusy);
  EXPECT_EQ(t.claimed(), 1);
  EXPECT_TRUE(t.remove(1));
  EXPECT_EQ(t.claimed(), 0);
}

TEST(ReservationTableTest, PollTellsEachOutcomeOnceAndEndsTheEntry) {
  ReservationTable t;
  // Filled.
  const uint64_t tag = t.add(1, 9, 1s);
  ReservationTable::Claim c = t.claim(1);
  EXPECT_FALSE(t.poll(1, c, false).has_value());
  EXPECT_TRUE(filled(t, tag));
  auto got = t.poll(1, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kFilled);
  EXPECT_EQ(got->num_tokens, 9);
  EXPECT_EQ(t.size(), 0);
  EXPECT_FALSE(filled(t, tag));  // used
  // Filled wins over a client that is leaving at the same time.
  const uint64_t tag2 = t.add(2, 3, 1s);
  c = t.claim(2);
  ASSERT_TRUE(filled(t, tag2));
  got = t.poll(2, c, true);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kFilled);
  // Gave up.
  t.add(3, 3, 1s);
  c = t.claim(3);
  got = t.poll(3, c, true);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kGaveUp);
  EXPECT_EQ(t.size(), 0);
  // Expired wins over filled: the engine has taken the blocks back.
  const uint64_t tag4 = t.add(4, 3, 1s);
  c = t.claim(4);
  ASSERT_TRUE(filled(t, tag4));
  ASSERT_TRUE(t.expire(4, tag4));
  got = t.poll(4, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kExpired);
  EXPECT_EQ(got->lease, 1s);
  // Released while waiting.
  t.add(5, 3, 1s);
  c = t.claim(5);
  EXPECT_TRUE(t.remove(5));
  EXPECT_FALSE(t.remove(5));
  got = t.poll(5, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kReleased);
  EXPECT_EQ(t.size(), 0);
}

TEST(ReservationTableTest, AnExpiredReservationTellsItsLastRenewal) {
  ReservationTable t;
  const uint64_t tag = t.add(7, 3, 1s);
  EXPECT_FALSE(t.renewed(8, 2s));  // no such entry
  ASSERT_TRUE(t.renewed(7, 2s));
  ASSERT_TRUE(t.renewed(7, 3s));
  ReservationTable::Claim c = t.claim(7);
  ASSERT_TRUE(t.expire(7, tag));
  auto got = t.poll(7, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kExpired);
  EXPECT_EQ(got->lease, 3s);
  EXPECT_EQ(got->renewals, 2);
}

TEST(ReservationTableTest, ShutdownEndsEveryWaitAndRefusesNewClaims) {
  ReservationTable t;
  t.add(1, 3, 1s);
  t.add(2, 3, 1s);
  const ReservationTable::Claim c = t.claim(1);
  t.shutdown();
  auto got = t.poll(1, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kShutdown);
  EXPECT_EQ(t.claim(2).outcome, Outcome::kShutdown);
  // A claim whose entry is gone also answers shutdown, not released.
  got = t.poll(1, c, false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->outcome, Outcome::kShutdown);
}

TEST(ReservationTableTest, TheListenerHearsEveryChangeAPollCanSee) {
  ReservationTable t;
  std::atomic<int> heard{0};
  t.set_listener([&] { heard.fetch_add(1); });
  const uint64_t a = t.add(1, 3, 1s);
  EXPECT_EQ(heard.load(), 0);  // adding changes nothing a waiter sees
  ASSERT_TRUE(filled(t, a));
  EXPECT_EQ(heard.load(), 1);
  const uint64_t b = t.add(2, 3, 1s);
  ASSERT_EQ(t.claim(2).outcome, Outcome::kFilled);
  ASSERT_TRUE(t.expire(2, b));
  EXPECT_EQ(heard.load(), 2);
  ASSERT_TRUE(t.remove(1));
  EXPECT_EQ(heard.load(), 3);
  EXPECT_FALSE(filled(t, 999));
  EXPECT_FALSE(t.remove(999));
  EXPECT_EQ(heard.load(), 3);
  t.shutdown();
  EXPECT_EQ(heard.load(), 4);
  t.set_listener(nullptr);
}

TEST(ReservationTableTest, ConcurrentNoticesAndPollsMatchEachReservationOnce) {
  ReservationTable t;
  constexpr int kN = 200;
  std::vector<uint64_t> tags(kN);
  std::vector<ReservationTable::Claim> claims(kN);
  for (int i = 0; i < kN; ++i) {
    tags[i] = t.add(static_cast<RequestId>(i), 4, 1s);
    claims[i] = t.claim(static_cast<RequestId>(i));
  }
  std::thread notices([&] {
    for (int i = 0; i < kN; ++i) {
      if (i % 3 == 0) {
        EXPECT_TRUE(t.expire(static_cast<RequestId>(i), tags[i]));
      } else {
        EXPECT_TRUE(filled(t, tags[i]));
      }
    }
  });
  std::vector<Outcome> seen(kN, Outcome::kNotFound);
  int ended = 0;
  while (ended < kN) {
    for (int i = 0; i < kN; ++i) {
      if (seen[i] != Outcome::kNotFound) continue;
      if (auto got = t.poll(static_cast<RequestId>(i), claims[i], false)) {
        seen[i] = got->outcome;
        ++ended;
      }
    }
  }
  notices.join();
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(seen[i], i % 3 == 0 ? Outcome::kExpired : Outcome::kFilled) << i;
  }
  EXPECT_EQ(t.size(), 0);
}

}  // namespace
}  // namespace cleave::worker_service
