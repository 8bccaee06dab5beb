// WorkerServer in-process on 127.0.0.1:0 with a synthetic model, driven over a real gRPC channel
// with the generated stub: unified Generate, a prefill + decode pair over the transfer engine
// (tcp;ofi_rxm and shm on loopback), pairing refusal, reservations and leases, role refusals,
// Abort, client cancellation, health and shutdown.
#include "cleave/worker/worker_service.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <future>
#include <thread>

#include "cleave/v1/worker.grpc.pb.h"
#include "cleave/worker/proto_convert.h"
#include "engine_test_util.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace cleave {
namespace {

using namespace std::chrono_literals;
using testing_engine::ModelUnderTest;
using testing_engine::synth_path;

WorkerConfig worker_config(const std::string& role, const std::string& provider = "tcp;ofi_rxm") {
  WorkerConfig c;
  c.model.path = synth_path();
  c.engine.threads = 1;
  c.engine.block_size = 16;
  c.engine.kv_blocks = 96;
  c.engine.max_tokens_per_step = 64;
  c.transfer.provider = provider;
  c.transfer.node = provider == "shm" ? "" : "127.0.0.1";
  c.transfer.completion_timeout_ms = 2000;
  c.worker.role = role;
  c.worker.listen = "127.0.0.1:0";
  c.worker.id = role + "-test";
  c.worker.lease_ms = 5000;
  return c;
}

// A larger synthetic model (~1 ms a token on one thread) for the tests that must interrupt a
// stream while it runs: 4,000 tokens take seconds, an Abort milliseconds.
std::string slow_synth_path() {
  static const std::string path = [] {
    const std::string p =
        (std::filesystem::path(synth_path()).parent_path() / "slow-synth.gguf").string();
    SynthOptions o;
    o.layers = 4;
    o.dim = 256;
    o.heads = 8;
    o.kv_heads = 4;
    o.ffn = 704;
    o.vocab = 512;
    o.context = 4096;
    o.seed = 11;
    const Status st = write_synth_model(o, p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return p;
  }();
  return path;
}

struct Worker {
  std::unique_ptr<WorkerServer> server;
  std::unique_ptr<v1::Worker::Stub> stub;
  std::shared_ptr<grpc::Channel> channel;
};

// Empty `server` with the reason in `why` when the transfer provider is not available here.
Worker start(const WorkerConfig& c, std::string* why = nullptr) {
  Worker w;
  auto s = WorkerServer::start(c);
  if (!s.ok()) {
    if (why) *why = s.status().to_string();
    else ADD_FAILURE() << s.status().to_string();
    return w;
  }
  w.server = std::move(*s);
  EXPECT_NE(w.server->port(), 0);
  w.channel = grpc::CreateChannel(w.server->address(), grpc::InsecureChannelCredentials());
  w.stub = v1::Worker::NewStub(w.channel);
  return w;
}

std::unique_ptr<grpc::ClientContext> ctx(std::chrono::milliseconds timeout = 15s) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + timeout);
  return c;
}

SamplingParams greedy(int32_t max_tokens, int32_t logprobs = -1) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.logprobs = logprobs;
  return p;
}

struct Output {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<float> logprobs;
  std::string finish_reason;
  int64_t completion_tokens = 0;
  double kv_tail_seconds = -1;
  uint64_t kv_bytes = 0;
};

void add_event(const v1::TokenEvent& ev, Output& out) {
  if (ev.has_token()) {
    out.tokens.push_back(ev.token());
    out.logprobs.push_back(ev.logprob());
  }
  out.text += ev.text();
  if (ev.finished()) {
    out.finish_reason = ev.finish_reason();
    out.completion_tokens = ev.usage().completion_tokens();
  }
}

void read_stream(grpc::ClientReader<v1::TokenEvent>& reader, Output& out) {
  v1::TokenEvent ev;
  while (reader.Read(&ev)) add_event(ev, out);
  out.status = reader.Finish();
}

Output generate(v1::Worker::Stub& stub, uint64_t id, const std::vector<int32_t>& prompt,
                const SamplingParams& p) {
  v1::GenerateRequest req;
  req.set_request_id(id);
  req.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
  to_proto(p, req.mutable_params());
  auto c = ctx();
  auto reader = stub.Generate(c.get(), req);
  Output out;
  read_stream(*reader, out);
  return out;
}

grpc::Status reserve(v1::Worker::Stub& decode, uint64_t id, int64_t tokens, int64_t lease_ms,
                     v1::KvDestination* dest) {
  v1::ReserveRequest req;
  req.set_request_id(id);
  req.set_num_prompt_tokens(tokens);
  req.set_lease_ms(lease_ms);
  auto c = ctx();
  return decode.Reserve(c.get(), req, dest);
}

bool release(v1::Worker::Stub& decode, uint64_t id) {
  v1::ReleaseRequest req;
  req.set_request_id(id);
  v1::ReleaseResponse resp;
  auto c = ctx();
  EXPECT_TRUE(decode.Release(c.get(), req, &resp).ok());
  return resp.released();
}

