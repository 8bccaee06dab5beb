// The CUDA kernels (kernels/cuda_kernels.h) against the CPU backend on fresh random inputs:
// fp32 results within 1e-5..1e-4 of the CPU's (relative to the largest reference value), KV
// writes byte for byte, no NaN, every output element written, and attention batch invariant on
// the GPU (a token alone gives the bits it gives in a batch).
//
// Exits 77 (skipped) when no CUDA device can be used, so that ctest reports it skipped.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cleave/common/thread_pool.h"
#include "cleave/engine/backend.h"
#include "cuda_kernels.h"

namespace cleave {
namespace {

#define CUDA_OK(expr)                                                           \
  do {                                                                          \
    const cudaError_t e_ = (expr);                                              \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);      \
  } while (0)

// Device memory holding a copy of a host vector.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return static_cast<T*>(p_); }
  void upload(const std::vector<T>& host) {
    if (p_ && !host.empty()) cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> out(n_);
    if (p_ && n_ > 0) cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }
  // Every byte set to 0xff: a float NaN, so that an element the kernel skips shows up.
  void poison() {
    if (p_) cudaMemset(p_, 0xff, std::max<size_t>(n_, 1) * sizeof(T));
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// max |got - want| / max(1e-6, max |want|); +inf when got holds a NaN.
double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, ref = 1e-6;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, static_cast<double>(std::fabs(got[i] - want[i])));
    ref = std::max(ref, static_cast<double>(std::fabs(want[i])));
  }
  return diff / ref;
}

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = std::make_unique<ThreadPool>(2, "cpu-ref");
    cpu_ = make_cpu_backend(*pool_);
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

  std::mt19937 rng_{20261202};
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Backend> cpu_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaKernelsTest, RmsNormMatchesTheCpu) {
  for (int64_t dim : {64, 576, 2048, 4099, 8192, 8196}) {
    const int64_t n = 7;
    auto x = random_floats(rng_, static_cast<size_t>(n * dim), 3.0f);
    auto w = random_floats(rng_, static_cast<size_t>(dim));
    std::vector<float> want(x.size());
    cpu_->rmsnorm(x.data(), w.data(), 1e-5f, n, dim, want.data());
    DeviceBuffer<float> dx(x), dw(w), dout(x.size());
    dout.poison();
    CUDA_OK(cuda::rmsnorm(dx.get(), dw.get(), 1e-5f, n, dim, dout.get(), stream_));
    sync();
    EXPECT_LT(relative_error(dout.download(), want), 1e-5) << "dim " << dim;
  }
}

TEST_F(CudaKernelsTest, RopeNormalAndNeoxMatchTheCpu) {
  const int64_t n = 5, heads = 9, hd = 64, stride = heads * hd + 64;  // q rows with room after
  std::vector<int64_t> pos = {0, 1, 17, 511, 4000};
  std::vector<float> inv(static_cast<size_t>(hd / 2));
  for (int64_t j = 0; j < hd / 2; ++j) {
    inv[static_cast<size_t>(j)] = std::pow(10000.0f, -2.0f * static_cast<float>(j) / hd);
  }
  for (RopeStyle style : {RopeStyle::kNormal, RopeStyle::kNeox}) {
    auto x = random_floats(rng_, static_cast<size_t>(n * stride));
    std::vector<float> want = x;
    RopeArgs a;
    a.x = want.data();
    a.row_stride = stride;
    a.n_tokens = n;
    a.positions = pos.data();
    a.n_heads = heads;
    a.head_dim = hd;
    a.style = style;
    a.inv_freq = inv.data();
    cpu_->rope(a);
    DeviceBuffer<float> dx(x), dinv(inv);
    DeviceBuffer<int64_t> dpos(pos);
    CUDA_OK(cuda::rope(dx.get(), stride, n, dpos.get(), heads, hd, style == RopeStyle::kNeox,
                       dinv.get(), stream_));
    sync();
    const auto got = dx.download();
    EXPECT_LT(relative_error(got, want), 1e-4) << (style == RopeStyle::kNeox ? "neox" : "normal");
    // The tail of each row (past the heads) is untouched.
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = heads * hd; i < stride; ++i) {
        ASSERT_EQ(got[static_cast<size_t>(t * stride + i)], x[static_cast<size_t>(t * stride + i)]);
      }
    }
  }
}

