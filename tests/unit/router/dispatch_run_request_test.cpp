// run_request and wait_until_ready (router/run_request.h) over real in-process workers: the
// outcome of a disaggregated request (Generator's tokens, the prefill's KV figures, handed off
// or not), of a unified one, a callback that cancels (every block back), a refusal, the
// caller's request id reaching the workers, and readiness saying why a dispatcher is not ready
// (a refused pairing at once, an unreachable worker by its address).
#include <gtest/gtest.h>

#include <atomic>

#include "cleave/router/run_request.h"
#include "dispatch_test_util.h"

namespace cleave::router {
namespace {

using namespace testing_dispatch;
using testing_engine::synth_path;

class DispatchRunRequestTest : public ReferenceModelTest {
 protected:
  static DispatcherOptions disaggregated(const TestWorker& prefill, const TestWorker& decode) {
    DispatcherOptions o = test_options();
    o.mode = DispatchMode::kDisaggregated;
    o.prefill.workers = {prefill.address};
    o.decode.workers = {decode.address};
    o.max_attempts = 1;
    o.lease = 3000ms;
    return o;
  }
};

// What a callback saw.
struct Seen {
  std::vector<int32_t> tokens;
  std::string text;
  int finished = 0;
};
TokenEventCallback record(Seen& s) {
  return [&s](const v1::TokenEvent& ev) {
    if (ev.has_token()) s.tokens.push_back(ev.token());
    s.text += ev.text();
    if (ev.finished()) ++s.finished;
    return true;
  };
}

TEST_F(DispatchRunRequestTest, DisaggregatedOutcomeHasTheTokensAndThePrefillsFigures) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", synth_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", synth_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated(prefill, decode));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE(wait_until_ready(**d, 10s).ok());

  const std::vector<int32_t> prompt = {1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
                                       44, 45, 46, 47};
  Seen seen;
  auto out = run_request(**d, {prompt, greedy(8)}, record(seen));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  const GenerationResult want = reference(prompt, greedy(8));
  EXPECT_EQ(seen.tokens, want.tokens);
  EXPECT_EQ(seen.text, want.text);
  EXPECT_EQ(seen.finished, 1);
  EXPECT_FALSE(out->cancelled);
  EXPECT_TRUE(out->handed_off);
  EXPECT_EQ(out->events, static_cast<int64_t>(want.tokens.size()));
  EXPECT_TRUE(out->last.finished());
  EXPECT_EQ(out->last.finish_reason(), std::string(finish_reason_name(want.finish_reason)));
  EXPECT_EQ(out->last.usage().prompt_tokens(), static_cast<int64_t>(prompt.size()));
  EXPECT_GT(out->kv_bytes, 0u);
  EXPECT_GE(out->kv_tail_seconds, 0.0);
  EXPECT_GT(out->ttft_seconds, 0.0);
  EXPECT_LE(out->ttft_seconds, out->total_seconds);

  // The first token ends it: not handed off, the prefill's figures still reported.
  Seen one;
  auto first_only = run_request(**d, {prompt, greedy(1)}, record(one));
  ASSERT_TRUE(first_only.ok()) << first_only.status().to_string();
  EXPECT_EQ(one.tokens.size(), 1u);
  EXPECT_EQ(first_only->events, 1);
  EXPECT_FALSE(first_only->handed_off);
  EXPECT_TRUE(first_only->last.finished());
  expect_blocks_back(*prefill.client, "prefill");
  expect_blocks_back(*decode.client, "decode");
}

TEST_F(DispatchRunRequestTest, UnifiedOutcomeIsNotHandedOff) {
  std::string why;
  TestWorker unified = start_worker(worker_config("unified", synth_path()), &why);
  if (!unified.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  DispatcherOptions o = test_options();
  o.unified.workers = {unified.address};
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE(wait_until_ready(**d, 10s).ok());
  const std::vector<int32_t> prompt = {1, 60, 61, 62, 63};
  Seen seen;
  auto out = run_request(**d, {prompt, greedy(6)}, record(seen));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(seen.tokens, reference(prompt, greedy(6)).tokens);
  EXPECT_FALSE(out->handed_off);
  EXPECT_EQ(out->kv_bytes, 0u);
  EXPECT_EQ(out->events, static_cast<int64_t>(seen.tokens.size()));
  EXPECT_TRUE(out->last.finished());
  expect_blocks_back(*unified.client, "unified");
}

// The callback says stop at the first token (before the Decode call) and mid-stream: the
// outcome is cancelled, nothing more reaches the callback, and both workers free every block.
TEST_F(DispatchRunRequestTest, ACallbackReturningFalseCancelsAndFreesTheBlocks) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated(prefill, decode));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE(wait_until_ready(**d, 10s).ok());
  for (int stop_after : {1, 5}) {
    int calls = 0;
    auto out = run_request(**d, {{1, 70, 71, 72, 73}, long_run(500)},
                           [&](const v1::TokenEvent&) { return ++calls < stop_after; });
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    EXPECT_TRUE(out->cancelled) << stop_after;
    EXPECT_FALSE(out->last.finished()) << stop_after;
    EXPECT_EQ(out->events, stop_after);
    EXPECT_EQ(calls, stop_after);
    EXPECT_EQ(out->handed_off, stop_after > 1);
    expect_blocks_back(*decode.client, fmt::format("decode after a stop at {}", stop_after));
    expect_blocks_back(*prefill.client, fmt::format("prefill after a stop at {}", stop_after));
    EXPECT_EQ(calls, stop_after) << "an event after the cancellation";
  }
}