// Reserve -> Prefill -> Decode, as a router drives it.
Output disaggregated(v1::Worker::Stub& prefill, v1::Worker::Stub& decode, uint64_t id,
                     const std::vector<int32_t>& prompt, const SamplingParams& p) {
  Output out;
  v1::KvDestination dest;
  out.status = reserve(decode, id, static_cast<int64_t>(prompt.size()), 0, &dest);
  if (!out.status.ok()) return out;
  v1::PrefillRequest preq;
  preq.set_request_id(id);
  preq.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
  to_proto(p, preq.mutable_params());
  *preq.mutable_destination() = dest;
  v1::PrefillResponse presp;
  auto pc = ctx();
  out.status = prefill.Prefill(pc.get(), preq, &presp);
  if (!out.status.ok()) {
    release(decode, id);
    return out;
  }
  add_event(presp.first(), out);
  out.kv_tail_seconds = presp.kv_tail_seconds();
  out.kv_bytes = presp.kv_bytes();
  if (presp.first().finished()) {
    release(decode, id);
    return out;
  }
  v1::DecodeRequest dreq;
  dreq.set_request_id(id);
  dreq.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
  to_proto(p, dreq.mutable_params());
  dreq.set_first_token(presp.first().token());
  auto dc = ctx();
  auto reader = decode.Decode(dc.get(), dreq);
  read_stream(*reader, out);
  return out;
}

v1::LoadReport load(v1::Worker::Stub& stub) {
  v1::LoadReport r;
  auto c = ctx();
  EXPECT_TRUE(stub.GetLoad(c.get(), v1::GetLoadRequest{}, &r).ok());
  return r;
}

// Polls GetLoad until every block is back (the engine publishes its stats after each step).
void expect_pool_back(v1::Worker::Stub& stub, const std::string& what) {
  v1::LoadReport r;
  for (int i = 0; i < 200; ++i) {
    r = load(stub);
    if (r.blocks_used() == 0 && r.running() == 0 && r.waiting() == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(r.blocks_used(), 0) << what;
  EXPECT_EQ(r.blocks_pinned(), 0) << what;
  EXPECT_EQ(r.blocks_reserved(), 0) << what;
  EXPECT_EQ(r.blocks_free() + r.blocks_cached(), r.blocks_total()) << what;
  EXPECT_EQ(r.running(), 0) << what;
}

std::string metrics_text(v1::Worker::Stub& stub) {
  v1::MetricsText m;
  auto c = ctx();
  EXPECT_TRUE(stub.GetMetrics(c.get(), v1::GetMetricsRequest{}, &m).ok());
  return m.text();
}

// The metrics once they contain `needle`, polled for at most 5 s: a stream's RPC is counted when
// the server is done with the call, which may be just after its client saw the final status.
std::string metrics_once_they_have(v1::Worker::Stub& stub, std::string_view needle) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::string m = metrics_text(stub);
  while (m.find(needle) == std::string::npos && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    m = metrics_text(stub);
  }
  return m;
}

std::vector<std::vector<int32_t>> mixed_prompts(const Tokenizer& tok, int n) {
  std::mt19937 rng(1234);
  const int64_t lens[] = {1, 5, 16, 17, 40, 95, 130, 7};
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(testing_engine::random_prompt(rng, tok, 512, lens[i % std::size(lens)]));
  }
  return out;
}

class WorkerServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ref_ = new ModelUnderTest(ModelUnderTest::load(synth_path())); }
  static void TearDownTestSuite() {
    delete ref_;
    ref_ = nullptr;
  }
  static GenerationResult reference(const std::vector<int32_t>& prompt, const SamplingParams& p) {
    auto model = ref_->model(1);
    return testing_engine::generate_alone(*model, *ref_->tok, prompt, p);
  }
  static ModelUnderTest* ref_;
};
ModelUnderTest* WorkerServiceTest::ref_ = nullptr;

void expect_matches(const Output& got, const GenerationResult& want, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status.error_message();
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(got.text, want.text) << what;
  EXPECT_EQ(got.finish_reason, std::string(finish_reason_name(want.finish_reason))) << what;
  EXPECT_EQ(got.completion_tokens, static_cast<int64_t>(want.tokens.size())) << what;
  if (!want.logprobs.empty()) {
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
    for (size_t i = 0; i < want.logprobs.size(); ++i) {
      EXPECT_EQ(got.logprobs[i], want.logprobs[i].logprob) << what << " token " << i;
    }
  }
}

