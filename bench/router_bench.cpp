// Router bench: what the router adds on top of the workers (issue 6).
//
//   router_bench [--cleave PATH] [--model FILE] [--requests N] [--warmup W] [--max-tokens M]
//                [--prompt-tokens P] [--streams C] [--stream-tokens T] [--workers K]
//                [--worker-threads X] [--kv-cache-bytes B] [--max-connecting Q]
//                [--deadline S] [--json FILE] [--skip-ttft] [--skip-streams]
//
// Real processes on 127.0.0.1: K `cleave worker --role unified` (the cleave binary defaults to
// ../bin/cleave beside this bench; the model to ../shared/models/stories260K.gguf from the
// repository root when it exists, else the embedded default model) and `cleave router --mode
// unified` with router.io_threads=1 (one HTTP I/O thread).
//
// 1. TTFT overhead. N requests each way, interleaved (the order alternates), after W of each
//    as warm-up, same P prompt token ids (BOS, then ids that vary per request), greedy,
//    M tokens, ignore_eos:
//      direct  gRPC Worker.Generate to worker 0 on one persistent channel: from the call to
//              the first event with a token;
//      router  POST /v1/completions "stream": true with the same token ids on one keep-alive
//              connection to a router whose pool is worker 0 only: from the request's first
//              byte to the first SSE data chunk with a choice.
//      grpc    the router's gRPC API, Inference.Generate with the same token ids on one
//              persistent channel: from the call to the first message with a token.
//    p50/p90/p99/mean of each and router - direct at p50 and p99 (aim: p99 within 1 ms).
// 2. Concurrent streams. C streaming completions (default 5,000; T tokens each, default 128,
//    ignore_eos), one TCP connection per stream, all connected from one thread with
//    Boost.Asio (at most Q connects pending at once) before the requests go out together,
//    every chunk read to [DONE], against a router over all K workers with
//    router.max_queue above C; the workers are sized to run every stream at once
//    (engine.max_num_seqs = ceil(C / K) + 8, a token budget to match, B bytes of KV each).
//    Reports completed streams (200, [DONE], usage.completion_tokens == T), every kind of
//    error, the peak of streams open at once, wall time, chunks/s, and the CPU seconds of the
//    router, its HTTP I/O thread and the workers meanwhile (aim: 5,000 streams).
// 3. Disaggregated hops (skip with --skip-disagg). One prefill and one decode worker, and two
//    `cleave router --mode disaggregated` over them: router.early_decode=true (the Decode opens
//    right after Reserve; the first token reaches the decode worker in the KV's notice) and
//    =false (the Decode opens after the Prefill's answer came back to the router). N requests
//    each, interleaved, through each router's gRPC API (Inference.Generate, one persistent
//    channel each, the same token ids, greedy, max(M, 2) tokens): from the call to the first
//    token and to the second. p50/p90/mean of each, and early - after at p50.
//
// Everything ends by the global deadline (S seconds, default 120): what is measured by then is
// reported and the exit status is 1. Children get SIGKILL through PR_SET_PDEATHSIG if this
// process dies, and SIGTERM (then SIGKILL) + waitpid on every other exit path.
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "bench_json.h"
#include "cleave/engine/sampler.h"
#include "cleave/v1/inference.grpc.pb.h"
#include "cleave/v1/worker.grpc.pb.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "router_bench_child.h"
#include "router_bench_sse.h"

