// safetensors writer → reader round trips, and hostile headers the reader must refuse cleanly.
#include "cleave/model/safetensors.h"
#include "fmt/format.h"
#include "gtest/gtest.h"
#include "modelfiles_test_util.h"

namespace cleave {
namespace {

using testing::Bytes;

// A file from a raw header text and `data_len` data bytes.
Bytes raw_file(const std::string& header, size_t data_len) {
  Bytes b(8 + header.size() + data_len, std::byte{0});
  const uint64_t n = header.size();
  std::memcpy(b.data(), &n, 8);
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

void expect_error(const Bytes& b, std::string_view substring,
                  StatusCode code = StatusCode::kDataLoss) {
  auto r = SafetensorsFile::parse(b);
  ASSERT_FALSE(r.ok()) << "expected an error mentioning '" << substring << "'";
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(substring), std::string::npos) << r.status().to_string();
}

TEST(SafetensorsTest, RoundTripsTensorsAndMetadata) {
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  Bytes f16(2 * 6), bf16(2 * 5);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = std::byte(i + 1);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = std::byte(100 + i);
  ASSERT_TRUE(w.add_tensor("a", DType::kF32, {2, 2}, testing::floats_to_bytes({1, 2, 3, 4})).ok());
  ASSERT_TRUE(w.add_tensor("b.f16", DType::kF16, {2, 3}, std::span<const std::byte>(f16)).ok());
  ASSERT_TRUE(w.add_tensor("c.bf16", DType::kBF16, {5}, bf16).ok());
  ASSERT_TRUE(w.add_tensor("scalar", DType::kF32, {}, testing::floats_to_bytes({9})).ok());
  auto bytes = w.to_bytes();
  ASSERT_TRUE(bytes.ok());
  uint64_t n;
  std::memcpy(&n, bytes->data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u) << "data section starts 8-byte aligned";
  auto r = SafetensorsFile::parse(*bytes);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->metadata().at("format"), "pt");
  ASSERT_EQ(r->tensors().size(), 4u);
  const SafetensorsTensor* a = r->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(a->dtype, DType::kF32);
  float x[4];
  std::memcpy(x, a->data, 16);
  EXPECT_EQ(x[3], 4.0f);
  EXPECT_EQ(std::memcmp(r->find("b.f16")->data, f16.data(), f16.size()), 0);
  EXPECT_EQ(r->find("b.f16")->dtype, DType::kF16);
  EXPECT_EQ(std::memcmp(r->find("c.bf16")->data, bf16.data(), bf16.size()), 0);
  EXPECT_EQ(r->find("c.bf16")->dtype, DType::kBF16);
  EXPECT_TRUE(r->find("scalar")->shape.empty());
  EXPECT_EQ(r->find("scalar")->nbytes, 4u);
  EXPECT_EQ(r->find("missing"), nullptr);
}

TEST(SafetensorsTest, WritesFilesThatOpenByMmap) {
  testing::TempDir dir("st");
  SafetensorsWriter w;
  ASSERT_TRUE(w.add_tensor("w", DType::kF32, {3}, testing::floats_to_bytes({1, 2, 3})).ok());
  ASSERT_TRUE(w.write(dir.file("m.safetensors")).ok());
  auto r = SafetensorsFile::open(dir.file("m.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->find("w")->nbytes, 12u);
  EXPECT_EQ(SafetensorsFile::open(dir.file("none")).status().code(), StatusCode::kNotFound);
}

TEST(SafetensorsTest, WriterRefusesWhatItCannotWrite) {
  SafetensorsWriter w;
  EXPECT_FALSE(w.add_tensor("q", DType::kQ8_0, {32}, Bytes(34)).ok());
  EXPECT_FALSE(w.add_tensor("short", DType::kF32, {4}, Bytes(12)).ok());
  EXPECT_TRUE(w.add_tensor("x", DType::kF32, {1}, Bytes(4)).ok());
  auto dup = w.add_tensor("x", DType::kF32, {1}, Bytes(4));
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.message().find("'x'"), std::string::npos);
  EXPECT_FALSE(w.add_tensor("__metadata__", DType::kF32, {1}, Bytes(4)).ok());
}

TEST(SafetensorsTest, RefusesHeadersThatLieAboutTheirLength) {
  expect_error(Bytes{}, "too short");
  expect_error(Bytes(7), "too short");
  Bytes b = raw_file("{}", 0);
  EXPECT_TRUE(SafetensorsFile::parse(b).ok());
  testing::poke<uint64_t>(b, 0, 3);
  expect_error(b, "truncated");
  testing::poke<uint64_t>(b, 0, 1ull << 62);
  expect_error(b, "header claims");
  testing::poke<uint64_t>(b, 0, ~0ull);
  expect_error(b, "header claims");
}

TEST(SafetensorsTest, RefusesMalformedJson) {
  expect_error(raw_file("[1, 2]", 0), "start with '{'");
  expect_error(raw_file("{\"a\": ", 0), "not a valid JSON");
  expect_error(raw_file("{\"a\": 1}", 0), "not an object");
  expect_error(raw_file(std::string(100000, '{'), 0), "nests deeper");
  std::string deep = "{\"a\":" + std::string(50, '[') + std::string(50, ']') + "}";
  expect_error(raw_file(deep, 0), "nests deeper");
  expect_error(raw_file("{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4), "no dtype");
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4), "no shape");
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4), "data_offsets");
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", 4),
               "data_offsets");
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4),
               "non-negative");
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4),
               "non-negative");
  expect_error(raw_file("{\"__metadata__\": {\"k\": 1}}", 0), "__metadata__");
  expect_error(raw_file("{\"__metadata__\": [1]}", 0), "__metadata__");
}

