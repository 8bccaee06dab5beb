// `cleave convert --to safetensors MODEL OUTDIR`: write a model (GGUF file or HF directory) as a
// Hugging Face directory (config.json, model.safetensors, tokenizer files).
// `cleave convert --to gguf --dtype T MODEL.gguf OUT.gguf`: rewrite a GGUF's weight matrices in
// dtype T (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k).
#include <cstdio>
#include <memory>
#include <string>

#include "cleave/model/hf_export.h"
#include "cleave/model/model_file.h"
#include "cleave/model/requantize.h"
#include "commands.h"
#include "fmt/format.h"

namespace cleave::cli {
namespace {

struct ConvertFlags {
  std::string to = "safetensors";
  std::string input;
  std::string out_dir;
  std::string dtype;
  bool no_dequantize = false;
  uint64_t shard_mb = 0;
};

Status run_to_gguf(const ConvertFlags& f) {
  if (f.dtype.empty()) return InvalidArgument("--to gguf needs --dtype (e.g. --dtype q4_k)");
  auto dt = parse_dtype(f.dtype);
  if (!dt)
    return InvalidArgument(fmt::format("--dtype '{}' is not one of f32, f16, bf16, q8_0, q4_0, "
                                       "q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k", f.dtype));
  CLEAVE_ASSIGN_OR_RETURN(RequantizeReport r, requantize_gguf(f.input, f.out_dir, *dt));
  std::fprintf(stderr,
               "cleave convert: wrote %s (%d matrices in %s, %d in a fallback type for rows that "
               "are not whole %s blocks, %d tensors kept; %.1f MiB)\n",
               f.out_dir.c_str(), r.converted, dtype_name(*dt).data(), r.fell_back,
               dtype_name(*dt).data(), r.kept, static_cast<double>(r.bytes) / (1 << 20));
  return Status::Ok();
}

Status run_convert(const ConvertFlags& f) {
  if (f.to == "gguf") return run_to_gguf(f);
  if (!f.dtype.empty()) return InvalidArgument("--dtype applies to --to gguf only");
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> model, load_model(f.input));
  HfExportOptions opts;
  opts.dequantize = !f.no_dequantize;
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
      "convert", "Convert a model: to a Hugging Face directory (--to safetensors), or a GGUF to "
                 "a GGUF in another weight dtype (--to gguf --dtype T)");
  cmd->add_option("--to", f->to, "output format (safetensors, gguf)")
      ->check(CLI::IsMember({"safetensors", "gguf"}))->capture_default_str();
  cmd->add_option("--dtype", f->dtype,
                  "with --to gguf: the weight matrices' dtype (f32, f16, bf16, q8_0, q4_0, q4_1, "
                  "q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k)");
  cmd->add_option("MODEL", f->input, "GGUF file or Hugging Face model directory")->required();
  cmd->add_option("OUT", f->out_dir,
                  "output directory (--to safetensors; created if missing) or file (--to gguf)")
      ->required();
  cmd->add_flag("--no-dequantize", f->no_dequantize,
                "refuse block-quantised tensors instead of dequantising them to f32");
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