namespace {

namespace fs = std::filesystem;
using cleave::bench::Clock;
using cleave::bench::ChildProcess;
using cleave::bench::cpu_seconds;

struct Options {
  std::string cleave;
  std::string model;  // empty: the embedded default model
  int64_t requests = 300;
  int64_t warmup = 30;
  int64_t max_tokens = 4;
  int64_t prompt_tokens = 8;
  int64_t streams = 5000;
  int64_t stream_tokens = 128;
  int64_t workers = 1;
  int64_t worker_threads = 1;
  int64_t kv_cache_bytes = 1ll << 30;
  int64_t max_connecting = 256;
  int64_t deadline_s = 120;
  std::string json;
  bool skip_ttft = false;
  bool skip_streams = false;
  bool skip_disagg = false;
};

constexpr const char* kUsage =
    "usage: router_bench [--cleave PATH] [--model FILE] [--requests N] [--warmup W] "
    "[--max-tokens M] [--prompt-tokens P] [--streams C] [--stream-tokens T] "
    "[--workers K] [--worker-threads X] [--kv-cache-bytes B] [--max-connecting Q] "
    "[--deadline S] [--json FILE] [--skip-ttft] [--skip-streams] [--skip-disagg]";

Options parse(int argc, char** argv) {
  Options o;
  bool model_given = false;
  cleave::bench::BenchFlags f("router_bench", kUsage, argc, argv);
  while (f.next()) {
    if (f.is("--cleave")) o.cleave = f.value();
    else if (f.is("--model")) { o.model = f.value(); model_given = true; }
    else if (f.is("--requests")) o.requests = f.integer(1);
    else if (f.is("--warmup")) o.warmup = f.integer(0);
    else if (f.is("--max-tokens")) o.max_tokens = f.integer(1);
    else if (f.is("--prompt-tokens")) o.prompt_tokens = f.integer(1);
    else if (f.is("--streams")) o.streams = f.integer(1);
    else if (f.is("--stream-tokens")) o.stream_tokens = f.integer(1);
    else if (f.is("--workers")) o.workers = f.integer(1);
    else if (f.is("--worker-threads")) o.worker_threads = f.integer(0);
    else if (f.is("--kv-cache-bytes")) o.kv_cache_bytes = f.integer(1 << 20);
    else if (f.is("--max-connecting")) o.max_connecting = f.integer(1);
    else if (f.is("--deadline")) o.deadline_s = f.integer(1);
    else if (f.is("--json")) o.json = f.value();
    else if (f.is("--skip-ttft")) o.skip_ttft = true;
    else if (f.is("--skip-streams")) o.skip_streams = true;
    else if (f.is("--skip-disagg")) o.skip_disagg = true;
    else f.unknown();
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (o.cleave.empty()) o.cleave = (self.parent_path().parent_path() / "bin" / "cleave").string();
  if (!model_given) {
    // From the repository root: the working directory, else the build folder's parent.
    for (const fs::path& root : {fs::current_path(ec), self.parent_path().parent_path().parent_path()}) {
      const fs::path m = root / ".." / "shared" / "models" / "stories260K.gguf";
      if (fs::is_regular_file(m, ec)) {
        o.model = fs::weakly_canonical(m, ec).string();
        break;
      }
    }
  }
  return o;
}

// gRPC deadlines are system_clock time points.
std::chrono::system_clock::time_point wall_clock(Clock::time_point t) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
}

// Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const auto rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

struct Summary {
  int64_t n = 0;
  double p50 = 0, p90 = 0, p99 = 0, mean = 0, max = 0;
};
Summary summarize(std::vector<double> v) {
  Summary s;
  std::sort(v.begin(), v.end());
  s.n = static_cast<int64_t>(v.size());
  if (v.empty()) return s;
  s.p50 = percentile(v, 0.50);
  s.p90 = percentile(v, 0.90);
  s.p99 = percentile(v, 0.99);
  s.max = v.back();
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

std::string summary_json(const Summary& s) {
  return fmt::format("{{\"n\": {}, \"p50_ms\": {:.4f}, \"p90_ms\": {:.4f}, \"p99_ms\": {:.4f}, "
                     "\"mean_ms\": {:.4f}, \"max_ms\": {:.4f}}}",
                     s.n, s.p50 * 1e3, s.p90 * 1e3, s.p99 * 1e3, s.mean * 1e3, s.max * 1e3);
}

std::string load_average() {
  double avg[3] = {0, 0, 0};
  if (getloadavg(avg, 3) != 3) return "unknown";
  return fmt::format("{:.2f} {:.2f} {:.2f}", avg[0], avg[1], avg[2]);
}

// The prompt of request i: BOS (1), then ids that differ from one request to the next.
std::vector<int32_t> prompt_of(int64_t i, int64_t length, int64_t vocab) {
  std::vector<int32_t> p;
  p.push_back(1);
  const int64_t span = std::max<int64_t>(vocab - 3, 1);
  for (int64_t j = 1; j < length; ++j) p.push_back(static_cast<int32_t>(3 + (i * 7 + j * 13) % span));
  return p;
}

std::string completion_body(const std::vector<int32_t>& prompt, int64_t max_tokens) {
  std::string ids;
  for (int32_t t : prompt) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(t);
  }
  return fmt::format("{{\"prompt\":[{}],\"max_tokens\":{},\"temperature\":0,\"ignore_eos\":true,"
                     "\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}",
                     ids, max_tokens);
}

std::string ms(double seconds) {
  return fmt::format("{:8.3f} ms", seconds * 1e3);
}

struct TtftFigures {
  Summary direct, router, grpc;
  int64_t errors = 0;
  int64_t empty_first_text = 0;  // direct first events without text (the router sends no chunk)
  int64_t http_connects = 0;
  bool complete = false;
  std::string first_error;
};

// Section 3: one router's figures (seconds from the call).
struct HopFigures {
  Summary first, second, gap;  // first token, second token, second - first
  int64_t errors = 0;
  std::string first_error;
};

struct Run {
  Run(const Options& options, Clock::time_point until) : o(options), deadline(until) {}
  const Options& o;
  Clock::time_point deadline;
  std::vector<std::unique_ptr<ChildProcess>> workers;
  std::vector<std::string> worker_addresses;
  int64_t vocab = 0;
  int64_t max_num_seqs = 0;
  int64_t max_tokens_per_step = 0;
  int64_t kv_blocks = 0;  // per worker
  std::optional<TtftFigures> ttft;
  std::optional<HopFigures> hops_early, hops_after;
  std::string load_before_disagg;
  std::optional<cleave::bench::StreamLoadResult> streams;
  // CPU seconds spent during the stream load: the router process, its HTTP I/O thread, the
  // workers together.
  double router_cpu_s = -1, router_io_cpu_s = -1, workers_cpu_s = -1;
  std::string load_before_ttft, load_before_streams, load_after;
  std::string failure;

