// Engine bench: prefill and single-sequence decode rates of a model file on the CPU engine, beside
// the floor that memory bandwidth sets for decode (every weight byte read once per token).
//
//   engine_bench --model FILE [--model FILE2 ...] [--threads N] [--prompt-tokens P]
//                [--gen-tokens G] [--repeat R] [--kv-dtype f32,f16,bf16] [--json FILE]
//
// With several models (e.g. one model in F16, Q8_0, Q6_K, Q4_K and Q4_1, made with `cleave
// convert --to gguf --dtype T`), each is measured in turn and a table of every model's decode and
// prefill rate beside its read floor (streaming-read bandwidth / weight bytes per token) ends
// the output; --json then holds one object per line.
//
// The prompt is P deterministic token ids; decode continues greedily for G tokens. A warm-up
// prefill of the whole prompt and one decode step first fault the mmapped weights in and size the
// scratch buffers, so the timings are steady-state rates (as llama-bench's warm-up run does);
// the prefill rate is the mean over R runs of the prompt (default 3, llama-bench's -r).
// --kv-dtype lists KV cache dtypes (engine.kv_dtype): each model is measured with each, and the
// table gives each run's decode rate over the first dtype's for that model (a long prompt,
// e.g. --prompt-tokens 1536, shows what halving the attention reads is worth).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/engine/cpu_kernels.h"
#include "cleave/engine/llama_model.h"
#include "cleave/kvcache/kv_block_pool.h"
#include "cleave/model/dtype.h"
#include "cleave/model/model_file.h"
#include "bench_flags.h"
#include "bench_json.h"
#include "copy_bandwidth.h"

namespace {

struct Options {
  std::vector<std::string> models;
  std::string model;  // the one being measured
  int threads = 0;
  int64_t prompt_tokens = 128;
  int64_t gen_tokens = 64;
  int repeat = 3;
  std::string json;
  std::vector<cleave::DType> kv_dtypes{cleave::DType::kF32};
  cleave::DType kv_dtype = cleave::DType::kF32;  // the one being measured
};

struct Figures {
  double load_s = 0;
  double prefill_tok_s = 0;
  double decode_tok_s = 0;
  uint64_t weight_bytes_per_token = 0;
  double copy_bytes_per_s = 0;
  double read_bytes_per_s = 0;
  double read_floor_tok_s = 0;
  double floor_tok_s = 0;
  double decode_over_floor = 0;
};

constexpr const char* kUsage =
    "usage: engine_bench --model FILE [--model FILE2 ...] [--threads N] [--prompt-tokens P] "
    "[--gen-tokens G] [--repeat R] [--kv-dtype f32,f16,bf16] [--json FILE]";

Options parse(int argc, char** argv) {
  Options o;
  cleave::bench::BenchFlags f("engine_bench", kUsage, argc, argv);
  while (f.next()) {
    if (f.is("--model")) o.models.push_back(f.value());
    else if (f.is("--threads")) o.threads = static_cast<int>(f.integer(0));
    else if (f.is("--prompt-tokens")) o.prompt_tokens = f.integer(1);
    else if (f.is("--gen-tokens")) o.gen_tokens = f.integer(1);
    else if (f.is("--repeat")) o.repeat = static_cast<int>(f.integer(1));
    else if (f.is("--json")) o.json = f.value();
    else if (f.is("--kv-dtype")) {
      o.kv_dtypes.clear();
      for (const std::string& name : f.values()) {
        const auto t = cleave::parse_dtype(name);
        if (!t || (*t != cleave::DType::kF32 && *t != cleave::DType::kF16 &&
                   *t != cleave::DType::kBF16))
          f.fail("--kv-dtype: '" + name + "' is not one of f32, f16, bf16");
        o.kv_dtypes.push_back(*t);
      }
    } else f.unknown();
  }
  if (o.models.empty()) f.fail("--model is required");
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

cleave::Status run(const Options& o, Figures& f) {
  const auto t_load = std::chrono::steady_clock::now();
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::ModelFile> file, cleave::load_model(o.model));
  std::shared_ptr<const cleave::ModelFile> shared(std::move(file));
  cleave::EngineOptions eo;
  eo.threads = o.threads;
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::LlamaModel> model,
                          cleave::LlamaModel::create(shared, eo));
  f.load_s = seconds_since(t_load);

