// Weight matrix times activations (decode's matrix-vector and prefill's matrix-matrix products)
// over every weight layout of cuda_kernels.h, and embedding rows of the same layouts.
//
// Memory-bound at decode: each warp streams one weight row with 16-byte loads (8 bf16/f16 values,
// or two float4 of f32, or 8 int8 levels) while the activations stay in L1/L2. Several chunks'
// loads are issued before the first multiply (kUnroll) so that enough bytes are in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "cuda_kernels.h"
#include "kernel_util.cuh"

namespace cleave::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kChunk = 256;  // columns a warp covers per step: 32 lanes x 8
// Chunks whose weights are loaded before they are used: 8 for one matrix and a tile of up to 2
// tokens (about 128 bytes of 16-bit weights in flight per lane), else 4 (a GLU's two matrices, or
// wider tiles, whose accumulators need the registers).
template <bool GLU, int TT>
constexpr int kUnroll = GLU || TT > 2 ? 4 : 8;

// 8 weights of row r from column k (k % 8 == 0) as loaded (WRaw) and as f32 (decode); columns
// >= cols read as 0. `vec`: the row starts 16-byte aligned and holds whole 8-column chunks
// (cols % 8 == 0). The raw form is what a load leaves in registers (4 for 16-bit weights, not 8
// floats), so more of a warp's loads fit in flight at once.
template <WeightType W>
struct WRaw {
  uint4 a, b;   // f32: two float4; f16/bf16: a; int8 levels: a.x, a.y
  float s, o;   // int8 groups: scale and offset
};

template <WeightType W>
__device__ __forceinline__ void load_raw(const DeviceWeights& w, int64_t r, int64_t k, bool vec,
                                         WRaw<W>& raw) {
  const int64_t cols = w.cols;
  if constexpr (W == WeightType::kF32) {
    const float* p = static_cast<const float*>(w.data) + r * cols + k;
    if (vec && k + 8 <= cols) {
      raw.a = __ldg(reinterpret_cast<const uint4*>(p));
      raw.b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    } else {
      float* f = reinterpret_cast<float*>(&raw.a);
      float* g = reinterpret_cast<float*>(&raw.b);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[j] = k + j < cols ? p[j] : 0.0f;
        g[j] = k + 4 + j < cols ? p[4 + j] : 0.0f;
      }
    }
  } else if constexpr (W == WeightType::kF16 || W == WeightType::kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(w.data) + r * cols + k;
    if (vec && k + 8 <= cols) {
      raw.a = __ldg(reinterpret_cast<const uint4*>(p));
    } else {
      uint16_t* h = reinterpret_cast<uint16_t*>(&raw.a);
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = k + j < cols ? p[j] : uint16_t{0};  // +0.0
    }
  } else {
    // kInt8Groups: cols % 32 == 0, so a chunk of 8 sits inside one group of 16.
    const int8_t* p = static_cast<const int8_t*>(w.data) + r * cols + k;
    const int64_t g = r * (cols / 16) + k / 16;
    raw.s = __ldg(w.scales + g);
    raw.o = __ldg(w.offsets + g);
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    raw.a.x = q.x;
    raw.a.y = q.y;
  }
}

template <WeightType W>
__device__ __forceinline__ void decode(const WRaw<W>& raw, float out[8]) {
  if constexpr (W == WeightType::kF32) {
    const float* f = reinterpret_cast<const float*>(&raw.a);
    const float* g = reinterpret_cast<const float*>(&raw.b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[j] = f[j];
      out[4 + j] = g[j];
    }
  } else if constexpr (W == WeightType::kF16) {
    const __half* h = reinterpret_cast<const __half*>(&raw.a);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __half2float(h[j]);
  } else if constexpr (W == WeightType::kBF16) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw.a);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __bfloat162float(h[j]);
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(&raw.a);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __fmaf_rn(raw.s, static_cast<float>(q[j]), raw.o);
  }
}

