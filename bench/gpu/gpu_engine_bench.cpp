// The CUDA engine's decode step beside the floor that HBM bandwidth sets, on a synthetic
// ~1B-parameter bf16 Llama (Llama-3.2-1B's shape: 16 layers, dim 2048, 32 heads, 8 KV heads of
// 64, FFN 8192; a 32K vocabulary), bf16 KV cache.
//
// For batch 1, 16 and 64: every sequence is prefilled with --context tokens, then --steps decode
// steps run for the whole batch (forward_batch with logits to the host, as the engine loop runs
// them); the median step time is compared with the floor: (weight bytes + the K/V bytes the
// step's attention reads) / --hbm-tbps (4.8 TB/s for an H200). A device-to-device copy measures
// what the card moves in this run, as a second reference. Prefill tokens/s of one sequence are
// printed too. Exits 77 without a CUDA device.
//
// Usage: gpu_engine_bench [--hbm-tbps 4.8] [--context 256] [--steps 24] [--dir /tmp]
//                         [--batches 1,16,64] [--extras 1]
// --extras 0 skips the runs without graphs and with the per-operation profile (for a profiler).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "cleave/engine/llama_model.h"
#include "cleave/model/model_file.h"
#include "cleave/model/synth.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void die(const cleave::Status& s, const char* what) {
  std::fprintf(stderr, "gpu_engine_bench: %s: %s\n", what, s.to_string().c_str());
  std::exit(1);
}

