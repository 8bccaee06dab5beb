// The compute backend interface that the forward pass runs on (DESIGN.md §3 "Backends").
//
// A backend owns its compute resources (a thread pool on CPU, streams on CUDA) and implements
// the handful of operations a Llama-family layer needs. The forward pass only talks to this
// interface, so it does not know which backend it runs on.
//
// Memory: every float pointer is in the backend's memory (host memory for the CPU backend,
// device memory for CUDA): activation buffers from alloc(), constant vectors (norm weights,
// biases, RoPE frequencies) from upload(). Weights are TensorViews in their file dtype, handed
// to prepare_weights() once (a device backend uploads them there, converting where its kernels
// need another layout); matmul() and embedding() then take the same TensorView. Activations are
// row-major [n_tokens, width]; a "row stride" is in floats. Results reach the host through
// to_host(). A KV pool's storage comes from make_kv_storage(), so that it lives where the
// backend's kernels read it.
//
// Order: a backend may run its operations asynchronously (CUDA: one stream), in call order.
// Index arrays (TokenBatch, token ids) are host memory handed to begin_batch() once per
// sub-batch; the operations until the next begin_batch() read that copy (a device backend
// uploads it once), whatever host pointers their arguments carry. After write_kv() of a layer the
// model calls mark_kv_written(layer); kv_written(layer, wait) says whether those K/V are in the
// pool's memory (with wait, once they are), so the per-layer KV export overlaps later layers.
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
#include <string>
#include <string_view>

#include "cleave/common/status.h"
#include "cleave/common/thread_pool.h"
#include "cleave/kvcache/kv_layout.h"
#include "cleave/kvcache/kv_storage.h"
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
  int32_t n_seqs = 0;                   // entries of seq_blocks
  int64_t n_block_ids = 0;              // entries of block_ids
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

// The largest attention() calls a model makes: batches of up to max_tokens tokens, each over up
// to max_context keys, with n_heads query heads of head_dim elements.
struct AttentionLimits {
  int64_t max_context = 0;
  int64_t max_tokens = 0;
  int64_t n_heads = 0;
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

// A byte range of a KV pool (kv_layout.h offsets).
struct KvRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// A host mirror of a KV pool in device memory, for a transfer engine whose provider cannot
// reach device memory (no FI_HMEM: tcp, shm, Debian's libfabric): pinned host memory of the
// pool's size and layout. The prefill side copies each layer's new K/V to the mirror before
// the writes read it; the decode side receives into the mirror and copies a request's blocks
// to the device before its first decode step. Costs host memory equal to the pool.
// Thread-safety: one caller at a time (the engine thread).
class KvStaging {
 public:
  virtual ~KvStaging() = default;
  virtual std::byte* host() = 0;
  virtual uint64_t size_bytes() const = 0;
  // Copies the ranges device -> mirror (to_host) or mirror -> device, and returns once they are
  // done. Ranges must lie inside the pool.
  virtual Status to_host(std::span<const KvRange> ranges) = 0;
  virtual Status to_device(std::span<const KvRange> ranges) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  // Compute threads (1 for a backend without host threads).
  virtual int threads() const = 0;
  // -1 for host memory; else the CUDA device whose memory the backend computes in.
  virtual int device() const = 0;

  // ---- memory (set-up; none of these is called per step) ----
  // n floats of zeroed activation memory, owned by the backend (freed with it).
  virtual Result<float*> alloc(int64_t n) = 0;
  // A copy of `host` in backend memory, owned by the backend.
  virtual Result<const float*> upload(std::span<const float> host) = 0;
  // Makes these weight tensors ready for matmul() and embedding() (uploads them once). A tensor
  // handed again is skipped. Errors: a dtype the backend cannot read, memory.
  virtual Status prepare_weights(std::span<const TensorView* const> tensors) = 0;
  // Storage for a KV pool of `bytes` bytes where the backend's kernels read it.
  virtual Result<std::unique_ptr<KvStorage>> make_kv_storage(uint64_t bytes) = 0;
  // A host mirror of `pool` (storage from make_kv_storage). FailedPrecondition for a pool in
  // host memory (it needs none).
  virtual Result<std::unique_ptr<KvStaging>> make_kv_staging(KvStorage& pool) = 0;

