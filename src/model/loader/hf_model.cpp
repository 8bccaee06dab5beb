// Hugging Face model directory → ModelFile: config.json, model.safetensors or a sharded
// model.safetensors.index.json, tokenizer.json. HF tensor names are mapped to the canonical GGUF
// names; Llama/Mistral Q and K rows are permuted into GGUF's interleaved rope layout exactly as
// llama.cpp's converter does, so that both loaders feed the engine identical weights.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "cleave/common/log.h"
#include "cleave/model/safetensors.h"
#include "cleave/model/tokenizer.h"
#include "fmt/format.h"
#include "loaders.h"
#include "nlohmann/json.hpp"

namespace cleave::detail {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kMaxJsonFile = 64ull << 20;

Result<json> read_json_file(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return NotFound(fmt::format("cannot read '{}': {}", path, ec.message()));
  if (size > kMaxJsonFile)
    return DataLoss(fmt::format("'{}' is {} bytes, more than a JSON file here may be", path, size));
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("cannot open '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return DataLoss(fmt::format("'{}' is not a valid JSON object", path));
  return j;
}

// Typed config.json fields; InvalidArgument names the key.
Result<int64_t> get_int(const json& j, const char* key, std::optional<int64_t> def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (def) return *def;
    return InvalidArgument(fmt::format("config.json has no '{}'", key));
  }
  if (!it->is_number_integer())
    return InvalidArgument(fmt::format("config.json '{}' is {}, expected an integer", key, it->dump()));
  return it->get<int64_t>();
}

Result<double> get_num(const json& j, const char* key, double def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number())
    return InvalidArgument(fmt::format("config.json '{}' is {}, expected a number", key, it->dump()));
  return it->get<double>();
}

Status read_rope_scaling(const json& j, ModelConfig& c) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_object()) return InvalidArgument("config.json 'rope_scaling' is not an object");
  std::string type;
  for (const char* k : {"rope_type", "type"}) {
    auto t = it->find(k);
    if (t != it->end() && t->is_string()) {
      type = t->get<std::string>();
      break;
    }
  }
  CLEAVE_ASSIGN_OR_RETURN(double factor, get_num(*it, "factor", 1.0));
  if (type == "default" || type.empty()) return Status::Ok();
  if (type == "linear") {
    c.rope_scaling.type = RopeScaling::Type::kLinear;
    c.rope_scaling.factor = static_cast<float>(factor);
  } else if (type == "llama3") {
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = static_cast<float>(factor);
    CLEAVE_ASSIGN_OR_RETURN(double lo, get_num(*it, "low_freq_factor", 1.0));
    CLEAVE_ASSIGN_OR_RETURN(double hi, get_num(*it, "high_freq_factor", 4.0));
    c.rope_scaling.low_freq_factor = static_cast<float>(lo);
    c.rope_scaling.high_freq_factor = static_cast<float>(hi);
    CLEAVE_ASSIGN_OR_RETURN(c.rope_scaling.original_context,
                            get_int(*it, "original_max_position_embeddings", 8192));
  } else {
    return Unimplemented(fmt::format("config.json rope_scaling type '{}' is not supported "
                                     "(linear, llama3 are)", type));
  }
  return Status::Ok();
}

