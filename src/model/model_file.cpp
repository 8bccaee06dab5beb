#include "cleave/model/model_file.h"

#include <cstring>

#include "cleave/model/quants.h"
#include "fmt/format.h"
#include "fmt/ranges.h"

namespace cleave {
namespace {

class Fnv64 {
 public:
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= b[i];
      h_ *= 0x100000001b3ull;
    }
  }
  void add(std::string_view s) {
    add_pod(static_cast<uint64_t>(s.size()));
    add(s.data(), s.size());
  }
  template <typename T>
  void add_pod(T v) { add(&v, sizeof v); }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

Status expect_tensor(const ModelFile& m, const std::string& name, std::vector<int64_t> shape,
                     bool matrix) {
  const TensorView* t = m.tensor(name);
  if (!t) return NotFound(fmt::format("tensor '{}' is missing", name));
  if (t->shape != shape)
    return InvalidArgument(fmt::format("tensor '{}' has shape [{}], expected [{}]", name,
                                       fmt::join(t->shape, ", "), fmt::join(shape, ", ")));
  if (!matrix && dtype_is_quantized(t->dtype))
    return InvalidArgument(fmt::format("tensor '{}' is {}; vectors must be f32, f16 or bf16",
                                       name, dtype_name(t->dtype)));
  auto row = dtype_row_bytes(t->dtype, static_cast<uint64_t>(shape.back()));
  uint64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= static_cast<uint64_t>(shape[i]);
  if (!row || *row * rows != t->nbytes || t->data == nullptr)
    return InvalidArgument(fmt::format("tensor '{}' holds {} bytes, which does not match shape "
                                       "[{}] in {}", name, t->nbytes, fmt::join(shape, ", "),
                                       dtype_name(t->dtype)));
  return Status::Ok();
}

}  // namespace

const TensorView* ModelFile::tensor(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Status ModelFile::validate_tensors() const {
  const ModelConfig& c = config_;
  if (auto err = c.validate(); !err.empty())
    return InvalidArgument(fmt::format("{}: {}", source_path_, err));
  const int64_t q_rows = c.n_heads * c.head_dim;
  const int64_t kv_rows = c.n_kv_heads * c.head_dim;
  auto wrap = [&](Status s) { return s.ok() ? s : s.with_context(source_path_); };
  CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, "token_embd.weight", {c.vocab_size, c.dim}, true)));
  CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, "output_norm.weight", {c.dim}, false)));
  if (c.tied_embeddings) {
    if (tensor("output.weight"))
      return InvalidArgument(fmt::format("{}: the config says the output embedding is tied but "
                                         "output.weight is present", source_path_));
  } else {
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, "output.weight", {c.vocab_size, c.dim}, true)));
  }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_norm.weight", {c.dim}, false)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_q.weight", {q_rows, c.dim}, true)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_k.weight", {kv_rows, c.dim}, true)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_v.weight", {kv_rows, c.dim}, true)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_output.weight", {c.dim, q_rows}, true)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "ffn_norm.weight", {c.dim}, false)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "ffn_gate.weight", {c.ffn_dim, c.dim}, true)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "ffn_up.weight", {c.ffn_dim, c.dim}, true)));
    CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "ffn_down.weight", {c.dim, c.ffn_dim}, true)));
    if (c.qkv_bias) {
      CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_q.bias", {q_rows}, false)));
      CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_k.bias", {kv_rows}, false)));
      CLEAVE_RETURN_IF_ERROR(wrap(expect_tensor(*this, b + "attn_v.bias", {kv_rows}, false)));
    }
  }
  return Status::Ok();
}

std::string ModelFile::fingerprint() const {
  Fnv64 h;
  const ModelConfig& c = config_;
  h.add(c.arch);
  for (int64_t v : {c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim,
                    c.vocab_size, c.context_length})
    h.add_pod(v);
  h.add_pod(c.rms_eps);
  h.add_pod(c.rope_theta);
  h.add_pod(static_cast<int>(c.rope_style));
  h.add_pod(static_cast<int>(c.rope_scaling.type));
  h.add_pod(c.rope_scaling.factor);
  h.add_pod(c.tied_embeddings);
  h.add_pod(c.qkv_bias);
  for (const auto& [name, t] : tensors_) {  // std::map: sorted by name
    h.add(name);
    h.add(dtype_name(t.dtype));
    for (auto d : t.shape) h.add_pod(d);
    h.add_pod(t.nbytes);
    // A sample of the data: the first and last 4 KiB and 64 strided 64-byte windows.
    const uint64_t n = t.nbytes;
    if (!t.data) continue;
    if (n <= 16384) {
      h.add(t.data, n);
    } else {
      h.add(t.data, 4096);
      h.add(t.data + n - 4096, 4096);
      const uint64_t step = (n - 64) / 64;
      for (uint64_t k = 0; k < 64; ++k) h.add(t.data + k * step, 64);
    }
  }
  return fmt::format("{:016x}", h.value());
}

}  // namespace cleave
