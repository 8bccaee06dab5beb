// Not named *_test.cpp: tests/worker.cmake registers it (it needs the cleave binary).
// Real `cleave worker` processes on 127.0.0.1, over tcp;ofi_rxm and over shm: a prefill and a
// decode worker (and a unified one) driven through the router's dispatcher over that fixed
// pair (router/run_request.h), as `cleave router` and `cleave client` drive them.
//  - many concurrent prompts give, greedy, the same tokens disaggregated, unified and through
//    the single-sequence engine (Generator in this process);
//  - the stories260K golden text comes out of the disaggregated path (`cleave client`);
//  - a pairing mismatch is refused with what differs; cancelled requests free every block.
// After every test the workers hold no block. (The SIGKILL cases: worker_failure_cases.cpp.)
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <random>
#include <thread>

#include "cleave/engine/generator.h"
#include "cleave/model/model_file.h"
#include "cleave/model/tokenizer.h"
#include "cleave/worker/proto_convert.h"
#include "cleave/worker/worker_client.h"
#include "fmt/format.h"
#include "worker_test_fixture.h"

namespace cleave {
namespace {

using namespace std::chrono_literals;
using namespace worker_testing;
namespace fs = std::filesystem;

class DisaggregationTest : public WorkerProcessTest {};

// (a) 64 prompts at once: short ones, ones longer than a step's token budget (chunked), ones
// sharing a long prefix (prefix-cache hits on the prefill side), text prompts; one with
// max_tokens 1 (the first token ends it: the reservation is released). Greedy tokens and text
// are the same disaggregated, unified and alone.
TEST_P(DisaggregationTest, ManyPromptsGiveTheSameTokensDisaggregatedUnifiedAndAlone) {
  if (!fs::exists(stories_path())) GTEST_SKIP() << stories_path() << " is absent";
  auto file = load_model(stories_path());
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  std::shared_ptr<const ModelFile> model_file(std::move(*file));
  auto tok = Tokenizer::create(model_file->tokenizer());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EngineOptions eo;
  eo.threads = 1;
  eo.device = engine_device();
  auto model = LlamaModel::create(model_file, eo);
  ASSERT_TRUE(model.ok()) << model.status().to_string();

  const int32_t vocab = static_cast<int32_t>(model_file->config().vocab_size);
  const int32_t bos = (*tok)->bos_id();
  std::mt19937 rng(1234);
  const std::vector<int32_t> shared_prefix = random_tokens(rng, vocab, bos, 2, 90);
  const char* texts[] = {"Once upon a time", "The little dog", "Lily and Tom went to the park.",
                         "One day, a big bird"};
  constexpr int kPrompts = 64;
  std::vector<std::vector<int32_t>> prompts(kPrompts);
  std::vector<SamplingParams> params(kPrompts);
  for (int i = 0; i < kPrompts; ++i) {
    std::vector<int32_t>& p = prompts[i];
    switch (i % 4) {
      case 0:  // short
        p = {bos};
        for (int32_t t : random_tokens(rng, vocab, bos, 2, rng() % 20)) p.push_back(t);
        break;
      case 1:  // longer than engine.max_tokens_per_step (64): chunked
        p = {bos};
        for (int32_t t : random_tokens(rng, vocab, bos, 2, 65 + rng() % 200)) p.push_back(t);
        break;
      case 2:  // a shared 91-token prefix and its own tail
        p = {bos};
        p.insert(p.end(), shared_prefix.begin(), shared_prefix.end());
        for (int32_t t : random_tokens(rng, vocab, bos, 2, 1 + rng() % 40)) p.push_back(t);
        break;
      default:
        p = (*tok)->encode(texts[(i / 4) % 4],
                           EncodeOptions{.add_bos = true, .parse_special = false});
        break;
    }
    params[i] = greedy(i == 5 ? 1 : 4 + (i * 7) % 29, static_cast<uint64_t>(i));
  }

  std::vector<GenerationResult> alone(kPrompts);
  {
    Generator gen(**model, **tok);
    for (int i = 0; i < kPrompts; ++i) {
      auto r = gen.generate(prompts[i], params[i]);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      alone[i] = std::move(*r);
    }
  }

  auto procs = start_workers({{"prefill", stories_path()}, {"decode", stories_path()},
                              {"unified", stories_path()}});
  auto& prefill_proc = procs[0];
  auto& decode_proc = procs[1];
  auto& unified_proc = procs[2];
  ASSERT_TRUE(prefill_proc && decode_proc && unified_proc);
  auto prefill = connect(*prefill_proc);
  auto decode = connect(*decode_proc);
  auto unified = connect(*unified_proc);
  ASSERT_TRUE(prefill && decode && unified);
  ASSERT_TRUE(pair_workers(*prefill, *decode).ok());
  auto disagg_dispatcher = ready_dispatcher(pair_options(*prefill_proc, *decode_proc, 20s));
  auto unified_dispatcher = ready_dispatcher(unified_options(*unified_proc));
  ASSERT_TRUE(disagg_dispatcher && unified_dispatcher);

  std::vector<Collected> disagg(kPrompts), uni(kPrompts);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < kPrompts; ++i) {
      threads.emplace_back([&, i] {
        auto out = router::run_request(*disagg_dispatcher, {prompts[i], params[i]},
                                       collect_into(disagg[i]));
        disagg[i].status = out.status();
        if (out.ok()) disagg[i].outcome = *out;
      });
      threads.emplace_back([&, i] {
        auto out = router::run_request(*unified_dispatcher, {prompts[i], params[i]},
                                       collect_into(uni[i]));
        uni[i].status = out.status();
        if (out.ok()) uni[i].outcome = *out;
      });
    }
    for (auto& t : threads) t.join();
  }