TEST_F(WorkerServiceTest, UnifiedGenerateEqualsGenerator) {
  Worker w = start(worker_config("unified"));
  ASSERT_TRUE(w.server);
  EXPECT_EQ(w.server->role(), WorkerRole::kUnified);
  const auto prompts = mixed_prompts(*ref_->tok, 6);
  // Concurrent streams: each equals its request run alone.
  std::vector<std::future<Output>> runs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SamplingParams p = greedy(12, i == 2 ? 3 : -1);
    runs.push_back(std::async(std::launch::async,
                              [&, i, p] { return generate(*w.stub, 100 + i, prompts[i], p); }));
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SamplingParams p = greedy(12, i == 2 ? 3 : -1);
    expect_matches(runs[i].get(), reference(prompts[i], p), fmt::format("prompt {}", i));
  }
  expect_pool_back(*w.stub, "unified");

  // Bad input comes back as the engine's error, mapped.
  Output bad = generate(*w.stub, 1, {}, greedy(4));
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  SamplingParams bad_p = greedy(4);
  bad_p.top_p = 0;
  bad = generate(*w.stub, 2, prompts[1], bad_p);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("top_p"), std::string::npos);
  bad = generate(*w.stub, 3, std::vector<int32_t>(600, 5), greedy(4));
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::OUT_OF_RANGE);

  const std::string generated = "cleave:worker_rpcs_total{rpc=\"Generate\",code=\"OK\"} 6";
  const std::string m = metrics_once_they_have(*w.stub, generated);
  EXPECT_NE(m.find("cleave:num_requests_running"), std::string::npos);
  EXPECT_NE(m.find("cleave:kv_cache_usage_perc"), std::string::npos);
  EXPECT_NE(m.find(generated), std::string::npos) << m;
}

class DisaggregatedTest : public WorkerServiceTest,
                          public ::testing::WithParamInterface<const char*> {};

TEST_P(DisaggregatedTest, PrefillPlusDecodeEqualsGenerator) {
  const std::string provider = GetParam();
  std::string why;
  Worker decode = start(worker_config("decode", provider), &why);
  if (!decode.server) GTEST_SKIP() << provider << " unavailable: " << why;
  Worker prefill = start(worker_config("prefill", provider));
  ASSERT_TRUE(prefill.server);

  v1::WorkerInfo pinfo, dinfo;
  auto c1 = ctx();
  ASSERT_TRUE(prefill.stub->GetInfo(c1.get(), v1::GetInfoRequest{}, &pinfo).ok());
  auto c2 = ctx();
  ASSERT_TRUE(decode.stub->GetInfo(c2.get(), v1::GetInfoRequest{}, &dinfo).ok());
  EXPECT_EQ(pinfo.role(), "prefill");
  EXPECT_EQ(dinfo.role(), "decode");
  EXPECT_EQ(dinfo.worker_id(), "decode-test");
  EXPECT_EQ(pinfo.model_fingerprint(), dinfo.model_fingerprint());
  EXPECT_FALSE(dinfo.transfer_address().empty());
  EXPECT_EQ(dinfo.transfer_provider(), provider);
  EXPECT_EQ(dinfo.kv_layout().block_size(), 16);
  EXPECT_EQ(dinfo.kv_layout().num_blocks(), 96);
  EXPECT_EQ(dinfo.vocab_size(), 512);

  const auto prompts = mixed_prompts(*ref_->tok, 8);
  std::vector<std::future<Output>> runs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    // One request ends with its first token (max_tokens 1): no handoff, reservation released.
    const SamplingParams p = greedy(i == 3 ? 1 : 10, i == 5 ? 2 : -1);
    runs.push_back(std::async(std::launch::async, [&, i, p] {
      return disaggregated(*prefill.stub, *decode.stub, 500 + i, prompts[i], p);
    }));
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SamplingParams p = greedy(i == 3 ? 1 : 10, i == 5 ? 2 : -1);
    Output got = runs[i].get();
    expect_matches(got, reference(prompts[i], p), fmt::format("{} prompt {}", provider, i));
    if (i != 3) {
      EXPECT_GT(got.kv_bytes, 0u);
      EXPECT_GE(got.kv_tail_seconds, 0.0);
    }
  }
  expect_pool_back(*prefill.stub, "prefill");
  expect_pool_back(*decode.stub, "decode");

  const std::string m = metrics_text(*prefill.stub);
  EXPECT_NE(m.find("cleave:kv_handoff_tail_seconds_count 7"), std::string::npos) << m;
  EXPECT_NE(m.find("cleave:kv_transfer_seconds_count 7"), std::string::npos) << m;
  EXPECT_NE(m.find("cleave:kv_transfer_bytes_total"), std::string::npos) << m;
}

INSTANTIATE_TEST_SUITE_P(Providers, DisaggregatedTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         [](const auto& info) {
                           return std::string(info.param) == "shm" ? "shm" : "tcp";
                         });

