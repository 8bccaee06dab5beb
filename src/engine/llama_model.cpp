// The Llama-family forward pass over a Backend.
#include "cleave/engine/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <string>

#include "batch_assembler.h"
#include "cleave/engine/cpu_kernels.h"
#include "fmt/format.h"

namespace cleave {
namespace {

struct LayerWeights {
  const TensorView* attn_q = nullptr;
  const TensorView* attn_k = nullptr;
  const TensorView* attn_v = nullptr;
  const TensorView* attn_output = nullptr;
  const TensorView* ffn_gate = nullptr;
  const TensorView* ffn_up = nullptr;
  const TensorView* ffn_down = nullptr;
  // In backend memory (Backend::upload); the biases are null without QKV bias.
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
};

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Result<const TensorView*> find_matrix(const ModelFile& file, const std::string& name,
                                      int64_t rows, int64_t cols) {
  const TensorView* t = file.tensor(name);
  if (t == nullptr) return NotFound(fmt::format("model tensor '{}' is missing", name));
  if (t->shape.size() != 2 || t->rows() != rows || t->cols() != cols) {
    return InvalidArgument(fmt::format("model tensor '{}' has shape {}, expected [{}, {}]", name,
                                       shape_str(t->shape), rows, cols));
  }
  if (t->data == nullptr) return DataLoss(fmt::format("model tensor '{}' has no data", name));
  return t;
}

// A 1-D tensor of n elements (norm weight, bias) converted to f32.
Result<std::vector<float>> load_vector(const ModelFile& file, const std::string& name,
                                       int64_t n) {
  const TensorView* t = file.tensor(name);
  if (t == nullptr) return NotFound(fmt::format("model tensor '{}' is missing", name));
  if (t->elements() != n || t->rows() != 1) {
    return InvalidArgument(fmt::format("model tensor '{}' has shape {}, expected [{}]", name,
                                       shape_str(t->shape), n));
  }
  if (t->data == nullptr) return DataLoss(fmt::format("model tensor '{}' has no data", name));
  std::vector<float> out(static_cast<size_t>(n));
  cpu::tensor_to_f32(*t, out.data());
  return out;
}

// Angular frequency of each rotated pair of a head, with the configured scaling. The base
// frequencies are computed in float as llama2.c and GGML do (theta^(-2j/d)). Llama-3 divisors are
// computed in double as llama.cpp's converter computes the rope_freqs tensor (which the GGUF
// loader checks against the config), so that GGUF and HF files of one model run identically.
Result<std::vector<float>> rope_frequencies(const ModelConfig& cfg) {
  const int64_t half = cfg.head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    inv_freq[j] = 1.0f / std::pow(cfg.rope_theta, static_cast<float>(2 * j) /
                                                      static_cast<float>(cfg.head_dim));
  }
  const RopeScaling& rs = cfg.rope_scaling;
  switch (rs.type) {
    case RopeScaling::Type::kNone:
      break;
    case RopeScaling::Type::kLinear:
      if (!(rs.factor > 0.0f)) {
        return InvalidArgument(fmt::format("rope scaling factor {} must be positive", rs.factor));
      }
      for (auto& f : inv_freq) f /= rs.factor;
      break;
    case RopeScaling::Type::kLlama3: {
      if (!(rs.factor > 0.0f) || !(rs.high_freq_factor > rs.low_freq_factor) ||
          !(rs.low_freq_factor > 0.0f) || rs.original_context <= 0) {
        return InvalidArgument(fmt::format(
            "llama3 rope scaling needs factor > 0, high_freq_factor > low_freq_factor > 0 and "
            "original_max_position_embeddings > 0 (got {}, {}, {}, {})",
            rs.factor, rs.high_freq_factor, rs.low_freq_factor, rs.original_context));
      }
      const double lo = rs.low_freq_factor, hi = rs.high_freq_factor, factor = rs.factor;
      const double old_ctx = static_cast<double>(rs.original_context);
      const double low_wavelen = old_ctx / lo;
      const double high_wavelen = old_ctx / hi;
      for (int64_t j = 0; j < half; ++j) {
        const double freq = 1.0 / std::pow(static_cast<double>(cfg.rope_theta),
                                           static_cast<double>(2 * j) /
                                               static_cast<double>(cfg.head_dim));
        const double wavelen = 2.0 * std::numbers::pi / freq;
        double divisor = 1.0;
        if (wavelen > low_wavelen) {
          divisor = factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (old_ctx / wavelen - lo) / (hi - lo);
          divisor = 1.0 / ((1.0 - smooth) / factor + smooth);
        }
        inv_freq[j] /= static_cast<float>(divisor);
      }
      break;
    }
  }
  return inv_freq;
}

}  // namespace

