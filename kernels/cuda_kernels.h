// The CUDA kernels of the GPU backend (DESIGN.md §3 "Backends"): the operations of one
// Llama-family layer over device memory, as the CPU backend (src/engine/backend/cpu_backend.cpp)
// defines them. Host-callable launchers; every pointer is device memory unless it says host.
// Each launcher enqueues on `stream` and returns the launch's error (cudaSuccess when queued).
//
// Activations are fp32, row-major [n_tokens, width]; the KV pool is paged exactly as
// kvcache/kv_layout.h lays it out (unit (layer, block) = K of block_size rows, then V; rows of
// kv_dim elements of f32, f16 or bf16; units layer-major), so the transfer engine moves the same
// bytes whichever backend wrote them.
//
// Batch invariance (backend.h): every output element is computed by one thread block whose
// work depends only on that token's data, its position and its sequence's keys: never on how
// many tokens share the launch or where they sit in it. The reduction orders differ from the
// CPU backend's (within the tolerances the GPU tests check), never between launches.
//
// This header is plain C++ (no CUDA language features), so host code compiled by the C++
// compiler includes it; it needs only the CUDA runtime's types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace cleave::cuda {

// Element types of a KV pool (the subset of model/tensor_view.h's DType a
// kernel reads directly).
enum class ElemType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// A weight matrix [rows, cols] in device memory, in one of the layouts matmul() reads.
//   kF32, kF16, kBF16: row-major elements.
//   kInt8Groups: the block-quantised formats (Q8_0, Q4_K, ...) unpacked at upload into int8
//     levels (row-major [rows, cols]) and, per 16 columns, an f32 scale and an f32 offset
//     ([rows, cols / 16] each): value = scale * q + offset. cols is a multiple of 32.
enum class WeightType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kInt8Groups = 3 };
struct DeviceWeights {
  WeightType type = WeightType::kF32;
  const void* data = nullptr;
  const float* scales = nullptr;   // kInt8Groups
  const float* offsets = nullptr;  // kInt8Groups
  int64_t rows = 0;
  int64_t cols = 0;
};

// Where a batch's tokens sit (backend.h TokenBatch), uploaded to the device once per step.
struct DeviceTokenBatch {
  int64_t n_tokens = 0;
  const int64_t* positions = nullptr;   // [n_tokens]
  const int64_t* kv_slots = nullptr;    // [n_tokens]: block * block_size + offset
  const int32_t* seq = nullptr;         // [n_tokens]: index of its sequence
  const int64_t* seq_blocks = nullptr;  // [n_seqs]: offset of sequence s's table in block_ids
  const int32_t* block_ids = nullptr;   // the block tables, concatenated
};

// A paged KV pool in device memory (backend.h PagedKv).
struct DevicePagedKv {
  std::byte* base = nullptr;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t kv_dim = 0;
  ElemType dtype = ElemType::kF32;
};

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, rows of `dim`; x and out may alias.
cudaError_t rmsnorm(const float* x, const float* weight, float eps, int64_t n_tokens, int64_t dim,
                    float* out, cudaStream_t stream);
// Rotary embedding in place of the first n_heads * head_dim floats of each row (row_stride
// floats apart), at the token's position (device array). neox: pairs (j, j + head_dim/2), else
// (2j, 2j+1). inv_freq: head_dim/2 angular frequencies (device), scaling already applied.
cudaError_t rope(float* x, int64_t row_stride, int64_t n_tokens, const int64_t* positions,
                 int64_t n_heads, int64_t head_dim, bool neox, const float* inv_freq,
                 cudaStream_t stream);
// out[i] = silu(gate[i]) * up[i]; out may alias gate.
cudaError_t silu_mul(const float* gate, const float* up, int64_t n, float* out,
                     cudaStream_t stream);
// y[i] += x[i].
cudaError_t add(float* y, const float* x, int64_t n, cudaStream_t stream);
// y[t * dim + i] += bias[i] for n_tokens rows.
cudaError_t add_bias(float* y, const float* bias, int64_t n_tokens, int64_t dim,
                     cudaStream_t stream);
// Stores each token's K and V rows ([n_tokens, kv_dim] f32) into its slot of `layer`, rounded
// to the pool's type (round to nearest even, as the CPU backend's kv_store).
cudaError_t write_kv(const DeviceTokenBatch& batch, const float* k, const float* v,
                     const DevicePagedKv& kv, int64_t layer, cudaStream_t stream);