template <WeightType W>
__device__ __forceinline__ void load_w8(const DeviceWeights& w, int64_t r, int64_t k, bool vec,
                                        float out[8]) {
  WRaw<W> raw;
  load_raw<W>(w, r, k, vec, raw);
  decode<W>(raw, out);
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

// Up to three matrices of one weight layout and column count in one launch (q, k and v share
// their input), or a gate and an up matrix whose outputs are combined as silu(gate) * up (GLU).
struct MatmulJob {
  DeviceWeights w[3];
  float* y[3];
  int64_t row_start[4];  // matrix m holds the job's rows [row_start[m], row_start[m + 1])
  int count;             // matrices (GLU: 1 output, w[0] gate, w[1] up)
  bool accumulate;       // y += W x (the residual add, as add() computes it) instead of y = W x
};

// Warps that share one row: a function of the column count alone (batch invariance), so that
// long rows are streamed by several warps at once.
__host__ __device__ inline int warps_per_row(int64_t cols) {
  return cols >= 4096 ? 4 : cols >= 2048 ? 2 : 1;
}

// Tokens [blockIdx.x * TT, +TT) of the job's row groups blockIdx.y, blockIdx.y + gridDim.y, ...
// (group g: rows [g * RPB, +RPB), RPB = kWarpsPerBlock / WPR rows per block), each row's
// 256-column chunks dealt to its WPR warps in turn (chunk c to part c % WPR): the token tiles of
// one row group are neighbours in launch order, so they run together and the weight rows come
// from HBM once. Every (t, r) takes the same sequence of __fmaf_rn over its part's columns in
// order whatever TT, n_tokens and the grid, the same butterfly, and the parts are added in part
// order: the instantiations give identical bits, and a fused GLU output equals matmul +
// silu_mul.
// Wide tiles with at most 102 registers (5 blocks an SM; a GLU 128, 4); narrow ones as ptxas
// chooses (about 72 for one token).
template <WeightType W, int TT, int WPR, bool GLU>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, TT > 4 ? (GLU ? 4 : 5) : 0)
    matmul_kernel(MatmulJob job, const float* __restrict__ x, int64_t n_tokens, bool vec) {
  constexpr int kRows = kWarpsPerBlock / WPR;
  __shared__ float part_sum[kWarpsPerBlock][GLU ? 2 : 1][TT];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int part = warp % WPR;
  const int64_t groups = (job.row_start[job.count] + kRows - 1) / kRows;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TT;
  const int nt = static_cast<int>(n_tokens - t0 < TT ? n_tokens - t0 : TT);
  const int64_t cols = job.w[0].cols;
  constexpr int64_t kStep = static_cast<int64_t>(kChunk) * WPR;
  // Row groups blockIdx.y, + gridDim.y, ...: a grid smaller than the rows keeps its warps
  // streaming instead of paying a block's start and drain per row (matmul_set_grid_cap()).
  for (int64_t G = blockIdx.y; G < groups; G += gridDim.y) {
    const int64_t R = G * kRows + warp / WPR;
    const bool valid = R < job.row_start[job.count];
    int m = 0;
    while (m + 1 < job.count && R >= job.row_start[m + 1]) ++m;
    const int64_t r = R - job.row_start[m];
    const DeviceWeights& w = job.w[m];
    float acc[TT], acc2[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[t] = acc2[t] = 0.0f;
    int64_t k0 = static_cast<int64_t>(part) * kChunk + lane * 8;
    if (valid) {
      for (; k0 + (kUnroll<GLU, TT> - 1) * kStep < cols; k0 += kUnroll<GLU, TT> * kStep) {
        WRaw<W> wr[kUnroll<GLU, TT>], ur[GLU ? kUnroll<GLU, TT> : 1];
#pragma unroll
        for (int u = 0; u < kUnroll<GLU, TT>; ++u) {
          load_raw<W>(w, r, k0 + u * kStep, vec, wr[u]);
          if constexpr (GLU) load_raw<W>(job.w[1], r, k0 + u * kStep, vec, ur[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll<GLU, TT>; ++u) {
          float wv[8], uv[8];
          decode<W>(wr[u], wv);
          if constexpr (GLU) decode<W>(ur[u], uv);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            if (t < nt) {
              float xv[8];
              load_x8(x, cols, t0 + t, k0 + u * kStep, vec, xv);
#pragma unroll
              for (int j = 0; j < 8; ++j) {
                acc[t] = __fmaf_rn(wv[j], xv[j], acc[t]);
                if constexpr (GLU) acc2[t] = __fmaf_rn(uv[j], xv[j], acc2[t]);
              }
            }
          }
        }
      }
      for (; k0 < cols; k0 += kStep) {
        float wv[8], uv[8];
        load_w8<W>(w, r, k0, vec, wv);
        if constexpr (GLU) load_w8<W>(job.w[1], r, k0, vec, uv);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t < nt) {
            float xv[8];
            load_x8(x, cols, t0 + t, k0, vec, xv);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              acc[t] = __fmaf_rn(wv[j], xv[j], acc[t]);
              if constexpr (GLU) acc2[t] = __fmaf_rn(uv[j], xv[j], acc2[t]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      acc[t] = warp_sum(acc[t]);
      if constexpr (GLU) acc2[t] = warp_sum(acc2[t]);
    }
    if constexpr (WPR > 1) {
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          part_sum[warp][0][t] = acc[t];
          if constexpr (GLU) part_sum[warp][1][t] = acc2[t];
        }
      }
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          float s = part_sum[warp][0][t], s2 = GLU ? part_sum[warp][GLU ? 1 : 0][t] : 0.0f;
#pragma unroll
          for (int p = 1; p < WPR; ++p) {
            s += part_sum[warp + p][0][t];
            if constexpr (GLU) s2 += part_sum[warp + p][GLU ? 1 : 0][t];
          }
          acc[t] = s;
          acc2[t] = s2;
        }
      }
      __syncthreads();  // part_sum is free for the next row group
    }
    if (valid && lane == 0 && part == 0) {
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= nt) continue;
        float v = acc[t];
        if constexpr (GLU) v = v / (1.0f + expf(-v)) * acc2[t];  // as silu_mul
        float* out = job.y[m] + (t0 + t) * w.rows + r;
        *out = job.accumulate ? *out + v : v;
      }
    }
  }
}

