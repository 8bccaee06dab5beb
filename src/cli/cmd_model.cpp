// `cleave model synth`: write a synthetic Llama GGUF (deterministic random weights, byte-level BPE
// tokenizer) for benchmarks and tests.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cleave/model/synth.h"
#include "commands.h"
#include "fmt/format.h"

namespace cleave::cli {
namespace {

struct SynthFlags {
  SynthOptions opts;
  std::string dtype = "f16";
  std::string out;
  bool tied = false;
};

int run_synth(const SynthFlags& f) {
  SynthOptions o = f.opts;
  auto dt = parse_dtype(f.dtype);
  if (!dt) {
    std::fprintf(stderr,
                 "cleave model synth: --dtype '%s' is not one of f32, f16, bf16, q8_0, q4_0, "
                 "q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k\n",
                 f.dtype.c_str());
    return 2;
  }
  o.dtype = *dt;
  o.tied_embeddings = f.tied;
  if (auto err = validate_synth_options(o); !err.empty()) {
    std::fprintf(stderr, "cleave model synth: %s\n", err.c_str());
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  Status st = write_synth_model(o, f.out);
  if (!st.ok()) {
    std::fprintf(stderr, "cleave model synth: %s\n", st.to_string().c_str());
    return 1;
  }
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(f.out, ec);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "cleave model synth: wrote %s (%llu bytes, %.2f s)\n", f.out.c_str(),
               static_cast<unsigned long long>(ec ? 0 : bytes), secs);
  return 0;
}

}  // namespace

void add_model_command(CLI::App& app, int* exit_code) {
  CLI::App* model = app.add_subcommand("model", "Model file utilities");
  model->require_subcommand(1);
  auto f = std::make_shared<SynthFlags>();
  CLI::App* synth = model->add_subcommand(
      "synth", "Write a synthetic Llama GGUF with deterministic random weights and a byte-level "
               "BPE tokenizer");
  SynthOptions& o = f->opts;
  synth->add_option("--layers", o.layers, "transformer blocks")->capture_default_str();
  synth->add_option("--dim", o.dim, "embedding size")->capture_default_str();
  synth->add_option("--heads", o.heads, "attention heads")->capture_default_str();
  synth->add_option("--kv-heads", o.kv_heads, "key/value heads (GQA)")->capture_default_str();
  synth->add_option("--ffn", o.ffn, "feed-forward size")->capture_default_str();
  synth->add_option("--vocab", o.vocab, "vocabulary size (>= 258)")->capture_default_str();
  synth->add_option("--dtype", f->dtype,
                    "matrix dtype: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, "
                    "q4_k, q5_k, q6_k (K-quants fall back per tensor as llama.cpp does when a "
                    "row is not a multiple of 256)")
      ->capture_default_str();
  synth->add_option("--seed", o.seed, "weight seed (same seed, same file)")->capture_default_str();
  synth->add_option("--context", o.context, "context length (llama.context_length)")
      ->capture_default_str();
  synth->add_option("--rope-theta", o.rope_theta, "RoPE base frequency")->capture_default_str();
  synth->add_flag("--tied", f->tied, "tie the output projection to the token embedding");
  synth->add_option("--name", o.name, "general.name (default: derived from the shape)");
  synth->add_option("--out", f->out, "output GGUF file")->required();
  synth->callback([f, exit_code] { *exit_code = run_synth(*f); });
}

}  // namespace cleave::cli
