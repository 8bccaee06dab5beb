// Row and element kernels: RMSNorm, RoPE, SiLU-and-multiply, residual adds (the embedding
// gather is matmul.cu's embedding_rows, over every weight layout).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "kernel_util.cuh"

namespace cleave::cuda {
namespace {

constexpr int kRowThreads = 256;

// Rows of up to kRowThreads * 4 * kRowVecs floats are held in registers by rmsnorm_kernel's
// fast path (read from memory once, every load issued before the first add).
constexpr int kRowVecs = 8;

// One block per token: the sum of squares in a fixed order, then a tree over the threads, so a
// row's result never depends on the batch. Fast path (rows of a multiple of 4 floats, 16-byte
// aligned, at most 8192): thread i holds float4s i, i + 256, ... in registers and adds their
// squares in that order (x, y, z, w); otherwise thread i takes elements i, i + 256, ... from
// memory. x and out may alias (the row is read before anything is written).
__global__ void rmsnorm_kernel(const float* x, const float* w, float eps, int64_t dim,
                               float* out, bool vec) {
  const int64_t t = blockIdx.x;
  const float* row = x + t * dim;
  float* o = out + t * dim;
  if (vec) {
    const int64_t n4 = dim / 4;
    float4 v[kRowVecs];
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(i) * kRowThreads;
      v[i] = j < n4 ? reinterpret_cast<const float4*>(row)[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      sum = fmaf(v[i].x, v[i].x, sum);
      sum = fmaf(v[i].y, v[i].y, sum);
      sum = fmaf(v[i].z, v[i].z, sum);
      sum = fmaf(v[i].w, v[i].w, sum);
    }
    sum = block_sum<kRowThreads>(sum);
    const float scale = rsqrtf(sum / static_cast<float>(dim) + eps);
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(i) * kRowThreads;
      if (j < n4) {
        const float4 g = reinterpret_cast<const float4*>(w)[j];
        reinterpret_cast<float4*>(o)[j] = make_float4(v[i].x * scale * g.x, v[i].y * scale * g.y,
                                                      v[i].z * scale * g.z, v[i].w * scale * g.w);
      }
    }
    return;
  }
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum = fmaf(row[i], row[i], sum);
  sum = block_sum<kRowThreads>(sum);
  const float scale = rsqrtf(sum / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = row[i] * scale * w[i];
}

// One thread per (token, head, pair).
__global__ void rope_kernel(float* x, int64_t row_stride, int64_t n_tokens,
                            const int64_t* positions, int64_t n_heads, int64_t head_dim,
                            bool neox, const float* inv_freq) {
  const int64_t half = head_dim / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_tokens * n_heads * half) return;
  const int64_t j = i % half;
  const int64_t h = (i / half) % n_heads;
  const int64_t t = i / (half * n_heads);
  const float angle = static_cast<float>(positions[t]) * inv_freq[j];
  float s, c;
  sincosf(angle, &s, &c);
  float* head = x + t * row_stride + h * head_dim;
  float* p0 = neox ? head + j : head + 2 * j;
  float* p1 = neox ? head + j + half : head + 2 * j + 1;
  const float v0 = *p0, v1 = *p1;
  *p0 = v0 * c - v1 * s;
  *p1 = v0 * s + v1 * c;
}

__global__ void silu_mul_kernel(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t n, int64_t dim) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += bias[i % dim];
  }
}

// Blocks for a grid-stride loop over n elements.
unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace

cudaError_t rmsnorm(const float* x, const float* weight, float eps, int64_t n_tokens, int64_t dim,
                    float* out, cudaStream_t stream) {
  if (n_tokens <= 0) return cudaSuccess;
  const bool vec = dim % 4 == 0 && dim <= int64_t{kRowThreads} * 4 * kRowVecs &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  rmsnorm_kernel<<<static_cast<unsigned>(n_tokens), kRowThreads, 0, stream>>>(x, weight, eps,
                                                                              dim, out, vec);
  return cudaGetLastError();
}

cudaError_t rope(float* x, int64_t row_stride, int64_t n_tokens, const int64_t* positions,
                 int64_t n_heads, int64_t head_dim, bool neox, const float* inv_freq,
                 cudaStream_t stream) {
  const int64_t n = n_tokens * n_heads * (head_dim / 2);
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  rope_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      x, row_stride, n_tokens, positions, n_heads, head_dim, neox, inv_freq);
  return cudaGetLastError();
}

cudaError_t silu_mul(const float* gate, const float* up, int64_t n, float* out,
                     cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  silu_mul_kernel<<<grid_for(n, 256), 256, 0, stream>>>(gate, up, n, out);
  return cudaGetLastError();
}

cudaError_t add(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_kernel<<<grid_for(n, 256), 256, 0, stream>>>(y, x, n);
  return cudaGetLastError();
}

cudaError_t add_bias(float* y, const float* bias, int64_t n_tokens, int64_t dim,
                     cudaStream_t stream) {
  const int64_t n = n_tokens * dim;
  if (n <= 0) return cudaSuccess;
  add_bias_kernel<<<grid_for(n, 256), 256, 0, stream>>>(y, bias, n, dim);
  return cudaGetLastError();
}

}  // namespace cleave::cuda