struct LlamaModel::Impl {
  std::shared_ptr<const ModelFile> file;
  ModelConfig cfg;
  int64_t max_context = 0;
  int64_t max_batch = 0;
  int64_t q_dim = 0, kv_dim = 0;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Backend> backend;

  const TensorView* token_embd = nullptr;
  const TensorView* output = nullptr;
  const float* output_norm = nullptr;  // backend memory, as every pointer below
  std::vector<LayerWeights> layers;
  const float* inv_freq = nullptr;
  uint64_t weight_bytes = 0;

  // Scratch, [max_batch, width] each; logits_scratch is [logit_group, vocab].
  float *x = nullptr, *xb = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *attn = nullptr,
        *hb = nullptr, *hb2 = nullptr, *logits_scratch = nullptr;
  int64_t logit_group = 0;
  engine_detail::BatchAssembler assembler;

  // Runs the assembler's current sub-batch through every layer; calls hooks.on_layer_done when
  // it is the batch's last sub-batch. Then writes the logits it owes.
  void run_sub_batch(KvBlockPool& kv, const ForwardHooks& hooks);
  // Embedding and every layer of the current sub-batch; with `hooks`, on_layer_done for each
  // layer whose K/V are in the pool (from next_hook on).
  void run_layers(const PagedKv& kv, const ForwardHooks* hooks, int64_t& next_hook);
  void write_logits(const ForwardHooks& hooks);
  // Hands the backend the model's weights and takes its scratch (the vectors went up as they
  // were loaded).
  Status prepare_backend();
};

