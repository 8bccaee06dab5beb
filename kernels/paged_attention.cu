// The paged KV cache on the GPU: writing a batch's new K/V into their slots, and causal
// attention over each token's own sequence through its block table.
#include <math_constants.h>

#include "cuda_kernels.h"
#include "kernel_util.cuh"

namespace cleave::cuda {
namespace {

constexpr int kAttnThreads = 128;  // 4 warps per (token, head)
constexpr int kWarps = kAttnThreads / 32;
constexpr int kKeyTile = 64;       // keys scored per round
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerThread = kMaxHeadDim / kAttnThreads;

__device__ __forceinline__ size_t elem_bytes(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// Byte offset of K row `offset` of (layer, block); its V row is block_size rows further.
__device__ __forceinline__ size_t k_row_offset(const DevicePagedKv& kv, int64_t layer,
                                               int64_t block, int64_t offset) {
  const size_t row = static_cast<size_t>(kv.kv_dim) * elem_bytes(kv.dtype);
  const size_t unit = 2 * static_cast<size_t>(kv.block_size) * row;
  return (static_cast<size_t>(layer) * static_cast<size_t>(kv.num_blocks) +
          static_cast<size_t>(block)) * unit + static_cast<size_t>(offset) * row;
}

template <ElemType T>
__global__ void write_kv_kernel(DeviceTokenBatch b, const float* k, const float* v,
                                DevicePagedKv kv, int64_t layer) {
  const int64_t t = blockIdx.x;
  const int64_t slot = b.kv_slots[t];
  std::byte* krow = kv.base + k_row_offset(kv, layer, slot / kv.block_size, slot % kv.block_size);
  std::byte* vrow = krow + static_cast<size_t>(kv.block_size) * kv.kv_dim * elem_bytes(T);
  for (int64_t i = threadIdx.x; i < kv.kv_dim; i += blockDim.x) {
    store_elem<T>(krow, i, k[t * kv.kv_dim + i]);
    store_elem<T>(vrow, i, v[t * kv.kv_dim + i]);
  }
}

// One block per (token, head): q in shared memory; keys 0..p in tiles of kKeyTile, in key
// order. Each warp scores keys warp, warp + kWarps, ... of a tile (lanes split head_dim, a
// fixed shuffle tree), then the running max and sum are updated once per tile and each thread
// accumulates its own output dimensions over the tile's keys in key order. The whole order is
// a function of (p, head_dim) alone.
template <ElemType T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(DeviceTokenBatch b, const float* q, float* out, DevicePagedKv kv,
                     int64_t layer, int64_t n_heads, int64_t group, int64_t head_dim,
                     float scale) {
  const int64_t t = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t kvh = h / group;
  const int64_t n_keys = b.positions[t] + 1;
  const int32_t* table = b.block_ids + b.seq_blocks[b.seq[t]];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  __shared__ float qs[kMaxHeadDim];
  __shared__ float scores[kKeyTile];
  __shared__ float tile_max_s, tile_sum_s;
  for (int64_t d = threadIdx.x; d < head_dim; d += kAttnThreads) {
    qs[d] = q[(t * n_heads + h) * head_dim + d];
  }
  __syncthreads();

  float acc[kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) acc[i] = 0.0f;
  float run_max = -CUDART_INF_F, run_sum = 0.0f;
  const size_t v_skip = static_cast<size_t>(kv.block_size) * kv.kv_dim * elem_bytes(T);

  for (int64_t j0 = 0; j0 < n_keys; j0 += kKeyTile) {
    const int n = static_cast<int>(n_keys - j0 < kKeyTile ? n_keys - j0 : kKeyTile);
    for (int j = warp; j < n; j += kWarps) {
      const int64_t key = j0 + j;
      const std::byte* krow =
          kv.base + k_row_offset(kv, layer, table[key / kv.block_size], key % kv.block_size);
      float dot = 0.0f;
      for (int64_t d = lane; d < head_dim; d += 32) {
        dot = fmaf(qs[d], load_elem<T>(krow, kvh * head_dim + d), dot);
      }
      dot = warp_sum(dot);
      if (lane == 0) scores[j] = dot * scale;
    }
    __syncthreads();
    if (warp == 0) {  // the tile's max and the new running max, one fixed order
      float m = -CUDART_INF_F;
      for (int j = lane; j < n; j += 32) m = fmaxf(m, scores[j]);
      m = warp_max(m);
      if (lane == 0) tile_max_s = m;
    }
    __syncthreads();
    const float new_max = fmaxf(run_max, tile_max_s);
    const float correction = expf(run_max - new_max);  // 0 on the first tile
    __syncthreads();
    if (warp == 0) {
      float s = 0.0f;
      for (int j = lane; j < n; j += 32) {
        const float p = expf(scores[j] - new_max);
        scores[j] = p;
        s += p;
      }
      s = warp_sum(s);
      if (lane == 0) tile_sum_s = s;
    }
    __syncthreads();
    run_sum = run_sum * correction + tile_sum_s;
    run_max = new_max;
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) {
      const int64_t d = threadIdx.x + static_cast<int64_t>(i) * kAttnThreads;
      float a = acc[i] * correction;
      if (d < head_dim) {
        for (int j = 0; j < n; ++j) {
          const int64_t key = j0 + j;
          const std::byte* vrow = kv.base +
                                  k_row_offset(kv, layer, table[key / kv.block_size],
                                               key % kv.block_size) + v_skip;
          a = fmaf(scores[j], load_elem<T>(vrow, kvh * head_dim + d), a);
        }
      }
      acc[i] = a;
    }
    __syncthreads();  // scores are rewritten by the next tile
  }
  const float inv = 1.0f / run_sum;
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) {
    const int64_t d = threadIdx.x + static_cast<int64_t>(i) * kAttnThreads;
    if (d < head_dim) out[(t * n_heads + h) * head_dim + d] = acc[i] * inv;
  }
}

}  // namespace

