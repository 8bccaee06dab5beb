// The paged KV cache on the GPU: writing a batch's new K/V into their slots, and causal
// attention over each token's own sequence through its block table.
#include <math_constants.h>

#include "cuda_kernels.h"
#include "kernel_util.cuh"

namespace cleave::cuda {
namespace {

constexpr int kAttnThreads = 128;  // 4 warps per (token, KV head, split)
constexpr int kWarps = kAttnThreads / 32;
constexpr int kMaxHeadDim = 256;
constexpr int kHeadsPerBlock = 8;  // query heads of one KV head handled together

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

// The attention of one split of a token's keys for up to kHeadsPerBlock query heads of one KV
// head. Warp w takes the split's tiles of 32 keys w, w + kWarps, ...: lane j scores key j of the
// tile for every head (its K row read once, in head_dim order), the warp updates its running max
// and sum per head, then accumulates the tile's V rows in key order, lane l owning dims
// [l * DPL, l * DPL + DPL). The warps' states are merged in warp order; a token with one split
// writes its output, else the split's (max, sum, accumulator) for combine_kernel. Every order is
// a function of the token's key count alone (batch invariance).
template <ElemType T, int DPL>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(DeviceTokenBatch b, const float* q, float* out, DevicePagedKv kv,
                     int64_t layer, int64_t n_heads, int64_t group, int64_t head_dim,
                     float scale, float* partials, int64_t max_splits) {
  const int64_t t = blockIdx.x;
  const int64_t chunks = (group + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const int64_t kvh = blockIdx.y / chunks;
  const int64_t h0 = kvh * group + (blockIdx.y % chunks) * kHeadsPerBlock;
  const int nh = static_cast<int>(min(static_cast<int64_t>(kHeadsPerBlock), kvh * group + group - h0));
  const int64_t n_keys = b.positions[t] + 1;
  const int64_t split = attention_split_keys(n_keys);
  const int64_t n_splits = (n_keys + split - 1) / split;
  const int64_t s = blockIdx.z;
  if (s >= n_splits) return;
  const int64_t k_begin = s * split, k_end = min(n_keys, k_begin + split);
  const int32_t* table = b.block_ids + b.seq_blocks[b.seq[t]];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t esize = T == ElemType::kF32 ? 4 : 2;
  const size_t row_bytes = static_cast<size_t>(kv.kv_dim) * esize;
  const size_t v_skip = static_cast<size_t>(kv.block_size) * row_bytes;
  const bool vec = head_dim % 8 == 0;

  __shared__ float qs[kHeadsPerBlock][kMaxHeadDim];
  __shared__ float wm[kWarps][kHeadsPerBlock], wl[kWarps][kHeadsPerBlock];
  __shared__ float wacc[kWarps][kHeadsPerBlock][kMaxHeadDim];
  for (int64_t i = threadIdx.x; i < nh * head_dim; i += kAttnThreads) {
    qs[i / head_dim][i % head_dim] = q[(t * n_heads + h0 + i / head_dim) * head_dim + i % head_dim];
  }
  __syncthreads();

  float m[kHeadsPerBlock], l[kHeadsPerBlock], acc[kHeadsPerBlock][DPL];
#pragma unroll
  for (int h = 0; h < kHeadsPerBlock; ++h) {
    m[h] = -CUDART_INF_F;
    l[h] = 0.0f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[h][d] = 0.0f;
  }
  for (int64_t j0 = k_begin + static_cast<int64_t>(warp) * 32; j0 < k_end; j0 += kWarps * 32) {
    const int64_t key = j0 + lane;
    const bool valid = key < k_end;
    float sc[kHeadsPerBlock];
#pragma unroll
    for (int h = 0; h < kHeadsPerBlock; ++h) sc[h] = 0.0f;
    // Each lane finds its own key's row once; the V pass below takes the other lanes' rows by
    // shuffle, so no key waits for a block-table load behind another's.
    const std::byte* krow =
        valid ? kv.base + k_row_offset(kv, layer, table[key / kv.block_size], key % kv.block_size) +
                    static_cast<size_t>(kvh * head_dim) * esize
              : kv.base;
    if (valid) {
      if (vec) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
          float kx[8];
          load8<T>(krow, d0, kx);
#pragma unroll
          for (int h = 0; h < kHeadsPerBlock; ++h) {
            if (h < nh) {
#pragma unroll
              for (int j = 0; j < 8; ++j) sc[h] = __fmaf_rn(qs[h][d0 + j], kx[j], sc[h]);
            }
          }
        }
      } else {
        for (int64_t d = 0; d < head_dim; ++d) {
          const float kx = load_elem<T>(krow, d);
#pragma unroll
          for (int h = 0; h < kHeadsPerBlock; ++h) {
            if (h < nh) sc[h] = __fmaf_rn(qs[h][d], kx, sc[h]);
          }
        }
      }
    }
    float p[kHeadsPerBlock];
#pragma unroll
    for (int h = 0; h < kHeadsPerBlock; ++h) {
      if (h >= nh) continue;
      const float x = valid ? sc[h] * scale : -CUDART_INF_F;
      const float new_m = fmaxf(m[h], warp_max(x));
      const float corr = expf(m[h] - new_m);  // 0 on the first tile
      p[h] = valid ? expf(x - new_m) : 0.0f;
      l[h] = l[h] * corr + warp_sum(p[h]);
      m[h] = new_m;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[h][d] *= corr;
    }
    const int n = static_cast<int>(min(static_cast<int64_t>(32), k_end - j0));
    const unsigned long long my_v = reinterpret_cast<unsigned long long>(krow + v_skip);
    // V rows in groups of kVGroup keys: the group's loads are all issued before the first
    // multiply (one memory round trip a group, not a key), then accumulated in key order.
    constexpr int kVGroup = 8;
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
#pragma unroll
        for (int h = 0; h < kHeadsPerBlock; ++h) {
          if (h >= nh) continue;
          const float pj = __shfl_sync(0xffffffffu, p[h], g + jj);
#pragma unroll
          for (int d = 0; d < DPL; ++d) acc[h][d] = __fmaf_rn(pj, vx[jj][d], acc[h][d]);
        }
      }
    }
  }
  // Warp states to shared memory, then merged in warp order by all threads over (head, dim).
