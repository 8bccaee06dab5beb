// Internal to the model library: the per-format loaders behind load_model(), and helpers they
// share with the HF exporter.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/model/model_file.h"

namespace cleave::detail {

// A ModelFile whose parts a loader fills in.
class LoadedModel : public ModelFile {
 public:
  ModelConfig& mutable_config() { return config_; }
  TokenizerSpec& mutable_tokenizer() { return tokenizer_; }
  std::map<std::string, TensorView, std::less<>>& mutable_tensors() { return tensors_; }
  void set_source_path(std::string p) { source_path_ = std::move(p); }
  void keep_alive(std::shared_ptr<void> p) { keep_alive_.push_back(std::move(p)); }
};

// GGUF file → model (config from `<arch>.*` keys, tensors as views into the mapping).
Result<std::unique_ptr<ModelFile>> load_gguf_model(const std::string& path);
// Hugging Face directory → model (config.json, safetensors, tokenizer.json).
Result<std::unique_ptr<ModelFile>> load_hf_model(const std::string& dir);

// Reorders the rows of a Q or K projection (or bias) between Hugging Face's rotate-half layout and
// GGUF's interleaved layout, exactly as llama.cpp's convert_hf_to_gguf.py permute() does:
// within each of `n_heads` heads of `rows / n_heads` rows, row j*(hd/2)+i moves to 2i+j.
// `inverse` undoes it. `row_bytes` is the byte size of one row (the whole element for a bias).
std::vector<std::byte> permute_rope_rows(std::span<const std::byte> src, int64_t rows,
                                         uint64_t row_bytes, int64_t n_heads, bool inverse);

}  // namespace cleave::detail
