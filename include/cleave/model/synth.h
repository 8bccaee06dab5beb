// Synthetic Llama models: deterministic random weights and a byte-level BPE tokenizer, written as
// a GGUF file in llama.cpp's conventions (general.architecture = llama, the llama.* keys,
// tokenizer.ggml.model = gpt2 with pre = llama-bpe), so that benchmarks and tests get realistic
// shapes without downloads and other GGUF runtimes can load the same file.
//
// Weights: each tensor is drawn from its own stream (the seed mixed with the tensor name), an
// approximately normal N(0, 0.02) made of uniform draws (no transcendental functions, so the
// bytes are the same on every platform); output projections of residual branches are scaled by
// 1/sqrt(2 × layers) as in GPT-2; norm weights are 1. Same options, same bytes.
//
// Tokenizer: ids 0..255 are the 256 bytes in GPT-2's bytes_to_unicode spelling (id = byte value),
// then merged tokens, then <|begin_of_text|> (BOS) and <|end_of_text|> (EOS) as CONTROL tokens.
// Merges are learnt by BPE on a built-in English paragraph and then continued deterministically
// (word-like tokens extended by one letter), so that every merge "a b" has a, b and ab in the
// vocabulary and the vocabulary has exactly `vocab` entries.
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/status.h"
#include "cleave/model/dtype.h"
#include "cleave/model/gguf_writer.h"
#include "cleave/model/tokenizer_spec.h"

namespace cleave {

struct SynthOptions {
  int64_t layers = 4;
  int64_t dim = 256;
  int64_t heads = 8;
  int64_t kv_heads = 4;
  int64_t ffn = 704;
  int64_t vocab = 2048;
  DType dtype = DType::kF16;  // matrices; norms are always f32
  uint64_t seed = 0;
  int64_t context = 2048;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_embeddings = false;  // true: no output.weight
  std::string name;              // general.name; empty: derived from the shape
};

// Empty when the options are usable, else a message naming the bad option (as its CLI flag,
// e.g. "--dim 100 is not a multiple of --heads 8").
std::string validate_synth_options(const SynthOptions& opts);

// The byte-level BPE tokenizer of a synthetic model with `vocab` tokens (vocab >= 258).
Result<TokenizerSpec> synth_tokenizer(int64_t vocab);

// The whole model, ready to write (tensor data is generated while writing).
Result<GgufWriter> synth_gguf(const SynthOptions& opts);
Status write_synth_model(const SynthOptions& opts, const std::string& path);

}  // namespace cleave