// Blocks per SM that a launch's row groups are folded into (0: one block per row group; -1:
// the default). The default, measured on an H200 (gpu_kernel_bench, gpu_engine_bench; bf16
// weights of a 1B model): a block per row group for one token tile (decode at batch 1: a step of
// 1.397 ms against 1.536 with 8 blocks per SM), and 4 per SM for several (batch 64: gate/up 541
// against 643 us, a step 25.9 against 27.7 ms), where the loop keeps fewer, longer-lived warps
// streaming instead of paying a block's start and drain per row group.
int g_grid_cap = -2;  // -2: not read from the environment yet
int g_sm_count = 0;

int64_t row_blocks(int64_t groups, int64_t token_tiles) {
  if (g_grid_cap == -2) {
    const char* env = std::getenv("CLEAVE_CUDA_MATMUL_BLOCKS_PER_SM");
    g_grid_cap = env ? std::max(0, std::atoi(env)) : -1;
  }
  if (g_sm_count == 0) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess) {
      g_sm_count = sms > 0 ? sms : 1;
    }
  }
  const int per_sm = g_grid_cap >= 0 ? g_grid_cap : (token_tiles == 1 ? 0 : 4);
  int64_t cap = 65535;
  if (per_sm > 0 && g_sm_count > 0) {
    // The whole grid (token tiles x row blocks) at about per_sm blocks per SM.
    const int64_t want = static_cast<int64_t>(per_sm) * g_sm_count;
    cap = std::min<int64_t>(cap, std::max<int64_t>(1, want / std::max<int64_t>(1, token_tiles)));
  }
  return std::min(groups, cap);
}

template <WeightType W, int TT, int WPR>
void launch_tile(const MatmulJob& job, const float* x, int64_t n, bool vec, bool glu,
                 cudaStream_t stream) {
  const int64_t rows = job.row_start[job.count];
  const int64_t rpb = kWarpsPerBlock / WPR;
  const int64_t tiles = (n + TT - 1) / TT;
  const dim3 grid(static_cast<unsigned>(tiles),
                  static_cast<unsigned>(row_blocks((rows + rpb - 1) / rpb, tiles)));
  if (glu) {
    matmul_kernel<W, TT, WPR, true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(job, x, n, vec);
  } else {
    matmul_kernel<W, TT, WPR, false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(job, x, n, vec);
  }
}

