#include "cleave/engine/cpu_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace cleave::cpu {
namespace {

// The f32 path (uses_int_path false); the block formats, Q8_0 among them, are in qdot_test.cpp.
const DType kAllDtypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// A weight matrix in a given dtype, with its exact f32 values (what the kernels must see).
struct TestMatrix {
  std::vector<std::byte> bytes;
  std::vector<float> values;  // dequantised, row-major [rows, n]
  TensorView view;
};

TestMatrix make_matrix(DType dtype, int64_t rows, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  TestMatrix m;
  m.values.resize(static_cast<size_t>(rows * n));
  const uint64_t row_bytes = *dtype_row_bytes(dtype, static_cast<uint64_t>(n));
  m.bytes.resize(static_cast<size_t>(row_bytes * rows));
  for (int64_t r = 0; r < rows; ++r) {
    std::byte* dst = m.bytes.data() + r * row_bytes;
    float* val = m.values.data() + r * n;
    std::vector<float> src(static_cast<size_t>(n));
    for (auto& v : src) v = dist(rng);
    switch (dtype) {
      case DType::kF32:
        std::memcpy(dst, src.data(), src.size() * 4);
        for (int64_t i = 0; i < n; ++i) val[i] = src[i];
        break;
      case DType::kF16:
        for (int64_t i = 0; i < n; ++i) {
          uint16_t h = f32_to_f16(src[i]);
          std::memcpy(dst + 2 * i, &h, 2);
          val[i] = f16_to_f32(h);
        }
        break;
      case DType::kBF16:
        for (int64_t i = 0; i < n; ++i) {
          uint16_t h = f32_to_bf16(src[i]);
          std::memcpy(dst + 2 * i, &h, 2);
          val[i] = bf16_to_f32(h);
        }
        break;
      default:  // the integer-path formats are tested in qdot_test.cpp
        break;
    }
  }
  m.view.name = "test.weight";
  m.view.dtype = dtype;
  m.view.shape = {rows, n};
  m.view.data = m.bytes.data();
  m.view.nbytes = m.bytes.size();
  return m;
}

std::vector<float> random_vector(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// Sizes that exercise the 32-element steps, the 8-chunk loop and the scalar tail, and the
// multi-token kernels' K-chunking (4096: two equal chunks on AVX-512, one on AVX2; 2008: one
// chunk and no tail; 576: one chunk and no tail, where 8 rows reduce at once; the large test
// below: several unequal chunks and a tail).
std::vector<int64_t> test_sizes(DType dtype) {
  return {1, 5, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 100, 257, 576, 2008, 4096};
}

void expect_close(double ref, double abs_sum, float got, const std::string& what) {
  // f32 accumulation of n terms: error well below 1e-5 of the sum of magnitudes.
  EXPECT_NEAR(got, ref, 1e-5 * abs_sum + 1e-6) << what;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

class KernelSetTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    previous_ = kernel_isa();
    if (!set_kernel_isa(GetParam())) GTEST_SKIP() << "this CPU cannot run the " << GetParam()
                                                  << " kernels";
  }
  void TearDown() override { ASSERT_TRUE(set_kernel_isa(previous_)); }
  std::string previous_;
};

TEST_P(KernelSetTest, DotRowMatchesDoubleReference) {
  for (DType dtype : kAllDtypes) {
    for (int64_t n : test_sizes(dtype)) {
      const int64_t rows = 3;
      TestMatrix m = make_matrix(dtype, rows, n, static_cast<uint32_t>(n));
      std::vector<float> x = random_vector(n, 1000 + static_cast<uint32_t>(n));
      for (int64_t r = 0; r < rows; ++r) {
        double ref = 0, abs_sum = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double p = static_cast<double>(m.values[r * n + i]) * x[i];
          ref += p;
          abs_sum += std::fabs(p);
        }
        expect_close(ref, abs_sum, dot_row(m.view, r, x.data()),
                     std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                         " row=" + std::to_string(r));
      }
    }
  }
}

