// Dispatch policies as pure functions (round robin, power of two choices, prefix aware) and the
// dispatch settings' names and validation.
#include "cleave/router/dispatch_policy.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "cleave/kvcache/prefix_hash.h"

namespace cleave::router {
namespace {

std::vector<WorkerCandidate> candidates(std::vector<int64_t> loads) {
  std::vector<WorkerCandidate> out;
  for (size_t i = 0; i < loads.size(); ++i) out.push_back({100 + i, loads[i], 0.0});
  return out;
}

std::vector<int32_t> tokens(int n, int first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(DispatchPolicyTest, RoundRobinTakesEachInTurn) {
  RoundRobinPolicy p;
  const auto c = candidates({5, 0, 9});
  std::vector<size_t> got;
  for (int i = 0; i < 7; ++i) got.push_back(p.pick(c, {}));
  EXPECT_EQ(got, (std::vector<size_t>{0, 1, 2, 0, 1, 2, 0}));
  // A smaller candidate set (a worker excluded) still gives a valid index.
  const auto two = candidates({1, 1});
  for (int i = 0; i < 5; ++i) EXPECT_LT(p.pick(two, {}), 2u);
}

TEST(DispatchPolicyTest, LeastLoadedIsPowerOfTwoChoices) {
  LeastLoadedPolicy p(7);
  EXPECT_EQ(p.pick(candidates({3}), {}), 0u);
  // Two candidates: both are always drawn, the less loaded wins.
  for (int i = 0; i < 20; ++i) EXPECT_EQ(p.pick(candidates({4, 1}), {}), 1u);
  // KV usage breaks a tie in load.
  std::vector<WorkerCandidate> tie = {{1, 2, 0.9}, {2, 2, 0.1}};
  for (int i = 0; i < 20; ++i) EXPECT_EQ(p.pick(tie, {}), 1u);

  // Four candidates: the most loaded never wins a draw of two distinct ones; the least loaded
  // wins every draw it is in (half of them: 1 - C(3,2)/C(4,2)).
  const auto c = candidates({8, 0, 3, 5});
  std::map<size_t, int> wins;
  const int n = 6000;
  for (int i = 0; i < n; ++i) ++wins[p.pick(c, {})];
  EXPECT_EQ(wins[0], 0);
  EXPECT_NEAR(wins[1] / double(n), 0.5, 0.05);
  EXPECT_NEAR(wins[2] / double(n), 1.0 / 3, 0.05);
  EXPECT_NEAR(wins[3] / double(n), 1.0 / 6, 0.05);

  // The same seed gives the same choices.
  LeastLoadedPolicy a(99), b(99);
  const auto even = candidates({1, 1, 1, 1, 1});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.pick(even, {}), b.pick(even, {}));
}

TEST(DispatchPolicyTest, PrefixAwarePrefersTheHolderOfTheLongestPrefix) {
  PrefixAwarePolicy p(1, 1000, 2);
  const auto system_prompt = tokens(64, 1);  // 4 blocks of 16
  auto prompt_a = system_prompt;
  prompt_a.insert(prompt_a.end(), {300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311,
                                   312, 313, 314, 315});
  auto prompt_b = tokens(40, 200);  // unrelated
  const auto ha = hash_full_blocks(prompt_a, 16);
  const auto hs = hash_full_blocks(system_prompt, 16);
  const auto hb = hash_full_blocks(prompt_b, 16);
  ASSERT_EQ(ha.size(), 5u);
  ASSERT_EQ(hs.size(), 4u);

  p.routed(101, ha);
  p.routed(102, hb);
  EXPECT_EQ(p.matched_blocks(101, hs), 4u);
  EXPECT_EQ(p.matched_blocks(101, ha), 5u);
  EXPECT_EQ(p.matched_blocks(102, ha), 0u);
  EXPECT_EQ(p.matched_blocks(102, hb), 2u);
  EXPECT_EQ(p.remembered(101), 5u);

  // A new question after the same system prompt goes where the prefix is.
  auto prompt_c = system_prompt;
  prompt_c.insert(prompt_c.end(), 20, 7);
  const auto hc = hash_full_blocks(prompt_c, 16);
  const auto c = candidates({1, 1, 0});  // keys 100, 101, 102
  for (int i = 0; i < 10; ++i) EXPECT_EQ(p.pick(c, hc), 1u);
  // ... while its load stays within the slack of the least loaded (0 + 2).
  EXPECT_EQ(p.pick(candidates({0, 2, 0}), hc), 1u);
  // Beyond it, least loaded decides (worker 101 is the most loaded: never drawn as the winner).
  for (int i = 0; i < 20; ++i) EXPECT_NE(p.pick(candidates({0, 3, 0}), hc), 1u);
  // No prefix anywhere: least loaded.
  const auto unseen = hash_full_blocks(tokens(32, 400), 16);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(p.pick(candidates({5, 0}), unseen), 1u);
  // Two holders: the longer match wins.
  p.routed(100, hs);
  EXPECT_EQ(p.pick(candidates({0, 0, 0}), ha), 1u);
  EXPECT_EQ(p.pick(candidates({0, 0, 0}), hs), 0u);  // equal matches: the first of the least loaded

  p.forget(101);
  EXPECT_EQ(p.remembered(101), 0u);
  EXPECT_EQ(p.pick(candidates({0, 0, 0}), ha), 0u);  // worker 100 holds the 4 system blocks
}

TEST(DispatchPolicyTest, PrefixAwareMemoryIsBoundedLeastRecentFirst) {
  PrefixAwarePolicy p(1, 6, 0);
  const auto h1 = hash_full_blocks(tokens(64, 1), 16);    // 4 blocks
  const auto h2 = hash_full_blocks(tokens(64, 500), 16);  // 4 other blocks
  p.routed(7, h1);
  EXPECT_EQ(p.remembered(7), 4u);
  p.routed(7, h2);
  EXPECT_EQ(p.remembered(7), 6u);
  // h2 is the most recent: all of it is held; h1 lost its deepest blocks first, keeping the
  // two leading ones (routed() puts a prompt's leading blocks most recent).
  EXPECT_EQ(p.matched_blocks(7, h2), 4u);
  EXPECT_EQ(p.matched_blocks(7, h1), 2u);
  // Routing h1 again refreshes it.
  p.routed(7, h1);
  EXPECT_EQ(p.matched_blocks(7, h1), 4u);
  EXPECT_EQ(p.remembered(7), 6u);
}

TEST(DispatchPolicyTest, FactoryMakesEachKind) {
  DispatcherOptions o;
  EXPECT_FALSE(make_dispatch_policy(DispatchPolicyKind::kRoundRobin, o, 1)->wants_block_hashes());
  EXPECT_FALSE(make_dispatch_policy(DispatchPolicyKind::kLeastLoaded, o, 1)->wants_block_hashes());
  EXPECT_TRUE(make_dispatch_policy(DispatchPolicyKind::kPrefixAware, o, 1)->wants_block_hashes());
}

TEST(DispatchOptionsTest, NamesRoundTripAndBadNamesAreRefused) {
  for (auto m : {DispatchMode::kUnified, DispatchMode::kDisaggregated}) {
    auto r = parse_dispatch_mode(dispatch_mode_name(m));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, m);
  }
  for (auto p : {DispatchPolicyKind::kRoundRobin, DispatchPolicyKind::kLeastLoaded,
                 DispatchPolicyKind::kPrefixAware}) {
    auto r = parse_dispatch_policy(dispatch_policy_name(p));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, p);
  }
  auto bad = parse_dispatch_policy("random");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("random"), std::string::npos);
  EXPECT_NE(bad.status().message().find("least_loaded"), std::string::npos);
  EXPECT_FALSE(parse_dispatch_mode("split").ok());
}

