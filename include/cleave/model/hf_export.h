// Writes a loaded model as a Hugging Face model directory: config.json, model.safetensors (or
// shards with model.safetensors.index.json) and the tokenizer files. Tensors get their HF names;
// for Llama-layout models (RopeStyle::kNormal) Q and K rows are permuted back from GGUF's
// interleaved layout to HF's rotate-half layout, so that loading the directory again gives the
// very same weights. Q8_0 tensors are dequantised to F32 when allowed, else refused.
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/status.h"
#include "cleave/model/model_file.h"

namespace cleave {

struct HfExportOptions {
  bool dequantize = true;  // false: a block-quantised tensor (Q8_0, Q4_K, ...) is an error
  uint64_t max_shard_bytes = 0; // 0: one model.safetensors; else shards of at most this size
                                // (a larger tensor gets a shard of its own)
  bool write_tokenizer = true;  // tokenizer.json + tokenizer_config.json
};

// Creates `dir` if needed. Existing files of the same names are replaced.
Status export_hf_model(const ModelFile& model, const std::string& dir, const HfExportOptions& opts);

}  // namespace cleave
