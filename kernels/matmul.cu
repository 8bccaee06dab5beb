// Weight matrix times activations (decode's matrix-vector and prefill's matrix-matrix products)
// over every weight layout of cuda_kernels.h, and embedding rows of the same layouts.
//
// Memory-bound at decode: each warp streams one weight row with 16-byte loads (8 bf16/f16 values,
// or two float4 of f32, or 8 int8 levels) while the activations stay in L1/L2. Several chunks'
// loads are issued before the first multiply (kUnroll) so that enough bytes are in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cuda_kernels.h"
#include "kernel_util.cuh"

namespace cleave::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kChunk = 256;  // columns a warp covers per step: 32 lanes x 8
constexpr int kUnroll = 4;   // chunks whose weights are loaded before they are used

// 8 weights of row r from column k (k % 8 == 0) as f32; columns >= cols read as 0. `vec`: the
// row starts 16-byte aligned and holds whole 8-column chunks (cols % 8 == 0).
template <WeightType W>
__device__ __forceinline__ void load_w8(const DeviceWeights& w, int64_t r, int64_t k, bool vec,
                                        float out[8]) {
  const int64_t cols = w.cols;
  if constexpr (W == WeightType::kF32) {
    const float* p = static_cast<const float*>(w.data) + r * cols + k;
    if (vec && k + 8 <= cols) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p));
      const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
      out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = k + j < cols ? p[j] : 0.0f;
    }
  } else if constexpr (W == WeightType::kF16 || W == WeightType::kBF16) {
    using T = std::conditional_t<W == WeightType::kF16, __half, __nv_bfloat16>;
    const T* p = static_cast<const T*>(w.data) + r * cols + k;
    if (vec && k + 8 <= cols) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if constexpr (W == WeightType::kF16) out[j] = __half2float(h[j]);
        else out[j] = __bfloat162float(h[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (k + j < cols) {
          if constexpr (W == WeightType::kF16) out[j] = __half2float(p[j]);
          else out[j] = __bfloat162float(p[j]);
        } else {
          out[j] = 0.0f;
        }
      }
    }
  } else {
    // kInt8Groups: cols % 32 == 0, so a chunk of 8 sits inside one group of 16.
    const int8_t* p = static_cast<const int8_t*>(w.data) + r * cols + k;
    const int64_t g = r * (cols / 16) + k / 16;
    const float s = __ldg(w.scales + g), o = __ldg(w.offsets + g);
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    const int8_t* q = reinterpret_cast<const int8_t*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __fmaf_rn(s, static_cast<float>(q[j]), o);
  }
}

// 8 activations of row t from column k, as load_w8.
__device__ __forceinline__ void load_x8(const float* x, int64_t cols, int64_t t, int64_t k,
                                        bool vec, float out[8]) {
  const float* p = x + t * cols + k;
  if (vec && k + 8 <= cols) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = k + j < cols ? p[j] : 0.0f;
  }
}

// Tokens [blockIdx.x * TT, +TT) of rows [blockIdx.y * kWarpsPerBlock, +kWarpsPerBlock): the
// token tiles of one row group are neighbours in launch order, so they run together and the
// weight rows come from HBM once (the other tiles hit L2). Every
// (t, r) takes the same sequence of __fmaf_rn over columns in order whatever TT and n_tokens,
// and the same butterfly: the instantiations give identical bits.
template <WeightType W, int TT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    matmul_kernel(DeviceWeights w, const float* __restrict__ x, int64_t n_tokens,
                  float* __restrict__ y, bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.y) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= w.rows) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TT;
  const int nt = static_cast<int>(n_tokens - t0 < TT ? n_tokens - t0 : TT);
  const int64_t cols = w.cols;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  int64_t k0 = static_cast<int64_t>(lane) * 8;
  for (; k0 + (kUnroll - 1) * kChunk < cols; k0 += kUnroll * kChunk) {
    float wv[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_w8<W>(w, r, k0 + u * kChunk, vec, wv[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t < nt) {
          float xv[8];
          load_x8(x, cols, t0 + t, k0 + u * kChunk, vec, xv);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[t] = __fmaf_rn(wv[u][j], xv[j], acc[t]);
        }
      }
    }
  }
  for (; k0 < cols; k0 += kChunk) {
    float wv[8];
    load_w8<W>(w, r, k0, vec, wv);
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < nt) {
        float xv[8];
        load_x8(x, cols, t0 + t, k0, vec, xv);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[t] = __fmaf_rn(wv[j], xv[j], acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0 && t < nt) y[(t0 + t) * w.rows + r] = s;
  }
}