cudaError_t write_kv(const DeviceTokenBatch& batch, const float* k, const float* v,
                     const DevicePagedKv& kv, int64_t layer, cudaStream_t stream) {
  if (batch.n_tokens <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(batch.n_tokens);
  switch (kv.dtype) {
    case ElemType::kF32:
      write_kv_kernel<ElemType::kF32><<<grid, 128, 0, stream>>>(batch, k, v, kv, layer);
      break;
    case ElemType::kF16:
      write_kv_kernel<ElemType::kF16><<<grid, 128, 0, stream>>>(batch, k, v, kv, layer);
      break;
    case ElemType::kBF16:
      write_kv_kernel<ElemType::kBF16><<<grid, 128, 0, stream>>>(batch, k, v, kv, layer);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t paged_attention(const DeviceTokenBatch& batch, const float* q, float* out,
                            const DevicePagedKv& kv, int64_t layer, int64_t n_heads,
                            int64_t n_kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (batch.n_tokens <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim > kMaxHeadDim || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      batch.n_tokens > 0x7fffffff || n_heads > 65535) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(batch.n_tokens), static_cast<unsigned>(n_heads));
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  const int64_t group = n_heads / n_kv_heads;
  switch (kv.dtype) {
    case ElemType::kF32:
      attention_kernel<ElemType::kF32><<<grid, kAttnThreads, 0, stream>>>(
          batch, q, out, kv, layer, n_heads, group, head_dim, scale);
      break;
    case ElemType::kF16:
      attention_kernel<ElemType::kF16><<<grid, kAttnThreads, 0, stream>>>(
          batch, q, out, kv, layer, n_heads, group, head_dim, scale);
      break;
    case ElemType::kBF16:
      attention_kernel<ElemType::kBF16><<<grid, kAttnThreads, 0, stream>>>(
          batch, q, out, kv, layer, n_heads, group, head_dim, scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cleave::cuda