  bool fail(std::string why) {
    if (failure.empty()) failure = std::move(why);
    return false;
  }

  std::vector<std::string> model_args() const {
    if (o.model.empty()) return {};
    return {"--model", o.model};
  }

  bool start_workers() {
    const int64_t per_worker = (o.streams + o.workers - 1) / o.workers;
    max_num_seqs = std::max<int64_t>(64, per_worker + 8);
    max_tokens_per_step = std::max<int64_t>(256, max_num_seqs + 256);
    for (int64_t k = 0; k < o.workers; ++k) {
      std::vector<std::string> argv = {o.cleave, "worker", "--role", "unified", "--id",
                                       fmt::format("bench-unified-{}", k), "--listen",
                                       "127.0.0.1:0"};
      for (const auto& a : model_args()) argv.push_back(a);
      for (const std::string& s :
           {fmt::format("engine.threads={}", o.worker_threads),
            fmt::format("engine.max_num_seqs={}", max_num_seqs),
            fmt::format("engine.max_tokens_per_step={}", max_tokens_per_step),
            fmt::format("engine.kv_cache_bytes={}", o.kv_cache_bytes), std::string("log.level=warn")}) {
        argv.push_back("--set");
        argv.push_back(s);
      }
      std::string error;
      auto child = ChildProcess::start(fmt::format("worker {}", k), argv, deadline, &error);
      if (!child) return fail(error);
      worker_addresses.push_back(child->listening_on());
      workers.push_back(std::move(child));
    }
    return inspect_workers();
  }

