// `cleave generate`: run one prompt through a model file and print the generated text.
// stdout carries only the generated text (streamed); diagnostics go to stderr.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include "cleave/common/log.h"
#include "cleave/engine/cpu_kernels.h"
#include "cleave/engine/generator.h"
#include "cleave/engine/llama_model.h"
#include "cleave/model/default_model.h"
#include "cleave/model/model_file.h"
#include "cleave/model/tokenizer.h"
#include "commands.h"
#include "fmt/format.h"
#include "nlohmann/json.hpp"

namespace cleave::cli {
namespace {

struct GenerateFlags {
  std::string model;
  std::optional<std::string> prompt;
  std::optional<std::string> prompt_file;
  int32_t max_tokens = 128;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  int threads = 0;
  std::string device = "cpu";
  std::string stats_json;
  std::string log_level = "warn";  // CLEAVE_LOG_LEVEL overrides
};

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("cannot open prompt file '{}'", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return DataLoss(fmt::format("error reading prompt file '{}'", path));
  return ss.str();
}

Status write_stats(const std::string& path, const GenerationStats& s, double load_seconds) {
  auto rate = [](int64_t n, double secs) { return secs > 0 ? static_cast<double>(n) / secs : 0.0; };
  nlohmann::json j = {
      {"prompt_tokens", s.prompt_tokens},
      {"generated_tokens", s.generated_tokens},
      {"prefill_tokens_per_s", rate(s.prompt_tokens, s.prefill_seconds)},
      {"decode_tokens_per_s", rate(s.decode_steps, s.decode_seconds)},
      {"load_seconds", load_seconds},
  };
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return NotFound(fmt::format("cannot write stats file '{}'", path));
  out << j.dump(2) << "\n";
  if (!out) return DataLoss(fmt::format("error writing stats file '{}'", path));
  return Status::Ok();
}

Status run_generate(const GenerateFlags& flags) {
  const char* env_level = std::getenv("CLEAVE_LOG_LEVEL");
  LogOptions log_opts;
  log_opts.level = env_level ? env_level : flags.log_level;
  CLEAVE_RETURN_IF_ERROR(init_logging(log_opts));
  std::string prompt_text;
  if (flags.prompt_file) {
    CLEAVE_ASSIGN_OR_RETURN(prompt_text, read_file(*flags.prompt_file));
  } else if (flags.prompt) {
    prompt_text = *flags.prompt;
  }

  const auto t_load = std::chrono::steady_clock::now();
  // No --model: CLEAVE_MODEL_PATH, else the embedded default (generated once into the cache).
  std::string model_path = flags.model;
  if (model_path.empty()) {
    const char* env_model = std::getenv("CLEAVE_MODEL_PATH");
    if (env_model != nullptr && *env_model != 0) {
      model_path = env_model;
    } else {
      CLEAVE_ASSIGN_OR_RETURN(model_path, ensure_default_model());
    }
  }
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> file, load_model(model_path));
  std::shared_ptr<const ModelFile> model_file(std::move(file));
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::create(model_file->tokenizer()));
  // An empty prompt is BOS alone (as llama2.c and llama.cpp do).
  std::vector<int32_t> prompt;
  if (prompt_text.empty()) {
    if (tokenizer->bos_id() < 0) {
      return InvalidArgument(fmt::format(
          "the prompt is empty and the model '{}' has no BOS token to start from", model_path));
    }
    prompt.push_back(tokenizer->bos_id());
  } else {
    prompt = tokenizer->encode(
        prompt_text, EncodeOptions{.add_bos = tokenizer->spec().add_bos, .parse_special = true});
    if (prompt.empty()) return InvalidArgument("the prompt encodes to no tokens");
  }