Status read_config(const json& j, ModelConfig& c) {
  std::string hf_arch;
  auto a = j.find("architectures");
  if (a != j.end() && a->is_array() && !a->empty() && (*a)[0].is_string())
    hf_arch = (*a)[0].get<std::string>();
  if (hf_arch == "LlamaForCausalLM" || hf_arch == "MistralForCausalLM") {
    c.arch = "llama";  // as llama.cpp stores Mistral
  } else if (hf_arch == "Qwen2ForCausalLM") {
    c.arch = "qwen2";
  } else {
    return Unimplemented(fmt::format("config.json architecture '{}' is not supported "
                                     "(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM are)",
                                     hf_arch));
  }
  CLEAVE_ASSIGN_OR_RETURN(c.dim, get_int(j, "hidden_size", std::nullopt));
  CLEAVE_ASSIGN_OR_RETURN(c.n_layers, get_int(j, "num_hidden_layers", std::nullopt));
  CLEAVE_ASSIGN_OR_RETURN(c.n_heads, get_int(j, "num_attention_heads", std::nullopt));
  CLEAVE_ASSIGN_OR_RETURN(c.n_kv_heads, get_int(j, "num_key_value_heads", c.n_heads));
  CLEAVE_ASSIGN_OR_RETURN(c.ffn_dim, get_int(j, "intermediate_size", std::nullopt));
  CLEAVE_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", std::nullopt));
  CLEAVE_ASSIGN_OR_RETURN(c.context_length, get_int(j, "max_position_embeddings", 2048));
  if (c.n_heads <= 0) return InvalidArgument("config.json 'num_attention_heads' must be positive");
  CLEAVE_ASSIGN_OR_RETURN(c.head_dim, get_int(j, "head_dim", c.dim / c.n_heads));
  CLEAVE_ASSIGN_OR_RETURN(double eps, get_num(j, "rms_norm_eps", 1e-6));
  CLEAVE_ASSIGN_OR_RETURN(double theta, get_num(j, "rope_theta", 10000.0));
  c.rms_eps = static_cast<float>(eps);
  c.rope_theta = static_cast<float>(theta);
  CLEAVE_RETURN_IF_ERROR(read_rope_scaling(j, c));
  auto tie = j.find("tie_word_embeddings");
  c.tied_embeddings = tie != j.end() && tie->is_boolean() && tie->get<bool>();
  c.rope_style = c.arch == "qwen2" ? RopeStyle::kNeox : RopeStyle::kNormal;
  c.qkv_bias = c.arch == "qwen2";
  if (c.arch == "llama") {
    auto ab = j.find("attention_bias");
    c.qkv_bias = ab != j.end() && ab->is_boolean() && ab->get<bool>();
  }
  return Status::Ok();
}

// HF name → canonical GGUF name; empty for tensors that carry nothing we need.
Result<std::string> canonical_name(const std::string& hf) {
  static const std::map<std::string, std::string> kTop = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  static const std::map<std::string, std::string> kLayer = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  if (auto it = kTop.find(hf); it != kTop.end()) return it->second;
  static const std::regex kLayerRe(R"(model\.layers\.(\d{1,5})\.(.+))");
  std::smatch m;
  if (std::regex_match(hf, m, kLayerRe)) {
    if (m[2] == "self_attn.rotary_emb.inv_freq") return std::string();
    if (auto it = kLayer.find(m[2]); it != kLayer.end())
      return fmt::format("blk.{}.{}", std::stoll(m[1]), it->second);
  }
  return Unimplemented(fmt::format("tensor '{}' is not part of a supported Llama-family model", hf));
}

bool plain_file_name(const std::string& f) {
  return !f.empty() && f.find('/') == std::string::npos && f != "." && f != "..";
}

// Which safetensors files to open, and for the index, which tensor is promised in which file.
Status list_shards(const std::string& dir, std::vector<std::string>* files,
                   std::map<std::string, std::string>* promised) {
  const std::string index = dir + "/model.safetensors.index.json";
  if (fs::exists(index)) {
    CLEAVE_ASSIGN_OR_RETURN(json j, read_json_file(index));
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object())
      return DataLoss(fmt::format("'{}' has no weight_map object", index));
    std::set<std::string> seen;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string())
        return DataLoss(fmt::format("'{}': weight_map entry '{}' is not a file name", index, it.key()));
      const std::string f = it->get<std::string>();
      if (!plain_file_name(f))
        return DataLoss(fmt::format("'{}': shard '{}' is not a plain file name in the model "
                                    "directory", index, f));
      (*promised)[it.key()] = f;
      if (seen.insert(f).second) files->push_back(f);
    }
    if (files->empty()) return DataLoss(fmt::format("'{}' lists no shards", index));
    return Status::Ok();
  }
  if (fs::exists(dir + "/model.safetensors")) {
    files->push_back("model.safetensors");
    return Status::Ok();
  }
  return NotFound(fmt::format("'{}' has neither model.safetensors nor "
                              "model.safetensors.index.json", dir));
}

// Copies `src` into an owned buffer when it is not aligned for its element type (safetensors
// data sections need not be), so that kernels may read it as typed elements.
const std::byte* aligned_data(const SafetensorsTensor& t, LoadedModel& m) {
  const auto align = static_cast<uintptr_t>(dtype_info(t.dtype).block_bytes);
  if (reinterpret_cast<uintptr_t>(t.data) % align == 0) return t.data;
  auto buf = std::make_shared<std::vector<std::byte>>(t.data, t.data + t.nbytes);
  m.keep_alive(buf);
  return buf->data();
}

}  // namespace