  // Vocabulary from worker 0; every worker's KV pool must hold its share of the streams.
  bool inspect_workers() {
    const int64_t per_worker = (o.streams + o.workers - 1) / o.workers;
    for (size_t k = 0; k < worker_addresses.size(); ++k) {
      auto channel = grpc::CreateChannel(worker_addresses[k], grpc::InsecureChannelCredentials());
      auto stub = cleave::v1::Worker::NewStub(channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(wall_clock(std::min(deadline, Clock::now() + std::chrono::seconds(10))));
      cleave::v1::WorkerInfo info;
      const grpc::Status s = stub->GetInfo(&ctx, cleave::v1::GetInfoRequest(), &info);
      if (!s.ok()) return fail(fmt::format("worker {} ({}): GetInfo: {}", k, worker_addresses[k], s.error_message()));
      if (k == 0) vocab = info.vocab_size();
      const auto& l = info.kv_layout();
      const int64_t bs = std::max<int64_t>(l.block_size(), 1);
      const int64_t per_seq = (o.prompt_tokens + o.stream_tokens + bs - 1) / bs;
      kv_blocks = l.num_blocks();
      if (!o.skip_streams && per_seq * per_worker > l.num_blocks()) {
        return fail(fmt::format("worker {} has {} KV blocks of {} tokens; {} streams of {} tokens need {}: "
                                "raise --kv-cache-bytes or --workers",
                                k, l.num_blocks(), bs, per_worker, o.prompt_tokens + o.stream_tokens,
                                per_seq * per_worker));
      }
    }
    return true;
  }

  // `cleave router --mode unified` over `addresses` (or, with `pools` set, the mode and pool
  // settings given there); its HTTP port (and the gRPC API's) once /health answers 200.
  std::unique_ptr<ChildProcess> start_router(const std::vector<std::string>& addresses, int* port,
                                             int* grpc_port = nullptr,
                                             std::vector<std::string> pools = {}) {
    std::string list;
    for (const auto& a : addresses) {
      if (!list.empty()) list += ',';
      list += a;
    }
    const bool unified = pools.empty();
    if (unified) pools = {"pools.unified.workers=" + list};
    std::vector<std::string> argv = {o.cleave, "router", "--mode",
                                     unified ? "unified" : "disaggregated", "--host",
                                     "127.0.0.1", "--port", "0", "--grpc-port", "0"};
    for (const auto& a : model_args()) argv.push_back(a);
    pools.push_back("router.io_threads=1");
    pools.push_back(fmt::format("router.max_queue={}", std::max<int64_t>(1024, o.streams + 64)));
    pools.push_back("log.level=warn");
    for (const std::string& s : pools) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    std::string error;
    auto child = ChildProcess::start("router", argv, deadline, &error);
    if (!child) {
      fail(error);
      return nullptr;
    }
    // "http://127.0.0.1:PORT/ (model '...', gRPC API on 127.0.0.1:PORT)"
    const std::string url = child->listening_on();
    const size_t colon = url.find(':', url.find("//") + 2);
    *port = colon == std::string::npos ? 0 : std::atoi(url.c_str() + colon + 1);
    if (*port <= 0) {
      fail("cannot read the router's port from '" + url + "'");
      return nullptr;
    }
    if (grpc_port != nullptr) {
      const size_t at = url.find("gRPC API on ");
      const size_t c = at == std::string::npos ? at : url.find(':', at);
      *grpc_port = c == std::string::npos ? 0 : std::atoi(url.c_str() + c + 1);
      if (*grpc_port <= 0) {
        fail("cannot read the router's gRPC port from '" + url + "'");
        return nullptr;
      }
    }
    cleave::bench::BlockingHttpClient http(*port);
    std::string last = "no answer";
    while (Clock::now() < deadline) {
      auto r = http.request("GET", "/health", "", std::min(deadline, Clock::now() + std::chrono::seconds(2)));
      if (r.ok && r.status == 200) return child;
      last = r.ok ? fmt::format("HTTP {} {}", r.status, r.body) : r.error;
      if (!child->running()) break;
      usleep(50 * 1000);
    }
    fail(fmt::format("the router's /health did not answer 200 (last: {})\n--- router stderr:\n{}",
                     last, child->stderr_tail()));
    return nullptr;
  }

  bool measure_ttft() {
    int port = 0, grpc_port = 0;
    auto router = start_router({worker_addresses.front()}, &port, &grpc_port);
    if (!router) return false;
    auto router_channel = grpc::CreateChannel(fmt::format("127.0.0.1:{}", grpc_port),
                                              grpc::InsecureChannelCredentials());
    auto inference = cleave::v1::Inference::NewStub(router_channel);
    auto channel = grpc::CreateChannel(worker_addresses.front(), grpc::InsecureChannelCredentials());
    if (!channel->WaitForConnected(wall_clock(std::min(deadline, Clock::now() + std::chrono::seconds(10))))) {
      return fail("the gRPC channel to worker 0 did not connect");
    }
    auto stub = cleave::v1::Worker::NewStub(channel);
    cleave::SamplingParams sp;
    sp.temperature = 0;
    sp.max_tokens = static_cast<int32_t>(o.max_tokens);
    sp.ignore_eos = true;
    cleave::v1::SamplingParams params;
    cleave::to_proto(sp, &params);

    TtftFigures f;
    std::vector<double> direct, routed, routed_grpc;
    cleave::bench::BlockingHttpClient http(port);
    auto note = [&](std::string why) {
      ++f.errors;
      if (f.first_error.empty()) f.first_error = std::move(why);
    };
    auto run_direct = [&](int64_t i) -> double {
      const auto prompt = prompt_of(i, o.prompt_tokens, vocab);
      cleave::v1::GenerateRequest req;
      req.set_request_id((1ull << 62) + static_cast<uint64_t>(i));
      req.mutable_prompt_tokens()->Assign(prompt.begin(), prompt.end());
      *req.mutable_params() = params;
      grpc::ClientContext ctx;
      ctx.set_deadline(wall_clock(std::min(deadline, Clock::now() + std::chrono::seconds(10))));
      const auto t0 = Clock::now();
      auto reader = stub->Generate(&ctx, req);
      cleave::v1::TokenEvent ev;
      double first = -1;
      int64_t tokens = 0;
      while (reader->Read(&ev)) {
        if (!ev.has_token()) continue;
        if (tokens++ == 0) {
          first = std::chrono::duration<double>(Clock::now() - t0).count();
          if (ev.text().empty()) ++f.empty_first_text;
        }
      }
      const grpc::Status s = reader->Finish();
      if (!s.ok() || tokens != o.max_tokens || first < 0) {
        note(fmt::format("direct request {}: {} ({} tokens)", i, s.ok() ? "OK" : s.error_message(), tokens));
        return -1;
      }
      return first;
    };
    auto run_router = [&](int64_t i) -> double {
      const std::string body = completion_body(prompt_of(i, o.prompt_tokens, vocab), o.max_tokens);
      auto r = http.request("POST", "/v1/completions", body,
                            std::min(deadline, Clock::now() + std::chrono::seconds(10)));
      if (!r.ok || r.status != 200 || r.error_event || !r.done_event || r.first_chunk_seconds < 0 ||
          r.completion_tokens != o.max_tokens) {
        note(fmt::format("router request {}: {} status {} usage {} {}", i, r.ok ? "answered" : r.error,
                         r.status, r.completion_tokens, r.body.substr(0, 300)));
        return -1;
      }
      return r.first_chunk_seconds;
    };
    auto run_grpc = [&](int64_t i) -> double {
      const auto prompt = prompt_of(i, o.prompt_tokens, vocab);
      cleave::v1::GenerateTextRequest req;
      auto* ids = req.add_prompts()->mutable_token_ids();
      ids->mutable_ids()->Assign(prompt.begin(), prompt.end());
      req.set_max_tokens(static_cast<int32_t>(o.max_tokens));
      req.set_temperature(0);
      req.set_ignore_eos(true);
      grpc::ClientContext ctx;
      ctx.set_deadline(wall_clock(std::min(deadline, Clock::now() + std::chrono::seconds(10))));
      const auto t0 = Clock::now();
      auto reader = inference->Generate(&ctx, req);
      cleave::v1::GenerateTextResponse msg;
      double first = -1;
      int64_t tokens = 0;
      while (reader->Read(&msg)) {
        for (const auto& d : msg.choices()) {
          if (d.token_ids_size() > 0 && first < 0) {
            first = std::chrono::duration<double>(Clock::now() - t0).count();
          }
          tokens += d.token_ids_size();
        }
      }
      const grpc::Status s = reader->Finish();
      if (!s.ok() || tokens != o.max_tokens || first < 0) {
        note(fmt::format("router gRPC request {}: {} ({} tokens)", i,
                         s.ok() ? "OK" : s.error_message(), tokens));
        return -1;
      }
      return first;
    };
    const int64_t total = o.warmup + o.requests;
    for (int64_t i = 0; i < total && Clock::now() < deadline; ++i) {
      // The three paths in a rotating order, so that none always goes first.
      double t[3] = {-1, -1, -1};  // direct, router HTTP, router gRPC
      for (int k = 0; k < 3; ++k) {
        const int path = static_cast<int>((i + k) % 3);
        t[path] = path == 0 ? run_direct(i) : path == 1 ? run_router(i) : run_grpc(i);
      }
      if (i < o.warmup) continue;
      if (t[0] >= 0) direct.push_back(t[0]);
      if (t[1] >= 0) routed.push_back(t[1]);
      if (t[2] >= 0) routed_grpc.push_back(t[2]);
    }
    f.complete = static_cast<int64_t>(direct.size()) == o.requests &&
                 static_cast<int64_t>(routed.size()) == o.requests &&
                 static_cast<int64_t>(routed_grpc.size()) == o.requests;
    f.direct = summarize(direct);
    f.router = summarize(routed);
    f.grpc = summarize(routed_grpc);
    f.http_connects = http.connects();
    ttft = f;
    if (!f.complete) {
      return fail(fmt::format("TTFT: {} direct, {} router HTTP and {} router gRPC requests of {} "
                              "measured ({} errors; first: {})",
                              direct.size(), routed.size(), routed_grpc.size(), o.requests,
                              f.errors, f.first_error));
    }
    return true;
  }

  // Section 3: a prefill and a decode worker, two routers over them (early_decode on and off).
  bool measure_disaggregated() {
    std::vector<std::unique_ptr<ChildProcess>> pd;
    std::vector<std::string> addr;
    for (const char* role : {"prefill", "decode"}) {
      std::vector<std::string> argv = {o.cleave, "worker", "--role", role, "--id",
                                       fmt::format("bench-{}", role), "--listen", "127.0.0.1:0"};
      for (const auto& a : model_args()) argv.push_back(a);
      for (const std::string& s : {fmt::format("engine.threads={}", o.worker_threads),
                                   std::string("engine.kv_cache_bytes=268435456"),
                                   std::string("log.level=warn")}) {
        argv.push_back("--set");
        argv.push_back(s);
      }
      std::string error;
      auto child = ChildProcess::start(fmt::format("{} worker", role), argv, deadline, &error);
      if (!child) return fail(error);
      addr.push_back(child->listening_on());
      pd.push_back(std::move(child));
    }
    struct Side {
      std::unique_ptr<ChildProcess> router;
      std::unique_ptr<cleave::v1::Inference::Stub> stub;
      std::vector<double> first, second, gap;
      HopFigures f;
    } sides[2];  // 0: early_decode=true, 1: false
    for (int k = 0; k < 2; ++k) {
      int port = 0, grpc_port = 0;
      sides[k].router = start_router({}, &port, &grpc_port,
                                     {"pools.prefill.workers=" + addr[0],
                                      "pools.decode.workers=" + addr[1],
                                      std::string("router.early_decode=") + (k == 0 ? "true" : "false")});
      if (!sides[k].router) return false;
      sides[k].stub = cleave::v1::Inference::NewStub(grpc::CreateChannel(
          fmt::format("127.0.0.1:{}", grpc_port), grpc::InsecureChannelCredentials()));
    }
    const int64_t max_tokens = std::max<int64_t>(o.max_tokens, 2);
    auto run_one = [&](Side& side, int64_t i) {
      const auto prompt = prompt_of(i, o.prompt_tokens, vocab);
      cleave::v1::GenerateTextRequest req;
      req.add_prompts()->mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
      req.set_max_tokens(static_cast<int32_t>(max_tokens));
      req.set_temperature(0);
      req.set_ignore_eos(true);
      grpc::ClientContext ctx;
      ctx.set_deadline(wall_clock(std::min(deadline, Clock::now() + std::chrono::seconds(20))));
      const auto t0 = Clock::now();
      auto reader = side.stub->Generate(&ctx, req);
      cleave::v1::GenerateTextResponse msg;
      double first = -1, second = -1;
      int64_t tokens = 0;
      while (reader->Read(&msg)) {
        for (const auto& d : msg.choices()) {
          for (int j = 0; j < d.token_ids_size(); ++j) {
            const double t = std::chrono::duration<double>(Clock::now() - t0).count();
            if (tokens == 0) first = t;
            if (tokens == 1) second = t;
            ++tokens;
          }
        }
      }
      const grpc::Status s = reader->Finish();
      if (!s.ok() || tokens != max_tokens || second < 0) {
        ++side.f.errors;
        if (side.f.first_error.empty()) {
          side.f.first_error = fmt::format("request {}: {} ({} tokens)", i,
                                           s.ok() ? "OK" : s.error_message(), tokens);
        }
        return std::pair<double, double>{-1, -1};
      }
      return std::pair<double, double>{first, second};
    };
    const int64_t total = o.warmup + o.requests;
    for (int64_t i = 0; i < total && Clock::now() < deadline; ++i) {
      for (int k = 0; k < 2; ++k) {
        Side& side = sides[(i + k) % 2];  // alternate which router goes first
        const auto [first, second] = run_one(side, (1ll << 40) + i);
        if (i < o.warmup || first < 0) continue;
        side.first.push_back(first);
        side.second.push_back(second);
        side.gap.push_back(second - first);
      }
    }
    for (int k = 0; k < 2; ++k) {
      Side& s = sides[k];
      s.f.first = summarize(s.first);
      s.f.second = summarize(s.second);
      s.f.gap = summarize(s.gap);
    }
    hops_early = sides[0].f;
    hops_after = sides[1].f;
    const auto n0 = static_cast<int64_t>(sides[0].first.size());
    const auto n1 = static_cast<int64_t>(sides[1].first.size());
    if (n0 != o.requests || n1 != o.requests) {
      return fail(fmt::format("disaggregated: {} early and {} after-prefill requests of {} measured "
                              "(first errors: {} / {})",
                              n0, n1, o.requests, sides[0].f.first_error, sides[1].f.first_error));
    }
    return true;
  }

  bool measure_streams() {
    int port = 0;
    auto router = start_router(worker_addresses, &port);
    if (!router) return false;
    cleave::bench::StreamLoadOptions lo;
    lo.port = port;
    lo.body = completion_body(prompt_of(7, o.prompt_tokens, vocab), o.stream_tokens);
    lo.streams = o.streams;
    lo.expected_tokens = o.stream_tokens;
    lo.max_connecting = o.max_connecting;
    lo.deadline = deadline;
    auto workers_cpu = [&] {
      double t = 0;
      for (const auto& w : workers) t += std::max(cpu_seconds(w->pid()), 0.0);
      return t;
    };
    const double router0 = cpu_seconds(router->pid()), io0 = cpu_seconds(router->pid(), "http-io-0");
    const double workers0 = workers_cpu();
    streams = cleave::bench::run_stream_load(lo);
    router_cpu_s = cpu_seconds(router->pid()) - router0;
    router_io_cpu_s = cpu_seconds(router->pid(), "http-io-0") - io0;
    workers_cpu_s = workers_cpu() - workers0;
    const auto& s = *streams;
    if (!router->running()) {
      return fail(fmt::format("the router exited during the stream load\n--- router stderr:\n{}",
                              router->stderr_tail()));
    }
    if (s.completed != o.streams) {
      return fail(fmt::format("streams: {} of {} completed (first error: {})", s.completed, o.streams,
                              s.first_error));
    }
    return true;
  }
};

void report(const Run& run) {
  const Options& o = run.o;
  fmt::print("router_bench: model {}, {} unified worker(s) (engine.threads={}, max_num_seqs={}, "
             "max_tokens_per_step={}, kv_cache_bytes={}: {} KV blocks), router.io_threads=1\n",
             o.model.empty() ? "(embedded default)" : o.model, o.workers, o.worker_threads,
             run.max_num_seqs, run.max_tokens_per_step, o.kv_cache_bytes, run.kv_blocks);
  if (run.ttft) {
    const TtftFigures& f = *run.ttft;
    fmt::print("TTFT ({} requests each way after {} warm-up, {} prompt tokens, max_tokens {}; load {})\n",
               o.requests, o.warmup, o.prompt_tokens, o.max_tokens, run.load_before_ttft);
    fmt::print("  {:8} {:>11} {:>11} {:>11} {:>11}  n\n", "", "p50", "p90", "p99", "mean");
    for (const auto& [name, s] : {std::pair{"direct", &f.direct}, std::pair{"router", &f.router},
                                  std::pair{"grpc", &f.grpc}}) {
      fmt::print("  {:8} {} {} {} {}  {}\n", name, ms(s->p50), ms(s->p90), ms(s->p99), ms(s->mean), s->n);
    }
    const double d50 = f.router.p50 - f.direct.p50, d99 = f.router.p99 - f.direct.p99;
    fmt::print("  router - direct: p50 {}, p99 {}  (aim p99 <= 1 ms: {})\n", ms(d50), ms(d99),
               d99 <= 1e-3 ? "met" : "NOT met");
    fmt::print("  router gRPC - direct: p50 {}, p99 {}\n", ms(f.grpc.p50 - f.direct.p50),
               ms(f.grpc.p99 - f.direct.p99));
    fmt::print("  errors {}, HTTP connections opened {}, direct first tokens without text {}\n",
               f.errors, f.http_connects, f.empty_first_text);
  }
  if (run.streams) {
    const auto& s = *run.streams;
    fmt::print("Streams ({} requested, {} tokens each, one connection per stream, one client "
               "thread; load before {})\n", o.streams, o.stream_tokens, run.load_before_streams);
    fmt::print("  completed {}  errors: http {} ({}), error events {}, wrong token count {}, "
               "connect {}, io {}, timeouts {}, not started {}\n",
               s.completed, s.http_errors, s.status_counts.empty() ? "-" : s.status_counts,
               s.error_events, s.wrong_tokens, s.connect_errors, s.io_errors, s.timeouts,
               o.streams - s.started);
    fmt::print("  peak open streams {} (peak TCP connections {}), every request sent before the "
               "first stream ended: {}; connects took {:.3f} s, then every response head was in "
               "{:.3f} s after the first request went out\n",
               s.peak_open, s.peak_connected, s.all_sent_before_first_done ? "yes" : "no",
               s.connect_seconds, s.all_open_seconds);
    fmt::print("  wall {:.3f} s, {} chunks, {:.0f} chunks/s  (aim 5,000 streams: {})\n", s.wall_seconds,
               s.chunks, s.wall_seconds > 0 ? static_cast<double>(s.chunks) / s.wall_seconds : 0.0,
               s.completed >= 5000 && s.peak_open >= 5000 ? "met" : "NOT met");
    fmt::print("  CPU during the load: router {:.2f} s (its HTTP I/O thread {:.2f} s), workers {:.2f} s, "
               "over {:.2f} s\n", run.router_cpu_s, run.router_io_cpu_s, run.workers_cpu_s, s.wall_seconds);
    if (!s.first_error.empty()) fmt::print("  first error: {}\n", s.first_error);
  }
  if (run.hops_early && run.hops_after) {
    const HopFigures& e = *run.hops_early;
    const HopFigures& a = *run.hops_after;
    fmt::print("Disaggregated hops (1 prefill + 1 decode worker, {} requests per router after {} "
               "warm-up, {} prompt tokens, router gRPC API; load {})\n",
               o.requests, o.warmup, o.prompt_tokens, run.load_before_disagg);
    fmt::print("  {:26} {:>11} {:>11} {:>11}  n\n", "", "p50", "p90", "mean");
    for (const auto& [name, s] :
         {std::pair{"TTFT early_decode", &e.first}, std::pair{"TTFT after prefill", &a.first},
          std::pair{"2nd token early_decode", &e.second},
          std::pair{"2nd token after prefill", &a.second},
          std::pair{"gap early_decode", &e.gap}, std::pair{"gap after prefill", &a.gap}}) {
      fmt::print("  {:26} {} {} {}  {}\n", name, ms(s->p50), ms(s->p90), ms(s->mean), s->n);
    }
    fmt::print("  early - after at p50: TTFT {}, 2nd token {}, gap {}; errors {} / {}\n",
               ms(e.first.p50 - a.first.p50), ms(e.second.p50 - a.second.p50),
               ms(e.gap.p50 - a.gap.p50), e.errors, a.errors);
  }
  fmt::print("load after: {}\n", run.load_after);
  if (!run.failure.empty()) fmt::print(stderr, "router_bench: {}\n", run.failure);
}

bool write_json(const Run& run) {
  const Options& o = run.o;
  std::string j = fmt::format(
      "{{\"model\": {}, \"workers\": {}, \"worker_threads\": {}, \"max_num_seqs\": {}, "
      "\"max_tokens_per_step\": {}, \"kv_cache_bytes\": {}, \"router_io_threads\": 1, "
      "\"load_before_ttft\": {}, \"load_before_streams\": {}, \"load_after\": {}, \"ok\": {}",
      cleave::bench::json_string(o.model), o.workers, o.worker_threads, run.max_num_seqs,
      run.max_tokens_per_step, o.kv_cache_bytes, cleave::bench::json_string(run.load_before_ttft),
      cleave::bench::json_string(run.load_before_streams), cleave::bench::json_string(run.load_after),
      run.failure.empty() ? "true" : "false");
  if (run.ttft) {
    const TtftFigures& f = *run.ttft;
    j += fmt::format(
        ", \"ttft\": {{\"requests\": {}, \"warmup\": {}, \"prompt_tokens\": {}, \"max_tokens\": {}, "
        "\"direct\": {}, \"router\": {}, \"router_grpc\": {}, \"diff_p50_ms\": {:.4f}, "
        "\"diff_p99_ms\": {:.4f}, \"grpc_diff_p50_ms\": {:.4f}, \"grpc_diff_p99_ms\": {:.4f}, "
        "\"aim_met\": {}, \"errors\": {}}}",
        o.requests, o.warmup, o.prompt_tokens, o.max_tokens, summary_json(f.direct),
        summary_json(f.router), summary_json(f.grpc), (f.router.p50 - f.direct.p50) * 1e3,
        (f.router.p99 - f.direct.p99) * 1e3, (f.grpc.p50 - f.direct.p50) * 1e3,
        (f.grpc.p99 - f.direct.p99) * 1e3, f.router.p99 - f.direct.p99 <= 1e-3 ? "true" : "false",
        f.errors);
  }
  if (run.hops_early && run.hops_after) {
    const HopFigures& e = *run.hops_early;
    const HopFigures& a = *run.hops_after;
    j += fmt::format(
        ", \"disaggregated\": {{\"early_decode\": {{\"ttft\": {}, \"second_token\": {}, "
        "\"gap\": {}, \"errors\": {}}}, \"after_prefill\": {{\"ttft\": {}, "
        "\"second_token\": {}, \"gap\": {}, \"errors\": {}}}}}",
        summary_json(e.first), summary_json(e.second), summary_json(e.gap), e.errors,
        summary_json(a.first), summary_json(a.second), summary_json(a.gap), a.errors);
  }
  if (run.streams) {
    const auto& s = *run.streams;
    j += fmt::format(
        ", \"streams\": {{\"requested\": {}, \"tokens_each\": {}, \"started\": {}, \"completed\": {}, "
        "\"http_errors\": {}, \"http_statuses\": {}, \"error_events\": {}, \"wrong_tokens\": {}, "
        "\"connect_errors\": {}, \"io_errors\": {}, \"timeouts\": {}, \"peak_open\": {}, "
        "\"peak_connected\": {}, \"all_sent_before_first_done\": {}, \"connect_seconds\": {:.4f}, \"all_open_seconds\": {:.4f}, "
        "\"wall_seconds\": {:.4f}, \"chunks\": {}, \"chunks_per_second\": {:.1f}, "
        "\"router_cpu_seconds\": {:.3f}, \"router_io_thread_cpu_seconds\": {:.3f}, "
        "\"workers_cpu_seconds\": {:.3f}, \"first_error\": {}}}",
        o.streams, o.stream_tokens, s.started, s.completed, s.http_errors,
        cleave::bench::json_string(s.status_counts), s.error_events, s.wrong_tokens,
        s.connect_errors, s.io_errors, s.timeouts, s.peak_open, s.peak_connected,
        s.all_sent_before_first_done ? "true" : "false", s.connect_seconds, s.all_open_seconds,
        s.wall_seconds, s.chunks,
        s.wall_seconds > 0 ? static_cast<double>(s.chunks) / s.wall_seconds : 0.0, run.router_cpu_s,
        run.router_io_cpu_s, run.workers_cpu_s, cleave::bench::json_string(s.first_error));
  }
  j += "}\n";
  return cleave::bench::write_json_file(o.json, j).ok();
}

// Soft RLIMIT_NOFILE up to the hard limit: one socket per stream.
int64_t raise_nofile() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return -1;
  lim.rlim_cur = lim.rlim_max;
  (void)setrlimit(RLIMIT_NOFILE, &lim);
  getrlimit(RLIMIT_NOFILE, &lim);
  return static_cast<int64_t>(lim.rlim_cur);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!fs::exists(o.cleave)) {
    fmt::print(stderr, "router_bench: the cleave binary '{}' is absent (--cleave PATH)\n", o.cleave);
    return 1;
  }
  const int64_t nofile = raise_nofile();
  if (!o.skip_streams && nofile < o.streams + 64) {
    fmt::print(stderr, "router_bench: the open files limit is {}, too low for {} streams (ulimit -Hn)\n",
               nofile, o.streams);
    return 1;
  }
  Run run(o, Clock::now() + std::chrono::seconds(o.deadline_s));
  if (run.start_workers()) {
    run.load_before_ttft = load_average();
    const bool ttft_ok = o.skip_ttft || run.measure_ttft();
    run.load_before_disagg = load_average();
    const bool disagg_ok = !ttft_ok || o.skip_disagg || run.measure_disaggregated();
    run.load_before_streams = load_average();
    if (ttft_ok && disagg_ok && !o.skip_streams) (void)run.measure_streams();
  }
  run.load_after = load_average();
  report(run);
  if (!o.json.empty() && !write_json(run)) {
    fmt::print(stderr, "router_bench: cannot write --json file {}\n", o.json);
    return 1;
  }
  return run.failure.empty() ? 0 : 1;
}
