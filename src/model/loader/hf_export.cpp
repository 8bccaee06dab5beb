#include "cleave/model/hf_export.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "cleave/model/quants.h"
#include "cleave/model/safetensors.h"
#include "cleave/model/tokenizer_json.h"
#include "fmt/format.h"
#include "loaders.h"
#include "nlohmann/json.hpp"

namespace cleave {
namespace {

namespace fs = std::filesystem;

// Canonical GGUF name → HF name.
Result<std::string> hf_name(const std::string& gguf) {
  static const std::map<std::string, std::string, std::less<>> kTop = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  static const std::map<std::string, std::string, std::less<>> kLayer = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_q.bias", "self_attn.q_proj.bias"},
      {"attn_k.bias", "self_attn.k_proj.bias"},
      {"attn_v.bias", "self_attn.v_proj.bias"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},
  };
  if (auto it = kTop.find(gguf); it != kTop.end()) return it->second;
  if (gguf.starts_with("blk.")) {
    const auto dot = gguf.find('.', 4);
    if (dot != std::string::npos) {
      const std::string layer = gguf.substr(4, dot - 4);
      if (auto it = kLayer.find(gguf.substr(dot + 1)); it != kLayer.end() && !layer.empty() &&
          layer.find_first_not_of("0123456789") == std::string::npos)
        return fmt::format("model.layers.{}.{}", layer, it->second);
    }
  }
  return Unimplemented(fmt::format("tensor '{}' has no Hugging Face name", gguf));
}

// Shortest decimal that reads back as the same float (1e-05, not 9.99999974738e-06).
double float_for_json(float f) { return std::stod(fmt::format("{}", f)); }

nlohmann::ordered_json config_json(const ModelFile& m, DType dtype) {
  const ModelConfig& c = m.config();
  nlohmann::ordered_json j;
  const bool qwen = c.arch == "qwen2";
  j["architectures"] = {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = qwen ? "qwen2" : "llama";
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.ffn_dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["head_dim"] = c.head_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.context_length;
  j["rms_norm_eps"] = float_for_json(c.rms_eps);
  j["rope_theta"] = float_for_json(c.rope_theta);
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tied_embeddings;
  if (!qwen) j["attention_bias"] = c.qkv_bias;
  if (m.tokenizer().bos_id >= 0) j["bos_token_id"] = m.tokenizer().bos_id;
  if (m.tokenizer().eos_id >= 0) j["eos_token_id"] = m.tokenizer().eos_id;
  switch (c.rope_scaling.type) {
    case RopeScaling::Type::kNone:
      j["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Type::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", float_for_json(c.rope_scaling.factor)}};
      break;
    case RopeScaling::Type::kLlama3:
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", float_for_json(c.rope_scaling.factor)},
                           {"low_freq_factor", float_for_json(c.rope_scaling.low_freq_factor)},
                           {"high_freq_factor", float_for_json(c.rope_scaling.high_freq_factor)},
                           {"original_max_position_embeddings", c.rope_scaling.original_context}};
      break;
  }
  j["torch_dtype"] = dtype == DType::kF16 ? "float16" : dtype == DType::kBF16 ? "bfloat16" : "float32";
  return j;
}

Status write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return NotFound(fmt::format("cannot create '{}'", path));
  out << text;
  out.close();
  if (!out) return Internal(fmt::format("writing '{}' failed", path));
  return Status::Ok();
}

std::vector<std::byte> dequantize(const TensorView& t) {
  std::vector<std::byte> out(static_cast<size_t>(t.elements()) * sizeof(float));
  decode_row(t.dtype, t.data, t.elements(), reinterpret_cast<float*>(out.data()));
  return out;
}

struct Prepared {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
  std::shared_ptr<std::vector<std::byte>> owned;
};

}  // namespace

Status export_hf_model(const ModelFile& model, const std::string& dir, const HfExportOptions& opts) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return NotFound(fmt::format("cannot create directory '{}': {}", dir, ec.message()));
  const ModelConfig& c = model.config();

  std::vector<Prepared> tensors;
  std::map<DType, int> dtype_votes;
  for (const auto& [name, t] : model.tensors()) {
    if (name == "rope_freqs.weight") continue;  // carried by config.json rope_scaling
    CLEAVE_ASSIGN_OR_RETURN(std::string hn, hf_name(name));
    Prepared p{hn, t.dtype, t.shape, {t.data, t.nbytes}, nullptr};
    if (dtype_is_quantized(t.dtype)) {
      if (!opts.dequantize)
        return InvalidArgument(fmt::format("tensor '{}' is {}, which safetensors cannot hold "
                                           "(allow dequantising to f32)", name,
                                           dtype_name(t.dtype)));
      p.owned = std::make_shared<std::vector<std::byte>>(dequantize(t));
      p.dtype = DType::kF32;
      p.data = *p.owned;
    }
    const bool is_q = name.ends_with("attn_q.weight") || name.ends_with("attn_q.bias");
    const bool is_k = name.ends_with("attn_k.weight") || name.ends_with("attn_k.bias");
    if (c.rope_style == RopeStyle::kNormal && (is_q || is_k)) {
      const int64_t rows = t.shape.front();
      const int64_t heads = is_q ? c.n_heads : c.n_kv_heads;
      p.owned = std::make_shared<std::vector<std::byte>>(detail::permute_rope_rows(
          p.data, rows, p.data.size() / static_cast<uint64_t>(rows), heads, /*inverse=*/true));
      p.data = *p.owned;
    }
    if (t.shape.size() >= 2) ++dtype_votes[p.dtype];
    tensors.push_back(std::move(p));
  }
  DType main_dtype = DType::kF32;
  int best = -1;
  for (const auto& [d, n] : dtype_votes)
    if (n > best) best = n, main_dtype = d;

  // Group into shards in HF name order (as transformers does).
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::vector<SafetensorsWriter> shards(1);
  std::vector<std::vector<std::string>> shard_names(1);
  for (auto& p : tensors) {
    if (opts.max_shard_bytes && shards.back().data_bytes() > 0 &&
        shards.back().data_bytes() + p.data.size() > opts.max_shard_bytes) {
      shards.emplace_back();
      shard_names.emplace_back();
    }
    if (p.owned) {
      CLEAVE_RETURN_IF_ERROR(shards.back().add_tensor(p.name, p.dtype, p.shape, std::move(*p.owned)));
    } else {
      CLEAVE_RETURN_IF_ERROR(shards.back().add_tensor(p.name, p.dtype, p.shape, p.data));
    }
    shard_names.back().push_back(p.name);
  }
  if (shards.size() == 1) {
    shards[0].set_metadata("format", "pt");
    CLEAVE_RETURN_IF_ERROR(shards[0].write(dir + "/model.safetensors"));
    fs::remove(dir + "/model.safetensors.index.json", ec);
  } else {
    nlohmann::ordered_json index;
    uint64_t total = 0;
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
      shards[i].set_metadata("format", "pt");
      CLEAVE_RETURN_IF_ERROR(shards[i].write(dir + "/" + file));
      total += shards[i].data_bytes();
      for (const auto& n : shard_names[i]) weight_map[n] = file;
    }
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = std::move(weight_map);
    CLEAVE_RETURN_IF_ERROR(write_text(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
    fs::remove(dir + "/model.safetensors", ec);
  }
  CLEAVE_RETURN_IF_ERROR(write_text(dir + "/config.json", config_json(model, main_dtype).dump(2) + "\n"));
  if (opts.write_tokenizer) CLEAVE_RETURN_IF_ERROR(write_hf_tokenizer(model.tokenizer(), dir));
  return Status::Ok();
}

}  // namespace cleave
