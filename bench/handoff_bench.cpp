// Handoff bench: how much of the KV transfer a prefill hides behind its compute.
//
//   handoff_bench [--cleave PATH] [--model FILE] [--provider P] [--prompt-tokens N] [--runs R]
//                 [--threads T] [--max-tokens-per-step S] [--transfer-iters I] [--json FILE]
//                 [--keep-model]
//
// Starts a prefill and a decode `cleave worker` process on 127.0.0.1 (provider P, default
// tcp;ofi_rxm; the cleave binary defaults to ../bin/cleave beside this bench) on a synthetic
// ~28M-parameter Llama (8 layers, dim 512, 8 heads, 4 KV heads, FFN 1408, vocab 4096, f16;
// written to a temp file unless --model) and measures, for an N-token prompt (default 2,048):
//   ttft_seconds                 Reserve -> Prefill -> first token through the router's
//                                dispatcher over the pair (router/run_request.h)
//   kv_tail_seconds              as the prefill reports it: end of the last layer's compute ->
//                                the notice placed at the decode worker
//   transfer_one_layer_seconds   one layer's KV blocks of the prompt, written by this process
//                                into a reservation of the same decode worker over the same
//                                provider (same write plan as the prefill: plan_kv_writes)
//   transfer_all_layers_seconds  every layer's blocks in one batch
// and the ratios tail / one layer (about 1 when the transfer overlaps compute) and all / one
// layer (about n_layers). The prompt runs as one engine step by default (S = N), so the last
// layer's writes cover the whole prompt. Medians over R runs (default 3) and I transfer
// iterations (default 5); prefix caching is off so that every run computes its prompt.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "bench_json.h"
#include "cleave/common/status.h"
#include "cleave/model/model_file.h"
#include "cleave/model/synth.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/run_request.h"
#include "cleave/transfer/transfer_engine.h"
#include "cleave/worker/kv_export.h"
#include "cleave/worker/proto_convert.h"
#include "cleave/worker/worker_client.h"
#include "worker_process.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using cleave::Result;
using cleave::Status;

struct Options {
  std::string cleave;
  std::string model;
  std::string provider = "tcp;ofi_rxm";
  int64_t prompt_tokens = 2048;
  int64_t runs = 3;
  int64_t threads = 0;
  int64_t max_tokens_per_step = 0;  // 0: the prompt length
  int64_t transfer_iters = 5;
  std::string json;
  bool keep_model = false;
};

constexpr const char* kUsage =
    "usage: handoff_bench [--cleave PATH] [--model FILE] [--provider P] "
    "[--prompt-tokens N] [--runs R] [--threads T] [--max-tokens-per-step S] "
    "[--transfer-iters I] [--json FILE] [--keep-model]";

Options parse(int argc, char** argv) {
  Options o;
  cleave::bench::BenchFlags f("handoff_bench", kUsage, argc, argv);
  while (f.next()) {
    if (f.is("--cleave")) o.cleave = f.value();
    else if (f.is("--model")) o.model = f.value();
    else if (f.is("--provider")) o.provider = f.value();
    else if (f.is("--prompt-tokens")) o.prompt_tokens = f.integer(16);
    else if (f.is("--runs")) o.runs = f.integer(1);
    else if (f.is("--threads")) o.threads = f.integer(0);
    else if (f.is("--max-tokens-per-step")) o.max_tokens_per_step = f.integer(1);
    else if (f.is("--transfer-iters")) o.transfer_iters = f.integer(1);
    else if (f.is("--json")) o.json = f.value();
    else if (f.is("--keep-model")) o.keep_model = true;
    else f.unknown();
  }
  if (o.cleave.empty()) {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    o.cleave = (self.parent_path().parent_path() / "bin" / "cleave").string();
  }
  if (o.max_tokens_per_step == 0) o.max_tokens_per_step = o.prompt_tokens;
  return o;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Sum and count of a histogram family (all label sets) in Prometheus text.
struct HistogramTotals {
  double sum = 0;
  double count = 0;
};
HistogramTotals histogram_totals(const std::string& text, const std::string& name) {
  HistogramTotals t;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    for (auto [suffix, field] : {std::pair{"_sum", &t.sum}, std::pair{"_count", &t.count}}) {
      const std::string key = name + suffix;
      if (line.rfind(key, 0) != 0) continue;
      const char next = line.size() > key.size() ? line[key.size()] : '\0';
      if (next != ' ' && next != '{') continue;
      *field += std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr);
    }
  }
  return t;
}