TEST_F(WorkerServiceTest, PairingRefusedWhenBlockSizeDiffers) {
  std::string why;
  WorkerConfig dc = worker_config("decode");
  dc.engine.block_size = 32;
  dc.engine.kv_blocks = 48;
  Worker decode = start(dc, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  Worker prefill = start(worker_config("prefill"));
  ASSERT_TRUE(prefill.server);
  const auto prompts = mixed_prompts(*ref_->tok, 5);
  Output got = disaggregated(*prefill.stub, *decode.stub, 7, prompts[4], greedy(4));
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(got.status.error_message().find("block_size"), std::string::npos)
      << got.status.error_message();
  EXPECT_NE(got.status.error_message().find("32"), std::string::npos);
  expect_pool_back(*prefill.stub, "prefill");
  expect_pool_back(*decode.stub, "decode");  // the helper released the reservation
}

TEST_F(WorkerServiceTest, PrefillFailsFastWhenTheDestinationIsGone) {
  std::string why;
  WorkerConfig dc = worker_config("decode");
  dc.transfer.completion_timeout_ms = 500;
  Worker decode = start(dc, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  WorkerConfig pc = worker_config("prefill");
  pc.transfer.completion_timeout_ms = 500;
  Worker prefill = start(pc);
  ASSERT_TRUE(prefill.server);
  const auto prompts = mixed_prompts(*ref_->tok, 7);
  v1::KvDestination dest;
  ASSERT_TRUE(reserve(*decode.stub, 9, static_cast<int64_t>(prompts[6].size()), 0, &dest).ok());
  decode.server->shutdown();  // its transfer engine and KV pool are gone

  v1::PrefillRequest preq;
  preq.set_request_id(9);
  preq.mutable_prompt_tokens()->Add(prompts[6].begin(), prompts[6].end());
  to_proto(greedy(8), preq.mutable_params());
  *preq.mutable_destination() = dest;
  v1::PrefillResponse presp;
  const auto t0 = std::chrono::steady_clock::now();
  auto c = ctx();
  grpc::Status s = prefill.stub->Prefill(c.get(), preq, &presp);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("decode-test"), std::string::npos) << s.error_message();
  EXPECT_LT(took, 4.0);
  expect_pool_back(*prefill.stub, "prefill after a failed transfer");
  EXPECT_NE(metrics_text(*prefill.stub).find("cleave:kv_handoff_failures_total 1"),
            std::string::npos);
}

TEST_F(WorkerServiceTest, ReservationsLeasesAndRelease) {
  std::string why;
  WorkerConfig dc = worker_config("decode");
  dc.engine.kv_blocks = 8;  // 128 tokens
  Worker decode = start(dc, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;

  v1::KvDestination dest;
  grpc::Status s = reserve(*decode.stub, 1, 400, 0, &dest);  // fits the context, not the pool
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  s = reserve(*decode.stub, 1, 100000, 0, &dest);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << s.error_message();
  s = reserve(*decode.stub, 1, 0, 0, &dest);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();

  // Given back on Release.
  ASSERT_TRUE(reserve(*decode.stub, 2, 40, 0, &dest).ok());
  EXPECT_EQ(dest.block_ids_size(), 3);
  EXPECT_EQ(dest.lease_ms(), 5000);
  EXPECT_NE(dest.notice_tag(), 0u);
  EXPECT_EQ(dest.worker_id(), "decode-test");
  EXPECT_EQ(load(*decode.stub).blocks_reserved(), 3);
  EXPECT_EQ(reserve(*decode.stub, 2, 40, 0, &dest).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(release(*decode.stub, 2));
  EXPECT_FALSE(release(*decode.stub, 2));
  expect_pool_back(*decode.stub, "after release");

  // Never filled: the blocks go back at the lease's end, and a waiting Decode says why.
  ASSERT_TRUE(reserve(*decode.stub, 3, 50, 300, &dest).ok());
  const auto t0 = std::chrono::steady_clock::now();
  v1::DecodeRequest dreq;
  dreq.set_request_id(3);
  for (int i = 0; i < 50; ++i) dreq.add_prompt_tokens(5);
  to_proto(greedy(4), dreq.mutable_params());
  auto dc1 = ctx();
  auto reader = decode.stub->Decode(dc1.get(), dreq);
  Output out;
  read_stream(*reader, out);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(out.status.error_message().find("lease of 300 ms"), std::string::npos)
      << out.status.error_message();
  EXPECT_GE(waited, 0.25);
  EXPECT_LT(waited, 3.0);
  expect_pool_back(*decode.stub, "after the lease");
  EXPECT_GE(load(*decode.stub).leases_expired(), 1u);

  // Unknown reservations.
  dreq.set_request_id(99);
  auto dc2 = ctx();
  reader = decode.stub->Decode(dc2.get(), dreq);
  out = {};
  read_stream(*reader, out);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::NOT_FOUND);

  // Abort ends a reservation (and a Decode waiting on it).
  ASSERT_TRUE(reserve(*decode.stub, 4, 20, 0, &dest).ok());
  dreq.set_request_id(4);
  dreq.clear_prompt_tokens();
  for (int i = 0; i < 20; ++i) dreq.add_prompt_tokens(5);
  auto waiting = std::async(std::launch::async, [&] {
    auto c = ctx();
    auto r = decode.stub->Decode(c.get(), dreq);
    Output o;
    read_stream(*r, o);
    return o;
  });
  // Abort once the Decode waits on the reservation (before, Abort would end the reservation
  // alone and the Decode find none: NOT_FOUND, which is another case).
  for (int i = 0; i < 500 && load(*decode.stub).decodes_waiting() < 1; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(load(*decode.stub).decodes_waiting(), 1);
  v1::AbortRequest areq;
  areq.set_request_id(4);
  v1::AbortResponse aresp;
  auto ac = ctx();
  ASSERT_TRUE(decode.stub->Abort(ac.get(), areq, &aresp).ok());
  EXPECT_TRUE(aresp.aborted());
  EXPECT_EQ(waiting.get().status.error_code(), grpc::StatusCode::CANCELLED);
  expect_pool_back(*decode.stub, "after abort");
}

TEST_F(WorkerServiceTest, ADecodeWaitingForItsKvGivesUpWhenItsClientLeaves) {
  std::string why;
  Worker decode = start(worker_config("decode"), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  v1::KvDestination dest;
  ASSERT_TRUE(reserve(*decode.stub, 5, 20, 10000, &dest).ok());
  v1::DecodeRequest dreq;
  dreq.set_request_id(5);
  for (int i = 0; i < 20; ++i) dreq.add_prompt_tokens(5);
  to_proto(greedy(4), dreq.mutable_params());
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + 15s);
  auto reader = decode.stub->Decode(&c, dreq);
  std::this_thread::sleep_for(100ms);
  const auto t0 = std::chrono::steady_clock::now();
  c.TryCancel();
  v1::TokenEvent ev;
  EXPECT_FALSE(reader->Read(&ev));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The reservation goes back at once, not at the end of its 10 s lease.
  const auto until = t0 + 3s;
  while (load(*decode.stub).blocks_reserved() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  expect_pool_back(*decode.stub, "after the client left");
  EXPECT_EQ(load(*decode.stub).leases_expired(), 0u);
}

// One Generate stream read by gRPC's callback client (no thread of this test per stream).
class CountingStream final : public grpc::ClientReadReactor<v1::TokenEvent> {
 public:
  CountingStream(v1::Worker::Stub& stub, v1::GenerateRequest req, std::atomic<int>* started)
      : req_(std::move(req)), started_(started) {
    ctx_.set_deadline(std::chrono::system_clock::now() + 60s);
    stub.async()->Generate(&ctx_, &req_, this);
    StartRead(&ev_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (ev_.has_token() && tokens_++ == 0) started_->fetch_add(1);
    StartRead(&ev_);
  }
  void OnDone(const grpc::Status& s) override {
    status_ = s;
    done_.set_value();
  }
  void wait() { done_.get_future().wait(); }
  const grpc::Status& status() const { return status_; }
  int tokens() const { return tokens_; }

 private:
  grpc::ClientContext ctx_;
  v1::GenerateRequest req_;
  v1::TokenEvent ev_;
  std::atomic<int>* started_;
  int tokens_ = 0;
  grpc::Status status_;
  std::promise<void> done_;
};

int thread_count() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)e;
    ++n;
  }
  return n;
}

TEST_F(WorkerServiceTest, ManyConcurrentStreamsHoldNoThreadEach) {
  WorkerConfig config = worker_config("unified");
  config.engine.max_num_seqs = 256;
  config.engine.max_tokens_per_step = 1024;
  Worker w = start(config);
  ASSERT_TRUE(w.server);
  const int baseline = thread_count();
  constexpr int kStreams = 200;
  constexpr int kTokens = 48;
  std::atomic<int> started{0};
  std::vector<std::unique_ptr<CountingStream>> streams;
  const auto prompts = mixed_prompts(*ref_->tok, 4);
  for (int i = 0; i < kStreams; ++i) {
    v1::GenerateRequest req;
    req.set_request_id(1000 + static_cast<uint64_t>(i));
    const auto& prompt = prompts[static_cast<size_t>(i) % prompts.size()];
    req.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
    SamplingParams p = greedy(kTokens);
    p.ignore_eos = true;
    to_proto(p, req.mutable_params());
    streams.push_back(std::make_unique<CountingStream>(*w.stub, std::move(req), &started));
  }
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (started.load() < kStreams && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  const int during = thread_count();
  std::printf("threads: %d before, %d with %d streams started\n", baseline, during, started.load());
  for (auto& s : streams) s->wait();
  int ok = 0;
  for (auto& s : streams) {
    if (s->status().ok() && s->tokens() == kTokens) ++ok;
  }
  EXPECT_EQ(ok, kStreams);
  // A thread per stream would add 200; gRPC's own pools stay well below that.
  EXPECT_LT(during - baseline, kStreams / 2) << "threads: " << baseline << " -> " << during;
  expect_pool_back(*w.stub, "after the streams");
}

// A reservation names its writer: the KV's notice from the prefill worker chosen for it fills
// it; the same notice from another engine than the one the Reserve named is refused (counted as
// unmatched), so the Decode waits until the lease ends and fails, and the blocks come back.
TEST_F(WorkerServiceTest, ANoticeFromAnEngineOtherThanTheExpectedWriterIsRefused) {
  WorkerConfig dconfig = worker_config("decode");
  dconfig.worker.lease_ms = 600;
  std::string why;
  Worker decode = start(dconfig, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  Worker prefill = start(worker_config("prefill"));
  ASSERT_TRUE(prefill.server);
  v1::WorkerInfo pinfo;
  auto c0 = ctx();
  ASSERT_TRUE(prefill.stub->GetInfo(c0.get(), v1::GetInfoRequest{}, &pinfo).ok());
  ASSERT_NE(pinfo.transfer_engine_id(), 0u);
  const auto prompt = mixed_prompts(*ref_->tok, 5)[4];
  const SamplingParams p = greedy(6);
  for (const bool right : {true, false}) {
    const uint64_t id = right ? 900 : 901;
    v1::ReserveRequest rreq;
    rreq.set_request_id(id);
    rreq.set_num_prompt_tokens(static_cast<int64_t>(prompt.size()));
    rreq.set_expected_writer_engine(right ? pinfo.transfer_engine_id()
                                          : pinfo.transfer_engine_id() ^ 0x5a5a);
    v1::KvDestination dest;
    auto rc = ctx();
    ASSERT_TRUE(decode.stub->Reserve(rc.get(), rreq, &dest).ok());
    v1::PrefillRequest preq;
    preq.set_request_id(id);
    preq.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
    to_proto(p, preq.mutable_params());
    *preq.mutable_destination() = dest;
    v1::PrefillResponse presp;
    auto pc = ctx();
    ASSERT_TRUE(prefill.stub->Prefill(pc.get(), preq, &presp).ok());
    v1::DecodeRequest dreq;
    dreq.set_request_id(id);
    dreq.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
    to_proto(p, dreq.mutable_params());
    dreq.set_first_token(presp.first().token());
    auto dc = ctx();
    auto reader = decode.stub->Decode(dc.get(), dreq);
    Output out;
    add_event(presp.first(), out);
    read_stream(*reader, out);
    if (right) {
      expect_matches(out, reference(prompt, p), "the expected writer");
    } else {
      EXPECT_FALSE(out.status.ok()) << "a notice from another engine filled the reservation";
      EXPECT_NE(out.status.error_message().find("lease"), std::string::npos)
          << out.status.error_message();
    }
  }
  const std::string m = metrics_text(*decode.stub);
  EXPECT_NE(m.find("cleave:kv_notices_unmatched_total 1"), std::string::npos) << m;
  expect_pool_back(*decode.stub, "decode");
  expect_pool_back(*prefill.stub, "prefill");
}

// The Decode opened right after Reserve, before the prefill ran (first_token_from_notice): the
// prefill's notice carries the first token, and the stream gives the rest of the reference
// tokens. A prefill not asked to put the token in its notice leaves such a Decode with a clear
// error, and the blocks come back either way.
TEST_F(WorkerServiceTest, ADecodeOpenedBeforeThePrefillTakesTheFirstTokenFromTheNotice) {
  std::string why;
  Worker decode = start(worker_config("decode"), &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  Worker prefill = start(worker_config("prefill"));
  ASSERT_TRUE(prefill.server);
  const auto prompts = mixed_prompts(*ref_->tok, 6);
  for (const bool in_notice : {true, false}) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (!in_notice && i > 0) break;
      const uint64_t id = (in_notice ? 1200 : 1300) + i;
      const SamplingParams p = greedy(9);
      v1::KvDestination dest;
      ASSERT_TRUE(reserve(*decode.stub, id, static_cast<int64_t>(prompts[i].size()), 0, &dest).ok());
      v1::DecodeRequest dreq;
      dreq.set_request_id(id);
      dreq.mutable_prompt_tokens()->Add(prompts[i].begin(), prompts[i].end());
      to_proto(p, dreq.mutable_params());
      dreq.set_first_token_from_notice(true);
      Output streamed;
      std::thread reader_thread([&] {
        auto dc = ctx();
        auto reader = decode.stub->Decode(dc.get(), dreq);
        read_stream(*reader, streamed);
      });
      v1::PrefillRequest preq;
      preq.set_request_id(id);
      preq.mutable_prompt_tokens()->Add(prompts[i].begin(), prompts[i].end());
      to_proto(p, preq.mutable_params());
      *preq.mutable_destination() = dest;
      preq.set_first_token_in_notice(in_notice);
      v1::PrefillResponse presp;
      auto pc = ctx();
      const grpc::Status ps = prefill.stub->Prefill(pc.get(), preq, &presp);
      reader_thread.join();
      ASSERT_TRUE(ps.ok()) << ps.error_message();
      if (!in_notice) {
        EXPECT_FALSE(streamed.status.ok());
        EXPECT_NE(streamed.status.error_message().find("carried none"), std::string::npos)
            << streamed.status.error_message();
        continue;
      }
      Output out;
      add_event(presp.first(), out);
      out.tokens.insert(out.tokens.end(), streamed.tokens.begin(), streamed.tokens.end());
      out.logprobs.insert(out.logprobs.end(), streamed.logprobs.begin(), streamed.logprobs.end());
      out.text += streamed.text;
      out.status = streamed.status;
      out.finish_reason = streamed.finish_reason;
      out.completion_tokens = streamed.completion_tokens;
      expect_matches(out, reference(prompts[i], p), fmt::format("prompt {}", i));
    }
  }
  expect_pool_back(*decode.stub, "decode");
  expect_pool_back(*prefill.stub, "prefill");
}

// Prefill runs on the callback API: prefills waiting for the engine hold no thread each. The
// prefill engine takes one sequence at a time, so that most of the calls wait at once.
TEST_F(WorkerServiceTest, ManyConcurrentPrefillsHoldNoThreadEach) {
  WorkerConfig dconfig = worker_config("decode");
  dconfig.engine.kv_blocks = 512;
  std::string why;
  Worker decode = start(dconfig, &why);
  if (!decode.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  WorkerConfig pconfig = worker_config("prefill");
  pconfig.engine.max_num_seqs = 1;
  pconfig.engine.max_tokens_per_step = 8;
  pconfig.engine.kv_blocks = 512;
  Worker prefill = start(pconfig);
  ASSERT_TRUE(prefill.server);
  const int baseline = thread_count();
  constexpr int kCalls = 120;
  const auto prompts = mixed_prompts(*ref_->tok, 8);
  struct Call {
    grpc::ClientContext ctx;
    v1::PrefillRequest req;
    v1::PrefillResponse resp;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::atomic<int> done{0};
  for (int i = 0; i < kCalls; ++i) {
    auto call = std::make_unique<Call>();
    const uint64_t id = 7000 + static_cast<uint64_t>(i);
    const auto& prompt = prompts[static_cast<size_t>(i) % prompts.size()];
    v1::KvDestination dest;
    ASSERT_TRUE(reserve(*decode.stub, id, static_cast<int64_t>(prompt.size()), 30000, &dest).ok());
    call->req.set_request_id(id);
    call->req.mutable_prompt_tokens()->Add(prompt.begin(), prompt.end());
    to_proto(greedy(4), call->req.mutable_params());
    *call->req.mutable_destination() = dest;
    call->ctx.set_deadline(std::chrono::system_clock::now() + 60s);
    calls.push_back(std::move(call));
  }
  for (auto& c : calls) {
    Call* raw = c.get();
    prefill.stub->async()->Prefill(&raw->ctx, &raw->req, &raw->resp, [raw, &done](grpc::Status s) {
      raw->status = std::move(s);
      done.fetch_add(1);
    });
  }
  int most = baseline;
  int done_when_most = 0;
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (done.load() < kCalls && std::chrono::steady_clock::now() < until) {
    const int n = thread_count();
    if (n > most) {
      most = n;
      done_when_most = done.load();
    }
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_EQ(done.load(), kCalls) << "prefills still in flight after 60 s";
  std::printf("threads: %d before, at most %d with %d of %d prefills done\n", baseline, most,
              done_when_most, kCalls);
  int ok = 0;
  for (auto& c : calls) {
    if (c->status.ok() && c->resp.first().has_token()) ++ok;
    else ADD_FAILURE() << c->status.error_message();
    release(*decode.stub, c->req.request_id());
  }
  EXPECT_EQ(ok, kCalls);
  // A thread per waiting call would add about kCalls; gRPC's own pools stay well below that.
  EXPECT_LT(most - baseline, kCalls / 3) << "threads: " << baseline << " -> " << most;
  expect_pool_back(*prefill.stub, "prefill");
  expect_pool_back(*decode.stub, "decode");
}

TEST_F(WorkerServiceTest, RolesRefuseWhatTheyDoNotServe) {
  Worker unified = start(worker_config("unified"));
  ASSERT_TRUE(unified.server);
  v1::KvDestination dest;
  grpc::Status s = reserve(*unified.stub, 1, 10, 0, &dest);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(s.error_message().find("unified"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("Reserve"), std::string::npos) << s.error_message();
  v1::PrefillRequest preq;
  v1::PrefillResponse presp;
  auto c = ctx();
  s = unified.stub->Prefill(c.get(), preq, &presp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);

  std::string why;
  Worker prefill = start(worker_config("prefill"), &why);
  if (!prefill.server) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << why;
  Output g = generate(*prefill.stub, 1, {1, 2, 3}, greedy(2));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(g.status.error_message().find("prefill"), std::string::npos);
  s = reserve(*prefill.stub, 1, 10, 0, &dest);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // A Prefill with no destination is the caller's mistake.
  auto c2 = ctx();
  s = prefill.stub->Prefill(c2.get(), preq, &presp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  Worker decode = start(worker_config("decode"));
  ASSERT_TRUE(decode.server);
  auto c3 = ctx();
  s = decode.stub->Prefill(c3.get(), preq, &presp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(s.error_message().find("decode"), std::string::npos);
  g = generate(*decode.stub, 1, {1, 2, 3}, greedy(2));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);

  for (Worker* w : {&unified, &prefill, &decode}) {
    v1::WorkerInfo info;
    auto ci = ctx();
    ASSERT_TRUE(w->stub->GetInfo(ci.get(), v1::GetInfoRequest{}, &info).ok());
    EXPECT_EQ(info.role(), worker_role_name(w->server->role()));
    EXPECT_EQ(info.pid(), ::getpid());
    EXPECT_EQ(info.max_context(), 512);
    v1::AbortRequest areq;
    areq.set_request_id(12345);
    v1::AbortResponse aresp;
    auto ca = ctx();
    ASSERT_TRUE(w->stub->Abort(ca.get(), areq, &aresp).ok());
    EXPECT_FALSE(aresp.aborted());
  }
}

// grpc.health.v1.Health/Check over a generic call: request {service: ""} is empty; the answer
// {status: SERVING} is the bytes 08 01.
grpc::Status health_check(grpc::Channel& channel, std::string* answer) {
  grpc::GenericStub stub(std::shared_ptr<grpc::ChannelInterface>(&channel, [](auto*) {}));
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + 5s);
  grpc::ByteBuffer request(nullptr, 0), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&c, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status s = done.get_future().get();
  std::vector<grpc::Slice> slices;
  if (s.ok() && response.Dump(&slices).ok()) {
    for (const auto& sl : slices) answer->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return s;
}

TEST_F(WorkerServiceTest, AbortCancelHealthAndShutdown) {
  WorkerConfig config = worker_config("unified");
  config.model.path = slow_synth_path();
  config.engine.kv_blocks = 3 * 4096 / 16;
  Worker w = start(config);
  ASSERT_TRUE(w.server);
  std::string answer;
  ASSERT_TRUE(health_check(*w.channel, &answer).ok());
  EXPECT_EQ(answer, std::string("\x08\x01", 2));

  const auto prompts = mixed_prompts(*ref_->tok, 3);
  SamplingParams long_run = greedy(4000);
  long_run.ignore_eos = true;

  // Abort in the middle of a stream: it ends CANCELLED and the blocks come back.
  {
    v1::GenerateRequest req;
    req.set_request_id(77);
    req.mutable_prompt_tokens()->Add(prompts[2].begin(), prompts[2].end());
    to_proto(long_run, req.mutable_params());
    auto c = ctx();
    auto reader = w.stub->Generate(c.get(), req);
    v1::TokenEvent ev;
    ASSERT_TRUE(reader->Read(&ev));
    v1::AbortRequest areq;
    areq.set_request_id(77);
    v1::AbortResponse aresp;
    auto ac = ctx();
    ASSERT_TRUE(w.stub->Abort(ac.get(), areq, &aresp).ok());
    EXPECT_TRUE(aresp.aborted());
    while (reader->Read(&ev)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    expect_pool_back(*w.stub, "after abort");
  }
  // The client goes away: the engine cancels the request.
  {
    v1::GenerateRequest req;
    req.set_request_id(78);
    req.mutable_prompt_tokens()->Add(prompts[1].begin(), prompts[1].end());
    to_proto(long_run, req.mutable_params());
    auto c = ctx();
    auto reader = w.stub->Generate(c.get(), req);
    v1::TokenEvent ev;
    ASSERT_TRUE(reader->Read(&ev));
    // The engine publishes its stats after the step whose token we read: wait to see it run.
    v1::LoadReport before = load(*w.stub);
    for (int i = 0; i < 200 && before.running() == 0; ++i) {
      std::this_thread::sleep_for(5ms);
      before = load(*w.stub);
    }
    ASSERT_EQ(before.running(), 1);
    const uint64_t cancelled_before = before.requests_cancelled();
    c->TryCancel();
    while (reader->Read(&ev)) {
    }
    (void)reader->Finish();
    expect_pool_back(*w.stub, "after the client went away");
    const v1::LoadReport after = load(*w.stub);
    EXPECT_EQ(after.requests_cancelled(), cancelled_before + 1) << after.DebugString();
  }
  // Shutdown with a stream in flight: the stream ends UNAVAILABLE, shutdown returns.
  {
    v1::GenerateRequest req;
    req.set_request_id(79);
    req.mutable_prompt_tokens()->Add(prompts[0].begin(), prompts[0].end());
    to_proto(long_run, req.mutable_params());
    auto c = ctx();
    auto reader = w.stub->Generate(c.get(), req);
    v1::TokenEvent ev;
    ASSERT_TRUE(reader->Read(&ev));
    std::thread waiter([&] { w.server->wait(); });
    const auto t0 = std::chrono::steady_clock::now();
    w.server->shutdown();
    waiter.join();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
    while (reader->Read(&ev)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
    w.server->shutdown();  // idempotent
  }
}

// parse_listen_address itself: tests/unit/common/listen_address_test.cpp.
TEST(WorkerServiceConfigTest, BadRoleAndListenAddressAreRefused) {
  EXPECT_EQ(parse_worker_role("router").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(parse_worker_role("router").status().message().find("router"), std::string::npos);
  WorkerConfig c;
  c.worker.listen = "nowhere";
  auto s = WorkerServer::start(c);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("nowhere"), std::string::npos);
  // A port in use is refused, not shared.
  Worker first = start(worker_config("unified"));
  ASSERT_TRUE(first.server);
  WorkerConfig second = worker_config("unified");
  second.worker.listen = first.server->address();
  s = WorkerServer::start(second);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(s.status().message().find(first.server->address()), std::string::npos);
}

// The synthetic model's directory goes when every suite is done.
class RemoveSynthDir : public ::testing::Environment {
 public:
  void TearDown() override { testing_engine::remove_synth_dir(); }
};
const auto* const kRemoveSynthDir = ::testing::AddGlobalTestEnvironment(new RemoveSynthDir);

}  // namespace
}  // namespace cleave