TEST_F(CudaKernelsTest, ElementwiseOpsMatchTheCpu) {
  const int64_t n_tokens = 3, dim = 1536, n = n_tokens * dim;
  auto gate = random_floats(rng_, static_cast<size_t>(n), 4.0f);
  auto up = random_floats(rng_, static_cast<size_t>(n));
  auto bias = random_floats(rng_, static_cast<size_t>(dim));
  std::vector<float> want(static_cast<size_t>(n));
  cpu_->silu_mul(gate.data(), up.data(), n, want.data());
  DeviceBuffer<float> dg(gate), du(up), db(bias), dout(static_cast<size_t>(n));
  dout.poison();
  CUDA_OK(cuda::silu_mul(dg.get(), du.get(), n, dout.get(), stream_));
  sync();
  EXPECT_LT(relative_error(dout.download(), want), 1e-6) << "silu_mul";

  std::vector<float> y = up;
  cpu_->add(y.data(), gate.data(), n);
  cpu_->add_bias(y.data(), bias.data(), n_tokens, dim);
  CUDA_OK(cuda::add(du.get(), dg.get(), n, stream_));
  CUDA_OK(cuda::add_bias(du.get(), db.get(), n_tokens, dim, stream_));
  sync();
  EXPECT_EQ(du.download(), y) << "add and add_bias are exact";
}

TEST_F(CudaKernelsTest, EmbeddingGathersExactRows) {
  const int64_t rows = 50, cols = 96;
  auto f = random_floats(rng_, static_cast<size_t>(rows * cols));
  std::vector<int32_t> tokens = {0, 49, 7, 7, 23};
  std::vector<float> want(tokens.size() * cols);
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::memcpy(&want[t * cols], &f[static_cast<size_t>(tokens[t] * cols)], cols * sizeof(float));
  }
  DeviceBuffer<float> table(f), out(want.size());
  DeviceBuffer<int32_t> dt(tokens);
  out.poison();
  const cuda::DeviceWeights w{cuda::WeightType::kF32, table.get(), nullptr, nullptr, rows, cols};
  CUDA_OK(cuda::embedding_rows(w, dt.get(), static_cast<int64_t>(tokens.size()), out.get(),
                               stream_));
  sync();
  EXPECT_EQ(out.download(), want);
}

// A paged KV pool and a batch over three sequences with scattered block tables.
struct PagedCase {
  static constexpr int64_t kLayers = 2, kBlocks = 64, kBlockSize = 16;
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  DType dtype = DType::kF32;
  std::vector<int64_t> lens = {1, 37, 300};
  std::vector<int64_t> seq_blocks;   // offsets into block_ids
  std::vector<BlockId> block_ids;
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  int64_t element_bytes() const { return dtype == DType::kF32 ? 4 : 2; }
  size_t pool_bytes() const {
    return static_cast<size_t>(kLayers * kBlocks * 2 * kBlockSize * kv_dim() * element_bytes());
  }
  PagedKv host_kv(std::vector<std::byte>& pool) const {
    PagedKv kv;
    kv.base = pool.data();
    kv.num_blocks = kBlocks;
    kv.block_size = kBlockSize;
    kv.kv_dim = kv_dim();
    kv.dtype = dtype;
    kv.element_bytes = element_bytes();
    return kv;
  }
  cuda::DevicePagedKv device_kv(std::byte* base) const {
    cuda::DevicePagedKv kv;
    kv.base = base;
    kv.num_blocks = kBlocks;
    kv.block_size = kBlockSize;
    kv.kv_dim = kv_dim();
    kv.dtype = dtype == DType::kF32 ? cuda::ElemType::kF32
               : dtype == DType::kF16 ? cuda::ElemType::kF16 : cuda::ElemType::kBF16;
    return kv;
  }
  void make_tables(std::mt19937& rng) {
    std::vector<BlockId> free(kBlocks);
    std::iota(free.begin(), free.end(), 0);
    std::shuffle(free.begin(), free.end(), rng);
    size_t next = 0;
    for (int64_t len : lens) {
      seq_blocks.push_back(static_cast<int64_t>(block_ids.size()));
      for (int64_t b = 0; b < (len + kBlockSize - 1) / kBlockSize; ++b) block_ids.push_back(free[next++]);
    }
  }
};