// The caller's request id is the one the workers know: aborting it there ends the request.
TEST_F(DispatchRunRequestTest, TheCallersRequestIdReachesTheWorkers) {
  std::string why;
  TestWorker decode = start_worker(worker_config("decode", slow_model_path()), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", slow_model_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated(prefill, decode));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_TRUE(wait_until_ready(**d, 10s).ok());
  constexpr uint64_t kId = 0x5eed0000123ull;
  std::atomic<int> events{0};
  DispatchRequest req{{1, 80, 81, 82}, long_run(900)};
  req.request_id = kId;
  Result<RequestOutcome> out = Internal("not run");
  std::thread runner([&] {
    out = run_request(**d, std::move(req), [&](const v1::TokenEvent&) {
      ++events;
      return true;
    });
  });
  ASSERT_TRUE(eventually([&] { return events.load() >= 3; }));
  auto aborted = decode.client->abort(kId);
  runner.join();
  ASSERT_TRUE(aborted.ok()) << aborted.status().to_string();
  EXPECT_TRUE(*aborted) << "the decode worker does not know request " << kId;
  EXPECT_FALSE(out.ok()) << "the aborted request finished";
  expect_blocks_back(*decode.client, "decode");
  expect_blocks_back(*prefill.client, "prefill");
}

TEST_F(DispatchRunRequestTest, ARefusedRequestNeverCallsTheCallback) {
  DispatcherOptions o = test_options();
  o.unified.workers = {fmt::format("127.0.0.1:{}", free_port())};
  auto d = make_dispatcher(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  int calls = 0;
  auto out = run_request(**d, {{1, 2, 3}, greedy(4)}, [&](const v1::TokenEvent&) {
    ++calls;
    return true;
  });
  EXPECT_EQ(out.status().code(), StatusCode::kUnavailable) << out.status().to_string();
  EXPECT_EQ(run_request(**d, {{}, greedy(4)}, [&](const v1::TokenEvent&) {
              ++calls;
              return true;
            }).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 0);
}

TEST_F(DispatchRunRequestTest, ReadinessSaysWhyARefusedPairOrAnAbsentWorkerIsNotReady) {
  std::string why;
  WorkerConfig dc = worker_config("decode", synth_path());
  dc.engine.block_size = 32;
  dc.engine.kv_blocks = 64;
  TestWorker decode = start_worker(dc, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  TestWorker prefill = start_worker(worker_config("prefill", synth_path()));
  ASSERT_TRUE(prefill.server);
  auto d = make_dispatcher(disaggregated(prefill, decode));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  auto t0 = std::chrono::steady_clock::now();
  const Status refused = wait_until_ready(**d, 20s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "a refused pair is known at once";
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.to_string();
  EXPECT_NE(refused.message().find("block_size"), std::string::npos) << refused.to_string();
  EXPECT_EQ((*d)->readiness().code(), StatusCode::kFailedPrecondition);

  // Nothing listens at the decode address: Unavailable naming it, once the timeout passed.
  const std::string absent = fmt::format("127.0.0.1:{}", free_port());
  DispatcherOptions o = disaggregated(prefill, decode);
  o.decode.workers = {absent};
  auto lonely = make_dispatcher(o);
  ASSERT_TRUE(lonely.ok()) << lonely.status().to_string();
  t0 = std::chrono::steady_clock::now();
  const Status unreachable = wait_until_ready(**lonely, 500ms);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 500ms);
  EXPECT_EQ(unreachable.code(), StatusCode::kUnavailable) << unreachable.to_string();
  EXPECT_NE(unreachable.message().find("no decode worker is ready"), std::string::npos)
      << unreachable.to_string();
  EXPECT_NE(unreachable.message().find(absent), std::string::npos) << unreachable.to_string();

  // Ready: OK.
  TestWorker good = start_worker(worker_config("decode", synth_path()));
  ASSERT_TRUE(good.server);
  auto paired = make_dispatcher(disaggregated(prefill, good));
  ASSERT_TRUE(paired.ok());
  EXPECT_TRUE(wait_until_ready(**paired, 10s).ok());
  EXPECT_TRUE((*paired)->readiness().ok());
}

}  // namespace
}  // namespace cleave::router