struct TransferFigures {
  double one_layer_s = 0;
  double all_layers_s = 0;
  uint64_t one_layer_bytes = 0;
  uint64_t all_layers_bytes = 0;
};

// Writes the prompt's KV blocks from a local buffer into a reservation of the decode worker,
// one layer per batch and then all layers in one batch, with the prefill's write plan.
Result<TransferFigures> measure_transfer(const Options& o, cleave::WorkerClient& decode,
                                         cleave::RequestId id) {
  cleave::TransferSettings ts;
  ts.provider = o.provider;
  ts.node = "127.0.0.1";
  CLEAVE_ASSIGN_OR_RETURN(auto engine, cleave::transfer::TransferEngine::create(ts, true));
  CLEAVE_ASSIGN_OR_RETURN(cleave::v1::KvDestination wire,
                          decode.reserve(id, o.prompt_tokens, std::chrono::seconds(120)));
  CLEAVE_ASSIGN_OR_RETURN(cleave::KvDestination dest, cleave::from_proto(wire));
  cleave::KvLayout local = dest.layout;
  local.num_blocks = static_cast<int64_t>(dest.blocks.size());
  std::vector<std::byte> buffer(local.total_bytes());
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= buffer.size(); i += 4096) {
    const uint64_t v = rng();
    std::memcpy(buffer.data() + i, &v, 8);
  }
  CLEAVE_ASSIGN_OR_RETURN(cleave::transfer::MemoryRegion region,
                          engine->register_memory(buffer.data(), buffer.size(),
                                                  cleave::transfer::MemoryKind::host()));
  CLEAVE_ASSIGN_OR_RETURN(uint64_t peer, engine->connect(dest.transfer_address));
  std::vector<cleave::BlockId> local_blocks(dest.blocks.size());
  for (size_t i = 0; i < local_blocks.size(); ++i) local_blocks[i] = static_cast<cleave::BlockId>(i);

  auto run_batch = [&](int64_t first_layer, int64_t layers, uint64_t* bytes) -> Result<double> {
    cleave::transfer::Batch batch;
    batch.peer = peer;
    for (int64_t l = first_layer; l < first_layer + layers; ++l) {
      cleave::plan_kv_writes(local, region.id, local_blocks, dest.layout, dest.region, dest.blocks,
                             l, 0, o.prompt_tokens, batch.writes);
    }
    *bytes = 0;
    for (const auto& w : batch.writes) *bytes += w.len;
    const auto t0 = Clock::now();
    CLEAVE_ASSIGN_OR_RETURN(cleave::transfer::TransferHandle h, engine->submit(batch));
    CLEAVE_RETURN_IF_ERROR(h.wait(std::chrono::seconds(30)));
    return seconds_since(t0);
  };

  TransferFigures f;
  std::vector<double> one, all;
  Status failed;
  for (int64_t it = 0; it < o.transfer_iters && failed.ok(); ++it) {
    for (int64_t l = 0; l < local.n_layers; ++l) {
      auto s = run_batch(l, 1, &f.one_layer_bytes);
      if (!s.ok()) {
        failed = s.status();
        break;
      }
      one.push_back(*s);
    }
    if (!failed.ok()) break;
    auto s = run_batch(0, local.n_layers, &f.all_layers_bytes);
    if (!s.ok()) failed = s.status();
    else all.push_back(*s);
  }
  auto released = decode.release(id);
  if (!released.ok()) fmt::print(stderr, "handoff_bench: release: {}\n", released.status().to_string());
  CLEAVE_RETURN_IF_ERROR(failed);
  CLEAVE_RETURN_IF_ERROR(engine->deregister(region.id));
  f.one_layer_s = median(one);
  f.all_layers_s = median(all);
  return f;
}

