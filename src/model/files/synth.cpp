// Synthetic Llama GGUF files (see synth.h).
#include "cleave/model/synth.h"

#include <cmath>
#include <cstring>

#include "cleave/model/quants.h"
#include "fmt/format.h"

namespace cleave {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Approximately normal values from sums of four 24-bit uniforms (Irwin-Hall), scaled to unit
// variance: pure arithmetic, so identical on every platform.
class NormalStream {
 public:
  NormalStream(uint64_t seed, std::string_view name) : state_(seed ^ fnv1a(name)) {
    splitmix64(state_);
  }
  float next() {
    const uint64_t a = splitmix64(state_), b = splitmix64(state_);
    constexpr float k = 1.0f / 16777216.0f;
    const float s = static_cast<float>(a >> 40) * k + static_cast<float>((a >> 8) & 0xffffff) * k +
                    static_cast<float>(b >> 40) * k + static_cast<float>((b >> 8) & 0xffffff) * k;
    return (s - 2.0f) * 1.7320508f;  // variance of the sum is 4/12
  }

 private:
  uint64_t state_;
};

GgufWriter::FillFn random_matrix(uint64_t seed, std::string name, int64_t rows, int64_t cols,
                                 DType dt, float stddev) {
  return [=](std::span<std::byte> dst) -> Status {
    NormalStream rng(seed, name);
    std::vector<float> row(static_cast<size_t>(cols));
    const uint64_t row_bytes = *dtype_row_bytes(dt, static_cast<uint64_t>(cols));
    if (dst.size() != row_bytes * static_cast<uint64_t>(rows))
      return Internal(fmt::format("tensor '{}': buffer of {} bytes, expected {}", name, dst.size(),
                                  row_bytes * static_cast<uint64_t>(rows)));
    for (int64_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = rng.next() * stddev;
      encode_row(dt, row.data(), cols, dst.data() + static_cast<uint64_t>(r) * row_bytes);
    }
    return Status::Ok();
  };
}

std::vector<std::byte> ones_f32(int64_t n) {
  std::vector<std::byte> out(static_cast<size_t>(n) * 4);
  const float one = 1.0f;
  for (int64_t i = 0; i < n; ++i) std::memcpy(out.data() + 4 * i, &one, 4);
  return out;
}

}  // namespace

std::string validate_synth_options(const SynthOptions& o) {
  auto range = [](const char* flag, int64_t v, int64_t lo, int64_t hi) -> std::string {
    if (v < lo || v > hi) return fmt::format("{} {} is out of range ({}..{})", flag, v, lo, hi);
    return {};
  };
  for (auto err : {range("--layers", o.layers, 1, 512), range("--dim", o.dim, 8, 32768),
                   range("--heads", o.heads, 1, 512), range("--kv-heads", o.kv_heads, 1, 512),
                   range("--ffn", o.ffn, 1, 262144), range("--vocab", o.vocab, 258, 1 << 22),
                   range("--context", o.context, 1, 1 << 24)})
    if (!err.empty()) return err;
  if (o.dim % o.heads != 0) return fmt::format("--dim {} is not a multiple of --heads {}", o.dim, o.heads);
  if ((o.dim / o.heads) % 2 != 0)
    return fmt::format("--dim {} / --heads {} gives an odd head size {} (RoPE needs it even)",
                       o.dim, o.heads, o.dim / o.heads);
  if (o.kv_heads > o.heads || o.heads % o.kv_heads != 0)
    return fmt::format("--heads {} is not a multiple of --kv-heads {}", o.heads, o.kv_heads);
  if (dtype_is_quantized(o.dtype) && (o.dim % kQK != 0 || o.ffn % kQK != 0))
    return fmt::format("--dtype {} needs --dim ({}) and --ffn ({}) to be multiples of {}",
                       dtype_name(o.dtype), o.dim, o.ffn, kQK);
  if (!(o.rope_theta > 0.0f)) return fmt::format("rope theta {} must be positive", o.rope_theta);
  if (!(o.rms_eps > 0.0f && o.rms_eps < 1.0f)) return fmt::format("rms eps {} must be in (0, 1)", o.rms_eps);
  return {};
}

