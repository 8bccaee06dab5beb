// `cleave convert --to safetensors MODEL OUTDIR`: write a model (GGUF file or HF directory) as a
// Hugging Face directory (config.json, model.safetensors, tokenizer files).
#include <cstdio>
#include <memory>
#include <string>

#include "cleave/model/hf_export.h"
#include "cleave/model/model_file.h"
#include "commands.h"
#include "fmt/format.h"

namespace cleave::cli {
namespace {

struct ConvertFlags {
  std::string to = "safetensors";
  std::string input;
  std::string out_dir;
  bool no_dequantize = false;
  uint64_t shard_mb = 0;
};

Status run_convert(const ConvertFlags& f) {
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> model, load_model(f.input));
  HfExportOptions opts;
  opts.dequantize_q8_0 = !f.no_dequantize;
  opts.max_shard_bytes = f.shard_mb << 20;
  CLEAVE_RETURN_IF_ERROR(export_hf_model(*model, f.out_dir, opts));
  std::fprintf(stderr, "cleave convert: wrote %s (%s, %lld layers)\n", f.out_dir.c_str(),
               model->config().arch.c_str(), static_cast<long long>(model->config().n_layers));
  return Status::Ok();
}

}  // namespace

void add_convert_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ConvertFlags>();
  CLI::App* cmd = app.add_subcommand(
      "convert", "Convert a model (GGUF file or HF directory) to a Hugging Face directory");
  cmd->add_option("--to", f->to, "output format (safetensors)")
      ->check(CLI::IsMember({"safetensors"}))->capture_default_str();
  cmd->add_option("MODEL", f->input, "GGUF file or Hugging Face model directory")->required();
  cmd->add_option("OUTDIR", f->out_dir, "output directory (created if missing)")->required();
  cmd->add_flag("--no-dequantize", f->no_dequantize,
                "refuse q8_0 tensors instead of dequantising them to f32");
  cmd->add_option("--shard-mb", f->shard_mb,
                  "split model.safetensors into shards of at most this many MiB (0: one file)")
      ->capture_default_str();
  cmd->callback([f, exit_code] {
    Status st = run_convert(*f);
    if (!st.ok()) {
      std::fprintf(stderr, "cleave convert: %s\n", st.to_string().c_str());
      *exit_code = 1;
    }
  });
}

}  // namespace cleave::cli
