#include "cleave/model/quants.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace cleave {
namespace {

const DType kBlockTypes[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1,
                             DType::kQ8_0, DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                             DType::kQ5_K, DType::kQ6_K};

std::string name(DType t) { return std::string(dtype_name(t)); }

TEST(QuantsTest, BlockLayoutsAndGgmlIdsAreGgmls) {
  struct Expect {
    DType t;
    uint32_t ggml;
    int64_t elems, bytes;
  };
  const Expect expect[] = {
      {DType::kQ4_0, 2, 32, 18},   {DType::kQ4_1, 3, 32, 20},   {DType::kQ5_0, 6, 32, 22},
      {DType::kQ5_1, 7, 32, 24},   {DType::kQ8_0, 8, 32, 34},   {DType::kQ2_K, 10, 256, 84},
      {DType::kQ3_K, 11, 256, 110}, {DType::kQ4_K, 12, 256, 144}, {DType::kQ5_K, 13, 256, 176},
      {DType::kQ6_K, 14, 256, 210}};
  for (const auto& e : expect) {
    EXPECT_EQ(dtype_to_ggml(e.t), e.ggml) << name(e.t);
    EXPECT_EQ(dtype_from_ggml(e.ggml), e.t) << name(e.t);
    EXPECT_EQ(dtype_info(e.t).block_elems, e.elems) << name(e.t);
    EXPECT_EQ(dtype_info(e.t).block_bytes, e.bytes) << name(e.t);
    EXPECT_EQ(parse_dtype(name(e.t)), e.t);
    EXPECT_TRUE(dtype_is_quantized(e.t));
  }
  EXPECT_EQ(parse_dtype("Q4_K"), DType::kQ4_K);
  // ggml's Q8_1, Q8_K and the IQ formats are not weight formats cleave reads.
  for (uint32_t id : {9u, 15u, 16u, 17u, 18u, 19u, 20u, 21u, 22u, 23u, 29u})
    EXPECT_FALSE(dtype_from_ggml(id).has_value()) << id;
  EXPECT_FALSE(dtype_row_bytes(DType::kQ4_K, 288).has_value());  // not whole super-blocks
  EXPECT_EQ(dtype_row_bytes(DType::kQ4_K, 512), 288u);
  EXPECT_FALSE(dtype_row_bytes(DType::kQ4_0, 48).has_value());
}

// Hand-packed blocks pin the byte layout of each format to ggml's element order.
TEST(QuantsTest, HandPackedBlocksDecodeAsGgmlLaysThemOut) {
  {  // Q4_0: element j in the low nibble of qs[j], element j + 16 in the high one; d * (q - 8).
    BlockQ4_0 b{};
    b.d = f32_to_f16(0.5f);
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
    float out[32];
    decode_row(DType::kQ4_0, reinterpret_cast<const std::byte*>(&b), 32, out);
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(out[j], 0.5f * static_cast<float>(j - 8)) << j;
      EXPECT_EQ(out[j + 16], 0.5f * static_cast<float>(7 - j)) << j;
    }
  }
  {  // Q5_1: the 5th bit of element j is bit j of qh; d * q + m.
    BlockQ5_1 b{};
    b.d = f32_to_f16(0.25f);
    b.m = f32_to_f16(-1.0f);
    const uint32_t h = 0x80000001u;  // elements 0 and 31
    std::memcpy(b.qh, &h, 4);
    b.qs[0] = 0x21;  // element 0: 1, element 16: 2
    b.qs[15] = 0xF0; // element 15: 0, element 31: 15
    float out[32];
    decode_row(DType::kQ5_1, reinterpret_cast<const std::byte*>(&b), 32, out);
    EXPECT_EQ(out[0], 0.25f * 17.0f - 1.0f);
    EXPECT_EQ(out[16], 0.25f * 2.0f - 1.0f);
    EXPECT_EQ(out[15], -1.0f);
    EXPECT_EQ(out[31], 0.25f * 31.0f - 1.0f);
  }
  {  // Q4_K: scale/min 5 take their high bits from bytes 1 and 5; block 5 is the high nibbles of
     // qs[64..96); value = d * sc * q - dmin * m.
    BlockQ4_K b{};
    b.d = f32_to_f16(1.0f);
    b.dmin = f32_to_f16(0.5f);
    // sc5 = 0x2A (low 4 bits 0xA in scales[9] low nibble, high 2 bits 0b10 in scales[1] bits 6-7),
    // m5 = 0x13 (low 4 bits 0x3 in scales[9] high nibble, high 2 bits 0b01 in scales[5] bits 6-7).
    b.scales[9] = 0x3A;
    b.scales[1] = 0x80;
    b.scales[5] = 0x40;
    b.qs[64 + 7] = 0x90;  // element 5 * 32 + 7 = 167: level 9
    std::vector<float> out(256);
    decode_row(DType::kQ4_K, reinterpret_cast<const std::byte*>(&b), 256, out.data());
    EXPECT_EQ(out[167], 42.0f * 9.0f - 0.5f * 19.0f);
    EXPECT_EQ(out[166], -0.5f * 19.0f);
    EXPECT_EQ(out[64 + 7], 0.0f);  // block 2, low nibble 0, scale and min 0
  }
  {  // Q6_K: element 96 + l is the high nibble of ql[32 + l] with qh bits 6-7, scale 6 + l / 16.
    BlockQ6_K b{};
    b.d = f32_to_f16(2.0f);
    b.scales[7] = -3;
    b.ql[32 + 20] = 0x50;
    b.qh[20] = 0xC0;                   // high bits 3 -> level (5 | 48) - 32 = 21
    std::vector<float> out(256);
    decode_row(DType::kQ6_K, reinterpret_cast<const std::byte*>(&b), 256, out.data());
    EXPECT_EQ(out[96 + 20], 2.0f * -3.0f * 21.0f);
  }
  {  // Q3_K: block jb takes 2 bits of qs[32 (jb / 4) + l] at shift 2 (jb % 4) and bit jb of
     // hmask[l] (set: +0, clear: -4); 6-bit scales biased by 32.
    BlockQ3_K b{};
    b.d = f32_to_f16(1.0f);
    // Scale 3 (elements 48..63): low nibble in scales[3], high bits in scales[11] bits 0-1.
    b.scales[3] = 0x05;
    b.scales[11] = 0x02;  // 0x25 = 37 -> 5
    b.qs[18] = 0x0B;      // block 0 element 18: 3; block 1 element 50: (0x0B >> 2) & 3 = 2
    b.hmask[18] = 0x02;   // block 1's bit set (+0), block 0's clear (-4)
    std::vector<float> out(256);
    decode_row(DType::kQ3_K, reinterpret_cast<const std::byte*>(&b), 256, out.data());
    EXPECT_EQ(out[50], 5.0f * 2.0f);
    EXPECT_EQ(out[18], -32.0f * (3.0f - 4.0f));  // scale 1 is 0 - 32
  }
}