  // The KV cache holds the prompt and the generated tokens, not the whole trained context
  // (a 128K-context model would otherwise reserve tens of GiB).
  const ModelConfig& cfg = model_file->config();
  EngineOptions engine_opts;
  engine_opts.threads = flags.threads;
  engine_opts.device = flags.device;
  engine_opts.max_context = std::min<int64_t>(
      cfg.context_length, static_cast<int64_t>(prompt.size()) + flags.max_tokens);
  if (static_cast<int64_t>(prompt.size()) > cfg.context_length) {
    return OutOfRange(fmt::format("the prompt has {} tokens, the model's context holds {}",
                                  prompt.size(), cfg.context_length));
  }
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model,
                          LlamaModel::create(model_file, engine_opts));
  const double load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  log::info("loaded '{}' ({} layers, dim {}, vocab {}) in {:.3f} s; kernels {}, {} threads",
            model_path, cfg.n_layers, cfg.dim, cfg.vocab_size, load_seconds, cpu::kernel_isa(),
            model->pool().size());

  SamplingParams params;
  params.temperature = flags.temperature;
  params.top_k = flags.top_k;
  params.top_p = flags.top_p;
  params.ignore_eos = flags.ignore_eos;
  params.max_tokens = flags.max_tokens;
  if (flags.seed) {
    params.seed = *flags.seed;
  } else {
    params.seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    log::info("seed {}", params.seed);
  }

  Generator generator(*model, *tokenizer);
  CLEAVE_ASSIGN_OR_RETURN(GenerationResult result,
                          generator.generate(prompt, params, [](const GeneratedToken& t) {
                            if (!t.text.empty()) {
                              std::fwrite(t.text.data(), 1, t.text.size(), stdout);
                              std::fflush(stdout);
                            }
                            return true;
                          }));
  const GenerationStats& s = result.stats;
  log::info("{} prompt tokens, {} generated ({}); prefill {:.1f} tok/s, decode {:.1f} tok/s",
            s.prompt_tokens, s.generated_tokens, finish_reason_name(result.finish_reason),
            s.prefill_seconds > 0 ? s.prompt_tokens / s.prefill_seconds : 0.0,
            s.decode_seconds > 0 ? s.decode_steps / s.decode_seconds : 0.0);
  if (!flags.stats_json.empty()) CLEAVE_RETURN_IF_ERROR(write_stats(flags.stats_json, s, load_seconds));
  return Status::Ok();
}

}  // namespace

void add_generate_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a prompt with a model file");
  cmd->add_option("--model", flags->model,
                  "GGUF file or Hugging Face model directory (default: $CLEAVE_MODEL_PATH, else the "
                  "embedded default model)");
  auto* prompt = cmd->add_option("--prompt", flags->prompt, "prompt text (empty: BOS alone)");
  auto* prompt_file = cmd->add_option("--prompt-file", flags->prompt_file, "read the prompt from a file");
  prompt->excludes(prompt_file);
  cmd->add_option("--max-tokens", flags->max_tokens, "most tokens to generate")
      ->check(CLI::Range(0, 1 << 30))->capture_default_str();
  cmd->add_option("--temperature", flags->temperature, "sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  cmd->add_option("--top-k", flags->top_k, "keep the K most likely tokens (0: off)")
      ->check(CLI::Range(0, 1 << 30))->capture_default_str();
  cmd->add_option("--top-p", flags->top_p, "nucleus sampling mass (1: off)")
      ->check(CLI::Range(0.0f, 1.0f))->capture_default_str();
  cmd->add_option("--seed", flags->seed, "sampling seed (default: random, logged)");
  cmd->add_flag("--ignore-eos", flags->ignore_eos, "keep generating past end-of-generation tokens");
  cmd->add_option("--device", flags->device, "compute backend: cpu, cuda or cuda:N");
  cmd->add_option("--threads", flags->threads, "compute threads (0: one per CPU)")
      ->check(CLI::Range(0, 4096))->capture_default_str();
  cmd->add_option("--stats-json", flags->stats_json, "write timing statistics as JSON to FILE");
  cmd->callback([flags, exit_code] {
    Status st = run_generate(*flags);
    if (!st.ok()) {
      std::fflush(stdout);
      std::fprintf(stderr, "cleave generate: %s\n", st.to_string().c_str());
      *exit_code = 1;
    }
  });
}

}  // namespace cleave::cli
