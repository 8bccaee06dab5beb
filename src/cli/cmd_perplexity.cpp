// `cleave perplexity`: the perplexity of a text file under a model, computed as llama.cpp's
// llama-perplexity does (see include/cleave/engine/perplexity.h). Progress on stderr, the final
// figure on stdout.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "cleave/common/log.h"
#include "cleave/engine/llama_model.h"
#include "cleave/engine/perplexity.h"
#include "cleave/model/model_file.h"
#include "cleave/model/tokenizer.h"
#include "commands.h"
#include "fmt/format.h"

namespace cleave::cli {
namespace {

struct PerplexityFlags {
  std::string model;
  std::string file;
  int64_t ctx = 512;
  int64_t batch = 0;
  int threads = 0;
  std::string device = "cpu";
};

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("cannot open text file '{}'", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return DataLoss(fmt::format("error reading text file '{}'", path));
  return ss.str();
}

Status run_perplexity(const PerplexityFlags& flags) {
  CLEAVE_ASSIGN_OR_RETURN(std::string text, read_text(flags.file));
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> loaded, load_model(flags.model));
  std::shared_ptr<const ModelFile> file(std::move(loaded));
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::create(file->tokenizer()));
  const bool add_bos = tokenizer->spec().add_bos && tokenizer->bos_id() >= 0;
  // As llama.cpp: the whole text tokenized at once (BOS first when the model adds one).
  const std::vector<int32_t> tokens =
      tokenizer->encode(text, EncodeOptions{.add_bos = add_bos, .parse_special = false});
  if (flags.ctx > file->config().context_length) {
    return InvalidArgument(fmt::format("--ctx {} exceeds the model's context of {} tokens",
                                       flags.ctx, file->config().context_length));
  }
  EngineOptions opts;
  opts.threads = flags.threads;
  opts.device = flags.device;
  opts.max_context = flags.ctx;
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model, LlamaModel::create(file, opts));
  PerplexityOptions po;
  po.ctx = flags.ctx;
  po.batch = flags.batch;
  po.bos_id = add_bos ? tokenizer->bos_id() : -1;
  std::fprintf(stderr, "perplexity: %zu tokens, %lld windows of %lld tokens\n", tokens.size(),
               static_cast<long long>(tokens.size() / static_cast<size_t>(flags.ctx)),
               static_cast<long long>(flags.ctx));
  CLEAVE_ASSIGN_OR_RETURN(
      PerplexityResult r,
      compute_perplexity(*model, tokens, po, [](const PerplexityResult& so_far, int64_t total) {
        std::fprintf(stderr, "\rperplexity: window %lld/%lld, PPL so far %.4f",
                     static_cast<long long>(so_far.windows), static_cast<long long>(total),
                     so_far.ppl);
        if (so_far.windows == total) std::fputc('\n', stderr);
        std::fflush(stderr);
      }));
  std::printf("PPL = %.4f +/- %.5f (%lld tokens scored in %lld windows of %lld)\n", r.ppl,
              r.ppl_error, static_cast<long long>(r.scored_tokens),
              static_cast<long long>(r.windows), static_cast<long long>(flags.ctx));
  return Status::Ok();
}

}  // namespace

void add_perplexity_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<PerplexityFlags>();
  CLI::App* cmd = app.add_subcommand(
      "perplexity", "Perplexity of a text file over non-overlapping windows (as llama-perplexity)");
  cmd->add_option("--model", flags->model, "GGUF file or Hugging Face model directory")->required();
  cmd->add_option("--file", flags->file, "the text to score")->required();
  cmd->add_option("--ctx", flags->ctx, "window length in tokens (the first half is context)")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 24))->capture_default_str();
  cmd->add_option("--batch", flags->batch, "tokens per forward pass (0: the whole window)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24))->capture_default_str();
  cmd->add_option("--device", flags->device, "compute backend: cpu, cuda or cuda:N");
  cmd->add_option("--threads", flags->threads, "compute threads (0: one per CPU)")
      ->check(CLI::Range(0, 4096))->capture_default_str();
  cmd->callback([flags, exit_code] {
    Status st = run_perplexity(*flags);
    if (!st.ok()) {
      std::fprintf(stderr, "cleave perplexity: %s\n", st.to_string().c_str());
      *exit_code = 1;
    }
  });
}

}  // namespace cleave::cli
