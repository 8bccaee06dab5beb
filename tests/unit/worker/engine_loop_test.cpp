// Engine loop mechanics: the prefix cache (a follow-up prompt computes only its new tokens and
// gives the same output as without the cache), cancellation mid-prefill and mid-decode,
// a sequence that outgrows the pool, submit validation, and shutdown with pending requests.
// Every test ends with all blocks back in the pool.
#include <atomic>
#include <chrono>
#include <thread>

#include "engine_test_util.h"

namespace cleave {
namespace {

using namespace testing_engine;

class EngineLoopTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string path = GetParam() == "stories260K" ? stories_path() : synth_path();
    m_ = ModelUnderTest::load(path);
    if (!m_.file) GTEST_SKIP() << path << " is absent (../shared/models is needed for stories260K)";
    ASSERT_TRUE(m_.tok);
  }
  int64_t vocab() const { return m_.file->config().vocab_size; }
  static EngineLoopOptions options(int64_t num_blocks, int64_t budget, bool prefix = true) {
    EngineLoopOptions o;
    o.block_size = 16;
    o.num_blocks = num_blocks;
    o.scheduler.max_tokens_per_step = budget;
    o.scheduler.prefix_caching = prefix;
    return o;
  }
  static SamplingParams greedy(int32_t max_tokens, bool ignore_eos = false) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = ignore_eos;
    return p;
  }
  // Submits and waits for the request to end.
  Stream run_one(EngineLoop& engine, RequestId id, const std::vector<int32_t>& prompt,
                 const SamplingParams& p) {
    EventSink sink;
    const Status st = engine.submit(EngineRequest{id, prompt, p}, sink.callback());
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(engine.wait_idle(std::chrono::seconds(30)));
    return sink.get(id);
  }

  ModelUnderTest m_;
};

TEST_P(EngineLoopTest, PrefixCacheComputesOnlyTheNewTokensAndKeepsTheOutput) {
  std::mt19937 rng(11);
  const std::vector<int32_t> first = random_prompt(rng, *m_.tok, vocab(), 320);
  // Shares the first 288 tokens (90%, 18 full blocks) and differs in the last 32.
  std::vector<int32_t> second(first.begin(), first.begin() + 288);
  const std::vector<int32_t> tail = random_prompt(rng, *m_.tok, vocab(), 33);
  second.insert(second.end(), tail.begin() + 1, tail.end());
  ASSERT_EQ(second.size(), 320u);
  const SamplingParams p = greedy(24);

  auto cached_engine = m_.engine(options(256, 128));
  ASSERT_TRUE(cached_engine);
  const Stream a = run_one(*cached_engine, 1, first, p);
  EXPECT_EQ(a.cached_prompt_tokens, 0);
  const SchedulerCounters before = cached_engine->stats().scheduler;
  const Stream b = run_one(*cached_engine, 2, second, p);
  const SchedulerCounters after = cached_engine->stats().scheduler;
  EXPECT_EQ(after.prompt_tokens_cached - before.prompt_tokens_cached, 288u);
  EXPECT_EQ(after.prompt_tokens_computed - before.prompt_tokens_computed, 32u);
  EXPECT_EQ(b.cached_prompt_tokens, 288);
  expect_all_blocks_back(*cached_engine);

  auto plain_engine = m_.engine(options(256, 128, /*prefix=*/false));
  ASSERT_TRUE(plain_engine);
  const Stream b_plain = run_one(*plain_engine, 2, second, p);
  EXPECT_EQ(b_plain.cached_prompt_tokens, 0);
  EXPECT_EQ(plain_engine->stats().scheduler.prompt_tokens_computed, 320u);
  EXPECT_EQ(b.tokens, b_plain.tokens);
  EXPECT_EQ(b.text, b_plain.text);
  auto reference = m_.model();
  const GenerationResult want = generate_alone(*reference, *m_.tok, second, p);
  expect_same(b, want, "second prompt with the prefix cache");
  expect_all_blocks_back(*plain_engine);
}