// The contract the forward pass depends on: every (row, token) output of matmul equals dot_row
// bit for bit, whatever the number of tokens, the strides and the thread count.
TEST_P(KernelSetTest, MatmulIsBatchInvariantBitForBit) {
  for (DType dtype : kAllDtypes) {
    for (int64_t n : test_sizes(dtype)) {
      if (n == 4096) continue;  // covered by the large test below
      const int64_t rows = 37;  // not a multiple of the tile height
      const int64_t in_stride = n + 3, out_stride = rows + 5;
      TestMatrix m = make_matrix(dtype, rows, n, 7 + static_cast<uint32_t>(n));
      const int64_t max_tokens = 70;
      std::vector<float> x = random_vector(in_stride * max_tokens, 99 + static_cast<uint32_t>(n));
      std::vector<float> expected(static_cast<size_t>(rows * max_tokens));
      for (int64_t t = 0; t < max_tokens; ++t)
        for (int64_t r = 0; r < rows; ++r)
          expected[t * rows + r] = dot_row(m.view, r, x.data() + t * in_stride);
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        // Every micro-tile width of each set (up to 6 tokens), several tiles, and more tokens
        // than one accumulator group of the block kernels (64).
        for (int64_t tokens : {1, 2, 3, 4, 5, 6, 7, 11, 13, 37, 70}) {
          std::vector<float> y(static_cast<size_t>(out_stride * tokens), -1.0f);
          matmul(pool, m.view, x.data(), in_stride, tokens, y.data(), out_stride);
          for (int64_t t = 0; t < tokens; ++t)
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(bits(y[t * out_stride + r]), bits(expected[t * rows + r]))
                  << dtype_name(dtype) << " n=" << n << " threads=" << threads
                  << " tokens=" << tokens << " row=" << r << " token=" << t;
        }
      }
    }
  }
}

TEST_P(KernelSetTest, LargeMatmulMatchesReferenceAndIsBatchInvariant) {
  for (DType dtype : kAllDtypes) {
    // AVX2: two unequal K-chunks (2056 + 2048) and a tail of 5; AVX-512: three (1368 each).
    const int64_t rows = 301, n = 4096 + 13;
    TestMatrix m = make_matrix(dtype, rows, n, 5);
    const int64_t tokens = 11;
    std::vector<float> x = random_vector(n * tokens, 6);
    ThreadPool pool2(2), pool3(3);
    std::vector<float> y_batch(static_cast<size_t>(rows * tokens));
    matmul(pool3, m.view, x.data(), n, tokens, y_batch.data(), rows);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<float> y_one(static_cast<size_t>(rows));
      matmul(pool2, m.view, x.data() + t * n, n, 1, y_one.data(), rows);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(bits(y_one[r]), bits(y_batch[t * rows + r]))
            << dtype_name(dtype) << " row=" << r << " token=" << t;
        double ref = 0, abs_sum = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double p = static_cast<double>(m.values[r * n + i]) * x[t * n + i];
          ref += p;
          abs_sum += std::fabs(p);
        }
        expect_close(ref, abs_sum, y_one[r], std::string(dtype_name(dtype)));
      }
    }
  }
}

TEST_P(KernelSetTest, DotF32MatchesReferenceAndDotRow) {
  for (int64_t n : test_sizes(DType::kF32)) {
    std::vector<float> a = random_vector(n, 11), b = random_vector(n, 12);
    double ref = 0, abs_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      ref += static_cast<double>(a[i]) * b[i];
      abs_sum += std::fabs(static_cast<double>(a[i]) * b[i]);
    }
    const float got = dot_f32(a.data(), b.data(), n);
    expect_close(ref, abs_sum, got, "n=" + std::to_string(n));
    TensorView v{"a", DType::kF32, {1, n}, reinterpret_cast<const std::byte*>(a.data()),
                 static_cast<uint64_t>(n) * 4};
    EXPECT_EQ(bits(got), bits(dot_row(v, 0, b.data())));
  }
}

// Element-wise: every set must give the portable loop's bits (a rounded product, then the sum).
TEST_P(KernelSetTest, AxpyMatchesScalarLoopBitForBit) {
  for (int64_t n : test_sizes(DType::kF32)) {
    std::vector<float> x = random_vector(n, 61), y = random_vector(n, 62);
    std::vector<float> expected = y;
    const float a = 0.3f;
    for (int64_t i = 0; i < n; ++i) {
      volatile float product = a * x[i];  // volatile: no fused multiply-add in the reference
      expected[i] = expected[i] + product;
    }
    axpy(y.data(), a, x.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits(y[i]), bits(expected[i])) << "n=" << n << " " << i;
  }
}