Result<std::unique_ptr<ModelFile>> load_hf_model(const std::string& dir) {
  auto m = std::make_unique<LoadedModel>();
  m->set_source_path(dir);
  ModelConfig& c = m->mutable_config();
  {
    auto j = read_json_file(dir + "/config.json");
    if (!j.ok()) return j.status();
    Status st = read_config(*j, c);
    if (!st.ok()) return st.with_context(dir + "/config.json");
  }
  c.name = fs::path(dir).filename().string();
  if (c.name.empty()) c.name = fs::path(dir).parent_path().filename().string();
  if (auto err = c.validate(); !err.empty())
    return InvalidArgument(fmt::format("{}/config.json: {}", dir, err));

  std::vector<std::string> files;
  std::map<std::string, std::string> promised;
  CLEAVE_RETURN_IF_ERROR(list_shards(dir, &files, &promised));
  const bool permute = c.rope_style == RopeStyle::kNormal;
  std::set<std::string, std::less<>> seen;  // HF names found in the shards
  for (const auto& f : files) {
    const std::string path = dir + "/" + f;
    CLEAVE_ASSIGN_OR_RETURN(SafetensorsFile st, SafetensorsFile::open(path));
    auto shared = std::make_shared<SafetensorsFile>(std::move(st));
    m->keep_alive(shared);
    for (const auto& t : shared->tensors()) {
      if (!promised.empty()) {
        auto p = promised.find(t.name);
        if (p == promised.end() || p->second != f)
          return DataLoss(fmt::format("'{}' holds tensor '{}', which the index does not place "
                                      "there", path, t.name));
      }
      seen.insert(t.name);
      auto cn = canonical_name(t.name);
      if (!cn.ok()) return cn.status().with_context(path);
      if (cn->empty()) continue;
      if (m->mutable_tensors().count(*cn))
        return DataLoss(fmt::format("'{}': tensor '{}' appears twice", path, t.name));
      TensorView v{*cn, t.dtype, t.shape, aligned_data(t, *m), t.nbytes};
      const bool is_q = cn->ends_with("attn_q.weight") || cn->ends_with("attn_q.bias");
      const bool is_k = cn->ends_with("attn_k.weight") || cn->ends_with("attn_k.bias");
      if (permute && (is_q || is_k)) {
        const int64_t heads = is_q ? c.n_heads : c.n_kv_heads;
        const int64_t rows = t.shape.empty() ? 0 : t.shape[0];
        if (rows != heads * c.head_dim)
          return InvalidArgument(fmt::format("{}: tensor '{}' has {} rows, expected {} heads × {}",
                                             path, t.name, rows, heads, c.head_dim));
        auto buf = std::make_shared<std::vector<std::byte>>(permute_rope_rows(
            {v.data, v.nbytes}, rows, v.nbytes / static_cast<uint64_t>(rows), heads, false));
        v.data = buf->data();
        m->keep_alive(buf);
      }
      m->mutable_tensors().emplace(*cn, std::move(v));
    }
  }
  for (const auto& [name, file] : promised)
    if (!seen.count(name))
      return DataLoss(fmt::format("{}: the index places '{}' in '{}' but it is not there", dir,
                                  name, file));
  if (c.tied_embeddings) {
    if (m->mutable_tensors().erase("output.weight"))
      log::debug("{}: tie_word_embeddings is set; ignoring lm_head.weight", dir);
  } else if (!m->mutable_tensors().count("output.weight")) {
    c.tied_embeddings = true;  // no lm_head: the embedding is reused, as transformers does
  }
  if (const TensorView* e = m->tensor("token_embd.weight"); e && e->rows() != c.vocab_size)
    return InvalidArgument(fmt::format("{}: config.json vocab_size is {} but "
                                       "model.embed_tokens.weight has {} rows", dir, c.vocab_size,
                                       e->rows()));
  auto tok = tokenizer_spec_from_hf_dir(dir);
  if (!tok.ok()) return tok.status().with_context(fmt::format("{}: tokenizer", dir));
  m->mutable_tokenizer() = std::move(*tok);
  return std::unique_ptr<ModelFile>(std::move(m));
}

}  // namespace cleave::detail