template <WeightType W, int WPR>
void launch_wpr(const MatmulJob& job, const float* x, int64_t n, bool vec, bool glu,
                cudaStream_t stream) {
  if (n == 1) launch_tile<W, 1, WPR>(job, x, n, vec, glu, stream);
  else if (n == 2) launch_tile<W, 2, WPR>(job, x, n, vec, glu, stream);
  else if (n <= 4) launch_tile<W, 4, WPR>(job, x, n, vec, glu, stream);
  else launch_tile<W, 8, WPR>(job, x, n, vec, glu, stream);
}

template <WeightType W>
void launch_type(const MatmulJob& job, const float* x, int64_t n, bool vec, bool glu,
                 cudaStream_t stream) {
  switch (warps_per_row(job.w[0].cols)) {
    case 1: launch_wpr<W, 1>(job, x, n, vec, glu, stream); break;
    case 2: launch_wpr<W, 2>(job, x, n, vec, glu, stream); break;
    default: launch_wpr<W, 4>(job, x, n, vec, glu, stream); break;
  }
}

cudaError_t launch_job(const MatmulJob& job, const float* x, int64_t n, bool glu,
                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const DeviceWeights& w0 = job.w[0];
  const int used = glu ? 2 : job.count;
  for (int m = 0; m < used; ++m) {
    const DeviceWeights& w = job.w[m];
    if (w.type != w0.type || w.cols != w0.cols || w.cols <= 0 || w.data == nullptr ||
        (w.type == WeightType::kInt8Groups && w.cols % 32 != 0) || (glu && w.rows != w0.rows)) {
      return cudaErrorInvalidValue;
    }
  }
  if (n > (int64_t{1} << 31)) return cudaErrorInvalidValue;
  // 16-byte loads need 16-byte aligned rows of both operands: cols % 8 == 0 (cudaMalloc'd bases).
  bool vec = w0.cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int m = 0; m < used; ++m) vec = vec && reinterpret_cast<uintptr_t>(job.w[m].data) % 16 == 0;
  switch (w0.type) {
    case WeightType::kF32: launch_type<WeightType::kF32>(job, x, n, vec, glu, stream); break;
    case WeightType::kF16: launch_type<WeightType::kF16>(job, x, n, vec, glu, stream); break;
    case WeightType::kBF16: launch_type<WeightType::kBF16>(job, x, n, vec, glu, stream); break;
    case WeightType::kInt8Groups:
      launch_type<WeightType::kInt8Groups>(job, x, n, vec, glu, stream);
      break;
    default: return cudaErrorInvalidValue;
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

void matmul_set_grid_cap(int blocks_per_sm) { g_grid_cap = blocks_per_sm < 0 ? -1 : blocks_per_sm; }

cudaError_t matmul(const DeviceWeights& w, const float* x, int64_t n_tokens, float* y,
                   cudaStream_t stream) {
  return matmul_many(&w, 1, x, n_tokens, &y, stream);
}

cudaError_t matmul_many(const DeviceWeights* w, int count, const float* x, int64_t n_tokens,
                        float* const* y, cudaStream_t stream) {
  if (count < 1 || count > 3) return cudaErrorInvalidValue;
  MatmulJob job{};
  job.count = count;
  job.row_start[0] = 0;
  for (int m = 0; m < count; ++m) {
    if (w[m].rows <= 0) return cudaErrorInvalidValue;
    job.w[m] = w[m];
    job.y[m] = y[m];
    job.row_start[m + 1] = job.row_start[m] + w[m].rows;
  }
  return launch_job(job, x, n_tokens, false, stream);
}

cudaError_t matmul_add(const DeviceWeights& w, const float* x, int64_t n_tokens, float* y,
                       cudaStream_t stream) {
  if (w.rows <= 0) return cudaErrorInvalidValue;
  MatmulJob job{};
  job.count = 1;
  job.w[0] = w;
  job.y[0] = y;
  job.row_start[1] = w.rows;
  job.accumulate = true;
  return launch_job(job, x, n_tokens, false, stream);
}

cudaError_t matmul_glu(const DeviceWeights& gate, const DeviceWeights& up, const float* x,
                       int64_t n_tokens, float* out, cudaStream_t stream) {
  if (gate.rows <= 0) return cudaErrorInvalidValue;
  MatmulJob job{};
  job.count = 1;
  job.w[0] = gate;
  job.w[1] = up;
  job.y[0] = out;
  job.row_start[1] = gate.rows;
  return launch_job(job, x, n_tokens, true, stream);
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