Result<std::unique_ptr<LlamaModel>> LlamaModel::create(std::shared_ptr<const ModelFile> model,
                                                       const EngineOptions& opts) {
  if (!model) return InvalidArgument("LlamaModel::create: no model");
  auto impl = std::make_unique<Impl>();
  impl->file = model;
  const ModelConfig& cfg = model->config();
  impl->cfg = cfg;
  if (std::string problem = cfg.validate(); !problem.empty()) {
    return InvalidArgument(fmt::format("model '{}': {}", model->source_path(), problem));
  }
  if (cfg.head_dim % 2 != 0) {
    return InvalidArgument(fmt::format("model '{}': head_dim {} must be even for RoPE",
                                       model->source_path(), cfg.head_dim));
  }
  CLEAVE_RETURN_IF_ERROR(model->validate_tensors());
  if (opts.max_context < 0 || opts.max_batch_tokens < 0) {
    return InvalidArgument(fmt::format("max_context {} and max_batch_tokens {} must be >= 0",
                                       opts.max_context, opts.max_batch_tokens));
  }
  impl->max_context = opts.max_context > 0 ? opts.max_context : cfg.context_length;
  impl->max_batch = std::min(opts.max_batch_tokens > 0 ? opts.max_batch_tokens : 256,
                             impl->max_context);
  impl->q_dim = cfg.n_heads * cfg.head_dim;
  impl->kv_dim = cfg.n_kv_heads * cfg.head_dim;
  const int64_t dim = cfg.dim, ffn = cfg.ffn_dim;
  const ModelFile& f = *model;
  impl->pool = std::make_unique<ThreadPool>(opts.device.starts_with("cuda") ? 1 : opts.threads,
                                            "compute");
  CLEAVE_ASSIGN_OR_RETURN(impl->backend, make_backend(opts.device, *impl->pool));
  Backend& be = *impl->backend;

  uint64_t bytes = 0;
  auto matrix = [&](const std::string& name, int64_t rows,
                    int64_t cols) -> Result<const TensorView*> {
    CLEAVE_ASSIGN_OR_RETURN(const TensorView* t, find_matrix(f, name, rows, cols));
    bytes += t->nbytes;
    return t;
  };
  // A vector (norm weight, bias) as f32 in backend memory.
  auto vector = [&](const std::string& name, int64_t n) -> Result<const float*> {
    bytes += f.tensor(name) ? f.tensor(name)->nbytes : 0;
    CLEAVE_ASSIGN_OR_RETURN(std::vector<float> v, load_vector(f, name, n));
    return be.upload(v);
  };

  CLEAVE_ASSIGN_OR_RETURN(impl->token_embd, find_matrix(f, "token_embd.weight", cfg.vocab_size, dim));
  if (f.tensor("output.weight") != nullptr) {
    CLEAVE_ASSIGN_OR_RETURN(impl->output, matrix("output.weight", cfg.vocab_size, dim));
  } else {
    impl->output = impl->token_embd;  // tied embeddings
    bytes += impl->token_embd->nbytes;
  }
  CLEAVE_ASSIGN_OR_RETURN(impl->output_norm, vector("output_norm.weight", dim));
  CLEAVE_ASSIGN_OR_RETURN(std::vector<float> inv_freq, rope_frequencies(cfg));
  CLEAVE_ASSIGN_OR_RETURN(impl->inv_freq, be.upload(inv_freq));
  impl->layers.resize(static_cast<size_t>(cfg.n_layers));
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    LayerWeights& w = impl->layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("blk.{}.", l);
    CLEAVE_ASSIGN_OR_RETURN(w.attn_norm, vector(p + "attn_norm.weight", dim));
    CLEAVE_ASSIGN_OR_RETURN(w.attn_q, matrix(p + "attn_q.weight", impl->q_dim, dim));
    CLEAVE_ASSIGN_OR_RETURN(w.attn_k, matrix(p + "attn_k.weight", impl->kv_dim, dim));
    CLEAVE_ASSIGN_OR_RETURN(w.attn_v, matrix(p + "attn_v.weight", impl->kv_dim, dim));
    CLEAVE_ASSIGN_OR_RETURN(w.attn_output, matrix(p + "attn_output.weight", dim, impl->q_dim));
    CLEAVE_ASSIGN_OR_RETURN(w.ffn_norm, vector(p + "ffn_norm.weight", dim));
    CLEAVE_ASSIGN_OR_RETURN(w.ffn_gate, matrix(p + "ffn_gate.weight", ffn, dim));
    CLEAVE_ASSIGN_OR_RETURN(w.ffn_up, matrix(p + "ffn_up.weight", ffn, dim));
    CLEAVE_ASSIGN_OR_RETURN(w.ffn_down, matrix(p + "ffn_down.weight", dim, ffn));
    if (cfg.qkv_bias) {
      CLEAVE_ASSIGN_OR_RETURN(w.q_bias, vector(p + "attn_q.bias", impl->q_dim));
      CLEAVE_ASSIGN_OR_RETURN(w.k_bias, vector(p + "attn_k.bias", impl->kv_dim));
      CLEAVE_ASSIGN_OR_RETURN(w.v_bias, vector(p + "attn_v.bias", impl->kv_dim));
    }
  }
  impl->weight_bytes = bytes;
  CLEAVE_RETURN_IF_ERROR(impl->prepare_backend());
  impl->assembler.reserve(impl->max_batch);
  return std::unique_ptr<LlamaModel>(new LlamaModel(std::move(impl)));
}

Status LlamaModel::Impl::prepare_backend() {
  Backend& be = *backend;
  be.reserve_attention({.max_context = max_context,
                        .max_tokens = max_batch,
                        .n_heads = cfg.n_heads,
                        .head_dim = cfg.head_dim});
  std::vector<const TensorView*> weights{token_embd, output};
  for (const LayerWeights& w : layers) {
    weights.insert(weights.end(), {w.attn_q, w.attn_k, w.attn_v, w.attn_output, w.ffn_gate,
                                   w.ffn_up, w.ffn_down});
  }
  CLEAVE_RETURN_IF_ERROR(be.prepare_weights(weights));
  auto scratch = [&](float** dst, int64_t width) -> Status {
    CLEAVE_ASSIGN_OR_RETURN(*dst, be.alloc(max_batch * width));
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(scratch(&x, cfg.dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&xb, cfg.dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&q, q_dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&k, kv_dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&v, kv_dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&attn, q_dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&hb, cfg.ffn_dim));
  CLEAVE_RETURN_IF_ERROR(scratch(&hb2, cfg.ffn_dim));
  // Logits are computed for up to this many sequences at a time (one pass over the output
  // matrix each), within about 16 MiB of scratch.
  logit_group = std::clamp<int64_t>((int64_t{16} << 20) / (4 * cfg.vocab_size), 1,
                                    std::min<int64_t>(max_batch, 64));
  CLEAVE_ASSIGN_OR_RETURN(logits_scratch, be.alloc(logit_group * cfg.vocab_size));
  return Status::Ok();
}

LlamaModel::LlamaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaModel::~LlamaModel() = default;

const ModelConfig& LlamaModel::config() const { return impl_->cfg; }
int64_t LlamaModel::max_context() const { return impl_->max_context; }
ThreadPool& LlamaModel::pool() { return *impl_->pool; }
Backend& LlamaModel::backend() { return *impl_->backend; }
KvLayout LlamaModel::kv_layout(int64_t block_size, int64_t num_blocks, DType kv_dtype) const {
  return KvLayout::for_model(impl_->cfg, block_size, num_blocks, kv_dtype);
}
uint64_t LlamaModel::weight_bytes_per_token() const { return impl_->weight_bytes; }

Result<std::unique_ptr<KvBlockPool>> LlamaModel::create_kv_pool(int64_t block_size,
                                                                int64_t num_blocks,
                                                                DType kv_dtype) {
  const KvLayout layout = kv_layout(block_size, num_blocks, kv_dtype);
  if (std::string err = layout.validate(); !err.empty()) {
    return InvalidArgument(fmt::format("KV pool layout ({}): {}", layout.to_string(), err));
  }
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<KvStorage> storage,
                          impl_->backend->make_kv_storage(layout.total_bytes()));
  return KvBlockPool::create(layout, std::move(storage));
}