#pragma unroll
  for (int h = 0; h < kHeadsPerBlock; ++h) {
    if (h >= nh) continue;
    if (lane == 0) {
      wm[warp][h] = m[h];
      wl[warp][h] = l[h];
    }
#pragma unroll
    for (int d = 0; d < DPL; ++d) {
      const int64_t dim = static_cast<int64_t>(lane) * DPL + d;
      if (dim < head_dim) wacc[warp][h][dim] = acc[h][d];
    }
  }
  __syncthreads();
  const int64_t stride = head_dim + 2;  // a partial: accumulator, then max and sum
  for (int64_t i = threadIdx.x; i < nh * head_dim; i += kAttnThreads) {
    const int h = static_cast<int>(i / head_dim);
    const int64_t dim = i % head_dim;
    float mx = -CUDART_INF_F;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wm[w][h]);
    float sum = 0.0f, a = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      if (wm[w][h] == -CUDART_INF_F) continue;  // a warp that had no key
      const float f = expf(wm[w][h] - mx);
      sum = __fmaf_rn(wl[w][h], f, sum);
      a = __fmaf_rn(wacc[w][h][dim], f, a);
    }
    const int64_t head = h0 + h;
    if (n_splits == 1) {
      out[(t * n_heads + head) * head_dim + dim] = a / sum;
    } else {
      float* part = partials + ((t * n_heads + head) * max_splits + s) * stride;
      part[dim] = a;
      if (dim == 0) {
        part[head_dim] = mx;
        part[head_dim + 1] = sum;
      }
    }
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
  const int64_t chunks = (group + kHeadsPerBlock - 1) / kHeadsPerBlock;
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
