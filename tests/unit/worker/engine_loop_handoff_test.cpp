// The engine loop's side of the KV handoff, with two engine loops in one process and a sink
// that copies each layer's K/V rows from the prefill pool into the decode pool's reserved blocks
// as the layer is computed (the transfer engine's part is tested in kv_export_test and the
// multi-process integration tests). A request run as prefill on one loop and decode on the other
// gives exactly what Generator gives alone; reservations expire after their lease; pinned blocks
// go back on release_pinned; a failing sink ends the prefill with an error.
#include <cstring>
#include <ctime>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "engine_test_util.h"

namespace cleave {
namespace {

using namespace testing_engine;
using namespace std::chrono_literals;

// Copies rows [begin, end) of a layer from one pool to another, checking that nothing is
// exported twice out of order and that the last call comes last.
class CopySink : public KvExportSink {
 public:
  CopySink(const EngineLoop& from, const EngineLoop& to, std::vector<BlockId> dest)
      : from_(from), to_(to), dest_(std::move(dest)) {}

  bool on_layer_ready(int64_t layer, int64_t begin, int64_t end,
                      std::span<const BlockId> table, bool last) override {
    ++calls;
    if (fail_after >= 0 && calls > fail_after) return false;
    const KvLayout& a = from_.kv_layout();
    const KvLayout& b = to_.kv_layout();
    const uint64_t row = a.block_bytes() / (2 * static_cast<uint64_t>(a.block_size));
    const uint64_t v_off = static_cast<uint64_t>(a.block_size) * row;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t blk = p / a.block_size, off = p % a.block_size;
      const std::byte* src = from_.kv_data() + a.offset(layer, table[static_cast<size_t>(blk)]) + off * row;
      std::byte* dst = to_.kv_data() + b.offset(layer, dest_[static_cast<size_t>(blk)]) + off * row;
      std::memcpy(dst, src, row);
      std::memcpy(dst + v_off, src + v_off, row);
    }
    if (layer == a.n_layers - 1) {
      covered = std::max(covered, end);
      if (begin > first_begin_seen) first_begin_seen = begin;
      saw_last = saw_last || last;
    }
    return true;
  }

  int calls = 0;
  int fail_after = -1;  // >= 0: fail every call after this many
  int64_t covered = 0;
  int64_t first_begin_seen = 0;
  bool saw_last = false;

 private:
  const EngineLoop& from_;
  const EngineLoop& to_;
  std::vector<BlockId> dest_;
};

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<SampleResult> logprobs;
  FinishReason reason = FinishReason::kLength;
  std::string stop_string;
  Status error;
  bool handoff = false;
};

// Runs one request to its finished event on `loop`; appends to `out`.
Status run_on(EngineLoop& loop, EngineRequest req, Outcome& out) {
  std::promise<void> done;
  auto fut = done.get_future();
  const Status st = loop.submit(std::move(req), [&](const EngineEvent& ev) {
    if (ev.has_token) {
      out.tokens.push_back(ev.token);
      out.logprobs.push_back(ev.sample);
    }
    out.text += ev.text;
    if (ev.finished) {
      out.reason = ev.finish_reason;
      out.stop_string = ev.stop_string;
      out.error = ev.error;
      out.handoff = ev.handoff;
      done.set_value();
    }
  });
  if (!st.ok()) return st;
  if (fut.wait_for(60s) != std::future_status::ready) return DeadlineExceeded("no finished event");
  return Status::Ok();
}

class HandoffLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    m_ = ModelUnderTest::load(synth_path());
    ASSERT_TRUE(m_.file);
    reference_ = m_.model();
  }
  static void TearDownTestSuite() { remove_synth_dir(); }

  EngineLoopOptions options(int64_t blocks, int64_t step_tokens, int64_t max_seqs = 16) {
    EngineLoopOptions o;
    o.block_size = 16;
    o.num_blocks = blocks;
    o.scheduler.max_tokens_per_step = step_tokens;
    o.scheduler.max_num_seqs = max_seqs;
    return o;
  }

  // Prefill on `pre`, decode on `dec`; the combined stream.
  Outcome disaggregated(EngineLoop& pre, EngineLoop& dec, RequestId id,
                        const std::vector<int32_t>& prompt, const SamplingParams& p) {
    Outcome out;
    auto blocks = dec.reserve(id, static_cast<int64_t>(prompt.size()), 10s);
    EXPECT_TRUE(blocks.ok()) << blocks.status().to_string();
    if (!blocks.ok()) return out;
    auto sink = std::make_shared<CopySink>(pre, dec, *blocks);
    EngineRequest r{id, prompt, p};
    r.kv_export = sink;
    Status st = run_on(pre, r, out);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(out.error.ok()) << out.error.to_string();
    EXPECT_TRUE(pre.release_pinned(id));
    EXPECT_EQ(sink->covered, static_cast<int64_t>(prompt.size()));
    EXPECT_TRUE(sink->saw_last);
    if (!out.handoff) {
      EXPECT_TRUE(dec.release_reservation(id));
      return out;
    }
    EngineRequest d{id, prompt, p};
    d.prefilled = true;
    d.first_token = out.tokens.at(0);
    st = run_on(dec, d, out);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  }

  ModelUnderTest m_;
  std::unique_ptr<LlamaModel> reference_;
};

TEST_F(HandoffLoopTest, DisaggregatedEqualsAloneConcurrently) {
  auto pre = m_.engine(options(256, 48));  // prompts above 48 tokens are chunked
  auto dec = m_.engine(options(192, 64));
  ASSERT_TRUE(pre && dec);
  std::mt19937 rng(11);
  struct Case {
    std::vector<int32_t> prompt;
    SamplingParams params;
  };
  std::vector<Case> cases;
  const auto shared = random_prompt(rng, *m_.tok, 512, 40);
  for (int i = 0; i < 24; ++i) {
    Case c;
    c.prompt = random_prompt(rng, *m_.tok, 512, 1 + static_cast<int64_t>(rng() % 150));
    if (i % 4 == 0) {  // a shared prefix: the prefill's prefix cache serves it the second time
      c.prompt = shared;
      for (int k = 0; k < i; ++k) c.prompt.push_back(static_cast<int32_t>(3 + k));
    }
    c.params.temperature = 0;
    c.params.max_tokens = 1 + static_cast<int32_t>(rng() % 40);
    if (i % 6 == 1) c.params.logprobs = 2;
    if (i % 6 == 2) {
      c.params.temperature = 0.8f;
      c.params.seed = rng();
      c.params.stop = {"a", "e "};
    }
    if (i % 6 == 3) c.params.min_tokens = std::min(3, c.params.max_tokens);
    cases.push_back(std::move(c));
  }
  std::vector<Outcome> got(cases.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back([&, i] {
      got[i] = disaggregated(*pre, *dec, 100 + i, cases[i].prompt, cases[i].params);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < cases.size(); ++i) {
    const GenerationResult want = generate_alone(*reference_, *m_.tok, cases[i].prompt, cases[i].params);
    const std::string what = fmt::format("case {} ({} prompt tokens)", i, cases[i].prompt.size());
    EXPECT_TRUE(got[i].error.ok()) << what << ": " << got[i].error.to_string();
    EXPECT_EQ(got[i].tokens, want.tokens) << what;
    EXPECT_EQ(got[i].text, want.text) << what;
    EXPECT_EQ(got[i].reason, want.finish_reason) << what;
    EXPECT_EQ(got[i].stop_string, want.stop_string) << what;
    if (!want.logprobs.empty()) {
      ASSERT_EQ(got[i].logprobs.size(), want.logprobs.size()) << what;
      for (size_t k = 0; k < want.logprobs.size(); ++k)
        EXPECT_EQ(got[i].logprobs[k].logprob, want.logprobs[k].logprob) << what;
    }
  }
  EXPECT_GT(pre->stats().scheduler.prompt_tokens_cached, 0u);
  expect_all_blocks_back(*pre);
  expect_all_blocks_back(*dec);
  EXPECT_EQ(dec->stats().leases_expired, 0u);
}

// f16 and bf16 pools: prefill on one loop and decode on another gives exactly what one unified
// loop of the same KV dtype gives, alone or with the others running beside it.
TEST_F(HandoffLoopTest, DisaggregatedEqualsUnifiedForEachKvDtype) {
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    EngineLoopOptions po = options(128, 32), dopt = options(128, 64), uo = options(128, 24);
    po.kv_dtype = dopt.kv_dtype = uo.kv_dtype = dtype;
    auto pre = m_.engine(po);
    auto dec = m_.engine(dopt);
    auto uni = m_.engine(uo);
    ASSERT_TRUE(pre && dec && uni);
    EXPECT_EQ(pre->kv_layout().dtype, dtype);
    EXPECT_EQ(pre->kv_layout().incompatibility(dec->kv_layout()), "");
    std::mt19937 rng(21);
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 6; ++i)
      prompts.push_back(random_prompt(rng, *m_.tok, 512, 5 + static_cast<int64_t>(rng() % 90)));
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = 20;
    p.ignore_eos = true;
    p.logprobs = 1;
    std::vector<Outcome> alone(prompts.size()), batched(prompts.size()), disagg(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i)
      ASSERT_TRUE(run_on(*uni, EngineRequest{500 + i, prompts[i], p}, alone[i]).ok());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < prompts.size(); ++i) {
      threads.emplace_back([&, i] {
        EXPECT_TRUE(run_on(*uni, EngineRequest{600 + i, prompts[i], p}, batched[i]).ok());
      });
      threads.emplace_back([&, i] { disagg[i] = disaggregated(*pre, *dec, 700 + i, prompts[i], p); });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string what = fmt::format("{} case {}", dtype_name(dtype), i);
      EXPECT_EQ(alone[i].tokens.size(), 20u) << what;
      EXPECT_EQ(batched[i].tokens, alone[i].tokens) << what;
      EXPECT_EQ(disagg[i].tokens, alone[i].tokens) << what;
      ASSERT_EQ(disagg[i].logprobs.size(), alone[i].logprobs.size()) << what;
      for (size_t k = 0; k < alone[i].logprobs.size(); ++k) {
        EXPECT_EQ(batched[i].logprobs[k].logprob, alone[i].logprobs[k].logprob) << what;
        EXPECT_EQ(disagg[i].logprobs[k].logprob, alone[i].logprobs[k].logprob) << what;
      }
    }
    expect_all_blocks_back(*pre);
    expect_all_blocks_back(*dec);
    expect_all_blocks_back(*uni);
  }
}