Status run(const Options& o) {
  if (!fs::exists(o.cleave)) {
    return cleave::NotFound(fmt::format("the cleave binary '{}' is absent (--cleave PATH)", o.cleave));
  }
  std::string model_path = o.model;
  fs::path temp_dir;
  if (model_path.empty()) {
    temp_dir = fs::temp_directory_path() / fmt::format("cleave-handoff-bench-{}", ::getpid());
    fs::create_directories(temp_dir);
    model_path = (temp_dir / "synth-28m.gguf").string();
    cleave::SynthOptions s;
    s.layers = 8;
    s.dim = 512;
    s.heads = 8;
    s.kv_heads = 4;
    s.ffn = 1408;
    s.vocab = 4096;
    s.context = std::max<int64_t>(4096, o.prompt_tokens + 64);
    s.seed = 1;
    CLEAVE_RETURN_IF_ERROR(cleave::write_synth_model(s, model_path));
  }
  struct Cleanup {
    fs::path dir;
    bool keep;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty() && !keep) fs::remove_all(dir, ec);
    }
  } cleanup{temp_dir, o.keep_model};

  const std::vector<std::string> settings = {
      "transfer.provider=" + o.provider, "transfer.node=127.0.0.1", "log.level=warn",
      fmt::format("engine.threads={}", o.threads),
      fmt::format("engine.max_tokens_per_step={}", o.max_tokens_per_step),
      "engine.prefix_caching=false"};
  std::string error;
  auto prefill_proc = cleave::worker_testing::WorkerProcess::start(
      {o.cleave, "prefill", "bench-prefill", model_path, settings}, std::chrono::seconds(120), &error);
  if (!prefill_proc) return cleave::Unavailable(error);
  auto decode_proc = cleave::worker_testing::WorkerProcess::start(
      {o.cleave, "decode", "bench-decode", model_path, settings}, std::chrono::seconds(120), &error);
  if (!decode_proc) return cleave::Unavailable(error);

  cleave::WorkerClientOptions co;
  co.prefill_timeout = std::chrono::minutes(10);
  CLEAVE_ASSIGN_OR_RETURN(auto prefill, cleave::WorkerClient::connect(prefill_proc->address(), co));
  CLEAVE_ASSIGN_OR_RETURN(auto decode, cleave::WorkerClient::connect(decode_proc->address(), co));
  // The requests go through the router's dispatcher over this one pair (one attempt each).
  cleave::router::DispatcherOptions dopts;
  dopts.mode = cleave::router::DispatchMode::kDisaggregated;
  dopts.prefill.workers = {prefill_proc->address()};
  dopts.decode.workers = {decode_proc->address()};
  dopts.max_attempts = 1;
  dopts.lease = std::chrono::minutes(10);
  dopts.timeouts.prefill = std::chrono::minutes(10);
  CLEAVE_ASSIGN_OR_RETURN(auto dispatcher, cleave::router::make_dispatcher(dopts));
  CLEAVE_RETURN_IF_ERROR(cleave::router::wait_until_ready(*dispatcher, std::chrono::seconds(10)));
  CLEAVE_ASSIGN_OR_RETURN(cleave::v1::WorkerInfo info, decode->info());
  const int64_t n_layers = info.kv_layout().n_layers();

  CLEAVE_ASSIGN_OR_RETURN(auto file, cleave::load_model(model_path));
  const int64_t vocab = file->config().vocab_size;
  uint64_t params = 0;
  for (const auto& [name, t] : file->tensors()) {
    uint64_t e = 1;
    for (int64_t d : t.shape) e *= static_cast<uint64_t>(d);
    params += e;
  }

  // A short request first: pages the weights in on both workers and connects the pair.
  cleave::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 2;
  sp.ignore_eos = true;
  auto ignore = [](const cleave::v1::TokenEvent&) { return true; };
  CLEAVE_RETURN_IF_ERROR(
      cleave::router::run_request(*dispatcher, {{1, 2, 3, 4, 5, 6, 7, 8}, sp}, ignore).status());

  std::vector<double> ttft, tail;
  uint64_t kv_bytes = 0;
  std::mt19937 rng(42);
  for (int64_t r = 0; r < o.runs; ++r) {
    std::vector<int32_t> prompt(static_cast<size_t>(o.prompt_tokens));
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab - 2));
    CLEAVE_ASSIGN_OR_RETURN(cleave::router::RequestOutcome out,
                            cleave::router::run_request(*dispatcher, {prompt, sp}, ignore));
    if (!out.handed_off) return cleave::Internal("the request ended with its first token");
    ttft.push_back(out.ttft_seconds);
    tail.push_back(out.kv_tail_seconds);
    kv_bytes = out.kv_bytes;
    fmt::print(stderr, "handoff_bench: run {}: ttft {:.4f} s, kv tail {:.6f} s, {} KV bytes\n", r,
               out.ttft_seconds, out.kv_tail_seconds, out.kv_bytes);
  }
  CLEAVE_ASSIGN_OR_RETURN(TransferFigures xfer, measure_transfer(o, *decode, 1000));
  CLEAVE_ASSIGN_OR_RETURN(std::string metrics_text, prefill->metrics());
  const HistogramTotals hist = histogram_totals(metrics_text, "cleave:kv_handoff_tail_seconds");

  const double ttft_s = median(ttft);
  const double tail_s = median(tail);
  const double tail_ratio = xfer.one_layer_s > 0 ? tail_s / xfer.one_layer_s : 0;
  const double all_ratio = xfer.one_layer_s > 0 ? xfer.all_layers_s / xfer.one_layer_s : 0;
  fmt::print("handoff_bench: provider {}, {:.1f}M params, {} layers, prompt {} tokens, step {} "
             "tokens, {} runs\n",
             o.provider, static_cast<double>(params) / 1e6, n_layers, o.prompt_tokens,
             o.max_tokens_per_step, o.runs);
  fmt::print("ttft_seconds                 {:.4f}\n", ttft_s);
  fmt::print("kv_tail_seconds              {:.6f}\n", tail_s);
  fmt::print("kv_bytes                     {}\n", kv_bytes);
  fmt::print("transfer_one_layer_seconds   {:.6f}  ({} bytes)\n", xfer.one_layer_s, xfer.one_layer_bytes);
  fmt::print("transfer_all_layers_seconds  {:.6f}  ({} bytes)\n", xfer.all_layers_s, xfer.all_layers_bytes);
  fmt::print("tail_over_one_layer          {:.2f}  (n_layers {})\n", tail_ratio, n_layers);
  fmt::print("all_layers_over_one_layer    {:.2f}\n", all_ratio);
  fmt::print("metric kv_handoff_tail       count {:.0f}, mean {:.6f} s\n", hist.count,
             hist.count > 0 ? hist.sum / hist.count : 0.0);

  if (!o.json.empty()) {
    return cleave::bench::write_json_file(o.json, fmt::format(
               "{{\"provider\": {}, \"params\": {}, \"n_layers\": {}, \"prompt_tokens\": {}, "
               "\"max_tokens_per_step\": {}, \"runs\": {}, \"ttft_seconds\": {}, "
               "\"kv_tail_seconds\": {}, \"kv_bytes\": {}, \"transfer_one_layer_seconds\": {}, "
               "\"transfer_all_layers_seconds\": {}, \"tail_over_one_layer\": {}, "
               "\"all_layers_over_one_layer\": {}}}\n",
               cleave::bench::json_string(o.provider), params, n_layers, o.prompt_tokens,
               o.max_tokens_per_step, o.runs, ttft_s, tail_s, kv_bytes, xfer.one_layer_s,
               xfer.all_layers_s, tail_ratio, all_ratio));
  }
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  const Status st = run(parse(argc, argv));
  if (!st.ok()) {
    fmt::print(stderr, "handoff_bench: {}\n", st.to_string());
    return 1;
  }
  return 0;
}
