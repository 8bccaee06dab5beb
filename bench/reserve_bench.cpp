// Reserve bench: how long a decode worker's KV reservation takes while its engine is busy
// decoding, beside the engine's own step time measured in the same run.
//
//   reserve_bench --model FILE [--threads N] [--streams S] [--reserves R] [--prompt-tokens P]
//                 [--json FILE]
//
// S requests (default 8) of P deterministic prompt tokens (default 32) decode greedily on one
// engine loop (ignore_eos, long enough to outlast the measurement) while another thread asks
// for R reservations (default 200) of P tokens, one at a time, at random moments (0-2 ms apart,
// so that they land in every phase of a step), and gives each back at once. Reported: the
// reservation's latency (reserve() called -> blocks in hand: mean, p50, p90, p99), the mean step
// time (forward passes / time in them, and wall time per step), and latency / step. A reservation
// that waits for the engine's next iteration costs about half a step on average; one made at
// once costs microseconds.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_flags.h"
#include "bench_json.h"
#include "cleave/common/status.h"
#include "cleave/engine/llama_model.h"
#include "cleave/model/model_file.h"
#include "cleave/model/tokenizer.h"
#include "cleave/worker/engine_loop.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model, json;
  int threads = 0;
  int64_t streams = 8, reserves = 200, prompt_tokens = 32;
};

double pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i =
      std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * static_cast<double>(v.size())));
  return v[i];
}

cleave::Status run(const Options& o) {
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::ModelFile> file, cleave::load_model(o.model));
  std::shared_ptr<const cleave::ModelFile> shared(std::move(file));
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::Tokenizer> tok,
                          cleave::Tokenizer::create(shared->tokenizer()));
  cleave::EngineOptions eo;
  eo.threads = o.threads;
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::LlamaModel> model,
                          cleave::LlamaModel::create(shared, eo));
  const int64_t vocab = model->config().vocab_size;
  // Long enough to outlast the measurement (R reservations ~1 ms apart, at least one step each).
  const int64_t gen =
      std::min<int64_t>(model->max_context() - o.prompt_tokens - 1, 4 * o.reserves + 64);
  cleave::EngineLoopOptions lo;
  lo.block_size = 16;
  lo.num_blocks = (o.prompt_tokens + gen + 15) / 16 * o.streams + (o.prompt_tokens + 15) / 16 + 4;
  lo.scheduler.max_num_seqs = o.streams;
  lo.scheduler.max_tokens_per_step = std::max<int64_t>(o.streams * o.prompt_tokens, 256);
  lo.scheduler.prefix_caching = false;
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::EngineLoop> engine,
                          cleave::EngineLoop::create(std::move(model), std::move(tok), lo));

  std::atomic<int64_t> first_tokens{0};
  std::vector<char> started(static_cast<size_t>(o.streams), 0);  // on the engine thread only
  for (int64_t s = 0; s < o.streams; ++s) {
    cleave::EngineRequest r;
    r.id = static_cast<cleave::RequestId>(s + 1);
    r.prompt.resize(static_cast<size_t>(o.prompt_tokens));
    for (int64_t i = 0; i < o.prompt_tokens; ++i)
      r.prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + s * 104729 + 13) % vocab);
    r.params.temperature = 0;
    r.params.max_tokens = gen;
    r.params.ignore_eos = true;
    CLEAVE_RETURN_IF_ERROR(engine->submit(std::move(r), [&, s](const cleave::EngineEvent& ev) {
      if (ev.has_token && !started[static_cast<size_t>(s)]) {
        started[static_cast<size_t>(s)] = 1;
        first_tokens.fetch_add(1);
      }
    }));
  }
  while (first_tokens.load() < o.streams) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Every stream decodes now: the measurement window.
  const cleave::EngineStats before = engine->stats();
  const auto t0 = Clock::now();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> gap_us(0, 2000);
  std::vector<double> ms;
  for (int64_t k = 0; k < o.reserves; ++k) {
    std::this_thread::sleep_for(std::chrono::microseconds(gap_us(rng)));
    const cleave::RequestId id = 1'000'000 + static_cast<cleave::RequestId>(k);
    const auto a = Clock::now();
    auto blocks = engine->reserve(id, o.prompt_tokens, std::chrono::seconds(30));
    const auto b = Clock::now();
    if (!blocks.ok()) return blocks.status();
    ms.push_back(std::chrono::duration<double, std::milli>(b - a).count());
    (void)engine->release_reservation(id);
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const cleave::EngineStats after = engine->stats();
  for (int64_t s = 0; s < o.streams; ++s) engine->cancel(static_cast<cleave::RequestId>(s + 1));
  const double passes = static_cast<double>(after.forward_passes - before.forward_passes);
  const double forward_ms =
      passes > 0 ? (after.forward_seconds - before.forward_seconds) * 1e3 / passes : 0;
  const double step_ms = passes > 0 ? wall * 1e3 / passes : 0;
  double mean = 0;
  for (double v : ms) mean += v;
  mean /= static_cast<double>(ms.size());
  fmt::print("model: {}, {} streams decoding, {} reservations of {} tokens\n", o.model, o.streams,
             o.reserves, o.prompt_tokens);
  fmt::print("step: {:.3f} ms wall, {:.3f} ms in forward ({} steps)\n", step_ms, forward_ms,
             static_cast<int64_t>(passes));
  fmt::print("reserve latency: mean {:.3f} ms, p50 {:.3f}, p90 {:.3f}, p99 {:.3f}, max {:.3f}\n",
             mean, pct(ms, 50), pct(ms, 90), pct(ms, 99), pct(ms, 100));
  fmt::print("reserve / step: mean {:.3f}, p99 {:.3f}\n", step_ms > 0 ? mean / step_ms : 0,
             step_ms > 0 ? pct(ms, 99) / step_ms : 0);
  if (!o.json.empty()) {
    return cleave::bench::write_json_file(o.json, fmt::format(
               "{{\"model\": {}, \"streams\": {}, \"reserves\": {}, \"step_ms\": {:.4f}, "
               "\"forward_ms\": {:.4f}, \"reserve_mean_ms\": {:.4f}, \"reserve_p50_ms\": {:.4f}, "
               "\"reserve_p99_ms\": {:.4f}, \"reserve_over_step\": {:.4f}}}\n",
               cleave::bench::json_string(o.model), o.streams, o.reserves, step_ms, forward_ms,
               mean, pct(ms, 50), pct(ms, 99), step_ms > 0 ? mean / step_ms : 0));
  }
  return cleave::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  cleave::bench::BenchFlags f("reserve_bench",
                              "usage: reserve_bench --model FILE [--threads N] [--streams S] "
                              "[--reserves R] [--prompt-tokens P] [--json FILE]",
                              argc, argv);
  while (f.next()) {
    if (f.is("--model")) {
      o.model = f.value();
    } else if (f.is("--threads")) {
      o.threads = static_cast<int>(f.integer(0));
    } else if (f.is("--streams")) {
      o.streams = f.integer(1);
    } else if (f.is("--reserves")) {
      o.reserves = f.integer(1);
    } else if (f.is("--prompt-tokens")) {
      o.prompt_tokens = f.integer(1);
    } else if (f.is("--json")) {
      o.json = f.value();
    } else {
      f.unknown();
    }
  }
  if (o.model.empty()) f.fail("--model is required");
  const cleave::Status st = run(o);
  if (!st.ok()) {
    fmt::print(stderr, "reserve_bench: {}\n", st.to_string());
    return 1;
  }
  return 0;
}