// Host index arrays of a batch and their device copies.
struct Batch {
  std::vector<int64_t> positions, slots, seq_blocks;
  std::vector<int32_t> seq;
  std::vector<BlockId> block_ids;
  TokenBatch host() const {
    TokenBatch b;
    b.n_tokens = static_cast<int64_t>(positions.size());
    b.positions = positions.data();
    b.kv_slots = slots.data();
    b.seq = seq.data();
    b.seq_blocks = seq_blocks.data();
    b.block_ids = block_ids.data();
    return b;
  }
};

struct DeviceBatch {
  DeviceBuffer<int64_t> positions, slots, seq_blocks;
  DeviceBuffer<int32_t> seq, block_ids;
  explicit DeviceBatch(const Batch& b)
      : positions(b.positions), slots(b.slots), seq_blocks(b.seq_blocks), seq(b.seq),
        block_ids(b.block_ids) {}
  cuda::DeviceTokenBatch view(int64_t n) const {
    cuda::DeviceTokenBatch d;
    d.n_tokens = n;
    d.positions = positions.get();
    d.kv_slots = slots.get();
    d.seq = seq.get();
    d.seq_blocks = seq_blocks.get();
    d.block_ids = block_ids.get();
    return d;
  }
};

// `tokens`: (sequence, position) pairs.
Batch make_batch(const PagedCase& c, const std::vector<std::pair<int32_t, int64_t>>& tokens) {
  Batch b;
  b.seq_blocks = c.seq_blocks;
  b.block_ids = c.block_ids;
  for (auto [s, p] : tokens) {
    b.seq.push_back(s);
    b.positions.push_back(p);
    const BlockId blk = c.block_ids[static_cast<size_t>(c.seq_blocks[static_cast<size_t>(s)] + p / PagedCase::kBlockSize)];
    b.slots.push_back(static_cast<int64_t>(blk) * PagedCase::kBlockSize + p % PagedCase::kBlockSize);
  }
  return b;
}

class PagedKernelsTest : public CudaKernelsTest,
                         public ::testing::WithParamInterface<std::tuple<DType, int>> {};