  int handed_off = 0;
  for (int i = 0; i < kPrompts; ++i) {
    const std::string what = fmt::format("prompt {} ({} tokens, max_tokens {})", i,
                                         prompts[i].size(), params[i].max_tokens);
    const std::string reason(finish_reason_name(alone[i].finish_reason));
    for (const auto* got : {&disagg[i], &uni[i]}) {
      const char* path = got == &disagg[i] ? "disaggregated" : "unified";
      ASSERT_TRUE(got->status.ok()) << what << " " << path << ": " << got->status.to_string();
      EXPECT_EQ(got->tokens, alone[i].tokens) << what << " " << path;
      EXPECT_EQ(got->text, alone[i].text) << what << " " << path;
      EXPECT_EQ(got->finish_reason, reason) << what << " " << path;
      EXPECT_EQ(got->finished_events, 1) << what << " " << path;
      EXPECT_EQ(got->usage.prompt_tokens(), static_cast<int64_t>(prompts[i].size())) << what << " " << path;
      EXPECT_EQ(got->usage.completion_tokens(), static_cast<int64_t>(alone[i].tokens.size()))
          << what << " " << path;
    }
    const bool one_token = alone[i].tokens.size() == 1;
    EXPECT_EQ(disagg[i].outcome.handed_off, !one_token) << what;
    if (disagg[i].outcome.handed_off) {
      ++handed_off;
      EXPECT_GT(disagg[i].outcome.kv_bytes, 0u) << what;
    }
  }
  EXPECT_GT(handed_off, kPrompts / 2);

  // Once more, alone: the shared prefix now comes from the prefill's cache (the cached blocks
  // are still sent), and the tokens do not change.
  Collected again;
  auto out = router::run_request(*disagg_dispatcher, {prompts[2], params[2]}, collect_into(again));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(again.tokens, alone[2].tokens);
  EXPECT_EQ(again.text, alone[2].text);
  auto metrics = prefill->metrics();
  ASSERT_TRUE(metrics.ok()) << metrics.status().to_string();
  EXPECT_GE(metric_sum(*metrics, "cleave:prefix_cache_hits_total"),
            static_cast<double>(shared_prefix.size() / 16 * 16));

  EXPECT_TRUE(drains(*prefill, 10s));
  EXPECT_TRUE(drains(*decode, 10s));
  EXPECT_TRUE(drains(*unified, 10s));
}