TEST_P(EngineLoopTest, CancelInPrefillAndInDecodeReturnsEveryBlock) {
  auto engine = m_.engine(options(256, 16));
  ASSERT_TRUE(engine);
  std::mt19937 rng(5);
  EventSink sink;
  auto sink_cb = sink.callback();
  EngineLoop* e = engine.get();
  // Request 1 decodes; on its 3rd token it cancels request 2, whose 300-token prompt needs ~19
  // steps of 16 tokens; on its 5th it cancels itself. Its first token waits until request 2 is
  // submitted: on a slow run (ASan) request 1 could otherwise reach its 3rd token first.
  const std::vector<int32_t> prompt1 = random_prompt(rng, *m_.tok, vocab(), 5);
  const std::vector<int32_t> prompt2 = random_prompt(rng, *m_.tok, vocab(), 300);
  std::atomic<bool> second_submitted{false};
  int seen = 0;
  auto cb1 = [&, e](const EngineEvent& ev) {
    sink_cb(ev);
    if (!ev.has_token) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!second_submitted.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ++seen;
    if (seen == 3) {
      EXPECT_TRUE(e->cancel(2));
    }
    if (seen == 5) {
      EXPECT_TRUE(e->cancel(1));
    }
  };
  ASSERT_TRUE(engine->submit(EngineRequest{1, prompt1, greedy(100, true)}, cb1).ok());
  ASSERT_TRUE(engine->submit(EngineRequest{2, prompt2, greedy(10)}, sink.callback()).ok());
  second_submitted.store(true);
  expect_all_blocks_back(*engine);
  const Stream s1 = sink.get(1), s2 = sink.get(2);
  EXPECT_TRUE(s1.finished);
  EXPECT_EQ(s1.reason, FinishReason::kCancelled);
  EXPECT_EQ(s1.tokens.size(), 5u);  // the cancel is handled before the next step
  EXPECT_TRUE(s2.finished);
  EXPECT_EQ(s2.reason, FinishReason::kCancelled);
  EXPECT_TRUE(s2.tokens.empty());
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.requests_cancelled, 2u);
  EXPECT_LT(st.scheduler.prompt_tokens_computed, 305u);  // request 2's prefill never completed
  EXPECT_FALSE(engine->cancel(1));  // no longer in flight
  EXPECT_FALSE(engine->cancel(99));
  // The ids can be used again.
  const Stream again = run_one(*engine, 2, random_prompt(rng, *m_.tok, vocab(), 20), greedy(3));
  EXPECT_TRUE(again.error.ok());
  EXPECT_EQ(again.generated_tokens, 3);
  expect_all_blocks_back(*engine);
}

TEST_P(EngineLoopTest, SequenceOutgrowingThePoolFailsWithResourceExhausted) {
  auto engine = m_.engine(options(4, 256));  // 64 positions
  ASSERT_TRUE(engine);
  std::mt19937 rng(3);
  const Stream s = run_one(*engine, 7, random_prompt(rng, *m_.tok, vocab(), 40), greedy(100, true));
  EXPECT_TRUE(s.finished);
  EXPECT_EQ(s.error.code(), StatusCode::kResourceExhausted) << s.error.to_string();
  EXPECT_NE(s.error.message().find("has 65 tokens"), std::string::npos) << s.error.to_string();
  EXPECT_EQ(s.tokens.size(), 25u);  // positions 40..64 sampled; 64 has no block
  EXPECT_EQ(engine->stats().requests_failed, 1u);
  expect_all_blocks_back(*engine);
}