  // ---- per step ----
  // The index arrays and token ids of the next operations (see "Order" above).
  virtual void begin_batch(const TokenBatch& batch, std::span<const int32_t> tokens) = 0;
  virtual void mark_kv_written(int64_t layer) = 0;
  virtual bool kv_written(int64_t layer, bool wait) = 0;
  // n floats of backend memory at `src`, readable on the host once this returns (it waits for
  // the work before it); valid until the next to_host() call or operation.
  virtual const float* to_host(const float* src, int64_t n) = 0;
  // Recorded steps (CUDA graphs): the model brackets the operations of a sub-batch that depend
  // only on begin_batch()'s arrays and its fixed buffers (not on the layer hooks) with these.
  // kReplayed: the backend has launched a recording of the same shape (same token count and
  // attention splits, the same pool: base, block count, block size, dtype): skip the
  // operations. kRecording: issue them, then call end_replayable(), which launches the
  // recording; false means recording failed and nothing ran: issue them again. kEager: issue
  // them.
  enum class Replay { kEager, kRecording, kReplayed };
  virtual Replay begin_replayable(const PagedKv& kv) { return Replay::kEager; }
  virtual bool end_replayable() { return true; }
  // Time per operation since creation or the last reset, as a table (CUDA with
  // CLEAVE_CUDA_PROFILE=1); empty where the backend does not measure it. `reset` starts over.
  virtual std::string profile_report(bool reset) { return {}; }
  // The first error of an operation since the last check() (a failed launch or device fault on
  // CUDA; the device may be unusable after it), else Ok. Always Ok on the CPU.
  virtual Status check() = 0;

  // Reserves the scratch of attention() calls within `limits`. Called once by the model before
  // the first forward pass. The CPU backend's attention() never allocates afterwards for calls
  // within the limits (a call beyond them grows the scratch once). The CUDA backend sizes its
  // split partials by each batch's longest context and grows them, outside recorded steps.
  virtual void reserve_attention(const AttentionLimits& limits) = 0;

  // y[t] = W x[t] for t in [0, n_tokens): W is [rows, cols], x is [n_tokens, cols] and y is
  // [n_tokens, rows] (both contiguous).
  virtual void matmul(const TensorView& w, const float* x, int64_t n_tokens, float* y) = 0;
  // matmul() of each ws[i] into ys[i] over the same x (q, k and v); a backend may do them in one
  // pass. Each output's bits are those of matmul() alone.
  virtual void matmul_many(std::span<const TensorView* const> ws, const float* x,
                           int64_t n_tokens, std::span<float* const> ys) {
    for (size_t i = 0; i < ws.size(); ++i) matmul(*ws[i], x, n_tokens, ys[i]);
  }
  // y += w x ([n_tokens, w.rows()]), bit for bit matmul(w -> scratch) and add(y, scratch); a
  // backend may fuse them (then `scratch` may stay untouched).
  virtual void matmul_add(const TensorView& w, const float* x, int64_t n_tokens, float* y,
                          float* scratch) {
    matmul(w, x, n_tokens, scratch);
    add(y, scratch, n_tokens * w.rows());
  }
  // out = silu(gate x) * (up x) ([n_tokens, gate.rows()]), bit for bit matmul(gate -> out),
  // matmul(up -> scratch), silu_mul(out, scratch -> out); a backend may fuse them (then
  // `scratch` may stay untouched).
  virtual void matmul_glu(const TensorView& gate, const TensorView& up, const float* x,
                          int64_t n_tokens, float* out, float* scratch) {
    matmul(gate, x, n_tokens, out);
    matmul(up, x, n_tokens, scratch);
    silu_mul(out, scratch, n_tokens * gate.rows(), out);
  }
  // out[t] = row tokens[t] of `table` as f32 ([n_tokens, cols]), the tokens being those of
  // begin_batch() (the same as `tokens`). Ids must be in range.
  virtual void embedding(const TensorView& table, std::span<const int32_t> tokens,
                         float* out) = 0;
  // out[t] = x[t] / rms(x[t]) * weight, rows of `dim`; x and out may alias.
  virtual void rmsnorm(const float* x, const float* weight, float eps, int64_t n_tokens,
                       int64_t dim, float* out) = 0;
  virtual void rope(const RopeArgs& args) = 0;
  virtual void write_kv(const KvWriteArgs& args) = 0;
  // rope(q), rope(k), then write_kv(kv) (kv.k is k.x): one launch on a GPU, the same bits.
  virtual void rope_write_kv(const RopeArgs& q, const RopeArgs& k, const KvWriteArgs& kv) {
    rope(q);
    rope(k);
    write_kv(kv);
  }
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

// The backend that engine.device names: "cpu", "cuda" (device 0) or "cuda:N". `pool` is the CPU
// backend's (it must outlive the result). InvalidArgument for another name; Unavailable when
// this build has no CUDA backend (CLEAVE_WITH_CUDA off, or no nvcc at build time) or the device
// cannot be used (no driver, no such device), with the reason.
Result<std::unique_ptr<Backend>> make_backend(std::string_view device, ThreadPool& pool);
// Whether `device` is a name make_backend() takes (cpu, cuda, cuda:N); for settings validation.
bool valid_device_name(std::string_view device);

}  // namespace cleave
