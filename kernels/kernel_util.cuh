// Device helpers shared by the kernels: typed element loads and stores, fixed-order reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"

namespace cleave::cuda {

template <ElemType T>
__device__ __forceinline__ float load_elem(const void* base, int64_t i) {
  if constexpr (T == ElemType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == ElemType::kF16) {
    return __half2float(static_cast<const __half*>(base)[i]);
  } else {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

// Rounds to nearest even, as the CPU backend's kv_store does.
template <ElemType T>
__device__ __forceinline__ void store_elem(void* base, int64_t i, float v) {
  if constexpr (T == ElemType::kF32) {
    static_cast<float*>(base)[i] = v;
  } else if constexpr (T == ElemType::kF16) {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  } else {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  }
}

// The rotation of one RoPE pair (x0, x1) of a token at `pos` by frequency inv_freq, written as
// rope_kernel (elementwise.cu) writes it, so that they round alike (rope_kernel is to use it too
// once the fused kernel's test has run on a GPU).
__device__ __forceinline__ void rope_pair(float pos, float inv_freq, float& x0, float& x1) {
  float s, c;
  sincosf(pos * inv_freq, &s, &c);
  const float v0 = x0, v1 = x1;
  x0 = v0 * c - v1 * s;
  x1 = v0 * s + v1 * c;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum over a block of kThreads threads (a multiple of 32), the same order every launch; every
// thread gets the result.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  __shared__ float partial[kThreads / 32];
  __shared__ float total;
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < kThreads / 32 ? partial[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

}  // namespace cleave::cuda