// Attention's batched helpers: each (row, x) pair and each element exactly what one dot_f32 or
// axpy call per row gives, for f32, f16 and bf16 rows (converted exactly), strided rows, and
// row and x counts around the tile sizes.
TEST_P(KernelSetTest, DotRowsAndAxpyRowsMatchOneCallPerRowBitForBit) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t n : {1, 7, 16, 24, 64, 80, 128, 131}) {
      const int64_t n_rows = 13, n_x = 5, row_elems = n + 9;  // rows padded: a stride > n
      TestMatrix m = make_matrix(dtype, n_rows, row_elems, 70 + static_cast<uint32_t>(n));
      const uint64_t row_bytes = m.bytes.size() / n_rows;
      std::vector<float> x = random_vector(n_x * (n + 3), 71);
      std::vector<float> out(static_cast<size_t>(n_x * n_rows), -1.0f);
      dot_rows(dtype, m.view.data, row_bytes, n_rows, x.data(), n + 3, n_x, n, out.data(), n_rows);
      for (int64_t t = 0; t < n_x; ++t) {
        for (int64_t r = 0; r < n_rows; ++r) {
          const float* row = m.values.data() + r * row_elems;  // the rows' exact f32 values
          ASSERT_EQ(bits(out[t * n_rows + r]), bits(dot_f32(x.data() + t * (n + 3), row, n)))
              << dtype_name(dtype) << " n=" << n << " row=" << r << " x=" << t;
        }
      }
    }
  }
  for (int64_t n : {1, 8, 15, 16, 24, 33, 48, 64, 100, 129}) {
    for (int64_t n_rows : {0, 1, 3, 16}) {
      for (int64_t n_y : {1, 2, 3, 4, 7}) {
        const int64_t stride = n + 5, y_stride = n + 2, a_stride = n_rows + 1;
        std::vector<float> rows = random_vector(n_rows * stride, 81);
        std::vector<float> a = random_vector(n_y * a_stride, 82);
        std::vector<float> y = random_vector(n_y * y_stride, 83), expected = y;
        for (int64_t o = 0; o < n_y; ++o)
          for (int64_t r = 0; r < n_rows; ++r)
            axpy(expected.data() + o * y_stride, a[o * a_stride + r], rows.data() + r * stride, n);
        axpy_rows(y.data(), y_stride, a.data(), a_stride, n_y, rows.data(), stride, n_rows, n);
        for (int64_t i = 0; i < n_y * y_stride; ++i)
          ASSERT_EQ(bits(y[i]), bits(expected[i]))
              << "n=" << n << " rows=" << n_rows << " outputs=" << n_y << " " << i;
      }
    }
  }
}

TEST_P(KernelSetTest, RmsnormMatchesReferenceAndMayAlias) {
  const int64_t n = 77;
  std::vector<float> x = random_vector(n, 21), w = random_vector(n, 22), out(n);
  const float eps = 1e-5f;
  rmsnorm(x.data(), w.data(), eps, n, out.data());
  double ss = 0;
  for (float v : x) ss += static_cast<double>(v) * v;
  const double scale = 1.0 / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(out[i], x[i] * scale * w[i], 1e-5) << i;
  std::vector<float> in_place = x;
  rmsnorm(in_place.data(), w.data(), eps, n, in_place.data());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(bits(in_place[i]), bits(out[i])) << i;
}

