// A loaded model: config, weights (views into mmapped files or owned buffers) and tokenizer spec,
// from a GGUF file or a Hugging Face model directory (config.json + *.safetensors +
// tokenizer.json). Tensors are exposed under canonical GGUF names:
//   token_embd.weight, output_norm.weight, output.weight (absent when tied),
//   blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,ffn_up,ffn_down}.weight,
//   blk.N.{attn_q,attn_k,attn_v}.bias (Qwen2).
// Q/K weights are in the layout that matches config().rope_style (HF llama checkpoints are
// permuted on load to GGUF's interleaved layout so that both loaders give identical logits).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/model/model_config.h"
#include "cleave/model/tensor_view.h"
#include "cleave/model/tokenizer_spec.h"

namespace cleave {

class ModelFile {
 public:
  virtual ~ModelFile() = default;
  const ModelConfig& config() const { return config_; }
  const TokenizerSpec& tokenizer() const { return tokenizer_; }
  // nullptr when absent.
  const TensorView* tensor(std::string_view name) const;
  const std::map<std::string, TensorView, std::less<>>& tensors() const { return tensors_; }
  // Checks that every tensor the architecture needs is present with the right shape and a
  // supported dtype; the error names the tensor and what was expected.
  Status validate_tensors() const;
  // Hex digest over config and tensor bytes' identity (names, shapes, dtypes, sizes, and a
  // sample of the data), stable across loaders for the same weights.
  std::string fingerprint() const;
  const std::string& source_path() const { return source_path_; }

 protected:
  ModelConfig config_;
  TokenizerSpec tokenizer_;
  std::map<std::string, TensorView, std::less<>> tensors_;
  std::string source_path_;
  std::vector<std::shared_ptr<void>> keep_alive_;  // mappings and owned buffers
};

// Opens a GGUF file or a Hugging Face model directory (decided by what `path` is).
Result<std::unique_ptr<ModelFile>> load_model(const std::string& path);

}  // namespace cleave
