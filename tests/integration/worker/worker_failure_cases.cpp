// Not named *_test.cpp: tests/worker.cmake registers it with disaggregation_cases.cpp.
// Workers killed with SIGKILL in the middle of a KV transfer, over tcp;ofi_rxm and over shm:
//  - the prefill worker: the decode worker frees the reservation within its lease;
//  - the decode worker: the prefill fails within the transfer engine's bound and frees its
//    blocks;
//  - the decode worker in the middle of a stream (SIGKILL, or SIGSTOP: silent past the stream
//    idle deadline): the router migrates the stream to the other decode worker and it
//    completes with the undisturbed run's text.
// Neither hangs, each survivor serves on with a fresh peer, and its pool drains.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <random>
#include <thread>

#include "cleave/common/metrics.h"
#include "cleave/model/synth.h"
#include "cleave/worker/proto_convert.h"
#include "cleave/worker/worker_client.h"
#include "fmt/format.h"
#include "worker_test_fixture.h"

namespace cleave {
namespace {

using namespace std::chrono_literals;
using namespace worker_testing;
namespace fs = std::filesystem;

class WorkerFailureTest : public WorkerProcessTest {};

// A synthetic model big enough that a long prompt's prefill (and so its transfer) lasts a
// good fraction of a second on one thread: the window in which the kill tests strike.
const std::string& synth_path() {
  static const std::string path = [] {
    const fs::path dir = fs::temp_directory_path() / fmt::format("cleave-disagg-test-{}", ::getpid());
    fs::create_directories(dir);
    const std::string p = (dir / "synth.gguf").string();
    SynthOptions o;
    o.layers = 6;
    o.dim = 256;
    o.heads = 8;
    o.kv_heads = 4;
    o.ffn = 704;
    o.vocab = 1024;
    o.context = 2048;
    o.seed = 11;
    const Status st = write_synth_model(o, p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return p;
  }();
  return path;
}

constexpr size_t kLongPrompt = 1800;
constexpr int64_t kBlockSize = 16;  // the workers' engine.block_size (default)

std::vector<int32_t> long_prompt(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p = random_tokens(rng, 1024, -1, -1, kLongPrompt);
  p[0] = 1000;
  return p;
}

// A Prefill RPC running on another thread.
struct PendingPrefill {
  std::future<Status> result;
  std::shared_ptr<std::atomic<int64_t>> returned_at_ns = std::make_shared<std::atomic<int64_t>>(0);
  bool returned() const { return returned_at_ns->load() != 0; }
  Clock::time_point returned_at() const {
    return Clock::time_point(Clock::duration(returned_at_ns->load()));
  }
};

PendingPrefill start_prefill(WorkerClient& prefill, RequestId id, const std::vector<int32_t>& prompt,
                             const v1::KvDestination& dest) {
  auto req = std::make_shared<v1::PrefillRequest>();
  req->set_request_id(id);
  req->mutable_prompt_tokens()->Assign(prompt.begin(), prompt.end());
  to_proto(greedy(2), req->mutable_params());
  *req->mutable_destination() = dest;
  PendingPrefill p;
  p.result = std::async(std::launch::async, [&prefill, req, at = p.returned_at_ns] {
    const Status st = prefill.prefill(*req).status();
    at->store(Clock::now().time_since_epoch().count());
    return st;
  });
  return p;
}

// Waits until the prefill worker holds the blocks of about a third of the prompt (blocks are
// taken chunk by chunk as the prompt is computed): its first chunks' KV has been written to
// the decode worker, the rest is still to come. false when the prefill ended first or 30 s
// passed.
bool wait_until_a_third_computed(WorkerClient& prefill, const PendingPrefill& p) {
  const int64_t want = static_cast<int64_t>(kLongPrompt) / kBlockSize / 3;
  const auto deadline = Clock::now() + 30s;
  while (Clock::now() < deadline && !p.returned()) {
    auto l = prefill.load();
    if (l.ok() && l->blocks_used() >= want) return !p.returned();
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

// Settings of the kill tests: 32-token steps, so that a long prompt's prefill (and its
// transfer, layer by layer and chunk by chunk) lasts a while; no prefix cache.
const std::vector<std::string> kSlowPrefill = {"engine.max_tokens_per_step=32",
                                               "engine.prefix_caching=false"};

// (c) SIGKILL of the prefill worker while it writes a long prompt's KV: the decode worker gives
// the reserved blocks back within the lease (nobody calls Release), and serves on afterwards.
TEST_P(WorkerFailureTest, PrefillKilledMidTransferDecodeFreesTheReservationWithinTheLease) {
  auto procs = start_workers({{"prefill", synth_path(), kSlowPrefill},
                              {"decode", synth_path(), kSlowPrefill}});
  auto& prefill_proc = procs[0];
  auto& decode_proc = procs[1];
  ASSERT_TRUE(prefill_proc && decode_proc);
  auto prefill = connect(*prefill_proc);
  auto decode = connect(*decode_proc);
  ASSERT_TRUE(prefill && decode);

  constexpr auto kLease = 4000ms;
  const std::vector<int32_t> prompt = long_prompt(2);
  const auto reserved_at = Clock::now();
  auto dest = decode->reserve(2, static_cast<int64_t>(prompt.size()), kLease);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  auto before = decode->load();
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->reservations(), 1);
  EXPECT_GE(before->blocks_reserved(), static_cast<int64_t>(kLongPrompt) / kBlockSize);

  PendingPrefill pending = start_prefill(*prefill, 2, prompt, *dest);
  ASSERT_TRUE(wait_until_a_third_computed(*prefill, pending))
      << "the prefill ended before the kill";
  auto mid = decode->load();
  ASSERT_TRUE(mid.ok());
  EXPECT_EQ(mid->reservations(), 1) << "the lease ended before the kill";
  prefill_proc->kill_now();
  ASSERT_EQ(pending.result.wait_for(20s), std::future_status::ready);
  EXPECT_FALSE(pending.result.get().ok());

  // Freed by the lease: not long after its end.
  EXPECT_TRUE(drains(*decode, until(reserved_at + kLease + 2s)));
  auto after = decode->load();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->leases_expired(), before->leases_expired() + 1);

  // The decode worker still serves: a fresh prefill worker hands a request over to it.
  auto prefill2_proc = start_worker("prefill", synth_path(), kSlowPrefill);
  ASSERT_TRUE(prefill2_proc);
  auto prefill2 = connect(*prefill2_proc);
  ASSERT_TRUE(prefill2);
  auto dispatcher = ready_dispatcher(pair_options(*prefill2_proc, *decode_proc));
  ASSERT_TRUE(dispatcher);
  Collected c;
  auto out = router::run_request(*dispatcher, {{1000, 5, 6, 7}, greedy(6, 0, true)},
                                 collect_into(c));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(c.tokens.size(), 6u);
  EXPECT_TRUE(drains(*prefill2, 10s));
  EXPECT_TRUE(drains(*decode, 10s));
}

// (d) SIGKILL of the decode worker while the prefill writes into it: the Prefill call fails
// within the transfer engine's bound (completion_timeout_ms) and the prefill's blocks are
// freed; the prefill worker serves on with another decode worker.
TEST_P(WorkerFailureTest, DecodeKilledMidTransferPrefillFailsFastAndFreesItsBlocks) {
  constexpr int64_t kCompletionTimeoutMs = 1000;
  std::vector<std::string> settings = kSlowPrefill;
  settings.push_back(fmt::format("transfer.completion_timeout_ms={}", kCompletionTimeoutMs));
  auto procs = start_workers({{"prefill", synth_path(), settings},
                              {"decode", synth_path(), settings}});
  auto& prefill_proc = procs[0];
  auto& decode_proc = procs[1];
  ASSERT_TRUE(prefill_proc && decode_proc);
  auto prefill = connect(*prefill_proc);
  auto decode = connect(*decode_proc);
  ASSERT_TRUE(prefill && decode);

  const std::vector<int32_t> prompt = long_prompt(4);
  auto dest = decode->reserve(2, static_cast<int64_t>(prompt.size()), 30s);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  PendingPrefill pending = start_prefill(*prefill, 2, prompt, *dest);
  ASSERT_TRUE(wait_until_a_third_computed(*prefill, pending))
      << "the prefill ended before the kill";
  decode_proc->kill_now();
  const auto killed_at = Clock::now();
  ASSERT_EQ(pending.result.wait_for(20s), std::future_status::ready);
  const Status st = pending.result.get();
  EXPECT_FALSE(st.ok());
  const auto failed_after =
      std::chrono::duration_cast<std::chrono::milliseconds>(pending.returned_at() - killed_at);
  // The transfer engine's bound, plus one engine step and the RPC's way back.
  EXPECT_LT(failed_after.count(), kCompletionTimeoutMs + 2000) << st.to_string();
  std::printf("the prefill failed %lld ms after the kill: %s\n",
              static_cast<long long>(failed_after.count()), st.to_string().c_str());

  EXPECT_TRUE(drains(*prefill, 5s));

  // The prefill worker still serves, with a fresh decode worker.
  auto decode2_proc = start_worker("decode", synth_path(), settings);
  ASSERT_TRUE(decode2_proc);
  auto decode2 = connect(*decode2_proc);
  ASSERT_TRUE(decode2);
  auto dispatcher = ready_dispatcher(pair_options(*prefill_proc, *decode2_proc));
  ASSERT_TRUE(dispatcher);
  Collected c;
  auto out = router::run_request(*dispatcher, {{1000, 5, 6, 7}, greedy(6, 0, true)},
                                 collect_into(c));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(c.tokens.size(), 6u);
  EXPECT_TRUE(drains(*prefill, 10s));
  EXPECT_TRUE(drains(*decode2, 10s));
}
// (e) SIGKILL of the decode worker while it streams a request: the router sends the prompt and
// the tokens delivered so far to a new prefill + decode on the other decode worker, and the
// client gets exactly the text of an undisturbed run, greedy and seeded, with the usage of the
// whole request.
TEST_P(WorkerFailureTest, DecodeKilledMidStreamTheStreamCompletesWithTheReferenceText) {
  auto procs = start_workers({{"prefill", synth_path()}, {"decode", synth_path()},
                              {"decode", synth_path()}});
  for (const auto& p : procs) ASSERT_TRUE(p);
  auto prefill = connect(*procs[0]);
  std::vector<std::unique_ptr<WorkerClient>> decoders;
  for (size_t i = 1; i < procs.size(); ++i) decoders.push_back(connect(*procs[i]));
  ASSERT_TRUE(prefill && decoders[0] && decoders[1]);
  metrics::MetricsRegistry registry;
  router::DispatcherOptions o = pair_options(*procs[0], *procs[1]);
  o.decode.workers = {procs[1]->address(), procs[2]->address()};
  o.metrics = &registry;
  auto dispatcher = ready_dispatcher(o);
  ASSERT_TRUE(dispatcher);

  std::mt19937 rng(5);
  std::vector<int32_t> prompt = random_tokens(rng, 1024, -1, -1, 60);
  prompt[0] = 1000;
  SamplingParams seeded = greedy(500, 77, true);
  seeded.temperature = 0.8f;
  seeded.top_p = 0.9f;
  seeded.frequency_penalty = 0.2f;
  int killed = 0;
  for (const SamplingParams& params : {greedy(500, 0, true), seeded}) {
    const std::string what = params.temperature == 0 ? "greedy" : "seeded";
    Collected reference;
    auto ref = router::run_request(*dispatcher, {prompt, params}, collect_into(reference));
    ASSERT_TRUE(ref.ok()) << what << ": " << ref.status().to_string();
    ASSERT_EQ(reference.tokens.size(), 500u) << what;
    for (auto& d : decoders) ASSERT_TRUE(drains(*d, 10s)) << what;  // its stats are current

    Collected c;
    auto running = std::async(std::launch::async, [&] {
      return router::run_request(*dispatcher, {prompt, params}, collect_into(c));
    });
    // The victim: the decode worker seen running it, killed a little later (mid-stream).
    int victim = -1;
    const auto deadline = Clock::now() + 30s;
    while (victim < 0 && Clock::now() < deadline &&
           running.wait_for(0ms) != std::future_status::ready) {
      for (size_t i = 0; i < decoders.size(); ++i) {
        if (!procs[i + 1]) continue;
        auto l = decoders[i]->load();
        if (l.ok() && l->running() >= 1) victim = static_cast<int>(i);
      }
      std::this_thread::sleep_for(2ms);
    }
    ASSERT_GE(victim, 0) << what << ": no decode worker was seen running the request";
    std::this_thread::sleep_for(50ms);
    ASSERT_NE(running.wait_for(0ms), std::future_status::ready)
        << what << ": the request ended before the kill";
    procs[static_cast<size_t>(victim) + 1]->kill_now();
    procs[static_cast<size_t>(victim) + 1].reset();
    ++killed;
    ASSERT_EQ(running.wait_for(60s), std::future_status::ready) << what << ": the stream hangs";
    auto out = running.get();
    ASSERT_TRUE(out.ok()) << what << ": " << out.status().to_string();
    EXPECT_EQ(c.tokens, reference.tokens) << what;
    EXPECT_EQ(c.text, reference.text) << what;
    EXPECT_EQ(c.finished_events, 1) << what;
    EXPECT_EQ(c.finish_reason, reference.finish_reason) << what;
    EXPECT_EQ(c.usage.completion_tokens(), 500) << what;
    EXPECT_EQ(c.usage.prompt_tokens(), static_cast<int64_t>(prompt.size())) << what;
    EXPECT_EQ(metric_sum(registry.render(), "cleave:migrations_total{outcome=\"resumed\"}"),
              killed)
        << what;
    // The second run needs a second decode worker: start one in the victim's place.
    if (killed == 1) {
      procs[static_cast<size_t>(victim) + 1] = start_worker("decode", synth_path());
      ASSERT_TRUE(procs[static_cast<size_t>(victim) + 1]);
      decoders[static_cast<size_t>(victim)] = connect(*procs[static_cast<size_t>(victim) + 1]);
      ASSERT_TRUE(decoders[static_cast<size_t>(victim)]);
      o.decode.workers = {procs[1]->address(), procs[2]->address()};
      dispatcher.reset();
      dispatcher = ready_dispatcher(o);
      ASSERT_TRUE(dispatcher);
    }
  }
  EXPECT_TRUE(drains(*prefill, 10s));
  for (size_t i = 0; i < decoders.size(); ++i) {
    if (procs[i + 1]) EXPECT_TRUE(drains(*decoders[i], 10s));
  }
}

// (f) The decode worker goes silent mid-stream (SIGSTOP): the router's stream idle deadline
// ends that attempt and the stream is migrated to the other decode worker, with the reference
// text. Resumed (SIGCONT), the silent worker finds its stream cancelled and frees its blocks.
TEST_P(WorkerFailureTest, DecodeSilentMidStreamTheStreamMovesOnAtTheIdleDeadline) {
  auto procs = start_workers({{"prefill", synth_path()}, {"decode", synth_path()},
                              {"decode", synth_path()}});
  for (const auto& p : procs) ASSERT_TRUE(p);
  auto prefill = connect(*procs[0]);
  auto d0 = connect(*procs[1]);
  auto d1 = connect(*procs[2]);
  ASSERT_TRUE(prefill && d0 && d1);
  metrics::MetricsRegistry registry;
  router::DispatcherOptions o = pair_options(*procs[0], *procs[1]);
  o.decode.workers = {procs[1]->address(), procs[2]->address()};
  o.timeouts.stream_idle = 1500ms;
  o.metrics = &registry;
  auto dispatcher = ready_dispatcher(o);
  ASSERT_TRUE(dispatcher);
  std::mt19937 rng(6);
  std::vector<int32_t> prompt = random_tokens(rng, 1024, -1, -1, 30);
  prompt[0] = 1000;
  const SamplingParams params = greedy(400, 0, true);
  Collected reference;
  ASSERT_TRUE(router::run_request(*dispatcher, {prompt, params}, collect_into(reference)).ok());
  ASSERT_EQ(reference.tokens.size(), 400u);
  ASSERT_TRUE(drains(*d0, 10s) && drains(*d1, 10s));

  Collected c;
  auto running = std::async(std::launch::async, [&] {
    return router::run_request(*dispatcher, {prompt, params}, collect_into(c));
  });
  WorkerClient* decoders[] = {d0.get(), d1.get()};
  int victim = -1;
  const auto deadline = Clock::now() + 30s;
  while (victim < 0 && Clock::now() < deadline &&
         running.wait_for(0ms) != std::future_status::ready) {
    for (int i = 0; i < 2; ++i) {
      auto l = decoders[i]->load();
      if (l.ok() && l->running() >= 1) victim = i;
    }
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_GE(victim, 0) << "no decode worker was seen running the request";
  std::this_thread::sleep_for(50ms);
  ASSERT_NE(running.wait_for(0ms), std::future_status::ready) << "it ended before the stop";
  const pid_t pid = procs[static_cast<size_t>(victim) + 1]->pid();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const auto outcome = running.wait_for(60s);
  ASSERT_EQ(::kill(pid, SIGCONT), 0);
  ASSERT_EQ(outcome, std::future_status::ready) << "the stream hangs";
  auto out = running.get();
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(c.tokens, reference.tokens);
  EXPECT_EQ(c.text, reference.text);
  EXPECT_EQ(c.finished_events, 1);
  EXPECT_EQ(c.usage.completion_tokens(), 400);
  EXPECT_EQ(metric_sum(registry.render(), "cleave:migrations_total{outcome=\"resumed\"}"), 1);
  EXPECT_TRUE(drains(*prefill, 10s));
  EXPECT_TRUE(drains(*d0, 20s));
  EXPECT_TRUE(drains(*d1, 20s));
}

INSTANTIATE_TEST_SUITE_P(Providers, WorkerFailureTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         provider_name);

// Removes the synthetic model written for this process.
class SynthCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(fs::temp_directory_path() / fmt::format("cleave-disagg-test-{}", ::getpid()), ec);
  }
};
[[maybe_unused]] ::testing::Environment* const kSynthCleanup =
    ::testing::AddGlobalTestEnvironment(new SynthCleanup);

}  // namespace
}  // namespace cleave