TEST_F(HandoffLoopTest, PendingWhenDecodeIsFull) {
  auto pre = m_.engine(options(128, 64));
  auto dec = m_.engine(options(128, 64, /*max_seqs=*/1));
  ASSERT_TRUE(pre && dec);
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_prompt(rng, *m_.tok, 512, 20 + 7 * i));
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 12;
  p.ignore_eos = true;
  std::vector<Outcome> got(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i)
    threads.emplace_back([&, i] { got[i] = disaggregated(*pre, *dec, i + 1, prompts[i], p); });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const GenerationResult want = generate_alone(*reference_, *m_.tok, prompts[i], p);
    EXPECT_EQ(got[i].tokens, want.tokens) << i;
  }
  expect_all_blocks_back(*pre);
  expect_all_blocks_back(*dec);
}

TEST_F(HandoffLoopTest, ReservationLeaseExpiresAndReleases) {
  auto dec = m_.engine(options(16, 64));
  ASSERT_TRUE(dec);
  auto a = dec->reserve(1, 40, 150ms);  // 3 blocks
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->size(), 3u);
  EXPECT_EQ(dec->stats().blocks_used, 3);
  EXPECT_EQ(dec->stats().reservations, 1);
  EXPECT_EQ(dec->reserve(1, 10, 1s).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(dec->reserve(2, 16 * 17, 1s).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(dec->reserve(3, 0, 1s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dec->reserve(4, 100000, 1s).status().code(), StatusCode::kOutOfRange);
  auto b = dec->reserve(2, 16 * 13, 10s);  // 13 of the 13 blocks left
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(dec->reserve(3, 1, 1s).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(dec->release_reservation(2));
  EXPECT_FALSE(dec->release_reservation(2));
  // The lease of 1 ends with nobody asking.
  const auto t0 = std::chrono::steady_clock::now();
  while (dec->stats().leases_expired == 0 && std::chrono::steady_clock::now() - t0 < 5s)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(dec->stats().leases_expired, 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_FALSE(dec->release_reservation(1));
  // A prefilled submit after the lease: refused, nothing leaks.
  EngineRequest late{1, {m_.tok->bos_id(), 5, 6}, SamplingParams{}};
  late.prefilled = true;
  late.first_token = 7;
  EXPECT_EQ(dec->submit(late, nullptr).code(), StatusCode::kFailedPrecondition);
  expect_all_blocks_back(*dec);
  EXPECT_EQ(dec->stats().reservations_released, 1u);
}

// renew_reservation(): the lease runs again from the renewal; an ended reservation is not
// renewed.
TEST_F(HandoffLoopTest, ARenewedReservationOutlivesItsFirstLease) {
  auto dec = m_.engine(options(16, 64));
  ASSERT_TRUE(dec);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(dec->reserve(1, 40, 150ms).ok());
  std::this_thread::sleep_until(t0 + 100ms);
  EXPECT_TRUE(dec->renew_reservation(1, 400ms));
  EXPECT_FALSE(dec->renew_reservation(2, 400ms)) << "no such reservation";
  EXPECT_FALSE(dec->renew_reservation(1, 0ms));
  std::this_thread::sleep_until(t0 + 350ms);  // past the first lease, within the renewed one
  EXPECT_EQ(dec->stats().leases_expired, 0u);
  EXPECT_EQ(dec->stats().reservations, 1);
  EXPECT_EQ(dec->stats().leases_renewed, 1u);
  while (dec->stats().leases_expired == 0 && std::chrono::steady_clock::now() - t0 < 5s)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(dec->stats().leases_expired, 1u);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 500ms);
  EXPECT_FALSE(dec->renew_reservation(1, 400ms)) << "an expired reservation came back";
  expect_all_blocks_back(*dec);
}

TEST_F(HandoffLoopTest, PinnedUntilReleasedAndFailingSinkEndsPrefill) {
  auto pre = m_.engine(options(64, 16));
  auto dec = m_.engine(options(64, 64));
  ASSERT_TRUE(pre && dec);
  std::mt19937 rng(3);
  const auto prompt = random_prompt(rng, *m_.tok, 512, 70);  // 5 blocks, 5 chunks of 16
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 8;
  {
    auto blocks = dec->reserve(9, 70, 10s);
    ASSERT_TRUE(blocks.ok());
    auto sink = std::make_shared<CopySink>(*pre, *dec, *blocks);
    EngineRequest r{9, prompt, p};
    r.kv_export = sink;
    Outcome out;
    ASSERT_TRUE(run_on(*pre, r, out).ok());
    EXPECT_TRUE(out.handoff);
    ASSERT_TRUE(pre->wait_idle(50ms) == false);  // pinned blocks: not idle
    EXPECT_EQ(pre->stats().blocks_pinned, 5);
    EXPECT_EQ(pre->stats().blocks_used, 5);
    EXPECT_TRUE(pre->release_pinned(9));
    EXPECT_FALSE(pre->release_pinned(9));
    expect_all_blocks_back(*pre);
    EXPECT_TRUE(dec->release_reservation(9));
  }
  {
    auto blocks = dec->reserve(10, 70, 10s);
    ASSERT_TRUE(blocks.ok());
    auto sink = std::make_shared<CopySink>(*pre, *dec, *blocks);
    sink->fail_after = 3;  // fails in the second chunk (2 layers per chunk)
    const auto other = random_prompt(rng, *m_.tok, 512, 70);  // no prefix-cache hit
    EngineRequest r{10, other, p};
    r.kv_export = sink;
    Outcome out;
    ASSERT_TRUE(run_on(*pre, r, out).ok());
    EXPECT_EQ(out.error.code(), StatusCode::kUnavailable) << out.error.to_string();
    EXPECT_TRUE(out.tokens.empty());
    EXPECT_LE(sink->calls, 4);  // the request ended right after the step that failed
    EXPECT_TRUE(pre->release_pinned(10));
    expect_all_blocks_back(*pre);
    EXPECT_TRUE(dec->release_reservation(10));
    expect_all_blocks_back(*dec);
  }
}

// A sink that throws (on the engine thread, inside the forward pass).
class ThrowingSink : public KvExportSink {
 public:
  bool on_layer_ready(int64_t, int64_t, int64_t, std::span<const BlockId>, bool) override {
    throw std::runtime_error("the sink blew up");
  }
};

TEST_F(HandoffLoopTest, ThrowInAStepFailsItsRequestsWithInternalNotTheEngine) {
  auto pre = m_.engine(options(64, 64));
  ASSERT_TRUE(pre);
  std::mt19937 rng(5);
  const auto prompt = random_prompt(rng, *m_.tok, 512, 40);
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 4;
  EngineRequest r{21, prompt, p};
  r.kv_export = std::make_shared<ThrowingSink>();
  Outcome out;
  ASSERT_TRUE(run_on(*pre, r, out).ok());
  EXPECT_EQ(out.error.code(), StatusCode::kInternal) << out.error.to_string();
  EXPECT_NE(out.error.message().find("the sink blew up"), std::string::npos)
      << out.error.to_string();
  EXPECT_TRUE(out.tokens.empty());
  EXPECT_TRUE(pre->release_pinned(21));
  expect_all_blocks_back(*pre);

  // The engine thread goes on serving.
  Outcome next;
  ASSERT_TRUE(run_on(*pre, EngineRequest{22, prompt, p}, next).ok());
  EXPECT_TRUE(next.error.ok()) << next.error.to_string();
  EXPECT_EQ(next.tokens.size(), 4u);
  expect_all_blocks_back(*pre);
}

TEST_F(HandoffLoopTest, FirstTokenEndsTheRequest) {
  auto pre = m_.engine(options(64, 64));
  auto dec = m_.engine(options(64, 64));
  ASSERT_TRUE(pre && dec);
  std::mt19937 rng(8);
  const auto prompt = random_prompt(rng, *m_.tok, 512, 30);
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 1;
  Outcome out = disaggregated(*pre, *dec, 77, prompt, p);
  EXPECT_FALSE(out.handoff);
  EXPECT_EQ(out.reason, FinishReason::kLength);
  const GenerationResult want = generate_alone(*reference_, *m_.tok, prompt, p);
  EXPECT_EQ(out.tokens, want.tokens);
  EXPECT_EQ(out.text, want.text);
  expect_all_blocks_back(*pre);
  expect_all_blocks_back(*dec);
}

// Blocks held by a reservation, nothing running: a request that fits only once the lease ends
// waits for it (it used to fail as "never fits") and then gives the reference tokens; so does
// one whose decode grows into the reserved blocks. Every block comes back.
TEST_F(HandoffLoopTest, RequestWaitsForReservedBlocksAndCompletesAfterTheLease) {
  auto dec = m_.engine(options(8, 128));  // 8 blocks of 16 tokens
  ASSERT_TRUE(dec);
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 30;
  p.ignore_eos = true;
  std::mt19937 rng(11);
  struct Case {
    const char* what;
    int64_t prompt_len;
  };
  // 70 tokens: its prompt needs 5 blocks, 4 are free. 50 tokens: its prompt fits in 4, its
  // 80 tokens with the generated ones need 5.
  const Case cases[] = {{"prompt waits", 70}, {"decode waits", 50}};
  RequestId id = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const auto prompt = random_prompt(rng, *m_.tok, 512, c.prompt_len);
    constexpr auto kLease = 300ms;
    const uint64_t expired_before = dec->stats().leases_expired;
    const auto t0 = std::chrono::steady_clock::now();
    auto held = dec->reserve(1000 + id, 16 * 4, kLease);  // 4 of the 8 blocks
    ASSERT_TRUE(held.ok()) << held.status().to_string();
    EventSink sink;
    ASSERT_TRUE(dec->submit(EngineRequest{id, prompt, p}, sink.callback()).ok());
    std::this_thread::sleep_for(50ms);
    // Waiting, not failed, and the engine thread sleeps meanwhile instead of stepping again
    // and again (process CPU time over 150 ms of waiting).
    const std::clock_t cpu0 = std::clock();
    std::this_thread::sleep_for(150ms);
    const double cpu_ms = 1000.0 * static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
    EXPECT_LT(cpu_ms, 60.0);
    EXPECT_FALSE(sink.get(id).finished);
    EXPECT_EQ(dec->stats().running + dec->stats().waiting, 1);
    ASSERT_TRUE(dec->wait_idle(30s));
    const Stream got = sink.get(id);
    expect_same(got, generate_alone(*reference_, *m_.tok, prompt, p), c.what);
    EXPECT_GE(got.finished_at - t0, kLease);
    EXPECT_EQ(dec->stats().leases_expired, expired_before + 1);
    EXPECT_EQ(dec->stats().requests_failed, 0u);
    expect_all_blocks_back(*dec);
    ++id;
  }
}

// reserve_async answers at once, on the caller's thread, while the engine waits for work; its
// errors before queueing come back as its status (the callback never runs), the pool's answer
// through the callback (the fence never runs then); the fence is told how each reservation
// ended.
TEST_F(HandoffLoopTest, ReserveAsyncAnswersAtOnceAndFencesEveryEnd) {
  auto dec = m_.engine(options(8, 64));
  ASSERT_TRUE(dec);
  std::mutex mu;
  std::map<RequestId, std::vector<ReservationEnd>> ends;
  const auto fence = [&](RequestId id) {
    return [&, id](ReservationEnd how) {
      std::lock_guard<std::mutex> lk(mu);
      ends[id].push_back(how);
    };
  };
  const auto reserve = [&](RequestId id, int64_t tokens, std::chrono::milliseconds lease) {
    auto reply = std::make_shared<std::promise<std::pair<Result<std::vector<BlockId>>, std::thread::id>>>();
    auto fut = reply->get_future();
    const Status queued = dec->reserve_async(id, tokens, lease, fence(id),
                                             [reply](Result<std::vector<BlockId>> r) {
                                               reply->set_value({std::move(r), std::this_thread::get_id()});
                                             });
    EXPECT_TRUE(queued.ok()) << queued.to_string();
    EXPECT_EQ(fut.wait_for(10s), std::future_status::ready);
    return fut.get();
  };
  bool ran = false;
  const auto never = [&](Result<std::vector<BlockId>>) { ran = true; };
  EXPECT_EQ(dec->reserve_async(1, 0, 1s, fence(1), never).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dec->reserve_async(1, 16 * 9, 1s, fence(1), never).code(),
            StatusCode::kResourceExhausted);  // more than the pool has
  EXPECT_EQ(dec->reserve_async(1, 16, 0ms, fence(1), never).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dec->reserve_async(1, 16, 1s, fence(1), {}).code(), StatusCode::kInvalidArgument);

  auto [a, a_thread] = reserve(1, 16 * 6, 10s);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->size(), 6u);
  EXPECT_EQ(a_thread, std::this_thread::get_id());
  EXPECT_EQ(dec->reserve_async(1, 16, 1s, fence(1), never).code(), StatusCode::kAlreadyExists);
  auto [b, b_thread] = reserve(2, 16 * 3, 10s);  // 2 left: the pool says no, through the callback
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status().to_string();
  EXPECT_FALSE(ran);
  EXPECT_TRUE(dec->release_reservation(1));
  auto [c, c_thread] = reserve(3, 16, 100ms);  // expires
  ASSERT_TRUE(c.ok());
  auto [d, d_thread] = reserve(4, 16, 10s);  // ends at shutdown
  ASSERT_TRUE(d.ok());
  const auto t0 = std::chrono::steady_clock::now();
  while (dec->stats().leases_expired == 0 && std::chrono::steady_clock::now() - t0 < 5s)
    std::this_thread::sleep_for(5ms);
  dec->shutdown();
  std::lock_guard<std::mutex> lk(mu);
  EXPECT_EQ(ends[1], std::vector<ReservationEnd>{ReservationEnd::kReleased});
  EXPECT_TRUE(ends[2].empty());  // failed: never fenced
  EXPECT_EQ(ends[3], std::vector<ReservationEnd>{ReservationEnd::kExpired});
  EXPECT_EQ(ends[4], std::vector<ReservationEnd>{ReservationEnd::kShutdown});
  EXPECT_EQ(dec->reserve_async(5, 16, 1s, fence(5), never).code(), StatusCode::kUnavailable);
}

// A sink that holds the forward pass at its first layer until told to go on.
class GateSink : public KvExportSink {
 public:
  bool on_layer_ready(int64_t, int64_t, int64_t, std::span<const BlockId>, bool) override {
    if (!entered_) {
      entered_ = true;
      in_forward.set_value();
      go.get_future().wait();
    }
    return true;
  }
  std::promise<void> in_forward, go;

 private:
  bool entered_ = false;
};

// A reservation asked for while a step's forward pass computes is made at once, on the caller's
// thread, without waiting for the pass to end (the engine's state is free then); one asked for
// from a callback on the engine thread is made before the next forward pass. Both hold their
// blocks until released, and the request computed meanwhile is right.
TEST_F(HandoffLoopTest, AReserveIsAnsweredWhileAForwardPassComputes) {
  auto eng = m_.engine(options(32, 64));
  ASSERT_TRUE(eng);
  std::mt19937 rng(9);
  const auto prompt = random_prompt(rng, *m_.tok, 512, 40);
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 6;
  auto gate = std::make_shared<GateSink>();
  EngineRequest r{31, prompt, p};
  r.kv_export = gate;
  std::promise<void> done;
  std::vector<int32_t> tokens;
  Status error;
  std::promise<Result<std::vector<BlockId>>> from_callback;
  bool asked_from_callback = false;
  ASSERT_TRUE(
      eng->submit(r,
                  [&](const EngineEvent& ev) {
                    if (ev.has_token) tokens.push_back(ev.token);
                    if (ev.has_token && !asked_from_callback) {
                      asked_from_callback = true;  // on the engine thread, its state lock held
                      EXPECT_TRUE(eng->reserve_async(33, 16, 10s, {},
                                                     [&](Result<std::vector<BlockId>> b) {
                                                       from_callback.set_value(std::move(b));
                                                     })
                                      .ok());
                    }
                    if (ev.finished) {
                      error = ev.error;
                      done.set_value();
                    }
                  })
          .ok());
  ASSERT_EQ(gate->in_forward.get_future().wait_for(30s), std::future_status::ready);
  // The engine thread is inside forward_batch, held by the sink.
  std::thread::id answered_on;
  Result<std::vector<BlockId>> got = Internal("not answered");
  ASSERT_TRUE(eng->reserve_async(32, 16 * 3, 10s, {},
                                 [&](Result<std::vector<BlockId>> b) {
                                   answered_on = std::this_thread::get_id();
                                   got = std::move(b);
                                 })
                  .ok());
  EXPECT_EQ(answered_on, std::this_thread::get_id()) << "not answered inside reserve_async";
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->size(), 3u);
  EXPECT_EQ(eng->stats().blocks_reserved, 3);
  gate->go.set_value();
  auto fut = from_callback.get_future();
  ASSERT_EQ(fut.wait_for(30s), std::future_status::ready);
  auto cb = fut.get();
  ASSERT_TRUE(cb.ok()) << cb.status().to_string();
  EXPECT_EQ(cb->size(), 1u);
  ASSERT_EQ(done.get_future().wait_for(60s), std::future_status::ready);
  EXPECT_TRUE(error.ok()) << error.to_string();
  // The prefill's token is that of the request alone.
  const auto want = generate_alone(*reference_, *m_.tok, prompt, p);
  ASSERT_FALSE(tokens.empty());
  ASSERT_FALSE(want.tokens.empty());
  EXPECT_EQ(tokens[0], want.tokens[0]);
  EXPECT_TRUE(eng->release_pinned(31));
  EXPECT_TRUE(eng->release_reservation(32));
  EXPECT_TRUE(eng->release_reservation(33));
  expect_all_blocks_back(*eng);
}

}  // namespace
}  // namespace cleave
