// Geometry and hyper-parameters of a Llama-family model, from GGUF metadata or HF config.json.
#pragma once

#include <cstdint>
#include <string>

namespace cleave {

enum class RopeStyle : uint8_t {
  kNormal,  // GGML "normal": rotates adjacent pairs (x[2i], x[2i+1]); GGUF llama/mistral
  kNeox,    // rotates halves (x[i], x[i + d/2]); HF layout, GGUF qwen2
};

struct RopeScaling {
  enum class Type : uint8_t { kNone, kLinear, kLlama3 } type = Type::kNone;
  float factor = 1.0f;
  float low_freq_factor = 1.0f;    // llama3
  float high_freq_factor = 4.0f;   // llama3
  int64_t original_context = 8192; // llama3: original_max_position_embeddings
};

struct ModelConfig {
  std::string arch = "llama";  // llama, mistral, qwen2 (GGUF general.architecture)
  std::string name;            // general.name or the directory name
  int64_t n_layers = 0;
  int64_t dim = 0;             // embedding length
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;        // dim / n_heads unless the file says otherwise
  int64_t ffn_dim = 0;
  int64_t vocab_size = 0;
  int64_t context_length = 2048;
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeStyle rope_style = RopeStyle::kNormal;
  RopeScaling rope_scaling;
  bool tied_embeddings = false;  // no output.weight: the token embedding is reused
  bool qkv_bias = false;         // Qwen2

  // Checks internal consistency (positive sizes, heads divide, GQA ratio integral, limits).
  // Returns an empty string when valid, else a description of the first problem.
  std::string validate() const;
};

}  // namespace cleave
