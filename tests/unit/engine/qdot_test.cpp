// The integer path (uses_int_path): every block format's kernels against a double-precision
// reference on the dequantised weights, bit identity across kernel sets, batch invariance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cleave/engine/cpu_kernels.h"
#include "cleave/model/quants.h"

namespace cleave::cpu {
namespace {

const DType kIntTypes[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1,
                           DType::kQ8_0, DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                           DType::kQ5_K, DType::kQ6_K};

struct Matrix {
  std::vector<std::byte> bytes;
  std::vector<float> values;  // decoded, [rows, n]
  TensorView view;
};

Matrix make_matrix(DType t, int64_t rows, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Matrix m;
  const uint64_t row_bytes = *dtype_row_bytes(t, static_cast<uint64_t>(n));
  m.bytes.resize(row_bytes * static_cast<uint64_t>(rows));
  m.values.resize(static_cast<size_t>(rows * n));
  std::vector<float> src(static_cast<size_t>(n));
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : src) v = dist(rng) + 0.3f;  // an offset exercises the formats' mins
    encode_row(t, src.data(), n, m.bytes.data() + r * row_bytes);
    decode_row(t, m.bytes.data() + r * row_bytes, n, m.values.data() + r * n);
  }
  m.view.name = "test.weight";
  m.view.dtype = t;
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

// The activation the integer path sees: x rounded to 8 bits per group of `group` elements (32
// for the legacy formats, 256 for the K-quants).
std::vector<double> quantised_activation(const float* x, int64_t n, int64_t group) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t b = 0; b < n / group; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < group; ++i) amax = std::fmax(amax, std::fabs(x[b * group + i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i = 0; i < group; ++i)
      out[b * group + i] = static_cast<double>(d) * std::nearbyint(x[b * group + i] * id);
  }
  return out;
}

int64_t act_group(DType t) { return dtype_info(t).block_elems == 256 ? 256 : 32; }

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<int64_t> sizes(DType t) {
  if (dtype_info(t).block_elems == 256) return {256, 512, 1536};
  return {32, 64, 96, 288, 576, 1536};
}

class IntPathTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    previous_ = kernel_isa();
    if (!set_kernel_isa(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << GetParam() << " kernels";
  }
  void TearDown() override { ASSERT_TRUE(set_kernel_isa(previous_)); }
  std::string previous_;
};

TEST_P(IntPathTest, EveryBlockFormatTakesTheIntegerPath) {
  for (DType t : kIntTypes) EXPECT_TRUE(uses_int_path(t)) << dtype_name(t);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) EXPECT_FALSE(uses_int_path(t));
}

// Two bounds. Against the exact product of the decoded weights with the 8-bit activation the
// kernel sees, only f32 rounding separates them (1e-5 of the sum of magnitudes). Against the
// exact product with the f32 activation, the activation's rounding adds at most half a level
// per element: sum_i |w_i| * d_x(group of i) / 2.
TEST_P(IntPathTest, DotMatchesDoubleReferenceOnDequantisedWeights) {
  for (DType t : kIntTypes) {
    for (int64_t n : sizes(t)) {
      const int64_t rows = 5;
      Matrix m = make_matrix(t, rows, n, static_cast<uint32_t>(n) + 11);
      std::vector<float> x = random_vector(n, 77 + static_cast<uint32_t>(n));
      const int64_t group = act_group(t);
      const std::vector<double> xq = quantised_activation(x.data(), n, group);
      std::vector<float> y(rows);
      ThreadPool pool(2);
      matmul(pool, m.view, x.data(), n, 1, y.data(), rows);
      for (int64_t r = 0; r < rows; ++r) {
        double ref_q = 0, ref = 0, mag = 0, act_bound = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double w = m.values[r * n + i];
          ref_q += w * xq[i];
          ref += w * x[i];
          mag += std::fabs(w * xq[i]);
          float amax = 0.0f;
          for (int64_t k = 0; k < group; ++k)
            amax = std::fmax(amax, std::fabs(x[(i / group) * group + k]));
          act_bound += std::fabs(w) * (amax / 127.0) / 2.0;
        }
        const std::string what = std::string(dtype_name(t)) + " n=" + std::to_string(n) +
                                 " row=" + std::to_string(r);
        EXPECT_NEAR(y[r], ref_q, 1e-5 * mag + 1e-6) << what;
        EXPECT_NEAR(y[r], ref, act_bound * 1.0001 + 1e-5 * mag + 1e-6) << what;
        EXPECT_EQ(bits(y[r]), bits(dot_row(m.view, r, x.data()))) << what;
        EXPECT_TRUE(std::isfinite(y[r])) << what;
      }
    }
  }
}

// Every (row, token) output is the same bits whatever the token count and thread count.
TEST_P(IntPathTest, MatmulIsBatchInvariantBitForBit) {
  for (DType t : kIntTypes) {
    const int64_t n = dtype_info(t).block_elems == 256 ? 512 : 160, rows = 37;
    Matrix m = make_matrix(t, rows, n, 5);
    const int64_t tokens = 11;
    std::vector<float> x = random_vector(n * tokens, 9);
    std::vector<float> single(static_cast<size_t>(rows * tokens));
    ThreadPool one(1);
    for (int64_t tok = 0; tok < tokens; ++tok)
      matmul(one, m.view, x.data() + tok * n, n, 1, single.data() + tok * rows, rows);
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      for (int64_t nt : {2, 3, 4, 7, 11}) {
        std::vector<float> y(static_cast<size_t>(rows * nt));
        matmul(pool, m.view, x.data(), n, nt, y.data(), rows);
        for (int64_t i = 0; i < rows * nt; ++i)
          ASSERT_EQ(bits(y[i]), bits(single[i]))
              << dtype_name(t) << " threads=" << threads << " nt=" << nt << " i=" << i;
      }
    }
  }
}

