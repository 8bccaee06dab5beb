// GGUF → ModelFile: the config from llama.cpp's `<arch>.*` keys, tensors as views into the mmap.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "cleave/common/log.h"
#include "cleave/model/gguf.h"
#include "cleave/model/tokenizer.h"
#include "fmt/format.h"
#include "loaders.h"

namespace cleave::detail {
namespace {

// Required integer key, as int64 (values beyond int64 are reported as absurd by validate()).
Result<int64_t> required_int(const GgufFile& g, const std::string& key) {
  auto r = g.get_uint(key);
  if (!r.ok()) return r.status();
  if (*r > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return InvalidArgument(fmt::format("metadata '{}' = {} is absurd", key, *r));
  return static_cast<int64_t>(*r);
}

Result<int64_t> optional_int(const GgufFile& g, const std::string& key, int64_t def) {
  if (!g.find(key)) return def;
  return required_int(g, key);
}

Result<double> optional_float(const GgufFile& g, const std::string& key, double def) {
  if (!g.find(key)) return def;
  return g.get_float(key);
}

// llama.cpp's convert_hf_to_gguf.py stores Llama-3 rope scaling as a rope_freqs tensor of
// per-dimension divisors. Recover the parameters (factor, low/high frequency factors, original
// context) and check that they reproduce the tensor, so that the engine can compute the same.
Status rope_scaling_from_freqs(const GgufTensorInfo& t, const GgufFile& g, const std::string& p,
                               ModelConfig& c) {
  const int64_t half = c.head_dim / 2;
  if (t.dtype != DType::kF32 || t.elements() != half)
    return InvalidArgument(fmt::format("tensor 'rope_freqs.weight' should be {} f32 values, got "
                                       "{} {}", half, t.elements(), dtype_name(t.dtype)));
  std::vector<float> f(static_cast<size_t>(half));
  std::memcpy(f.data(), t.data, f.size() * sizeof(float));
  RopeScaling s;
  s.type = RopeScaling::Type::kLlama3;
  s.factor = 1.0f;
  for (float x : f) s.factor = std::max(s.factor, x);
  CLEAVE_ASSIGN_OR_RETURN(double lo, optional_float(g, p + "rope.scaling.low_freq_factor", 1.0));
  CLEAVE_ASSIGN_OR_RETURN(double hi, optional_float(g, p + "rope.scaling.high_freq_factor", 4.0));
  CLEAVE_ASSIGN_OR_RETURN(int64_t orig, optional_int(g, p + "rope.scaling.original_context_length", 8192));
  s.low_freq_factor = static_cast<float>(lo);
  s.high_freq_factor = static_cast<float>(hi);
  s.original_context = orig;
  // Recompute as convert_hf_to_gguf.py does and compare.
  const double low_wavelen = static_cast<double>(orig) / lo;
  const double high_wavelen = static_cast<double>(orig) / hi;
  for (int64_t i = 0; i < half; ++i) {
    const double freq = 1.0 / std::pow(static_cast<double>(c.rope_theta),
                                       static_cast<double>(2 * i) / static_cast<double>(c.head_dim));
    const double wavelen = 2 * M_PI / freq;
    double want;
    if (wavelen < high_wavelen) want = 1.0;
    else if (wavelen > low_wavelen) want = s.factor;
    else {
      const double smooth = (static_cast<double>(orig) / wavelen - lo) / (hi - lo);
      want = 1.0 / ((1 - smooth) / s.factor + smooth);
    }
    if (std::fabs(want - f[static_cast<size_t>(i)]) > 1e-3 * want)
      return Unimplemented(fmt::format("tensor 'rope_freqs.weight' value {} at {} does not match "
                                       "Llama-3 rope scaling (factor {}, low {}, high {}, original "
                                       "context {}, expected {}); other schemes are not supported",
                                       f[static_cast<size_t>(i)], i, s.factor, lo, hi, orig, want));
  }
  c.rope_scaling = s;
  return Status::Ok();
}

Status read_config(const GgufFile& g, ModelConfig& c) {
  CLEAVE_ASSIGN_OR_RETURN(c.arch, g.get_string("general.architecture"));
  if (c.arch != "llama" && c.arch != "mistral" && c.arch != "qwen2")
    return Unimplemented(fmt::format("architecture '{}' is not supported (llama, mistral, qwen2 "
                                     "are)", c.arch));
  const std::string p = c.arch + ".";
  c.name = g.get_string_or("general.name", "");
  CLEAVE_ASSIGN_OR_RETURN(c.n_layers, required_int(g, p + "block_count"));
  CLEAVE_ASSIGN_OR_RETURN(c.dim, required_int(g, p + "embedding_length"));
  CLEAVE_ASSIGN_OR_RETURN(c.ffn_dim, required_int(g, p + "feed_forward_length"));
  CLEAVE_ASSIGN_OR_RETURN(c.n_heads, required_int(g, p + "attention.head_count"));
  CLEAVE_ASSIGN_OR_RETURN(c.n_kv_heads, optional_int(g, p + "attention.head_count_kv", c.n_heads));
  CLEAVE_ASSIGN_OR_RETURN(c.context_length, optional_int(g, p + "context_length", 2048));
  if (c.n_heads <= 0) return InvalidArgument(fmt::format("metadata '{}attention.head_count' is 0", p));
  CLEAVE_ASSIGN_OR_RETURN(c.head_dim, optional_int(g, p + "attention.key_length", c.dim / c.n_heads));
  CLEAVE_ASSIGN_OR_RETURN(int64_t v_len, optional_int(g, p + "attention.value_length", c.head_dim));
  if (v_len != c.head_dim)
    return Unimplemented(fmt::format("value head size {} differs from key head size {}", v_len, c.head_dim));
  CLEAVE_ASSIGN_OR_RETURN(double eps, optional_float(g, p + "attention.layer_norm_rms_epsilon", 1e-5));
  CLEAVE_ASSIGN_OR_RETURN(double theta, optional_float(g, p + "rope.freq_base", 10000.0));
  c.rms_eps = static_cast<float>(eps);
  c.rope_theta = static_cast<float>(theta);
  CLEAVE_ASSIGN_OR_RETURN(int64_t rope_dims, optional_int(g, p + "rope.dimension_count", c.head_dim));
  if (rope_dims != c.head_dim)
    return Unimplemented(fmt::format("'{}rope.dimension_count' {} differs from the head size {}: "
                                     "partial rotary embeddings are not supported", p, rope_dims,
                                     c.head_dim));
  c.rope_style = c.arch == "qwen2" ? RopeStyle::kNeox : RopeStyle::kNormal;

  const std::string scaling = g.get_string_or(p + "rope.scaling.type", "none");
  CLEAVE_ASSIGN_OR_RETURN(double factor, optional_float(g, p + "rope.scaling.factor", 1.0));
  if (scaling == "linear" && factor != 1.0) {
    c.rope_scaling.type = RopeScaling::Type::kLinear;
    c.rope_scaling.factor = static_cast<float>(factor);
  } else if (scaling == "llama3") {
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = static_cast<float>(factor);
    CLEAVE_ASSIGN_OR_RETURN(double lo, optional_float(g, p + "rope.scaling.low_freq_factor", 1.0));
    CLEAVE_ASSIGN_OR_RETURN(double hi, optional_float(g, p + "rope.scaling.high_freq_factor", 4.0));
    c.rope_scaling.low_freq_factor = static_cast<float>(lo);
    c.rope_scaling.high_freq_factor = static_cast<float>(hi);
    CLEAVE_ASSIGN_OR_RETURN(c.rope_scaling.original_context,
                            optional_int(g, p + "rope.scaling.original_context_length", 8192));
  } else if (scaling != "none" && scaling != "linear") {
    return Unimplemented(fmt::format("'{}rope.scaling.type' = '{}' is not supported (none, linear, "
                                     "llama3 are)", p, scaling));
  }
  if (const GgufTensorInfo* rf = g.find_tensor("rope_freqs.weight"); rf && c.head_dim > 0)
    CLEAVE_RETURN_IF_ERROR(rope_scaling_from_freqs(*rf, g, p, c));

  const GgufTensorInfo* embd = g.find_tensor("token_embd.weight");
  if (!embd) return NotFound("tensor 'token_embd.weight' is missing");
  c.vocab_size = embd->shape.front();
  if (g.find(p + "vocab_size")) {
    CLEAVE_ASSIGN_OR_RETURN(int64_t v, required_int(g, p + "vocab_size"));
    if (v != c.vocab_size)
      return InvalidArgument(fmt::format("'{}vocab_size' is {} but token_embd.weight has {} rows",
                                         p, v, c.vocab_size));
  }
  c.tied_embeddings = g.find_tensor("output.weight") == nullptr;
  c.qkv_bias = g.find_tensor("blk.0.attn_q.bias") != nullptr;
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ModelFile>> load_gguf_model(const std::string& path) {
  CLEAVE_ASSIGN_OR_RETURN(GgufFile g, GgufFile::open(path));
  auto m = std::make_unique<LoadedModel>();
  m->set_source_path(path);
  Status st = read_config(g, m->mutable_config());
  if (!st.ok()) return st.with_context(path);
  if (m->mutable_config().name.empty())
    m->mutable_config().name = std::filesystem::path(path).stem().string();
  auto tok = tokenizer_spec_from_gguf(g);
  if (!tok.ok()) return tok.status().with_context(fmt::format("{}: tokenizer", path));
  m->mutable_tokenizer() = std::move(*tok);
  for (const auto& t : g.tensors()) {
    TensorView v{t.name, t.dtype, t.shape, t.data, t.nbytes};
    m->mutable_tensors().emplace(t.name, std::move(v));
  }
  m->keep_alive(std::make_shared<GgufFile>(std::move(g)));
  return std::unique_ptr<ModelFile>(std::move(m));
}

}  // namespace cleave::detail
