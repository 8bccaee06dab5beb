// The compute backend interface that the forward pass runs on (DESIGN.md §3 "Backends").
//
// A backend owns its compute resources (a thread pool on CPU, streams on CUDA) and implements
// the handful of operations a Llama-family layer needs. The forward pass only talks to this
// interface, so it does not know which backend it runs on.
//
// Memory: every float pointer is an activation buffer in the backend's memory (host memory for
// the CPU backend). Weights are TensorViews in their file dtype; the backend converts them inside
// its kernels. Activations are row-major [n_tokens, width]; a "row stride" is in floats.
//
// Batch invariance: every operation computes each token's output with a reduction order that
// depends only on that token's data (and, for attention, its position), never on n_tokens, on
// the thread count or on what else is in the call. A backend that cannot promise this must not
// implement this interface.
//
// Thread-safety: one caller at a time (the engine thread).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "cleave/common/thread_pool.h"
#include "cleave/model/model_config.h"
#include "cleave/model/tensor_view.h"

namespace cleave {

// Causal attention of one chunk of tokens of one sequence over its KV cache (one layer).
struct AttentionArgs {
  const float* q = nullptr;  // [n_tokens, n_heads * head_dim], RoPE already applied
  const float* k = nullptr;  // layer's K cache: [capacity, n_kv_heads * head_dim]
  const float* v = nullptr;  // layer's V cache, same layout
  float* out = nullptr;      // [n_tokens, n_heads * head_dim]
  int64_t n_tokens = 0;
  int64_t start_pos = 0;     // token t is at position start_pos + t and sees keys 0..start_pos+t
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;    // query head h reads KV head h / (n_heads / n_kv_heads)
  int64_t head_dim = 0;
};

// Rotary position embedding of a chunk of tokens.
struct RopeArgs {
  float* x = nullptr;         // [n_tokens, row_stride]; heads are the first n_heads * head_dim
  int64_t row_stride = 0;
  int64_t n_tokens = 0;
  int64_t start_pos = 0;      // token t is at position start_pos + t
  int64_t n_heads = 0;
  int64_t head_dim = 0;
  RopeStyle style = RopeStyle::kNormal;
  const float* inv_freq = nullptr;  // head_dim / 2 angular frequencies (scaling applied)
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  // Compute threads (1 for a backend without host threads).
  virtual int threads() const = 0;

  // Reserves per-thread scratch for attention over up to `max_context` keys. Called once by the
  // model before the first forward(); attention() never allocates afterwards.
  virtual void reserve_attention(int64_t max_context) = 0;

  // y[t] = W x[t] for t in [0, n_tokens): W is [rows, cols], x is [n_tokens, cols] and y is
  // [n_tokens, rows] (both contiguous).
  virtual void matmul(const TensorView& w, const float* x, int64_t n_tokens, float* y) = 0;
  // out[t] = row tokens[t] of `table` as f32 ([n_tokens, cols]). Ids must be in range.
  virtual void embedding(const TensorView& table, std::span<const int32_t> tokens,
                         float* out) = 0;
  // out[t] = x[t] / rms(x[t]) * weight, rows of `dim`; x and out may alias.
  virtual void rmsnorm(const float* x, const float* weight, float eps, int64_t n_tokens,
                       int64_t dim, float* out) = 0;
  virtual void rope(const RopeArgs& args) = 0;
  virtual void attention(const AttentionArgs& args) = 0;
  // out[i] = silu(gate[i]) * up[i] over n elements; out may alias gate.
  virtual void silu_mul(const float* gate, const float* up, int64_t n, float* out) = 0;
  // y[i] += x[i] over n elements.
  virtual void add(float* y, const float* x, int64_t n) = 0;
  // y[t] += bias for each of n_tokens rows of `dim`.
  virtual void add_bias(float* y, const float* bias, int64_t n_tokens, int64_t dim) = 0;
};

// The CPU backend over cpu_kernels.h, threaded over `pool` (which must outlive it).
std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool);

}  // namespace cleave