Result<GgufWriter> synth_gguf(const SynthOptions& o) {
  if (auto err = validate_synth_options(o); !err.empty()) return InvalidArgument(err);
  CLEAVE_ASSIGN_OR_RETURN(TokenizerSpec tok, synth_tokenizer(o.vocab));
  const int64_t hd = o.dim / o.heads;
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.type", "model");
  w.set_string("general.name", o.name.empty()
                                   ? fmt::format("cleave-synth-L{}-D{}-H{}-K{}-F{}-V{}-{}", o.layers,
                                                 o.dim, o.heads, o.kv_heads, o.ffn, o.vocab,
                                                 dtype_name(o.dtype))
                                   : o.name);
  w.set_u32("general.file_type", ggml_file_type(o.dtype));
  w.set_u64("cleave.synth.seed", o.seed);
  w.set_u32("llama.context_length", static_cast<uint32_t>(o.context));
  w.set_u32("llama.embedding_length", static_cast<uint32_t>(o.dim));
  w.set_u32("llama.block_count", static_cast<uint32_t>(o.layers));
  w.set_u32("llama.feed_forward_length", static_cast<uint32_t>(o.ffn));
  w.set_u32("llama.attention.head_count", static_cast<uint32_t>(o.heads));
  w.set_u32("llama.attention.head_count_kv", static_cast<uint32_t>(o.kv_heads));
  w.set_f32("llama.attention.layer_norm_rms_epsilon", o.rms_eps);
  w.set_f32("llama.rope.freq_base", o.rope_theta);
  w.set_u32("llama.rope.dimension_count", static_cast<uint32_t>(hd));
  w.set_u32("llama.vocab_size", static_cast<uint32_t>(o.vocab));

  w.set_string("tokenizer.ggml.model", tok.model);
  w.set_string("tokenizer.ggml.pre", tok.pre);
  std::vector<int64_t> types;
  for (auto t : tok.token_types) types.push_back(static_cast<int64_t>(t));
  w.set_string_array("tokenizer.ggml.tokens", tok.tokens);
  w.set_int_array("tokenizer.ggml.token_type", GgufType::kInt32, std::move(types));
  w.set_string_array("tokenizer.ggml.merges", tok.merges);
  w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(tok.bos_id));
  w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(tok.eos_id));
  w.set_bool("tokenizer.ggml.add_bos_token", tok.add_bos);
  w.set_bool("tokenizer.ggml.add_eos_token", tok.add_eos);

  constexpr float kStd = 0.02f;
  const float resid_std = kStd / std::sqrt(2.0f * static_cast<float>(o.layers));
  const uint64_t s = o.seed;
  // A K-quant asked for rows it cannot hold falls back as llama.cpp's quantiser does.
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols, float stddev) {
    const DType dt = quant_fallback(o.dtype, cols);
    w.add_tensor(name, dt, {rows, cols}, random_matrix(s, name, rows, cols, dt, stddev));
  };
  matrix("token_embd.weight", o.vocab, o.dim, kStd);
  w.add_tensor("output_norm.weight", DType::kF32, {o.dim}, ones_f32(o.dim));
  if (!o.tied_embeddings) matrix("output.weight", o.vocab, o.dim, kStd);
  for (int64_t l = 0; l < o.layers; ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    w.add_tensor(b + "attn_norm.weight", DType::kF32, {o.dim}, ones_f32(o.dim));
    matrix(b + "attn_q.weight", o.heads * hd, o.dim, kStd);
    matrix(b + "attn_k.weight", o.kv_heads * hd, o.dim, kStd);
    matrix(b + "attn_v.weight", o.kv_heads * hd, o.dim, kStd);
    matrix(b + "attn_output.weight", o.dim, o.heads * hd, resid_std);
    w.add_tensor(b + "ffn_norm.weight", DType::kF32, {o.dim}, ones_f32(o.dim));
    matrix(b + "ffn_gate.weight", o.ffn, o.dim, kStd);
    matrix(b + "ffn_up.weight", o.ffn, o.dim, kStd);
    matrix(b + "ffn_down.weight", o.dim, o.ffn, resid_std);
  }
  return w;
}

Status write_synth_model(const SynthOptions& opts, const std::string& path) {
  CLEAVE_ASSIGN_OR_RETURN(GgufWriter w, synth_gguf(opts));
  return w.write(path);
}

}  // namespace cleave