TEST(SafetensorsTest, RefusesUnsupportedDtypesByName) {
  for (const char* dt : {"I8", "U8", "I64", "F64", "BOOL", "F8_E4M3", "f32"}) {
    auto h = fmt::format("{{\"w.x\": {{\"dtype\": \"{}\", \"shape\": [4], \"data_offsets\": [0, 4]}}}}", dt);
    auto r = SafetensorsFile::parse(raw_file(h, 4));
    ASSERT_FALSE(r.ok()) << dt;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("w.x"), std::string::npos);
    EXPECT_NE(r.status().message().find(dt), std::string::npos);
  }
}

TEST(SafetensorsTest, RefusesLyingOffsetsAndSizes) {
  const char* tpl = "{{\"w\": {{\"dtype\": \"F32\", \"shape\": {}, \"data_offsets\": [{}, {}]}}}}";
  auto file = [&](const char* shape, uint64_t b, uint64_t e, size_t data) {
    return raw_file(fmt::format(fmt::runtime(tpl), shape, b, e), data);
  };
  EXPECT_TRUE(SafetensorsFile::parse(file("[2, 2]", 0, 16, 16)).ok());
  expect_error(file("[2, 2]", 0, 16, 15), "outside the data section");    // truncated data
  expect_error(file("[2, 2]", 16, 0, 32), "outside the data section");    // begin > end
  expect_error(file("[2, 2]", 0, 12, 16), "needs 16");                    // shape × dtype lies
  expect_error(file("[2, 3]", 0, 16, 16), "needs 24");
  expect_error(file("[1]", 18446744073709551612ull, 18446744073709551615ull, 16), "outside");
  expect_error(file("[1099511627776, 1099511627776]", 0, 16, 16), "absurd shape");
  expect_error(file("[1, 1, 1, 1, 1, 1, 1, 1, 1]", 0, 4, 4), "dimensions");
}

TEST(SafetensorsTest, RefusesOverlappingAndDuplicateTensors) {
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                        " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", 12),
               "overlap");
  expect_error(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
                        " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8),
               "'a' more than once");
  // Nested keys of the same name in different tensors are not duplicates.
  EXPECT_TRUE(SafetensorsFile::parse(
                  raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
                           " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8))
                  .ok());
  // Zero-sized tensors at the same offset do not overlap.
  EXPECT_TRUE(SafetensorsFile::parse(
                  raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]},"
                           " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4))
                  .ok());
}

TEST(SafetensorsTest, EveryTruncationOfAValidFileIsRefused) {
  SafetensorsWriter w;
  ASSERT_TRUE(w.add_tensor("a", DType::kF32, {4}, testing::floats_to_bytes({1, 2, 3, 4})).ok());
  ASSERT_TRUE(w.add_tensor("b", DType::kF16, {2}, Bytes(4)).ok());
  auto b = w.to_bytes();
  ASSERT_TRUE(b.ok());
  for (size_t len = 0; len < b->size(); ++len) {
    Bytes cut(b->begin(), b->begin() + static_cast<std::ptrdiff_t>(len));
    EXPECT_FALSE(SafetensorsFile::parse(cut).ok()) << len;
  }
}

}  // namespace
}  // namespace cleave