  const auto& cfg = model->config();
  if (o.prompt_tokens + o.gen_tokens > model->max_context())
    return cleave::InvalidArgument(fmt::format(
        "--prompt-tokens {} + --gen-tokens {} exceed the model's context of {} positions",
        o.prompt_tokens, o.gen_tokens, model->max_context()));
  std::vector<int32_t> prompt(static_cast<size_t>(o.prompt_tokens));
  for (int64_t i = 0; i < o.prompt_tokens; ++i)
    prompt[i] = static_cast<int32_t>((i * 7919 + 13) % cfg.vocab_size);
  std::vector<float> logits(static_cast<size_t>(cfg.vocab_size));

  // Same threads as the model, measured while the model is idle.
  const auto bw = cleave::bench::measure_bandwidth(model->pool());
  f.copy_bytes_per_s = bw.copy_bytes_per_s;
  f.read_bytes_per_s = bw.read_bytes_per_s;

  // One sequence in a pool of its own, blocks in order (the layout a fresh pool hands out).
  constexpr int64_t kBlockSize = 16;
  const int64_t blocks = (o.prompt_tokens + o.gen_tokens + kBlockSize - 1) / kBlockSize;
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<cleave::KvBlockPool> kv,
                          cleave::KvBlockPool::create(model->kv_layout(kBlockSize, blocks,
                                                                       o.kv_dtype)));
  std::vector<cleave::BlockId> table;
  CLEAVE_RETURN_IF_ERROR(kv->allocate(blocks, table));

  // warm-up: faults the weights in and sizes the scratch buffers for the whole prompt (its KV is
  // overwritten below)
  CLEAVE_RETURN_IF_ERROR(model->forward(prompt, 0, table, *kv, logits));
  CLEAVE_RETURN_IF_ERROR(model->forward({prompt.data(), 1}, o.prompt_tokens, table, *kv, logits));

  double prefill_s = 0;
  for (int i = 0; i < o.repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    CLEAVE_RETURN_IF_ERROR(model->forward(prompt, 0, table, *kv, logits));
    prefill_s += seconds_since(t0);
  }
  f.prefill_tok_s = static_cast<double>(o.prompt_tokens * o.repeat) / prefill_s;

  int32_t next = argmax(logits);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < o.gen_tokens; ++i) {
    CLEAVE_RETURN_IF_ERROR(model->forward({&next, 1}, o.prompt_tokens + i, table, *kv, logits));
    next = argmax(logits);
  }
  f.decode_tok_s = static_cast<double>(o.gen_tokens) / seconds_since(t0);

  f.weight_bytes_per_token = model->weight_bytes_per_token();
  f.floor_tok_s = f.copy_bytes_per_s / static_cast<double>(f.weight_bytes_per_token);
  f.decode_over_floor = f.decode_tok_s / f.floor_tok_s;
  f.read_floor_tok_s = f.read_bytes_per_s / static_cast<double>(f.weight_bytes_per_token);

  fmt::print("model:                 {}\n", o.model);
  fmt::print("kernels / threads:     {} / {}\n", cleave::cpu::kernel_isa(), model->pool().size());
  fmt::print("kv dtype:              {}\n", cleave::dtype_name(o.kv_dtype));
  fmt::print("load:                  {:.3f} s\n", f.load_s);
  fmt::print("prefill:               {:.1f} tok/s ({} tokens, mean of {} runs)\n", f.prefill_tok_s,
             o.prompt_tokens, o.repeat);
  fmt::print("decode:                {:.1f} tok/s ({} tokens)\n", f.decode_tok_s, o.gen_tokens);
  fmt::print("weight bytes / token:  {} ({:.1f} MiB)\n", f.weight_bytes_per_token,
             static_cast<double>(f.weight_bytes_per_token) / (1 << 20));
  fmt::print("copy bandwidth:        {:.2f} GB/s (bytes copied per second)\n", f.copy_bytes_per_s / 1e9);
  fmt::print("bandwidth floor:       {:.1f} tok/s (copy bandwidth / weight bytes per token)\n",
             f.floor_tok_s);
  fmt::print("decode / floor:        {:.3f}\n", f.decode_over_floor);
  fmt::print("read bandwidth:        {:.2f} GB/s (streaming read; stricter floor {:.1f} tok/s, "
             "decode / read floor {:.3f})\n",
             f.read_bytes_per_s / 1e9, f.read_floor_tok_s, f.decode_tok_s / f.read_floor_tok_s);

  if (!o.json.empty()) {
    const bool first = o.model == o.models.front() && o.kv_dtype == o.kv_dtypes.front();
    return cleave::bench::write_json_file(o.json, fmt::format(
               "{{\"model\": {}, \"kv_dtype\": \"{}\", \"kernels\": \"{}\", \"threads\": {}, "
               "\"prompt_tokens\": {}, "
               "\"gen_tokens\": {}, \"load_seconds\": {:.6f}, \"prefill_tokens_per_s\": {:.3f}, "
               "\"decode_tokens_per_s\": {:.3f}, \"weight_bytes_per_token\": {}, "
               "\"copy_bandwidth_bytes_per_s\": {:.0f}, \"bandwidth_floor_tokens_per_s\": {:.3f}, "
               "\"decode_over_floor\": {:.4f}, \"read_bandwidth_bytes_per_s\": {:.0f}}}\n",
               cleave::bench::json_string(o.model), cleave::dtype_name(o.kv_dtype),
               cleave::cpu::kernel_isa(), model->pool().size(), o.prompt_tokens,
               o.gen_tokens, f.load_s, f.prefill_tok_s, f.decode_tok_s,
               f.weight_bytes_per_token, f.copy_bytes_per_s, f.floor_tok_s,
               f.decode_over_floor, f.read_bytes_per_s), !first);
  }
  return cleave::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  struct Run {
    std::string model;
    cleave::DType kv_dtype;
    Figures f;
  };
  std::vector<Run> all;
  for (const std::string& m : o.models) {
    for (cleave::DType kv : o.kv_dtypes) {
      o.model = m;
      o.kv_dtype = kv;
      Figures f;
      const cleave::Status st = run(o, f);
      if (!st.ok()) {
        fmt::print(stderr, "engine_bench: {}\n", st.to_string());
        return 1;
      }
      all.push_back({m, kv, f});
      fmt::print("\n");
    }
  }
  if (all.size() > 1) {
    fmt::print("{:<44} {:>4} {:>9} {:>12} {:>12} {:>12} {:>10} {:>12}\n", "model", "kv", "MiB/tok",
               "decode tok/s", "read floor", "decode/floor", "prefill", "decode/kv[0]");
    for (const Run& r : all) {
      const Figures& f = r.f;
      const auto first = std::find_if(all.begin(), all.end(),
                                      [&](const Run& x) { return x.model == r.model; });
      fmt::print("{:<44} {:>4} {:>9.1f} {:>12.1f} {:>12.1f} {:>12.3f} {:>10.1f} {:>12.3f}\n",
                 r.model, cleave::dtype_name(r.kv_dtype),
                 static_cast<double>(f.weight_bytes_per_token) / (1 << 20), f.decode_tok_s,
                 f.read_floor_tok_s, f.decode_tok_s / f.read_floor_tok_s, f.prefill_tok_s,
                 f.decode_tok_s / first->f.decode_tok_s);
    }
  }
  return 0;
}