Status LlamaModel::forward(std::span<const int32_t> tokens, int64_t start_pos,
                           std::span<const BlockId> block_table, KvBlockPool& kv,
                           std::span<float> logits) {
  if (static_cast<int64_t>(logits.size()) < impl_->cfg.vocab_size) {
    return InvalidArgument(fmt::format("forward: logits buffer holds {} floats, the vocabulary has {}",
                                       logits.size(), impl_->cfg.vocab_size));
  }
  const BatchSequence seq{.tokens = tokens, .start_pos = start_pos, .block_table = block_table,
                          .logits = logits};
  return forward_batch(std::span<const BatchSequence>(&seq, 1), kv);
}

Status LlamaModel::forward_batch(std::span<const BatchSequence> batch, KvBlockPool& kv,
                                 const ForwardHooks& hooks) {
  Impl& m = *impl_;
  CLEAVE_RETURN_IF_ERROR(
      engine_detail::BatchAssembler::validate(batch, kv.layout(), m.cfg, m.max_context));
  if (kv.storage().device() != m.backend->device()) {
    return InvalidArgument(fmt::format(
        "forward_batch: the KV pool is in {} memory and the {} backend computes in {} memory "
        "(make the pool with LlamaModel::create_kv_pool)",
        kv.storage().on_device() ? fmt::format("cuda:{}", kv.storage().device()) : "host",
        m.backend->name(),
        m.backend->device() >= 0 ? fmt::format("cuda:{}", m.backend->device()) : "host"));
  }
  if (!hooks.on_token_logits) {
    for (size_t s = 0; s < batch.size(); ++s) {
      if (batch[s].all_logits) {
        return InvalidArgument(fmt::format(
            "forward_batch: sequence {} asks for every token's logits, and no on_token_logits "
            "hook takes them",
            s));
      }
    }
  }
  m.assembler.begin(batch, kv.layout().block_size);
  while (m.assembler.next()) {
    m.run_sub_batch(kv, hooks);
    CLEAVE_RETURN_IF_ERROR(m.backend->check());
  }
  return Status::Ok();
}