TEST_P(PagedKernelsTest, WriteKvIsExactAndAttentionMatchesTheCpuAndIsBatchInvariant) {
  const auto [dtype, shape] = GetParam();
  PagedCase c;
  c.n_heads = shape == 0 ? 9 : 8;  // SmolLM2's 9/3 heads of 64, or 8/2 heads of 128
  c.n_kv_heads = shape == 0 ? 3 : 2;
  c.head_dim = shape == 0 ? 64 : 128;
  c.dtype = dtype;
  c.make_tables(rng_);
  const int64_t layer = 1;
  // Every position of every sequence is written.
  std::vector<std::pair<int32_t, int64_t>> all;
  for (size_t s = 0; s < c.lens.size(); ++s) {
    for (int64_t p = 0; p < c.lens[s]; ++p) all.emplace_back(static_cast<int32_t>(s), p);
  }
  const Batch wb = make_batch(c, all);
  const int64_t nw = static_cast<int64_t>(all.size());
  auto k = random_floats(rng_, static_cast<size_t>(nw * c.kv_dim()));
  auto v = random_floats(rng_, static_cast<size_t>(nw * c.kv_dim()));
  std::vector<std::byte> host_pool(c.pool_bytes(), std::byte{0});
  const TokenBatch hwb = wb.host();
  KvWriteArgs wa;
  wa.batch = &hwb;
  wa.k = k.data();
  wa.v = v.data();
  wa.kv = c.host_kv(host_pool);
  wa.layer = layer;
  cpu_->write_kv(wa);

  DeviceBuffer<std::byte> dpool(c.pool_bytes());
  CUDA_OK(cudaMemset(dpool.get(), 0, c.pool_bytes()));
  DeviceBuffer<float> dk(k), dv(v);
  DeviceBatch dwb(wb);
  CUDA_OK(cuda::write_kv(dwb.view(nw), dk.get(), dv.get(), c.device_kv(dpool.get()), layer, stream_));
  sync();
  const auto got_pool = dpool.download();
  ASSERT_EQ(std::memcmp(got_pool.data(), host_pool.data(), host_pool.size()), 0)
      << "the GPU's KV pool differs from the CPU's";

  // Queries: the last positions of each sequence (decode) and a chunk in the middle (prefill).
  std::vector<std::pair<int32_t, int64_t>> qt = {{0, 0}, {1, 36}, {1, 20}, {2, 299}, {2, 150},
                                                 {2, 151}, {2, 63}, {2, 64}, {1, 0}};
  const Batch qb = make_batch(c, qt);
  const int64_t nq = static_cast<int64_t>(qt.size());
  const int64_t width = c.n_heads * c.head_dim;
  auto q = random_floats(rng_, static_cast<size_t>(nq * width));
  std::vector<float> want(q.size());
  const TokenBatch hqb = qb.host();
  AttentionArgs aa;
  aa.batch = &hqb;
  aa.q = q.data();
  aa.out = want.data();
  aa.kv = c.host_kv(host_pool);
  aa.layer = layer;
  aa.n_heads = c.n_heads;
  aa.n_kv_heads = c.n_kv_heads;
  aa.head_dim = c.head_dim;
  cpu_->reserve_attention(
      {.max_context = 512, .max_tokens = nq, .n_heads = c.n_heads, .head_dim = c.head_dim});
  cpu_->attention(aa);

  DeviceBuffer<float> dq(q), dout(q.size());
  dout.poison();
  DeviceBatch dqb(qb);
  int64_t max_keys = 0;
  for (const auto& [s, p] : qt) max_keys = std::max(max_keys, p + 1);
  const int64_t pf = cuda::attention_partial_floats(nq, max_keys, c.n_heads, c.head_dim);
  ASSERT_GT(pf, 0) << "the case must have a token of several splits";
  DeviceBuffer<float> partials(static_cast<size_t>(pf));
  CUDA_OK(cuda::paged_attention(dqb.view(nq), dq.get(), dout.get(), c.device_kv(dpool.get()),
                                layer, c.n_heads, c.n_kv_heads, c.head_dim, max_keys,
                                partials.get(), pf, stream_));
  sync();
  const auto batched = dout.download();
  EXPECT_LT(relative_error(batched, want), 1e-4);

  // Each token alone (a batch of one, its own index arrays) gives the same bits.
  for (int64_t t = 0; t < nq; ++t) {
    const Batch one = make_batch(c, {qt[static_cast<size_t>(t)]});
    DeviceBatch d1(one);
    std::vector<float> q1(q.begin() + t * width, q.begin() + (t + 1) * width);
    DeviceBuffer<float> dq1(q1), dout1(q1.size());
    CUDA_OK(cuda::paged_attention(d1.view(1), dq1.get(), dout1.get(), c.device_kv(dpool.get()),
                                  layer, c.n_heads, c.n_kv_heads, c.head_dim,
                                  qt[static_cast<size_t>(t)].second + 1, partials.get(), pf,
                                  stream_));
    sync();
    const auto alone = dout1.download();
    ASSERT_EQ(std::memcmp(alone.data(), batched.data() + t * width, width * sizeof(float)), 0)
        << "token " << t << " differs alone and in the batch";
  }
}

INSTANTIATE_TEST_SUITE_P(DTypesAndShapes, PagedKernelsTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kF16,
                                                              DType::kBF16),
                                            ::testing::Values(0, 1)));

