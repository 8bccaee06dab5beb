// The GPU kernels beside the floor the device's memory bandwidth sets: paged decode attention of a
// Llama-3.2-1B-shaped layer (32 query heads, 8 KV heads of 64, bf16 KV) at batch 1 over 256 and
// 4,096 tokens and at batch 16 and 64 over 4,096, RMSNorm over its 2,048-wide rows, and its
// matmuls at each grid cap. Bytes are what the kernel must read at least (each token's K and V
// rows once); the floor is bytes / bandwidth, the bandwidth given by --hbm-tbps (4.8 for H200).
// Exits 77 without a CUDA device.
//
// Usage: gpu_kernel_bench [--hbm-tbps 4.8] [--context 4096] [--iters 50] [--matmul-caps -1,0,4,8]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_kernels.h"

namespace {

#define CHECK(expr)                                                                  \
  do {                                                                               \
    const cudaError_t e_ = (expr);                                                   \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));              \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

template <typename T>
T* device_copy(const std::vector<T>& host) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, host.size() * sizeof(T)));
  CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

// Median milliseconds of `iters` runs of fn (after two warm-up runs), timed by events.
template <typename Fn>
float median_ms(int iters, cudaStream_t stream, Fn&& fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(a, stream));
    fn();
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  double tbps = 4.8;
  int64_t context_flag = 4096;
  int iters = 50;
  std::vector<int> caps = {-1, 0, 4, 8, 16};  // -1: the default
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--hbm-tbps") tbps = std::atof(argv[i + 1]);
    else if (f == "--context") context_flag = std::atoll(argv[i + 1]);
    else if (f == "--matmul-caps") {
      caps.clear();
      for (const char* p = argv[i + 1]; *p;) {
        char* end = nullptr;
        caps.push_back(static_cast<int>(std::strtol(p, &end, 10)));
        if (end == p) break;
        p = *end == ',' ? end + 1 : end;
      }
    }
    else if (f == "--iters") iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "gpu_kernel_bench: unknown flag '%s'\n", f.c_str());
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const int64_t heads = 32, kv_heads = 8, hd = 64, kv_dim = kv_heads * hd, bs = 16;
  const int64_t max_batch = 64, blocks_per_seq = (context_flag + bs - 1) / bs;
  const int64_t num_blocks = max_batch * blocks_per_seq;
  const size_t pool_bytes = static_cast<size_t>(num_blocks) * 2 * bs * kv_dim * 2;  // bf16
  std::byte* pool = nullptr;
  CHECK(cudaMalloc(reinterpret_cast<void**>(&pool), pool_bytes));
  CHECK(cudaMemset(pool, 0x3c, pool_bytes));  // bf16 ~0.0115 everywhere: finite scores
  std::printf("device: %s, %d SMs, L2 %d MiB; floor at %.2f TB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, tbps);
  std::printf("%-34s %10s %12s %10s %8s\n", "kernel", "median us", "bytes", "floor us", "x floor");
  std::mt19937 rng(7);
  for (const auto& shape : std::vector<std::pair<int64_t, int64_t>>{
           {1, 256}, {1, context_flag}, {16, context_flag}, {64, context_flag}}) {
    const int64_t batch = shape.first, context = shape.second;
    std::vector<int64_t> positions(batch, context - 1), slots(batch), seq_blocks(batch);
    std::vector<int32_t> seq(batch), ids(static_cast<size_t>(batch * blocks_per_seq));
    for (int64_t s = 0; s < batch; ++s) {
      seq[s] = static_cast<int32_t>(s);
      seq_blocks[s] = s * blocks_per_seq;
      for (int64_t b = 0; b < blocks_per_seq; ++b) ids[s * blocks_per_seq + b] = static_cast<int32_t>(s * blocks_per_seq + b);
      slots[s] = ids[s * blocks_per_seq + blocks_per_seq - 1] * bs + (context - 1) % bs;
    }
    std::shuffle(ids.begin(), ids.end(), rng);  // scattered blocks, as a busy pool has them
    std::vector<float> q(static_cast<size_t>(batch * heads * hd), 0.5f);
    cleave::cuda::DeviceTokenBatch b;
    b.n_tokens = batch;
    b.positions = device_copy(positions);
    b.kv_slots = device_copy(slots);
    b.seq = device_copy(seq);
    b.seq_blocks = device_copy(seq_blocks);
    b.block_ids = device_copy(ids);
    float* dq = device_copy(q);
    float* dout = nullptr;
    CHECK(cudaMalloc(reinterpret_cast<void**>(&dout), q.size() * sizeof(float)));
    cleave::cuda::DevicePagedKv kv{pool, num_blocks, bs, kv_dim, cleave::cuda::ElemType::kBF16};
    const int64_t pf = cleave::cuda::attention_partial_floats(batch, context, heads, hd);
    float* partials = nullptr;
    CHECK(cudaMalloc(reinterpret_cast<void**>(&partials), std::max<int64_t>(pf, 1) * 4));
    const float ms = median_ms(iters, stream, [&] {
      CHECK(cleave::cuda::paged_attention(b, dq, dout, kv, 0, heads, kv_heads, hd, context,
                                          partials, pf, stream));
    });
    cudaFree(partials);
    const double bytes = static_cast<double>(batch) * context * 2 * kv_dim * 2;
    const double floor_us = bytes / (tbps * 1e12) * 1e6;
    char name[64];
    std::snprintf(name, sizeof name, "paged_attention bf16 b=%lld ctx=%lld",
                  static_cast<long long>(batch), static_cast<long long>(context));
    std::printf("%-34s %10.1f %12.0f %10.1f %8.2f\n", name, ms * 1e3, bytes, floor_us,
                ms * 1e3 / floor_us);
    cudaFree(dq);
    cudaFree(dout);
    cudaFree(const_cast<int64_t*>(b.positions));
    cudaFree(const_cast<int64_t*>(b.kv_slots));
    cudaFree(const_cast<int32_t*>(b.seq));
    cudaFree(const_cast<int64_t*>(b.seq_blocks));
    cudaFree(const_cast<int32_t*>(b.block_ids));
  }
  {
    const int64_t n = 64, dim = 2048;
    std::vector<float> x(static_cast<size_t>(n * dim), 1.0f), w(static_cast<size_t>(dim), 1.0f);
    float* dx = device_copy(x);
    float* dw = device_copy(w);
    const float ms = median_ms(iters, stream, [&] {
      CHECK(cleave::cuda::rmsnorm(dx, dw, 1e-5f, n, dim, dx, stream));
    });
    const double bytes = static_cast<double>(n) * dim * 4 * 2;
    const double floor_us = bytes / (tbps * 1e12) * 1e6;
    std::printf("%-34s %10.1f %12.0f %10.1f %8.2f\n", "rmsnorm f32 64x2048", ms * 1e3, bytes,
                floor_us, ms * 1e3 / floor_us);
    cudaFree(dx);
    cudaFree(dw);
  }
  // Weight matrix times activations (bf16 weights, f32 activations) for a 1B model's shapes:
  // the fused gate/up (GLU, two 8192x2048), down (2048x8192) and q/k/v (3072x2048). Bytes are
  // the weights once plus the activations in and out. Each runs at every grid cap of
  // --matmul-caps (matmul_set_grid_cap: blocks per SM; 0 = a block per row group; -1 = the
  // default); the bits are the same, so the default can be chosen by measurement.
  struct Shape {
    const char* name;
    int64_t rows, cols;
    bool glu;
  };
  for (const Shape& sh : {Shape{"glu", 8192, 2048, true}, Shape{"down", 2048, 8192, false},
                          Shape{"qkv", 3072, 2048, false}}) {
    const int64_t rows = sh.rows, cols = sh.cols;
    std::vector<uint16_t> w(static_cast<size_t>(rows * cols));
    for (auto& e : w) e = static_cast<uint16_t>(0x3c00 + (rng() & 0xff));  // bf16 near 0.008
    uint16_t* dw = device_copy(w);
    uint16_t* du = sh.glu ? device_copy(w) : nullptr;
    cleave::cuda::DeviceWeights dwt{cleave::cuda::WeightType::kBF16, dw, nullptr, nullptr, rows,
                                    cols};
    cleave::cuda::DeviceWeights dut = dwt;
    dut.data = du;
    for (int64_t n : {1, 16, 64}) {
      std::vector<float> x(static_cast<size_t>(n * cols), 0.5f);
      float* dx = device_copy(x);
      float* dy = nullptr;
      CHECK(cudaMalloc(reinterpret_cast<void**>(&dy), static_cast<size_t>(n * rows) * 4));
      for (int cap : caps) {
        cleave::cuda::matmul_set_grid_cap(cap);
        const float ms = median_ms(iters, stream, [&] {
          if (sh.glu) CHECK(cleave::cuda::matmul_glu(dwt, dut, dx, n, dy, stream));
          else CHECK(cleave::cuda::matmul(dwt, dx, n, dy, stream));
        });
        const double bytes =
            static_cast<double>(rows) * cols * 2 * (sh.glu ? 2 : 1) + 4.0 * n * (rows + cols);
        const double floor_us = bytes / (tbps * 1e12) * 1e6;
        char name[64];
        std::snprintf(name, sizeof name, "matmul %s %lldx%lld n=%lld cap=%s", sh.name,
                      static_cast<long long>(rows), static_cast<long long>(cols),
                      static_cast<long long>(n), cap < 0 ? "dflt" : std::to_string(cap).c_str());
        std::printf("%-34s %10.1f %12.0f %10.1f %8.2f\n", name, ms * 1e3, bytes, floor_us,
                    ms * 1e3 / floor_us);
      }
      cudaFree(dx);
      cudaFree(dy);
    }
    cudaFree(dw);
    if (du) cudaFree(du);
  }
  cudaFree(pool);
  return 0;
}