// Device-to-device copy rate (bytes read + bytes written per second), median of 10.
double copy_bytes_per_s() {
  const size_t n = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) return 0;
  cudaMemset(a, 1, n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(e0);
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 2) ms.push_back(t);
  }
  cudaFree(a);
  cudaFree(b);
  std::sort(ms.begin(), ms.end());
  return 2.0 * static_cast<double>(n) / (ms[ms.size() / 2] * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  double tbps = 4.8;
  int64_t context = 256, steps = 24;
  std::string dir = std::filesystem::temp_directory_path().string();
  std::vector<int64_t> batches{1, 16, 64};
  bool extras = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--hbm-tbps") tbps = std::atof(argv[i + 1]);
    else if (f == "--context") context = std::atoll(argv[i + 1]);
    else if (f == "--steps") steps = std::atoll(argv[i + 1]);
    else if (f == "--dir") dir = argv[i + 1];
    else if (f == "--extras") extras = std::atoi(argv[i + 1]) != 0;
    else if (f == "--batches") {
      batches.clear();
      for (const char* p = argv[i + 1]; *p;) {
        char* end = nullptr;
        const long long b = std::strtoll(p, &end, 10);
        if (end == p || b < 1) {
          std::fprintf(stderr, "gpu_engine_bench: bad --batches '%s'\n", argv[i + 1]);
          return 2;
        }
        batches.push_back(b);
        p = *end == ',' ? end + 1 : end;
      }
    }
    else {
      std::fprintf(stderr, "gpu_engine_bench: unknown flag '%s'\n", f.c_str());
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  if (context < 1 || steps < 3) {
    std::fprintf(stderr, "gpu_engine_bench: --context must be >= 1 and --steps >= 3\n");
    return 2;
  }
  cleave::SynthOptions so;
  so.layers = 16;
  so.dim = 2048;
  so.heads = 32;
  so.kv_heads = 8;
  so.ffn = 8192;
  so.vocab = 32768;
  so.dtype = cleave::DType::kBF16;
  so.context = 4096;
  so.seed = 1;
  const std::string path = dir + "/cleave-bench-1b-bf16.gguf";
  auto t0 = Clock::now();
  if (!std::filesystem::exists(path)) {
    if (auto s = cleave::write_synth_model(so, path); !s.ok()) die(s, "synthesizing the model");
  }
  const double synth_s = seconds_since(t0);
  auto loaded = cleave::load_model(path);
  if (!loaded.ok()) die(loaded.status(), "loading the model");
  std::shared_ptr<const cleave::ModelFile> file(std::move(*loaded));
  cleave::EngineOptions eo;
  eo.device = "cuda";
  eo.max_context = context + steps + 16;
  eo.max_batch_tokens = 2048;
  t0 = Clock::now();
  auto created = cleave::LlamaModel::create(file, eo);
  if (!created.ok()) die(created.status(), "creating the model");
  cleave::LlamaModel* mp = created->get();
  const double upload_s = seconds_since(t0);
  const auto& cfg = mp->config();
  const double weight_bytes = static_cast<double>(mp->weight_bytes_per_token());
  const double copy = copy_bytes_per_s();
  std::printf("model: %.2f B parameters of bf16 (%.2f GB per step), synthesized in %.1f s, "
              "uploaded in %.1f s; device copy %.2f TB/s (read + write)\n",
              weight_bytes / 2e9, weight_bytes / 1e9, synth_s, upload_s, copy / 1e12);

  const int64_t bs = 16;
  const int64_t kv_dim = cfg.n_kv_heads * cfg.head_dim;
  std::vector<float> scratch(static_cast<size_t>(cfg.vocab_size));
  struct Row {
    int64_t batch;
    double step_ms, floor_ms, copy_floor_ms;
  };
  std::vector<Row> rows;
  double prefill_tok_s = 0;
  // Median decode step of `batch` sequences on `model` (prefilled first).
  auto measure = [&](cleave::LlamaModel& model, int64_t batch) -> Row {
    const int64_t per_seq = (context + steps + bs) / bs;
    auto kv = model.create_kv_pool(bs, batch * per_seq, cleave::DType::kBF16);
    if (!kv.ok()) die(kv.status(), "creating the KV pool");
    std::vector<std::vector<cleave::BlockId>> tables(static_cast<size_t>(batch));
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
    std::vector<std::vector<float>> logits(static_cast<size_t>(batch),
                                           std::vector<float>(static_cast<size_t>(cfg.vocab_size)));
    for (int64_t s = 0; s < batch; ++s) {
      if (auto st = (*kv)->allocate(per_seq, tables[s]); !st.ok()) die(st, "allocating blocks");
      for (int64_t i = 0; i < context; ++i) {
        prompts[s].push_back(static_cast<int32_t>((s * 7919 + i * 104729) % cfg.vocab_size));
      }
    }
    // Prefill, one sequence at a time (the first one timed).
    for (int64_t s = 0; s < batch; ++s) {
      t0 = Clock::now();
      if (auto st = model.forward(prompts[s], 0, tables[s], **kv, logits[s]); !st.ok()) {
        die(st, "prefill");
      }
      if (batch == 1) prefill_tok_s = static_cast<double>(context) / seconds_since(t0);
    }
    (void)model.backend().profile_report(true);  // the decode steps alone
    std::vector<int32_t> next(static_cast<size_t>(batch));
    std::vector<cleave::BatchSequence> seqs(static_cast<size_t>(batch));
    std::vector<double> ms;
    for (int64_t i = 0; i < steps; ++i) {
      for (int64_t s = 0; s < batch; ++s) {
        next[s] = static_cast<int32_t>(
            std::max_element(logits[s].begin(), logits[s].end()) - logits[s].begin());
        seqs[s] = cleave::BatchSequence{.tokens = {&next[s], 1}, .start_pos = context + i,
                                        .block_table = tables[s], .logits = logits[s]};
      }
      t0 = Clock::now();
      if (auto st = model.forward_batch(seqs, **kv); !st.ok()) die(st, "decode step");
      if (i >= 2) ms.push_back(seconds_since(t0) * 1e3);
    }
    std::sort(ms.begin(), ms.end());
    // Attention reads each sequence's K and V rows (bf16) of every layer once.
    const double kv_bytes = static_cast<double>(batch) * (context + steps / 2) * cfg.n_layers *
                            2.0 * static_cast<double>(kv_dim) * 2.0;
    const double bytes = weight_bytes + kv_bytes;
    return Row{batch, ms[ms.size() / 2], bytes / (tbps * 1e12) * 1e3,
               copy > 0 ? bytes / (copy / 2) * 1e3 : 0};
  };
  for (int64_t batch : batches) rows.push_back(measure(*mp, batch));
  Row eager1{};
  std::string profile;
  if (extras) {
    // The same model with every launch issued by the host (no recorded steps): what CUDA graphs
    // save per step.
    setenv("CLEAVE_CUDA_GRAPHS", "0", 1);
    auto eager = cleave::LlamaModel::create(file, eo);
    unsetenv("CLEAVE_CUDA_GRAPHS");
    // And once more with every operation timed between events (no graphs): where a step goes.
    setenv("CLEAVE_CUDA_PROFILE", "1", 1);
    auto profiled = cleave::LlamaModel::create(file, eo);
    unsetenv("CLEAVE_CUDA_PROFILE");
    if (!profiled.ok()) die(profiled.status(), "creating the model");
    if (!eager.ok()) die(eager.status(), "creating the model");
    eager1 = measure(**eager, 1);
    eager->reset();
    (void)measure(**profiled, 1);
    profile = (*profiled)->backend().profile_report(false);
  }
  std::printf("\nprefill, one sequence of %lld tokens: %.0f tokens/s\n",
              static_cast<long long>(context), prefill_tok_s);
  std::printf("decode step at context %lld (median of %lld steps; floor = bytes / %.2f TB/s; "
              "copy floor = bytes / measured copy read rate)\n",
              static_cast<long long>(context), static_cast<long long>(steps - 2), tbps);
  std::printf("%-6s %10s %12s %10s %9s %14s\n", "batch", "step ms", "tokens/s", "floor ms",
              "x floor", "x copy floor");
  for (const Row& r : rows) {
    std::printf("%-6lld %10.3f %12.0f %10.3f %9.2f %14.2f\n", static_cast<long long>(r.batch),
                r.step_ms, static_cast<double>(r.batch) * 1e3 / r.step_ms, r.floor_ms,
                r.step_ms / r.floor_ms, r.copy_floor_ms > 0 ? r.step_ms / r.copy_floor_ms : 0.0);
  }
  if (extras) {
    std::printf("\nbatch 1 decode steps, each operation between events (host launch gaps "
                "included):\n%s",
                profile.c_str());
    std::printf("batch 1 without CUDA graphs: %.3f ms per step (%.2f x floor)\n", eager1.step_ms,
                eager1.step_ms / eager1.floor_ms);
  }
  return 0;
}