// rope() of q ([n_tokens, q_stride], n_q_heads heads) and of k ([n_tokens, kv.kv_dim]), then
// write_kv() of the rotated k and v, in one launch; q and k are rotated in place. The same bits
// as the three launches (one RoPE rotation for both). positions: the batch's (device memory).
// Not yet used by the backend: its test (FusedRopeAndKvWriteEqualTheSeparateLaunches) has not
// run on a GPU.
cudaError_t rope_write_kv(const DeviceTokenBatch& batch, float* q, int64_t q_stride,
                          int64_t n_q_heads, float* k, const float* v, int64_t n_kv_heads,
                          int64_t head_dim, bool neox, const float* inv_freq,
                          const DevicePagedKv& kv, int64_t layer, cudaStream_t stream);
// Keys of one split of a token's attention: 32 (one tile, a key per lane) times
// ceil(n_keys / 512), so a token has at most 16 splits and short contexts are spread over many
// blocks; a function of the token's key count alone (batch invariance).
__host__ __device__ inline int64_t attention_split_keys(int64_t n_keys) {
  const int64_t m = (n_keys + 511) / 512;
  return 32 * (m > 0 ? m : 1);
}
// Floats of `partials` paged_attention() needs for n_tokens tokens of at most max_keys keys
// (0 when no token has more than one split).
int64_t attention_partial_floats(int64_t n_tokens, int64_t max_keys, int64_t n_heads,
                                 int64_t head_dim);
// Causal attention of every token over keys 0..position of its own sequence (through its block
// table), its own K/V already in the pool: out = softmax(q k^T / sqrt(head_dim)) v per head;
// query head h reads KV head h / (n_heads / n_kv_heads). head_dim at most 256. max_keys: the
// largest position + 1 in the batch (it sizes the grid); partials: attention_partial_floats()
// floats of scratch (may be null when that is 0).
// Flash-decoding: one block per (token, KV head, split of attention_split_keys keys), a warp per
// query head of that KV head (up to 4; more take more blocks), then a second kernel merges a
// token's splits in split order. Every reduction order depends on the token's position alone, so
// a token's result does not depend on the batch.
cudaError_t paged_attention(const DeviceTokenBatch& batch, const float* q, float* out,
                            const DevicePagedKv& kv, int64_t layer, int64_t n_heads,
                            int64_t n_kv_heads, int64_t head_dim, int64_t max_keys,
                            float* partials, int64_t partial_floats, cudaStream_t stream);

// y[t, r] = sum_c W[r, c] x[t, c] for t < n_tokens (x: [n_tokens, cols], y: [n_tokens, rows],
// f32). One to four warps per output row (by cols alone) and tile of tokens; lane l takes
// columns 8l..8l+7 of each of its 256-column chunks, in column order, with one fused
// multiply-add each, then a fixed butterfly over the lanes and the warps' parts added in order:
// the reduction order depends only on cols, never on n_tokens (batch invariant; the weight row
// is read once per tile of up to 8 tokens).
cudaError_t matmul(const DeviceWeights& w, const float* x, int64_t n_tokens, float* y,
                   cudaStream_t stream);
// matmul() of 1 to 3 matrices of one WeightType and column count over the same x, in one launch
// (y[m] for w[m]); each output's bits are those of matmul() alone.
cudaError_t matmul_many(const DeviceWeights* w, int count, const float* x, int64_t n_tokens,
                        float* const* y, cudaStream_t stream);
// y[t, r] += (W x[t])[r] in one launch, bit for bit matmul() into scratch and add().
cudaError_t matmul_add(const DeviceWeights& w, const float* x, int64_t n_tokens, float* y,
                       cudaStream_t stream);
// out[t, r] = silu(gate x[t])[r] * (up x[t])[r] in one launch, bit for bit matmul() twice and
// silu_mul(); gate and up of one WeightType and shape.
cudaError_t matmul_glu(const DeviceWeights& gate, const DeviceWeights& up, const float* x,
                       int64_t n_tokens, float* out, cudaStream_t stream);
// The matmul launches' grid: blocks_per_sm > 0 folds a launch's row groups into about that
// many blocks per SM, each looping over its groups; 0 launches one block per row group; < 0
// restores the default (matmul.cu row_blocks: measured per token-tile count). The bits do not
// depend on it (a row's reduction order does not change). CLEAVE_CUDA_MATMUL_BLOCKS_PER_SM sets
// it at the first launch. Not thread safe: call it before launches, not beside them.
void matmul_set_grid_cap(int blocks_per_sm);
// out[t] = row tokens[t] of w as f32 ([n_tokens, cols]), any WeightType.
cudaError_t embedding_rows(const DeviceWeights& w, const int32_t* tokens, int64_t n_tokens,
                           float* out, cudaStream_t stream);

}  // namespace cleave::cuda