// The AVX-512 set promises the AVX2 set's bits exactly (kernel_set.h): a model gives the same
// tokens whichever of the two a machine picks.
TEST(CpuKernelsTest, Avx512SetMatchesAvx2SetBitForBit) {
  const std::string previous = kernel_isa();
  if (!set_kernel_isa("avx512")) GTEST_SKIP() << "this CPU cannot run the avx512 kernels";
  ASSERT_TRUE(set_kernel_isa(previous));
  ThreadPool pool(2);
  for (DType dtype : kAllDtypes) {
    for (int64_t n : test_sizes(dtype)) {
      const int64_t rows = 53;
      TestMatrix m = make_matrix(dtype, rows, n, 300 + static_cast<uint32_t>(n));
      for (int64_t tokens : {1, 3, 16, 67}) {
        std::vector<float> x = random_vector(n * tokens, 400 + static_cast<uint32_t>(n));
        std::vector<float> y2(static_cast<size_t>(rows * tokens));
        std::vector<float> y512(y2.size());
        ASSERT_TRUE(set_kernel_isa("avx2"));
        matmul(pool, m.view, x.data(), n, tokens, y2.data(), rows);
        ASSERT_TRUE(set_kernel_isa("avx512"));
        matmul(pool, m.view, x.data(), n, tokens, y512.data(), rows);
        ASSERT_TRUE(set_kernel_isa(previous));
        for (size_t i = 0; i < y2.size(); ++i)
          ASSERT_EQ(bits(y2[i]), bits(y512[i]))
              << dtype_name(dtype) << " n=" << n << " tokens=" << tokens << " index=" << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSets, KernelSetTest, ::testing::Values("avx512", "avx2", "generic"),
                         [](const auto& info) { return info.param; });

TEST(CpuKernelsTest, KernelIsaIsKnownAndSwitchable) {
  const std::string isa = kernel_isa();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "generic") << isa;
  EXPECT_FALSE(set_kernel_isa("sse9"));
  EXPECT_EQ(kernel_isa(), isa);
  ASSERT_TRUE(set_kernel_isa("generic"));
  EXPECT_STREQ(kernel_isa(), "generic");
  ASSERT_TRUE(set_kernel_isa(isa));
}

TEST(CpuKernelsTest, RowAndTensorToF32AreExact) {
  for (DType dtype : kAllDtypes) {
    const int64_t rows = 4, n = 64;
    TestMatrix m = make_matrix(dtype, rows, n, 31);
    std::vector<float> row(n);
    for (int64_t r = 0; r < rows; ++r) {
      row_to_f32(m.view, r, row.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(bits(row[i]), bits(m.values[r * n + i])) << dtype_name(dtype) << " " << r;
    }
    std::vector<float> all(static_cast<size_t>(rows * n));
    tensor_to_f32(m.view, all.data());
    for (size_t i = 0; i < all.size(); ++i)
      ASSERT_EQ(bits(all[i]), bits(m.values[i])) << dtype_name(dtype) << " " << i;
  }
}

// The engine's exp: within 2 ulp of the true value over the range softmax and SiLU use, clamped
// outside it, and the same bits on every kernel set (the SIMD lanes and the scalar tail alike).
TEST_P(KernelSetTest, ExpIsAccurateAndTheSameOnEverySet) {
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.0173f) x.push_back(v);
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> got(x.size());
  exp_f32(x.data(), got.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double ref = std::exp(static_cast<double>(x[i]));
    const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);
    ASSERT_LE(std::fabs(got[i] - ref), 2 * ulp) << "x=" << x[i];
  }
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> edge = {0.0f, -0.0f, 1.0f, -1.0f, -87.0f, 88.0f, -100.0f, 100.0f, -inf,
                             inf, std::numeric_limits<float>::quiet_NaN(), 1e-30f, -1e-40f};
  for (int i = 0; i < 20; ++i) edge.push_back(static_cast<float>(i) * 0.37f - 3.0f);  // a tail
  std::vector<float> mine(edge.size()), generic(edge.size());
  exp_f32(edge.data(), mine.data(), static_cast<int64_t>(edge.size()));
  const std::string previous = kernel_isa();
  ASSERT_TRUE(set_kernel_isa("generic"));
  exp_f32(edge.data(), generic.data(), static_cast<int64_t>(edge.size()));
  exp_f32(x.data(), x.data(), n);  // in place, generic: the accuracy pass's bits again
  ASSERT_TRUE(set_kernel_isa(previous));
  for (size_t i = 0; i < edge.size(); ++i) {
    if (std::isnan(edge[i])) continue;  // below
    EXPECT_EQ(bits(mine[i]), bits(generic[i])) << "x=" << edge[i];
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits(got[i]), bits(x[i])) << i;
  EXPECT_EQ(mine[0], 1.0f);
  EXPECT_EQ(mine[8], generic[4]);  // -inf clamps to exp(-87)
  EXPECT_TRUE(std::isfinite(mine[9]));
  // A NaN stays NaN (softmax and SiLU must not turn a corrupt value into a plausible one), in the
  // SIMD lanes and in the tail alike.
  EXPECT_TRUE(std::isnan(mine[10]));
  EXPECT_TRUE(std::isnan(generic[10]));
  std::vector<float> nans(37, 0.5f);
  nans[3] = nans[20] = nans[36] = std::numeric_limits<float>::quiet_NaN();
  exp_f32(nans.data(), nans.data(), 37);
  for (int i = 0; i < 37; ++i)
    EXPECT_EQ(std::isnan(nans[i]), i == 3 || i == 20 || i == 36) << i;
}

TEST(CpuKernelsTest, SoftmaxMatchesReference) {
  std::vector<float> x = random_vector(300, 41);
  for (auto& v : x) v *= 20.0f;  // large logits: needs the max subtraction
  std::vector<double> ref(x.size());
  double max = x[0], sum = 0;
  for (float v : x) max = std::max(max, static_cast<double>(v));
  for (size_t i = 0; i < x.size(); ++i) sum += ref[i] = std::exp(x[i] - max);
  softmax(x.data(), static_cast<int64_t>(x.size()));
  double total = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(x[i], ref[i] / sum, 1e-6) << i;
    total += x[i];
  }
  EXPECT_NEAR(total, 1.0, 1e-5);
  float one = 3.0f;
  softmax(&one, 1);
  EXPECT_EQ(one, 1.0f);
}