template <WeightType W>
cudaError_t launch_matmul(const DeviceWeights& w, const float* x, int64_t n, float* y, bool vec,
                          cudaStream_t stream) {
  const int tt = n == 1 ? 1 : n == 2 ? 2 : n <= 4 ? 4 : 8;
  const dim3 grid(static_cast<unsigned>((n + tt - 1) / tt),
                  static_cast<unsigned>((w.rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(kWarpsPerBlock * 32);
  switch (tt) {
    case 1: matmul_kernel<W, 1><<<grid, block, 0, stream>>>(w, x, n, y, vec); break;
    case 2: matmul_kernel<W, 2><<<grid, block, 0, stream>>>(w, x, n, y, vec); break;
    case 4: matmul_kernel<W, 4><<<grid, block, 0, stream>>>(w, x, n, y, vec); break;
    default: matmul_kernel<W, 8><<<grid, block, 0, stream>>>(w, x, n, y, vec); break;
  }
  return cudaGetLastError();
}

template <WeightType W>
__global__ void embedding_rows_kernel(DeviceWeights w, const int32_t* tokens, float* out) {
  const int64_t t = blockIdx.x;
  const int64_t r = tokens[t];
  for (int64_t k = static_cast<int64_t>(threadIdx.x) * 8; k < w.cols; k += blockDim.x * 8) {
    float v[8];
    load_w8<W>(w, r, k, false, v);
    for (int j = 0; j < 8 && k + j < w.cols; ++j) out[t * w.cols + k + j] = v[j];
  }
}

}  // namespace

cudaError_t matmul(const DeviceWeights& w, const float* x, int64_t n_tokens, float* y,
                   cudaStream_t stream) {
  if (n_tokens <= 0 || w.rows <= 0) return cudaSuccess;
  if (w.cols <= 0 || n_tokens > (int64_t{1} << 31) || w.rows > 65535LL * kWarpsPerBlock) {
    return cudaErrorInvalidValue;
  }
  if (w.type == WeightType::kInt8Groups && w.cols % 32 != 0) return cudaErrorInvalidValue;
  // 16-byte loads need 16-byte aligned rows of both operands: cols % 8 == 0 (cudaMalloc'd bases).
  const bool vec = w.cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
  switch (w.type) {
    case WeightType::kF32: return launch_matmul<WeightType::kF32>(w, x, n_tokens, y, vec, stream);
    case WeightType::kF16: return launch_matmul<WeightType::kF16>(w, x, n_tokens, y, vec, stream);
    case WeightType::kBF16: return launch_matmul<WeightType::kBF16>(w, x, n_tokens, y, vec, stream);
    case WeightType::kInt8Groups:
      return launch_matmul<WeightType::kInt8Groups>(w, x, n_tokens, y, vec, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t embedding_rows(const DeviceWeights& w, const int32_t* tokens, int64_t n_tokens,
                           float* out, cudaStream_t stream) {
  if (n_tokens <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(n_tokens)), block(128);
  switch (w.type) {
    case WeightType::kF32:
      embedding_rows_kernel<WeightType::kF32><<<grid, block, 0, stream>>>(w, tokens, out); break;
    case WeightType::kF16:
      embedding_rows_kernel<WeightType::kF16><<<grid, block, 0, stream>>>(w, tokens, out); break;
    case WeightType::kBF16:
      embedding_rows_kernel<WeightType::kBF16><<<grid, block, 0, stream>>>(w, tokens, out); break;
    case WeightType::kInt8Groups:
      embedding_rows_kernel<WeightType::kInt8Groups><<<grid, block, 0, stream>>>(w, tokens, out);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cleave::cuda