TEST_P(EngineLoopTest, SubmitValidatesBeforeQueueing) {
  auto engine = m_.engine(options(8, 64));
  ASSERT_TRUE(engine);
  EventSink sink;
  auto submit = [&](RequestId id, std::vector<int32_t> prompt, SamplingParams p) {
    return engine->submit(EngineRequest{id, std::move(prompt), std::move(p)}, sink.callback());
  };
  EXPECT_EQ(submit(1, {}, greedy(4)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(submit(1, {1, static_cast<int32_t>(vocab())}, greedy(4)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(submit(1, {1, -1}, greedy(4)).code(), StatusCode::kInvalidArgument);
  SamplingParams bad = greedy(4);
  bad.top_p = 0;
  EXPECT_EQ(submit(1, {1, 2}, bad).code(), StatusCode::kInvalidArgument);
  const int64_t ctx = m_.file->config().context_length;
  EXPECT_EQ(submit(1, std::vector<int32_t>(static_cast<size_t>(ctx) + 1, 1), greedy(4)).code(),
            StatusCode::kOutOfRange);
  const Status big = submit(1, std::vector<int32_t>(129, 1), greedy(4));  // 9 blocks > 8
  EXPECT_EQ(big.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.message().find("8 blocks"), std::string::npos) << big.message();
  ASSERT_TRUE(submit(1, {m_.tok->bos_id()}, greedy(60, true)).ok());
  EXPECT_EQ(submit(1, {m_.tok->bos_id()}, greedy(4)).code(), StatusCode::kAlreadyExists);
  expect_all_blocks_back(*engine);
  EXPECT_EQ(engine->stats().requests_finished, 1u);
}

TEST_P(EngineLoopTest, ShutdownEndsPendingRequestsWithAnError) {
  auto engine = m_.engine(options(64, 32));
  ASSERT_TRUE(engine);
  EventSink sink;
  std::mt19937 rng(9);
  for (RequestId id = 0; id < 8; ++id) {
    ASSERT_TRUE(engine->submit(EngineRequest{id, random_prompt(rng, *m_.tok, vocab(), 50),
                                             greedy(400, true)},
                               sink.callback()).ok());
  }
  engine->shutdown();
  int unavailable = 0;
  for (RequestId id = 0; id < 8; ++id) {
    const Stream s = sink.get(id);
    EXPECT_TRUE(s.finished) << "request " << id;
    if (s.error.code() == StatusCode::kUnavailable) ++unavailable;
  }
  EXPECT_EQ(unavailable, 8);  // none can finish 400 tokens that fast... or be left hanging
  EXPECT_EQ(engine->submit(EngineRequest{100, {1}, greedy(1)}, sink.callback()).code(),
            StatusCode::kUnavailable);
  EXPECT_TRUE(engine->wait_idle(std::chrono::milliseconds(10)));
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.blocks_used, 0);
  engine->shutdown();  // idempotent
}

TEST_P(EngineLoopTest, FirstTokenReportsTheWaitInTheEnginesQueue) {
  // One running sequence at a time: the second request waits for the first to end.
  EngineLoopOptions o = options(64, 256);
  o.scheduler.max_num_seqs = 1;
  auto engine = m_.engine(o);
  ASSERT_TRUE(engine);
  std::mt19937 rng(5);
  const auto prompt = random_prompt(rng, *m_.tok, vocab(), 24);
  EventSink sink;
  ASSERT_TRUE(engine->submit(EngineRequest{1, prompt, greedy(120, true)}, sink.callback()).ok());
  const auto second_submitted = std::chrono::steady_clock::now();
  ASSERT_TRUE(engine->submit(EngineRequest{2, prompt, greedy(4, true)}, sink.callback()).ok());
  ASSERT_TRUE(engine->wait_idle(std::chrono::seconds(60)));
  const Stream first = sink.get(1);
  const Stream second = sink.get(2);
  ASSERT_TRUE(first.finished && second.finished);
  EXPECT_GE(first.queue_seconds, 0.0);
  EXPECT_EQ(first.events_with_queue_seconds, 1);
  EXPECT_EQ(second.events_with_queue_seconds, 1);
  // The second could not start before the first had finished.
  const double waited = std::chrono::duration<double>(first.finished_at - second_submitted).count();
  EXPECT_GE(second.queue_seconds, 0.9 * waited) << "waited " << waited;
  expect_all_blocks_back(*engine);
}

TEST_P(EngineLoopTest, CreateRejectsBadOptions) {
  EngineLoopOptions o = options(0, 64);
  o.kv_cache_bytes = 16;
  auto r = EngineLoop::create(m_.model(), m_.tok, o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  o = options(16, 0);
  EXPECT_EQ(EngineLoop::create(m_.model(), m_.tok, o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EngineLoop::create(nullptr, m_.tok, options(16, 16)).status().code(),
            StatusCode::kInvalidArgument);
}

// The host mirror is for device pools whose provider cannot reach device memory; asked for on
// a host pool, the loop does without it and the transfer engine registers the pool itself.
TEST_P(EngineLoopTest, TheKvMirrorIsForDevicePoolsOnly) {
  EXPECT_TRUE(kv_mirror_needed(0, /*provider_hmem=*/false));
  EXPECT_FALSE(kv_mirror_needed(0, /*provider_hmem=*/true));
  EXPECT_FALSE(kv_mirror_needed(-1, /*provider_hmem=*/false));
  EXPECT_FALSE(kv_mirror_needed(-1, /*provider_hmem=*/true));
  EngineLoopOptions o = options(16, 64);
  o.kv_staging = true;
  auto r = EngineLoop::create(m_.model(), m_.tok, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE((*r)->kv_staged());
  EXPECT_EQ((*r)->kv_device(), -1);
  EXPECT_EQ((*r)->kv_transfer_data(), (*r)->kv_data());
}

INSTANTIATE_TEST_SUITE_P(Models, EngineLoopTest, ::testing::Values("stories260K", "synth"),
                         [](const auto& info) { return info.param; });

class CleanUp : public ::testing::Environment {
 public:
  void TearDown() override { remove_synth_dir(); }
};
const auto* const kCleanUp = ::testing::AddGlobalTestEnvironment(new CleanUp);

}  // namespace
}  // namespace cleave