// The fused RoPE + KV write gives the bits of rope(q), rope(k) and write_kv, for both RoPE
// styles and every KV type.
TEST_F(CudaKernelsTest, FusedRopeAndKvWriteEqualTheSeparateLaunches) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (bool neox : {false, true}) {
      PagedCase c;
      c.n_heads = 9;
      c.n_kv_heads = 3;
      c.head_dim = 64;
      c.dtype = dtype;
      c.make_tables(rng_);
      std::vector<std::pair<int32_t, int64_t>> toks = {{0, 0}, {1, 36}, {2, 299}, {2, 64}, {1, 5}};
      const Batch b = make_batch(c, toks);
      const int64_t n = static_cast<int64_t>(toks.size()), q_stride = c.n_heads * c.head_dim + 32;
      std::vector<float> inv(static_cast<size_t>(c.head_dim / 2));
      for (size_t j = 0; j < inv.size(); ++j) {
        inv[j] = std::pow(10000.0f, -2.0f * static_cast<float>(j) / static_cast<float>(c.head_dim));
      }
      const auto q = random_floats(rng_, static_cast<size_t>(n * q_stride));
      const auto k = random_floats(rng_, static_cast<size_t>(n * c.kv_dim()));
      const auto v = random_floats(rng_, static_cast<size_t>(n * c.kv_dim()));
      DeviceBatch db(b);
      DeviceBuffer<float> dinv(inv);
      auto ok = [](cudaError_t e) { EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e); };
      using Out = std::tuple<std::vector<float>, std::vector<float>, std::vector<std::byte>>;
      auto run = [&](bool fused) -> Out {
        DeviceBuffer<float> dq(q), dk(k), dv(v);
        DeviceBuffer<std::byte> pool(c.pool_bytes());
        ok(cudaMemset(pool.get(), 0, c.pool_bytes()));
        const auto kv = c.device_kv(pool.get());
        if (fused) {
          ok(cuda::rope_write_kv(db.view(n), dq.get(), q_stride, c.n_heads, dk.get(), dv.get(),
                                      c.n_kv_heads, c.head_dim, neox, dinv.get(), kv, 1, stream_));
        } else {
          ok(cuda::rope(dq.get(), q_stride, n, db.positions.get(), c.n_heads, c.head_dim, neox,
                             dinv.get(), stream_));
          ok(cuda::rope(dk.get(), c.kv_dim(), n, db.positions.get(), c.n_kv_heads, c.head_dim,
                             neox, dinv.get(), stream_));
          ok(cuda::write_kv(db.view(n), dk.get(), dv.get(), kv, 1, stream_));
        }
        sync();
        return std::make_tuple(dq.download(), dk.download(), pool.download());
      };
      const auto [q1, k1, p1] = run(false);
      const auto [q2, k2, p2] = run(true);
      const std::string what = std::string(dtype_name(dtype)) + (neox ? " neox" : " normal");
      EXPECT_EQ(std::memcmp(q1.data(), q2.data(), q1.size() * 4), 0) << what << ": q";
      EXPECT_EQ(std::memcmp(k1.data(), k2.data(), k1.size() * 4), 0) << what << ": k";
      EXPECT_EQ(std::memcmp(p1.data(), p2.data(), p1.size()), 0) << what << ": the pool";
      EXPECT_NE(q1, q) << what << ": nothing was rotated";
    }
  }
}

TEST_F(CudaKernelsTest, BadAttentionShapesAreRefused) {
  cuda::DeviceTokenBatch b;
  b.n_tokens = 1;
  cuda::DevicePagedKv kv;
  EXPECT_EQ(cuda::paged_attention(b, nullptr, nullptr, kv, 0, 8, 3, 64, 1, nullptr, 0, stream_),
            cudaErrorInvalidValue);  // 8 heads over 3 KV heads
  EXPECT_EQ(cuda::paged_attention(b, nullptr, nullptr, kv, 0, 8, 2, 512, 1, nullptr, 0, stream_),
            cudaErrorInvalidValue);  // head_dim over 256
  EXPECT_EQ(cuda::paged_attention(b, nullptr, nullptr, kv, 0, 8, 2, 64, 5000, nullptr, 0, stream_),
            cudaErrorInvalidValue);  // several splits and no scratch for them
}

}  // namespace
}  // namespace cleave
