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
// depends only on that token's data (and, for attention, its position and its sequence's keys,
// taken in key order 0..pos), never on n_tokens, on the thread count, on the block ids or block
// size, or on what else is in the call. A backend that cannot promise this must not
// implement this interface.
//
// Thread-safety: one caller at a time (the engine thread).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "cleave/common/thread_pool.h"
#include "cleave/kvcache/kv_layout.h"
#include "cleave/model/model_config.h"
#include "cleave/model/tensor_view.h"

namespace cleave {

// Where the tokens of one batch sit: in their sequences and in the paged KV pool. A batch holds
// tokens of one or more sequences, in any order. The index arrays are host memory (a device
// backend uploads them) and stay valid for every layer of the batch.
struct TokenBatch {
  int64_t n_tokens = 0;
  const int64_t* positions = nullptr;   // [n_tokens]: position of the token in its sequence
  const int64_t* kv_slots = nullptr;    // [n_tokens]: where its K/V go: block * block_size + offset
  const int32_t* seq = nullptr;         // [n_tokens]: index of its sequence
  const int64_t* seq_blocks = nullptr;  // [n_seqs]: sequence s's block table is block_ids +
                                        // seq_blocks[s]; it covers positions 0..max position
  const BlockId* block_ids = nullptr;   // the block tables of all sequences, concatenated
};

// A paged KV pool (kvcache/kv_layout.h): the unit (layer, block) is K of block_size tokens
// ([block_size, kv_dim] elements of `dtype`: f32, f16 or bf16) followed by their V; units are
// layer-major.
struct PagedKv {
  std::byte* base = nullptr;  // the pool buffer, in backend memory
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t kv_dim = 0;         // n_kv_heads * head_dim
  DType dtype = DType::kF32;
  int64_t element_bytes = 4;  // of dtype
  int64_t row_bytes() const { return kv_dim * element_bytes; }
  int64_t unit_bytes() const { return 2 * block_size * row_bytes(); }
  // K of (layer, block); its V follows at + block_size * row_bytes().
  std::byte* k(int64_t layer, BlockId block) const {
    return base + (layer * num_blocks + block) * unit_bytes();
  }
};

// Writes K and V rows of the batch's tokens into their slots of one layer.
struct KvWriteArgs {
  const TokenBatch* batch = nullptr;
  const float* k = nullptr;  // [n_tokens, kv_dim], RoPE already applied
  const float* v = nullptr;  // [n_tokens, kv_dim]
  PagedKv kv;
  int64_t layer = 0;
};

// Causal attention of every token of a batch over its own sequence's keys (one layer). Token t
// (position p) of sequence s sees keys 0..p of s, read through s's block table; its own K/V must
// already be in the pool.
struct AttentionArgs {
  const TokenBatch* batch = nullptr;
  const float* q = nullptr;  // [n_tokens, n_heads * head_dim], RoPE already applied
  float* out = nullptr;      // [n_tokens, n_heads * head_dim]
  PagedKv kv;
  int64_t layer = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;    // query head h reads KV head h / (n_heads / n_kv_heads)
  int64_t head_dim = 0;
};

// Rotary position embedding of a batch of tokens.
struct RopeArgs {
  float* x = nullptr;         // [n_tokens, row_stride]; heads are the first n_heads * head_dim
  int64_t row_stride = 0;
  int64_t n_tokens = 0;
  const int64_t* positions = nullptr;  // [n_tokens] (host memory)
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
  // model before the first forward pass; attention() never allocates afterwards.
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
  virtual void write_kv(const KvWriteArgs& args) = 0;
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