TEST(DispatchOptionsTest, ValidationNamesTheField) {
  DispatcherOptions o;
  auto expect_bad = [](const DispatcherOptions& opts, const std::string& needle) {
    const Status s = validate_dispatcher_options(opts);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect_bad(o, "unified pool has no workers");
  o.unified.workers = {"127.0.0.1:7001", "worker-1.svc:7001"};
  EXPECT_TRUE(validate_dispatcher_options(o).ok());
  o.unified.workers.push_back("nohost");
  expect_bad(o, "nohost");
  o.unified.workers.back() = "127.0.0.1:0";
  expect_bad(o, "port 0");
  o.unified.workers.pop_back();
  o.unified.dns_name = "workers.svc";
  expect_bad(o, "needs a port");
  o.unified.dns_port = 7001;
  EXPECT_TRUE(validate_dispatcher_options(o).ok());
  o.queue_limit = 0;
  expect_bad(o, "queue_limit");
  o.queue_limit = 10;
  o.max_attempts = 0;
  expect_bad(o, "max_attempts");
  o.max_attempts = 2;
  o.timeouts.stream_idle = std::chrono::milliseconds(0);
  expect_bad(o, "timeouts.stream_idle");
  o.timeouts.stream_idle = std::chrono::milliseconds(100);

  o.mode = DispatchMode::kDisaggregated;
  expect_bad(o, "prefill pool has no workers");
  o.prefill.workers = {"127.0.0.1:7001"};
  expect_bad(o, "decode pool has no workers");
  o.decode.dns_name = "decode.svc";
  o.decode.dns_port = 7002;
  EXPECT_TRUE(validate_dispatcher_options(o).ok());
  EXPECT_EQ(o.prefill.policy, DispatchPolicyKind::kPrefixAware);  // the default for prefill
  auto d = make_dispatcher(DispatcherOptions{});
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cleave::router