// (b) The golden text (llama2.c's greedy output of stories260K from BOS alone) through
// `cleave client` over a prefill and a decode worker, byte for byte.
TEST_P(DisaggregationTest, GoldenStoriesTextThroughTheClientCommand) {
  const std::string want_path = models_dir() + "/stories260K-empty.txt";
  if (!fs::exists(stories_path()) || !fs::exists(want_path)) {
    GTEST_SKIP() << stories_path() << " or " << want_path << " is absent";
  }
  auto procs = start_workers({{"prefill", stories_path()}, {"decode", stories_path()}});
  auto& prefill_proc = procs[0];
  auto& decode_proc = procs[1];
  ASSERT_TRUE(prefill_proc && decode_proc);
  const auto r = worker_testing::run_command(
      {cleave_binary(), "client", "--prefill", prefill_proc->address(), "--decode",
       decode_proc->address(), "--model", stories_path(), "--prompt", "", "--max-tokens", "200",
       "--temperature", "0", "--seed", "0"},
      60s);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, read_text(want_path));

  // The same request as token ids (BOS = 1), with the JSON report.
  const auto j = worker_testing::run_command(
      {cleave_binary(), "client", "--prefill", prefill_proc->address(), "--decode",
       decode_proc->address(), "--prompt-tokens", "1", "--max-tokens", "200", "--temperature",
       "0", "--json"},
      60s);
  EXPECT_EQ(j.exit_code, 0);
  EXPECT_NE(j.out.find("\"finish_reason\": \"length\""), std::string::npos) << j.out;
  EXPECT_NE(j.out.find("\"completion_tokens\": 200"), std::string::npos) << j.out;
  EXPECT_NE(j.out.find("\"handed_off\": true"), std::string::npos) << j.out;
  EXPECT_NE(j.out.find("Once upon a time, there was a little girl named Lily."), std::string::npos)
      << j.out;

  auto prefill = connect(*prefill_proc);
  auto decode = connect(*decode_proc);
  ASSERT_TRUE(prefill && decode);
  EXPECT_TRUE(drains(*prefill, 10s));
  EXPECT_TRUE(drains(*decode, 10s));
}

// A decode worker with another block size cannot take this prefill's KV: pairing says so (and
// the dispatcher, which never uses the pair), and a prefill sent there anyway is refused before
// anything is written, the reservation left to free.
TEST_P(DisaggregationTest, PairingMismatchIsRefusedWithWhatDiffers) {
  if (!fs::exists(stories_path())) GTEST_SKIP() << stories_path() << " is absent";
  auto procs = start_workers(
      {{"prefill", stories_path()}, {"decode", stories_path(), {"engine.block_size=32"}}});
  auto& prefill_proc = procs[0];
  auto& decode_proc = procs[1];
  ASSERT_TRUE(prefill_proc && decode_proc);
  auto prefill = connect(*prefill_proc);
  auto decode = connect(*decode_proc);
  ASSERT_TRUE(prefill && decode);

  const Status paired = pair_workers(*prefill, *decode);
  EXPECT_EQ(paired.code(), StatusCode::kFailedPrecondition) << paired.to_string();
  EXPECT_NE(paired.message().find("block_size"), std::string::npos) << paired.to_string();
  EXPECT_EQ(pair_workers(*decode, *prefill).code(), StatusCode::kFailedPrecondition);

  // The dispatcher over the pair: both workers healthy, the pair refused with what differs,
  // and no request sent there.
  auto d = router::make_dispatcher(pair_options(*prefill_proc, *decode_proc));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const Status ready = router::wait_until_ready(**d, 10s);
  EXPECT_EQ(ready.code(), StatusCode::kFailedPrecondition) << ready.to_string();
  EXPECT_NE(ready.message().find("block_size"), std::string::npos) << ready.to_string();
  Collected c;
  auto refused = router::run_request(**d, {{1, 300, 301, 302}, greedy(8)}, collect_into(c));
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().to_string();
  EXPECT_TRUE(c.tokens.empty());

  // Reserve and Prefill by hand: the prefill worker refuses to write into that destination.
  auto dest = decode->reserve(77, 4);
  ASSERT_TRUE(dest.ok()) << dest.status().to_string();
  v1::PrefillRequest req;
  req.set_request_id(77);
  for (int32_t t : {1, 300, 301, 302}) req.add_prompt_tokens(t);
  to_proto(greedy(8), req.mutable_params());
  *req.mutable_destination() = std::move(*dest);
  auto out = prefill->prefill(req);
  EXPECT_EQ(out.status().code(), StatusCode::kFailedPrecondition) << out.status().to_string();
  EXPECT_NE(out.status().message().find("block_size"), std::string::npos) << out.status().to_string();
  auto released = decode->release(77);
  ASSERT_TRUE(released.ok()) << released.status().to_string();
  EXPECT_TRUE(*released) << "the refused prefill took the reservation";

  EXPECT_TRUE(drains(*prefill, 10s));
  EXPECT_TRUE(drains(*decode, 10s));
}