// softmax and softmax_rows against the plain sequence of operations they promise: a sequential
// maximum, exp of the differences, a sum in index order, one reciprocal.
void softmax_in_order(float* x, int64_t n) {
  float max = x[0];
  for (int64_t i = 1; i < n; ++i) max = std::max(max, x[i]);
  for (int64_t i = 0; i < n; ++i) x[i] -= max;
  exp_f32(x, x, n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

TEST(CpuKernelsTest, SoftmaxRowsMatchDivisionAndSoftmaxPerRowBitForBit) {
  // Lengths that cross the eight-row groups and the eight-lane maximum, an empty row, a row of
  // one; signed zeros and ties for the maximum.
  const std::vector<int64_t> n = {1, 7, 8, 9, 33, 130, 0, 37, 64, 5, 129, 16, 2};
  const int64_t stride = 131;
  const int64_t rows = static_cast<int64_t>(n.size());
  for (float div : {1.0f, 8.0f, std::sqrt(128.0f)}) {
    SCOPED_TRACE(testing::Message() << "div " << div);
    std::vector<float> x = random_vector(static_cast<size_t>(rows * stride), 61);
    for (auto& v : x) v *= 30.0f;
    x[2 * stride + 3] = -0.0f;
    x[2 * stride + 4] = 0.0f;
    x[4 * stride + 10] = x[4 * stride + 20] = 90.0f;  // the row's maximum, twice
    std::vector<float> want = x;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = want.data() + r * stride;
      for (int64_t i = 0; i < n[r]; ++i) row[i] /= div;
      if (n[r] > 0) softmax_in_order(row, n[r]);
    }
    softmax_rows(x.data(), stride, n.data(), rows, div);
    EXPECT_EQ(0, std::memcmp(x.data(), want.data(), x.size() * sizeof(float)));
    if (div == 1.0f) {  // softmax() is the one-row case
      std::vector<float> one(x.begin() + 5 * stride, x.begin() + 5 * stride + n[5]);
      std::vector<float> again(one);
      softmax_in_order(one.data(), n[5]);
      softmax(again.data(), n[5]);
      EXPECT_EQ(0, std::memcmp(one.data(), again.data(), one.size() * sizeof(float)));
    }
  }
}

TEST(CpuKernelsTest, ElementwiseOpsMatchReference) {
  const int64_t n = 45;
  std::vector<float> a = random_vector(n, 51), b = random_vector(n, 52), out(n);
  silu_mul(a.data(), b.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) {
    const double g = a[i];
    EXPECT_NEAR(out[i], g / (1.0 + std::exp(-g)) * b[i], 1e-6) << i;
  }
  std::vector<float> y = a;
  add_inplace(y.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], a[i] + b[i]) << i;
  y = a;
  axpy(y.data(), 0.25f, b.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], a[i] + 0.25f * b[i]) << i;
}

}  // namespace
}  // namespace cleave::cpu