// ggml's quantisation test signal: 0.1 + 2 cos(i + offset).
std::vector<float> test_signal(int64_t n, float offset) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = 0.1f + 2.0f * std::cos(static_cast<float>(i) + offset);
  return x;
}

double rms_error(DType t, const std::vector<float>& x) {
  const auto n = static_cast<int64_t>(x.size());
  std::vector<std::byte> q(*dtype_row_bytes(t, static_cast<uint64_t>(n)));
  encode_row(t, x.data(), n, q.data());
  std::vector<float> y(x.size());
  decode_row(t, q.data(), n, y.data());
  double err = 0, sig = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (static_cast<double>(y[i]) - x[i]) * (static_cast<double>(y[i]) - x[i]);
    sig += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(err / sig);
}

TEST(QuantsTest, RoundTripErrorIsWithinEachFormatsResolution) {
  // Relative RMS error; a uniform quantiser with L levels over the block's range gives about
  // range / (L - 1) / sqrt(12), and the signal's range is ~2x its RMS.
  struct Bound {
    DType t;
    double max_rel;
  };
  const Bound bounds[] = {{DType::kQ8_0, 0.005}, {DType::kQ6_K, 0.02}, {DType::kQ5_0, 0.04},
                          {DType::kQ5_1, 0.035}, {DType::kQ5_K, 0.04}, {DType::kQ4_0, 0.08},
                          {DType::kQ4_1, 0.07},  {DType::kQ4_K, 0.08}, {DType::kQ3_K, 0.17},
                          {DType::kQ2_K, 0.35}};
  for (const auto& b : bounds) {
    for (float offset : {0.0f, 1.0f, 2.5f}) {
      const double e = rms_error(b.t, test_signal(32 * 128, offset));
      EXPECT_LT(e, b.max_rel) << name(b.t) << " offset " << offset;
      EXPECT_GT(e, 0.0) << name(b.t);
    }
  }
}

// Weights as trained models have them: Gaussian (Box-Muller over a fixed LCG, so the values
// are the same with every standard library).
std::vector<float> gaussian_weights(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto uniform = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<double>(state >> 11) + 0.5) / 9007199254740992.0;
  };
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(0.02 * std::sqrt(-2.0 * std::log(uniform())) *
                              std::cos(6.283185307179586 * uniform()));
  }
  return x;
}