TEST_P(IntPathTest, ZeroActivationsGiveZero) {
  for (DType t : kIntTypes) {
    const int64_t n = 256, rows = 4;
    Matrix m = make_matrix(t, rows, n, 3);
    std::vector<float> x(n, 0.0f), y(rows, 1.0f);
    ThreadPool pool(1);
    matmul(pool, m.view, x.data(), n, 1, y.data(), rows);
    for (float v : y) EXPECT_EQ(v, 0.0f) << dtype_name(t);
  }
}

INSTANTIATE_TEST_SUITE_P(Sets, IntPathTest, ::testing::Values("generic", "avx2", "avx512"));

// The kernel sets give the same bits for every format (the reference order is exact integers and
// the same f32 steps). The token counts: 1 (the decode kernels), then from 2 up to 67 (where the
// per-call scale tables of several tiles grow and are reused), which give whole multi-token
// tiles of every set (AVX2 4, AVX-512 6 and 8) and every leftover width; 9 rows: whole row
// tiles (2 and 4) and leftovers.
TEST(IntPathSets, AllKernelSetsAgreeBitForBit) {
  const std::string previous = kernel_isa();
  for (DType t : kIntTypes) {
    for (const int64_t tokens : {1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 13, 14, 19, 67}) {
      const int64_t n = dtype_info(t).block_elems == 256 ? 768 : 416, rows = 9;
      Matrix m = make_matrix(t, rows, n, 21);
      std::vector<float> x = random_vector(n * tokens, 22);
      ThreadPool pool(2);
      std::vector<float> ref;
      for (const char* isa : {"generic", "avx2", "avx512"}) {
        if (!set_kernel_isa(isa)) continue;
        std::vector<float> y(static_cast<size_t>(rows * tokens));
        matmul(pool, m.view, x.data(), n, tokens, y.data(), rows);
        if (ref.empty()) {
          ref = y;
          continue;
        }
        for (size_t i = 0; i < y.size(); ++i)
          ASSERT_EQ(bits(y[i]), bits(ref[i]))
              << dtype_name(t) << " " << isa << " tokens=" << tokens << " i=" << i;
      }
    }
  }
  ASSERT_TRUE(set_kernel_isa(previous));
}

// The fused passes give the separate calls' bits when their matrices need different activation
// groups (a K-quant beside legacy formats and f16, as in a Q4_K_M file's mixed tensors): x is
// quantised once per group size the call needs, and each matrix reads its own.
TEST(IntPathSets, FusedMatmulsWithMixedFormatsMatchSeparateCalls) {
  const int64_t n = 512, rows = 13;
  for (const int64_t tokens : {1, 7}) {
    const std::vector<float> x = random_vector(n * tokens, 31);
    Matrix q4k = make_matrix(DType::kQ4_K, rows, n, 41);
    Matrix q8 = make_matrix(DType::kQ8_0, rows, n, 42);
    Matrix f16 = make_matrix(DType::kF16, rows, n, 43);
    Matrix q6k = make_matrix(DType::kQ6_K, rows, n, 44);
    ThreadPool pool(2);
    auto separate = [&](const Matrix& m) {
      std::vector<float> y(static_cast<size_t>(rows * tokens));
      matmul(pool, m.view, x.data(), n, tokens, y.data(), rows);
      return y;
    };
    const std::vector<float> a = separate(q4k), b = separate(q8), c = separate(f16),
                             d = separate(q6k);
    std::vector<float> ya(a.size()), yb(a.size()), yc(a.size()), yd(a.size());
    const TensorView* ws[] = {&q4k.view, &q8.view, &f16.view, &q6k.view};
    float* ys[] = {ya.data(), yb.data(), yc.data(), yd.data()};
    matmul_many(pool, ws, x.data(), tokens, ys);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(bits(ya[i]), bits(a[i])) << "q4_k tokens=" << tokens << " i=" << i;
      ASSERT_EQ(bits(yb[i]), bits(b[i])) << "q8_0 tokens=" << tokens << " i=" << i;
      ASSERT_EQ(bits(yc[i]), bits(c[i])) << "f16 tokens=" << tokens << " i=" << i;
      ASSERT_EQ(bits(yd[i]), bits(d[i])) << "q6_k tokens=" << tokens << " i=" << i;
    }
    // gate Q4_K, up Q8_0: out = silu(gate x) * up x.
    std::vector<float> glu(a.size()), scratch(a.size()), want(a.size());
    matmul_glu(pool, q4k.view, q8.view, x.data(), tokens, glu.data(), scratch.data());
    silu_mul(a.data(), b.data(), static_cast<int64_t>(a.size()), want.data());
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(bits(glu[i]), bits(want[i])) << "glu tokens=" << tokens << " i=" << i;
  }
}

}  // namespace
}  // namespace cleave::cpu
