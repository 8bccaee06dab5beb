// The paged KV cache on the GPU: writing a batch's new K/V into their slots, and causal
// attention over each token's own sequence through its block table.
#include <math_constants.h>

#include "cuda_kernels.h"
#include "kernel_util.cuh"

namespace cleave::cuda {
namespace {

constexpr int kAttnThreads = 128;  // 4 warps (query heads) per (token, KV head, split)
constexpr int kWarps = kAttnThreads / 32;
constexpr int kMaxHeadDim = 256;

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

// RoPE of each token's q and k rows, then its k (rotated) and v rows into its slot, in one
// launch: a block per token; the k pairs are stored to the pool as they are rotated.
template <ElemType T>
__global__ void rope_write_kv_kernel(DeviceTokenBatch b, float* q, int64_t q_stride,
                                     int64_t n_q_heads, float* k, const float* v,
                                     int64_t n_kv_heads, int64_t head_dim, bool neox,
                                     const float* inv_freq, DevicePagedKv kv, int64_t layer) {
  const int64_t t = blockIdx.x;
  const int64_t slot = b.kv_slots[t];
  const float pos = static_cast<float>(b.positions[t]);
  std::byte* krow = kv.base + k_row_offset(kv, layer, slot / kv.block_size, slot % kv.block_size);
  std::byte* vrow = krow + static_cast<size_t>(kv.block_size) * kv.kv_dim * elem_bytes(T);
  const int64_t half = head_dim / 2;
  for (int64_t i = threadIdx.x; i < (n_q_heads + n_kv_heads) * half; i += blockDim.x) {
    const int64_t h = i / half, j = i % half;
    const int64_t i0 = neox ? j : 2 * j, i1 = neox ? j + half : 2 * j + 1;
    if (h < n_q_heads) {
      float* head = q + t * q_stride + h * head_dim;
      float x0 = head[i0], x1 = head[i1];
      rope_pair(pos, inv_freq[j], x0, x1);
      head[i0] = x0;
      head[i1] = x1;
    } else {
      const int64_t off = (h - n_q_heads) * head_dim;
      float* head = k + t * kv.kv_dim + off;
      float x0 = head[i0], x1 = head[i1];
      rope_pair(pos, inv_freq[j], x0, x1);
      head[i0] = x0;
      head[i1] = x1;
      store_elem<T>(krow, off + i0, x0);
      store_elem<T>(krow, off + i1, x1);
    }
  }
  for (int64_t i = threadIdx.x; i < kv.kv_dim; i += blockDim.x) {
    store_elem<T>(vrow, i, v[t * kv.kv_dim + i]);
  }
}

// 8 elements of a K or V row from element i (i % 8 == 0, the row 16-byte aligned) as f32.
template <ElemType T>
__device__ __forceinline__ void load8(const std::byte* row, int64_t i, float out[8]) {
  if constexpr (T == ElemType::kF32) {
    const float4* p = reinterpret_cast<const float4*>(row) + i / 4;
    const float4 a = p[0], b = p[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
    const uint4 raw = *(reinterpret_cast<const uint4*>(row) + i / 8);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = load_elem<T>(h, j);
  }
}

// The attention of one split of a token's keys for one query head per warp: warp w of block
// (t, y, s) takes query head (y % chunks) * kWarps + w of KV head y / chunks (the block's warps
// read the same K and V rows, so they come from L2 once). For each tile of 32 keys of the split,
// in order, lane j scores key j (its K row read once, in head_dim order), the warp updates its
// running max and sum, then accumulates the tile's V rows in key order, lane l owning dims
// [l * DPL, l * DPL + DPL). A token with one split writes its output, else the split's (max,
// sum, accumulator) for combine_kernel. Every order is a function of the token's key count
// alone (batch invariance), and no warp waits for another.
template <ElemType T, int DPL>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(DeviceTokenBatch b, const float* q, float* out, DevicePagedKv kv,
                     int64_t layer, int64_t n_heads, int64_t group, int64_t head_dim,
                     float scale, float* partials, int64_t max_splits) {
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunks = (group + kWarps - 1) / kWarps;
  const int64_t kvh = blockIdx.y / chunks;
  const int64_t hq = (blockIdx.y % chunks) * kWarps + warp;
  if (hq >= group) return;  // no barrier below: a warp without a head may leave
  const int64_t head = kvh * group + hq;
  const int64_t n_keys = b.positions[t] + 1;
  const int64_t split = attention_split_keys(n_keys);
  const int64_t n_splits = (n_keys + split - 1) / split;
  const int64_t s = blockIdx.z;
  if (s >= n_splits) return;
  const int64_t k_begin = s * split, k_end = min(n_keys, k_begin + split);
  const int32_t* table = b.block_ids + b.seq_blocks[b.seq[t]];
  const size_t esize = T == ElemType::kF32 ? 4 : 2;
  const size_t row_bytes = static_cast<size_t>(kv.kv_dim) * esize;
  const size_t v_skip = static_cast<size_t>(kv.block_size) * row_bytes;
  const size_t head_off = static_cast<size_t>(kvh * head_dim) * esize;
  const bool vec = head_dim % 8 == 0;

  __shared__ float qs_all[kWarps][kMaxHeadDim];
  float* qs = qs_all[warp];
  for (int64_t i = lane; i < head_dim; i += 32) qs[i] = q[(t * n_heads + head) * head_dim + i];
  __syncwarp();

  float m = -CUDART_INF_F, l = 0.0f, acc[DPL];
#pragma unroll
  for (int d = 0; d < DPL; ++d) acc[d] = 0.0f;
  for (int64_t j0 = k_begin; j0 < k_end; j0 += 32) {
    const int64_t key = j0 + lane;
    const bool valid = key < k_end;
    // Each lane finds its own key's row once; the V pass below takes the other lanes' rows by
    // shuffle, so no key waits for a block-table load behind another's.
    const std::byte* krow =
        valid ? kv.base + k_row_offset(kv, layer, table[key / kv.block_size], key % kv.block_size) +
                    head_off
              : kv.base;
    float sc = 0.0f;
    if (valid) {
      if (vec) {
        // head_dim <= 32 * DPL: at most 4 * DPL pieces of 8, in order.
#pragma unroll
        for (int c = 0; c < 4 * DPL; ++c) {
          const int64_t d0 = static_cast<int64_t>(c) * 8;
          if (d0 >= head_dim) break;
          float kx[8];
          load8<T>(krow, d0, kx);
#pragma unroll
          for (int j = 0; j < 8; ++j) sc = __fmaf_rn(qs[d0 + j], kx[j], sc);
        }
      } else {
        for (int64_t d = 0; d < head_dim; ++d) sc = __fmaf_rn(qs[d], load_elem<T>(krow, d), sc);
      }
    }
    const float x = valid ? sc * scale : -CUDART_INF_F;
    const float new_m = fmaxf(m, warp_max(x));
    const float corr = expf(m - new_m);  // 0 on the first tile
    const float p = valid ? expf(x - new_m) : 0.0f;
    l = l * corr + warp_sum(p);
    m = new_m;
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[d] *= corr;
    const int n = static_cast<int>(min(static_cast<int64_t>(32), k_end - j0));
    const unsigned long long my_v = reinterpret_cast<unsigned long long>(krow + v_skip);
    // V rows in groups of kVGroup keys: the group's loads are all issued before the first
    // multiply (one memory round trip a group, not a key), then accumulated in key order.
    constexpr int kVGroup = DPL <= 2 ? 16 : 8;
    for (int g = 0; g < n; g += kVGroup) {
      float vx[kVGroup][DPL];
#pragma unroll
      for (int jj = 0; jj < kVGroup; ++jj) {
        const std::byte* vrow =
            reinterpret_cast<const std::byte*>(__shfl_sync(0xffffffffu, my_v, g + jj));
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
          const int64_t dim = static_cast<int64_t>(lane) * DPL + d;
          vx[jj][d] = g + jj < n && dim < head_dim ? load_elem<T>(vrow, dim) : 0.0f;
        }
      }
#pragma unroll
      for (int jj = 0; jj < kVGroup; ++jj) {
        if (g + jj >= n) break;
        const float pj = __shfl_sync(0xffffffffu, p, g + jj);
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[d] = __fmaf_rn(pj, vx[jj][d], acc[d]);
      }
    }
  }
  const int64_t stride = head_dim + 2;  // a partial: accumulator, then max and sum
  float* part = partials + ((t * n_heads + head) * max_splits + s) * stride;
#pragma unroll
  for (int d = 0; d < DPL; ++d) {
    const int64_t dim = static_cast<int64_t>(lane) * DPL + d;
    if (dim >= head_dim) break;
    if (n_splits == 1) {
      out[(t * n_heads + head) * head_dim + dim] = acc[d] / l;
    } else {
      part[dim] = acc[d];
    }
  }
  if (n_splits > 1 && lane == 0) {
    part[head_dim] = m;
    part[head_dim + 1] = l;
  }
}

// Merges a token's splits in split order (tokens with one split were written already).
__global__ void combine_kernel(DeviceTokenBatch b, float* out, int64_t n_heads, int64_t head_dim,
                               const float* partials, int64_t max_splits) {
  const int64_t t = blockIdx.x, head = blockIdx.y;
  const int64_t n_keys = b.positions[t] + 1;
  const int64_t split = attention_split_keys(n_keys);
  const int64_t n_splits = (n_keys + split - 1) / split;
  if (n_splits == 1) return;
  const int64_t stride = head_dim + 2;
  const float* part = partials + (t * n_heads + head) * max_splits * stride;
  float mx = -CUDART_INF_F;
  for (int64_t s = 0; s < n_splits; ++s) mx = fmaxf(mx, part[s * stride + head_dim]);
  for (int64_t dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
    float sum = 0.0f, a = 0.0f;
    for (int64_t s = 0; s < n_splits; ++s) {
      const float f = expf(part[s * stride + head_dim] - mx);
      sum = __fmaf_rn(part[s * stride + head_dim + 1], f, sum);
      a = __fmaf_rn(part[s * stride + dim], f, a);
    }
    out[(t * n_heads + head) * head_dim + dim] = a / sum;
  }
}

template <ElemType T>
cudaError_t launch_attention(const DeviceTokenBatch& batch, const float* q, float* out,
                             const DevicePagedKv& kv, int64_t layer, int64_t n_heads,
                             int64_t group, int64_t head_dim, float* partials,
                             int64_t max_splits, cudaStream_t stream) {
  const int64_t chunks = (group + kWarps - 1) / kWarps;
  const dim3 grid(static_cast<unsigned>(batch.n_tokens),
                  static_cast<unsigned>((n_heads / group) * chunks),
                  static_cast<unsigned>(max_splits));
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  const int dpl = head_dim <= 32 ? 1 : head_dim <= 64 ? 2 : head_dim <= 128 ? 4 : 8;
#define CLEAVE_ATTN(D)                                                                 \
  attention_kernel<T, D><<<grid, kAttnThreads, 0, stream>>>(batch, q, out, kv, layer, \
                                                            n_heads, group, head_dim, \
                                                            scale, partials, max_splits)
  switch (dpl) {
    case 1: CLEAVE_ATTN(1); break;
    case 2: CLEAVE_ATTN(2); break;
    case 4: CLEAVE_ATTN(4); break;
    default: CLEAVE_ATTN(8); break;
  }
#undef CLEAVE_ATTN
  if (max_splits > 1) {
    combine_kernel<<<dim3(static_cast<unsigned>(batch.n_tokens), static_cast<unsigned>(n_heads)),
                     64, 0, stream>>>(batch, out, n_heads, head_dim, partials, max_splits);
  }
  return cudaGetLastError();
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

cudaError_t rope_write_kv(const DeviceTokenBatch& batch, float* q, int64_t q_stride,
                          int64_t n_q_heads, float* k, const float* v, int64_t n_kv_heads,
                          int64_t head_dim, bool neox, const float* inv_freq,
                          const DevicePagedKv& kv, int64_t layer, cudaStream_t stream) {
  if (batch.n_tokens <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim % 2 != 0 || n_kv_heads * head_dim != kv.kv_dim ||
      q_stride < n_q_heads * head_dim) {
    return cudaErrorInvalidValue;
  }
  const unsigned grid = static_cast<unsigned>(batch.n_tokens);
#define CLEAVE_ROPE_KV(T)                                                                 \
  rope_write_kv_kernel<T><<<grid, 256, 0, stream>>>(batch, q, q_stride, n_q_heads, k, v, \
                                                    n_kv_heads, head_dim, neox, inv_freq,  \
                                                    kv, layer)
  switch (kv.dtype) {
    case ElemType::kF32: CLEAVE_ROPE_KV(ElemType::kF32); break;
    case ElemType::kF16: CLEAVE_ROPE_KV(ElemType::kF16); break;
    case ElemType::kBF16: CLEAVE_ROPE_KV(ElemType::kBF16); break;
    default: return cudaErrorInvalidValue;
  }
#undef CLEAVE_ROPE_KV
  return cudaGetLastError();
}

int64_t attention_partial_floats(int64_t n_tokens, int64_t max_keys, int64_t n_heads,
                                 int64_t head_dim) {
  const int64_t split = attention_split_keys(max_keys);
  const int64_t splits = (max_keys + split - 1) / split;
  return splits > 1 ? n_tokens * n_heads * splits * (head_dim + 2) : 0;
}

cudaError_t paged_attention(const DeviceTokenBatch& batch, const float* q, float* out,
                            const DevicePagedKv& kv, int64_t layer, int64_t n_heads,
                            int64_t n_kv_heads, int64_t head_dim, int64_t max_keys,
                            float* partials, int64_t partial_floats, cudaStream_t stream) {
  if (batch.n_tokens <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim > kMaxHeadDim || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
      batch.n_tokens > 0x7fffffff || n_heads > 65535 || max_keys < 1 ||
      partial_floats < attention_partial_floats(batch.n_tokens, max_keys, n_heads, head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t split = attention_split_keys(max_keys);
  const int64_t max_splits = (max_keys + split - 1) / split;
  const int64_t group = n_heads / n_kv_heads;
  switch (kv.dtype) {
    case ElemType::kF32:
      return launch_attention<ElemType::kF32>(batch, q, out, kv, layer, n_heads, group, head_dim,
                                              partials, max_splits, stream);
    case ElemType::kF16:
      return launch_attention<ElemType::kF16>(batch, q, out, kv, layer, n_heads, group, head_dim,
                                              partials, max_splits, stream);
    case ElemType::kBF16:
      return launch_attention<ElemType::kBF16>(batch, q, out, kv, layer, n_heads, group, head_dim,
                                               partials, max_splits, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cleave::cuda