TEST(QuantsTest, KQuantScaleSearchBeatsRangeRounding) {
  // Each bound lies between the error of plain range rounding (sub-block scale = range over
  // the levels, the encoder before the search) and that of the least-squares search; Q4_K at
  // 4.5 bits per weight must beat Q4_1 at 5, as llama.cpp's Q4_K does.
  const std::vector<float> x = gaussian_weights(256 * 1024);
  struct Bound {
    DType t;
    double max_rel;  // range rounding gave: Q2_K 0.328, Q3_K 0.155, Q5_K 0.0382, Q6_K 0.0188
  };
  const Bound bounds[] = {{DType::kQ2_K, 0.29}, {DType::kQ3_K, 0.150}, {DType::kQ5_K, 0.0370},
                          {DType::kQ6_K, 0.0182}};
  for (const auto& b : bounds) EXPECT_LT(rms_error(b.t, x), b.max_rel) << name(b.t);
  EXPECT_LT(rms_error(DType::kQ4_K, x), 0.95 * rms_error(DType::kQ4_1, x));
}

TEST(QuantsTest, EncodingDecodedValuesAgainChangesNothingForLegacyFormats) {
  // A decoded legacy block is on its own grid, so encoding it again must give the same values.
  for (DType t : {DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1, DType::kQ8_0}) {
    const auto x = test_signal(256, 0.3f);
    std::vector<std::byte> q(*dtype_row_bytes(t, 256));
    std::vector<float> y(256), z(256);
    encode_row(t, x.data(), 256, q.data());
    decode_row(t, q.data(), 256, y.data());
    encode_row(t, y.data(), 256, q.data());
    decode_row(t, q.data(), 256, z.data());
    for (int i = 0; i < 256; ++i) EXPECT_NEAR(z[i], y[i], 1e-3 * std::fabs(y[i]) + 1e-6) << name(t) << " " << i;
  }
}

TEST(QuantsTest, IntBlocksDescribeTheDecodedValues) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (DType t : kBlockTypes) {
    std::vector<float> x(512);
    for (auto& v : x) v = dist(rng);
    std::vector<std::byte> q(*dtype_row_bytes(t, 512));
    encode_row(t, x.data(), 512, q.data());
    std::vector<float> y(512);
    decode_row(t, q.data(), 512, y.data());
    for (int64_t b = 0; b < 16; ++b) {
      IntBlock ib;
      int_block(t, q.data(), b, &ib);
      for (int i = 0; i < 32; ++i) {
        const int h = i / 16;
        const double v = static_cast<double>(ib.d) * ib.sc[h] * ib.q[i] +
                         static_cast<double>(ib.m) * ib.mn[h];
        EXPECT_NEAR(y[b * 32 + i], v, 1e-6 * (std::fabs(v) + 1)) << name(t) << " " << b << " " << i;
        EXPECT_LE(std::abs(static_cast<int>(ib.q[i])), t == DType::kQ8_0 ? 128 : 32) << name(t);
      }
    }
  }
}

TEST(QuantsTest, ZeroBlocksEncodeToZero) {
  for (DType t : kBlockTypes) {
    std::vector<float> x(256, 0.0f), y(256, 1.0f);
    std::vector<std::byte> q(*dtype_row_bytes(t, 256));
    encode_row(t, x.data(), 256, q.data());
    decode_row(t, q.data(), 256, y.data());
    for (float v : y) EXPECT_EQ(v, 0.0f) << name(t);
  }
}

TEST(QuantsTest, FallbackFollowsLlamaCppForRowsThatAreNotWholeSuperBlocks) {
  EXPECT_EQ(quant_fallback(DType::kQ4_K, 576), DType::kQ5_0);
  EXPECT_EQ(quant_fallback(DType::kQ3_K, 576), DType::kQ5_0);
  EXPECT_EQ(quant_fallback(DType::kQ2_K, 576), DType::kQ5_0);
  EXPECT_EQ(quant_fallback(DType::kQ5_K, 576), DType::kQ5_1);
  EXPECT_EQ(quant_fallback(DType::kQ6_K, 576), DType::kQ8_0);
  EXPECT_EQ(quant_fallback(DType::kQ4_K, 1536), DType::kQ4_K);
  EXPECT_EQ(quant_fallback(DType::kQ4_0, 48), DType::kF16);
  EXPECT_EQ(quant_fallback(DType::kQ6_K, 48), DType::kF16);
  EXPECT_EQ(quant_fallback(DType::kF32, 7), DType::kF32);
}

}  // namespace
}  // namespace cleave