void LlamaModel::Impl::run_layers(const PagedKv& kv, const ForwardHooks* hooks,
                                  int64_t& next_hook) {
  const TokenBatch& tb = assembler.tokens();
  const int64_t n = tb.n_tokens;
  const int64_t dim = cfg.dim;
  Backend& be = *backend;
  be.embedding(*token_embd, assembler.token_ids(), x);
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    const LayerWeights& w = layers[static_cast<size_t>(l)];

    // Attention block: K and V of these tokens go into their pool slots, then every token
    // attends over its sequence's keys.
    be.rmsnorm(x, w.attn_norm, cfg.rms_eps, n, dim, xb);
    const TensorView* qkv_w[] = {w.attn_q, w.attn_k, w.attn_v};
    float* const qkv_y[] = {q, k, v};
    be.matmul_many(qkv_w, xb, n, qkv_y);
    if (cfg.qkv_bias) {
      be.add_bias(q, w.q_bias, n, q_dim);
      be.add_bias(k, w.k_bias, n, kv_dim);
      be.add_bias(v, w.v_bias, n, kv_dim);
    }
    const RopeArgs rope_q{.x = q, .row_stride = q_dim, .n_tokens = n, .positions = tb.positions,
                          .n_heads = cfg.n_heads, .head_dim = cfg.head_dim,
                          .style = cfg.rope_style, .inv_freq = inv_freq};
    RopeArgs rope_k = rope_q;
    rope_k.x = k;
    rope_k.row_stride = kv_dim;
    rope_k.n_heads = cfg.n_kv_heads;
    be.rope_write_kv(rope_q, rope_k,
                     KvWriteArgs{.batch = &tb, .k = k, .v = v, .kv = kv, .layer = l});
    if (hooks != nullptr) {
      be.mark_kv_written(l);
      while (next_hook <= l && be.kv_written(next_hook, false)) hooks->on_layer_done(next_hook++);
    }
    be.attention(AttentionArgs{.batch = &tb, .q = q, .out = attn, .kv = kv,
                               .layer = l, .n_heads = cfg.n_heads, .n_kv_heads = cfg.n_kv_heads,
                               .head_dim = cfg.head_dim});
    be.matmul_add(*w.attn_output, attn, n, x, xb);

    // SwiGLU feed-forward block.
    be.rmsnorm(x, w.ffn_norm, cfg.rms_eps, n, dim, xb);
    be.matmul_glu(*w.ffn_gate, *w.ffn_up, xb, n, hb, hb2);
    be.matmul_add(*w.ffn_down, hb, n, x, xb);
  }
}

void LlamaModel::Impl::run_sub_batch(KvBlockPool& pool, const ForwardHooks& hooks) {
  const TokenBatch& tb = assembler.tokens();
  const bool last_sub_batch = assembler.last();
  const KvLayout& layout = pool.layout();
  const PagedKv kv{.base = pool.data(), .num_blocks = layout.num_blocks,
                   .block_size = layout.block_size, .kv_dim = kv_dim, .dtype = layout.dtype,
                   .element_bytes = dtype_info(layout.dtype).block_bytes};
  Backend& be = *backend;
  be.begin_batch(tb, assembler.token_ids());
  // The layer hooks are called in layer order as soon as each layer's K/V are in the pool: at
  // once on a synchronous backend, else as the device gets there (the host queues later layers
  // meanwhile, so the export overlaps their compute).
  const bool hook_layers = last_sub_batch && static_cast<bool>(hooks.on_layer_done);
  int64_t next_hook = 0;
  auto layers_pass = [&] { run_layers(kv, hook_layers ? &hooks : nullptr, next_hook); };
  // Without layer hooks (decode steps), the pass may be a recording the backend replays.
  const Backend::Replay mode =
      hook_layers ? Backend::Replay::kEager : be.begin_replayable(kv);
  if (mode == Backend::Replay::kEager) {
    layers_pass();
  } else if (mode == Backend::Replay::kRecording) {
    layers_pass();
    if (!be.end_replayable()) layers_pass();
  }
  while (hook_layers && next_hook < cfg.n_layers) {
    be.kv_written(next_hook, true);
    hooks.on_layer_done(next_hook++);
  }
  write_logits(hooks);
}

void LlamaModel::Impl::write_logits(const ForwardHooks& hooks) {
  const auto rows = assembler.logit_rows();
  const int64_t dim = cfg.dim, vocab = cfg.vocab_size;
  Backend& be = *backend;
  for (size_t g0 = 0; g0 < rows.size(); g0 += static_cast<size_t>(logit_group)) {
    const size_t g1 = std::min(rows.size(), g0 + static_cast<size_t>(logit_group));
    // Final norm of each wanted token's residual row, packed into xb, then one matmul.
    for (size_t i = g0; i < g1; ++i) {
      be.rmsnorm(x + rows[i].row * dim, output_norm, cfg.rms_eps, 1, dim,
                 xb + static_cast<int64_t>(i - g0) * dim);
    }
    const auto group = static_cast<int64_t>(g1 - g0);
    be.matmul(*output, xb, group, logits_scratch);
    const float* host = be.to_host(logits_scratch, group * vocab);
    for (size_t i = g0; i < g1; ++i) {
      const float* row = host + static_cast<int64_t>(i - g0) * vocab;
      if (rows[i].logits.empty()) {
        hooks.on_token_logits(rows[i].sequence, rows[i].index,
                              std::span<const float>(row, static_cast<size_t>(vocab)));
      } else {
        std::memcpy(rows[i].logits.data(), row, static_cast<size_t>(vocab) * sizeof(float));
      }
    }
  }
}

}  // namespace cleave