// A caller that stops reading (its callback returns false) at the first token, before the
// Decode call, or mid-stream: the request is aborted on every worker and no block stays held.
TEST_P(DisaggregationTest, CancelledRequestsFreeEveryBlock) {
  if (!fs::exists(stories_path())) GTEST_SKIP() << stories_path() << " is absent";
  auto procs = start_workers({{"prefill", stories_path()}, {"decode", stories_path()},
                              {"unified", stories_path()}});
  ASSERT_TRUE(procs[0] && procs[1] && procs[2]);
  auto prefill = connect(*procs[0]);
  auto decode = connect(*procs[1]);
  auto unified = connect(*procs[2]);
  ASSERT_TRUE(prefill && decode && unified);
  auto disagg_dispatcher = ready_dispatcher(pair_options(*procs[0], *procs[1], 20s));
  auto unified_dispatcher = ready_dispatcher(unified_options(*procs[2]));
  ASSERT_TRUE(disagg_dispatcher && unified_dispatcher);

  constexpr int kRequests = 8;
  std::vector<std::thread> threads;
  std::vector<Status> errors(2 * kRequests);
  std::vector<int> seen(2 * kRequests, 0);
  std::vector<bool> cancelled(2 * kRequests, false);
  for (int i = 0; i < kRequests; ++i) {
    for (int mode = 0; mode < 2; ++mode) {
      threads.emplace_back([&, i, mode] {
        const int k = mode * kRequests + i;
        const int stop_after = 1 + i;  // tokens seen before the callback says stop
        const router::DispatchRequest req{{1, 400, 401, 402, 403}, greedy(100, 0, true)};
        auto on_event = [&, k, stop_after](const v1::TokenEvent& ev) {
          if (ev.has_token()) ++seen[k];
          return seen[k] < stop_after;
        };
        auto out = router::run_request(mode == 0 ? *disagg_dispatcher : *unified_dispatcher, req,
                                       on_event);
        errors[k] = out.status();
        if (out.ok()) cancelled[k] = out->cancelled;
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < 2 * kRequests; ++k) {
    EXPECT_TRUE(errors[k].ok()) << k << ": " << errors[k].to_string();
    EXPECT_TRUE(cancelled[k]) << k;
    EXPECT_EQ(seen[k], 1 + k % kRequests) << k;
  }
  EXPECT_TRUE(drains(*prefill, 10s));
  EXPECT_TRUE(drains(*decode, 10s));
  EXPECT_TRUE(drains(*unified, 10s));
}

// Pairing and connection checks that need no worker process.
v1::WorkerInfo info_for(const std::string& role, const std::string& fingerprint, int64_t block_size) {
  v1::WorkerInfo info;
  info.set_worker_id(role + "-x");
  info.set_role(role);
  info.set_model_fingerprint(fingerprint);
  info.set_transfer_provider("tcp;ofi_rxm");
  KvLayout layout;
  layout.block_size = block_size;
  layout.n_layers = 5;
  layout.n_kv_heads = 4;
  layout.head_dim = 8;
  layout.num_blocks = 100;
  to_proto(layout, info.mutable_kv_layout());
  return info;
}

TEST(CheckPairing, AcceptsAMatchingPairWhateverTheirBlockCounts) {
  v1::WorkerInfo decode = info_for("decode", "abc", 16);
  decode.mutable_kv_layout()->set_num_blocks(7);
  EXPECT_TRUE(check_pairing(info_for("prefill", "abc", 16), decode).ok());
  EXPECT_TRUE(check_pairing(info_for("unified", "abc", 16), info_for("unified", "abc", 16)).ok());
}

TEST(CheckPairing, NamesEveryDifference) {
  v1::WorkerInfo decode = info_for("decode", "def", 32);
  decode.set_transfer_provider("shm");
  const Status st = check_pairing(info_for("prefill", "abc", 16), decode);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  for (const char* what : {"fingerprint", "block_size", "provider", "abc", "def", "16", "32"}) {
    EXPECT_NE(st.message().find(what), std::string::npos) << what << " in " << st.message();
  }
}

TEST(CheckPairing, RefusesRolesTheOtherWayRound) {
  const Status st = check_pairing(info_for("decode", "abc", 16), info_for("prefill", "abc", 16));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("not prefill or unified"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("not decode or unified"), std::string::npos) << st.message();
}

TEST(WorkerClientConnect, NobodyListeningFailsWithinTheTimeout) {
  WorkerClientOptions o;
  o.connect_timeout = 300ms;
  const auto t0 = Clock::now();
  // Port 1 on loopback: nothing listens there (it needs root to bind).
  auto c = WorkerClient::connect("127.0.0.1:1", o);
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
  EXPECT_NE(c.status().message().find("127.0.0.1:1"), std::string::npos);
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_EQ(WorkerClient::connect("", o).status().code(), StatusCode::kInvalidArgument);
}
INSTANTIATE_TEST_SUITE_P(Providers, DisaggregationTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         provider_name);

}  // namespace
}  // namespace cleave
