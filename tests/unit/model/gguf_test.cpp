// GGUF writer → reader round trips, and every kind of bad file the reader must refuse cleanly.
#include <cmath>
#include <limits>

#include "cleave/model/gguf.h"
#include "cleave/model/gguf_writer.h"
#include "gtest/gtest.h"
#include "modelfiles_test_util.h"

namespace cleave {
namespace {

using testing::Bytes;
using testing::find_bytes;
using testing::peek;
using testing::poke;

Bytes bytes_of(const GgufWriter& w) {
  auto r = w.to_bytes();
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : Bytes{};
}

Result<GgufFile> parse(const Bytes& b) { return GgufFile::parse(b); }

// A small valid file: a few keys and two tensors.
GgufWriter small_writer() {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u32("test.count", 7);
  w.set_string_array("test.strings", {"a", "bb", "ccc"});
  w.set_float_array("test.floats", GgufType::kFloat32, {0.5, -1.25});
  w.add_tensor("tensor.a", DType::kF32, {2, 3}, testing::floats_to_bytes({1, 2, 3, 4, 5, 6}));
  w.add_tensor("tensor.b", DType::kF32, {4}, testing::floats_to_bytes({7, 8, 9, 10}));
  return w;
}

// Byte offset of the offset field of tensor `name` (n_dims dimensions) in the tensor directory.
size_t tensor_offset_field(const Bytes& b, std::string_view name, int n_dims) {
  size_t at = find_bytes(b, name);
  EXPECT_NE(at, std::string_view::npos);
  return at + name.size() + 4 + 8 * n_dims + 4;
}

void expect_error(const Bytes& b, std::string_view substring) {
  auto r = parse(b);
  ASSERT_FALSE(r.ok()) << "expected an error mentioning '" << substring << "'";
  EXPECT_NE(r.status().message().find(substring), std::string::npos) << r.status().to_string();
}

TEST(GgufWriterTest, RoundTripsEveryMetadataType) {
  GgufWriter w;
  w.set_u8("k.u8", 200);
  w.set_i8("k.i8", -100);
  w.set_u16("k.u16", 60000);
  w.set_i16("k.i16", -30000);
  w.set_u32("k.u32", 4000000000u);
  w.set_i32("k.i32", -2000000000);
  w.set_u64("k.u64", 1ull << 63);
  w.set_i64("k.i64", -(1ll << 62));
  w.set_f32("k.f32", 1.5f);
  w.set_f64("k.f64", 3.25e100);
  w.set_bool("k.bool", true);
  w.set_string("k.str", "h\xC3\xA9llo");
  w.set_string("k.empty", "");
  w.set_string_array("k.strs", {"x", "", "zzz"});
  w.set_int_array("k.i32s", GgufType::kInt32, {-1, 0, 1});
  w.set_int_array("k.u8s", GgufType::kUint8, {0, 255});
  w.set_int_array("k.bools", GgufType::kBool, {1, 0});
  w.set_float_array("k.f32s", GgufType::kFloat32, {0.25, -2});
  w.set_float_array("k.f64s", GgufType::kFloat64, {1e300});
  w.set_int_array("k.emptyarr", GgufType::kInt64, {});
  w.set_u32("k.replaced", 1);
  w.set_u32("k.replaced", 2);
  Bytes b = bytes_of(w);
  auto r = parse(b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const GgufFile& g = *r;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.metadata().size(), 21u);
  EXPECT_EQ(*g.get_uint("k.u8"), 200u);
  EXPECT_EQ(g.find("k.i8")->i, -100);
  EXPECT_EQ(*g.get_uint("k.u16"), 60000u);
  EXPECT_EQ(g.find("k.i16")->i, -30000);
  EXPECT_EQ(*g.get_uint("k.u32"), 4000000000u);
  EXPECT_EQ(g.find("k.i32")->i, -2000000000);
  EXPECT_EQ(*g.get_uint("k.u64"), 1ull << 63);
  EXPECT_EQ(g.find("k.i64")->i, -(1ll << 62));
  EXPECT_EQ(g.find("k.f32")->type, GgufType::kFloat32);
  EXPECT_EQ(*g.get_float("k.f32"), 1.5);
  EXPECT_EQ(*g.get_float("k.f64"), 3.25e100);
  EXPECT_TRUE(*g.get_bool("k.bool"));
  EXPECT_EQ(*g.get_string("k.str"), "h\xC3\xA9llo");
  EXPECT_EQ(*g.get_string("k.empty"), "");
  EXPECT_EQ((*g.get_array("k.strs", GgufType::kString))->strs, (std::vector<std::string>{"x", "", "zzz"}));
  EXPECT_EQ((*g.get_array("k.i32s", GgufType::kInt32))->ints, (std::vector<int64_t>{-1, 0, 1}));
  EXPECT_EQ(g.find("k.u8s")->elem_type, GgufType::kUint8);
  EXPECT_EQ(g.find("k.u8s")->ints, (std::vector<int64_t>{0, 255}));
  EXPECT_EQ(g.find("k.bools")->ints, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(g.find("k.f32s")->floats, (std::vector<double>{0.25, -2}));
  EXPECT_EQ(g.find("k.f64s")->floats, (std::vector<double>{1e300}));
  EXPECT_EQ(g.find("k.emptyarr")->array_size(), 0u);
  EXPECT_EQ(*g.get_uint("k.replaced"), 2u);
  // Typed look-ups name the key when the type is wrong.
  auto wrong = g.get_string("k.u32");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("k.u32"), std::string::npos);
  EXPECT_EQ(g.get_uint("nope").status().code(), StatusCode::kNotFound);
}

TEST(GgufWriterTest, RoundTripsTensorsOfEveryDtypeAligned) {
  GgufWriter w;
  Bytes f16(2 * 64), bf16(2 * 64 * 3), q8(sizeof(BlockQ8_0) * 4);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = std::byte(i * 7);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = std::byte(i * 13);
  for (size_t i = 0; i < q8.size(); ++i) q8[i] = std::byte(i * 3);
  w.add_tensor("t.f32", DType::kF32, {3}, testing::floats_to_bytes({1, 2, 3}));
  w.add_tensor("t.f16", DType::kF16, {64}, f16);
  w.add_tensor("t.bf16", DType::kBF16, {3, 64}, bf16);
  w.add_tensor("t.q8", DType::kQ8_0, {2, 64}, q8);
  int fills = 0;
  w.add_tensor("t.gen", DType::kF32, {2, 2, 2}, [&](std::span<std::byte> dst) {
    ++fills;
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = std::byte(0xA5);
    return Status::Ok();
  });
  Bytes b = bytes_of(w);
  EXPECT_EQ(fills, 1);
  auto r = parse(b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->tensors().size(), 5u);
  for (const auto& t : r->tensors()) {
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    EXPECT_EQ(static_cast<size_t>(t.data - b.data()) % 32, 0u) << t.name;
  }
  auto check = [&](const char* name, DType dt, std::vector<int64_t> shape, const Bytes& data) {
    const GgufTensorInfo* t = r->find_tensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, dt);
    EXPECT_EQ(t->shape, shape);
    ASSERT_EQ(t->nbytes, data.size());
    EXPECT_EQ(std::memcmp(t->data, data.data(), data.size()), 0) << name;
  };
  check("t.f32", DType::kF32, {3}, testing::floats_to_bytes({1, 2, 3}));
  check("t.f16", DType::kF16, {64}, f16);
  check("t.bf16", DType::kBF16, {3, 64}, bf16);
  check("t.q8", DType::kQ8_0, {2, 64}, q8);
  check("t.gen", DType::kF32, {2, 2, 2}, Bytes(32, std::byte(0xA5)));
}

TEST(GgufWriterTest, WritesFilesThatOpenByMmap) {
  testing::TempDir dir("gguf");
  ASSERT_TRUE(small_writer().write(dir.file("m.gguf")).ok());
  auto r = GgufFile::open(dir.file("m.gguf"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r->get_string("general.architecture"), "llama");
  float x[6];
  std::memcpy(x, r->find_tensor("tensor.a")->data, sizeof x);
  EXPECT_EQ(x[5], 6.0f);
  EXPECT_FALSE(std::filesystem::exists(dir.file("m.gguf.tmp")));
  auto missing = GgufFile::open(dir.file("nope.gguf"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

TEST(GgufWriterTest, RefusesDataOfTheWrongSize) {
  GgufWriter w;
  w.add_tensor("t", DType::kF32, {4}, Bytes(12));
  auto r = w.to_bytes();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'t'"), std::string::npos);
  GgufWriter q;
  q.add_tensor("q", DType::kQ8_0, {31}, Bytes(34));
  EXPECT_FALSE(q.to_bytes().ok());
}

TEST(GgufWriterTest, NonDefaultAlignmentIsRecorded) {
  GgufWriter w(64);
  w.add_tensor("a", DType::kF32, {1}, testing::floats_to_bytes({1}));
  w.add_tensor("b", DType::kF32, {1}, testing::floats_to_bytes({2}));
  Bytes b = bytes_of(w);
  auto r = parse(b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->alignment(), 64u);
  EXPECT_EQ(r->find_tensor("b")->offset, 64u);
}

TEST(GgufReaderTest, RefusesBadMagicAndVersion) {
  Bytes b = bytes_of(small_writer());
  Bytes bad = b;
  bad[0] = std::byte('X');
  expect_error(bad, "bad magic");
  bad = b;
  poke<uint32_t>(bad, 4, 1);
  expect_error(bad, "version 1");
  poke<uint32_t>(bad, 4, 4);
  expect_error(bad, "version 4");
  expect_error(Bytes{}, "truncated");
  expect_error(Bytes(3), "truncated");
}

TEST(GgufReaderTest, VersionTwoIsAccepted) {
  Bytes b = bytes_of(small_writer());
  poke<uint32_t>(b, 4, 2);
  EXPECT_TRUE(parse(b).ok());
}

TEST(GgufReaderTest, EveryTruncationIsAnErrorNotACrash) {
  Bytes b = bytes_of(small_writer());
  const auto full = parse(b);
  ASSERT_TRUE(full.ok());
  // Every prefix that cuts the header or any tensor's data must be refused.
  const GgufTensorInfo* last = full->find_tensor("tensor.b");
  const size_t needed = static_cast<size_t>(last->data - b.data()) + last->nbytes;
  for (size_t len = 0; len < needed; ++len) {
    Bytes cut(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(len));
    auto r = parse(cut);
    EXPECT_FALSE(r.ok()) << "prefix of " << len << " bytes was accepted";
    if (!r.ok()) {
      EXPECT_TRUE(r.status().code() == StatusCode::kDataLoss) << r.status().to_string();
    }
  }
  // The alignment padding after the last tensor is optional.
  Bytes cut(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(needed));
  EXPECT_TRUE(parse(cut).ok());
}

TEST(GgufReaderTest, TruncationMessagesNameTheProblem) {
  Bytes b = bytes_of(small_writer());
  const size_t at = find_bytes(b, "test.strings");
  expect_error(Bytes(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(at + 3)), "metadata key #2");
  auto full = parse(b);
  const size_t data_at = static_cast<size_t>(full->find_tensor("tensor.a")->data - b.data());
  expect_error(Bytes(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(data_at + 8)), "tensor.a");
}

TEST(GgufReaderTest, RefusesLyingTensorOffsetsAndSizes) {
  Bytes b = bytes_of(small_writer());
  {
    Bytes bad = b;
    poke<uint64_t>(bad, tensor_offset_field(bad, "tensor.b", 1), 1ull << 40);
    expect_error(bad, "tensor.b");
  }
  {
    Bytes bad = b;  // offset near 2^64: offset + size must not wrap around
    poke<uint64_t>(bad, tensor_offset_field(bad, "tensor.b", 1), ~0ull - 31);
    expect_error(bad, "tensor.b");
  }
  {
    Bytes bad = b;  // tensor.b claims 4096 elements
    poke<uint64_t>(bad, find_bytes(bad, "tensor.b") + 8 + 4, 4096);
    expect_error(bad, "beyond the end");
  }
  {
    Bytes bad = b;  // absurd dimension
    poke<uint64_t>(bad, find_bytes(bad, "tensor.a") + 8 + 4, 1ull << 62);
    expect_error(bad, "absurd dimension");
  }
  {
    Bytes bad = b;  // 0 and 5 dimensions
    poke<uint32_t>(bad, find_bytes(bad, "tensor.a") + 8, 0);
    expect_error(bad, "0 dimensions");
    poke<uint32_t>(bad, find_bytes(bad, "tensor.a") + 8, 5);
    expect_error(bad, "5 dimensions");
  }
  {
    Bytes bad = b;  // a zero-sized dimension
    poke<uint64_t>(bad, find_bytes(bad, "tensor.a") + 8 + 4, 0);
    expect_error(bad, "tensor.a");
  }
}

TEST(GgufReaderTest, RefusesMisalignedOffsets) {
  Bytes b = bytes_of(small_writer());
  poke<uint64_t>(b, tensor_offset_field(b, "tensor.b", 1), 33);
  expect_error(b, "not aligned");
}

TEST(GgufReaderTest, RefusesAbsurdCounts) {
  Bytes b = bytes_of(small_writer());
  {
    Bytes bad = b;
    poke<uint64_t>(bad, 8, 1ull << 60);  // tensor count
    expect_error(bad, "tensor count");
  }
  {
    Bytes bad = b;
    poke<uint64_t>(bad, 16, 1ull << 60);  // metadata count
    expect_error(bad, "metadata count");
  }
  {
    Bytes bad = b;
    poke<uint64_t>(bad, 16, 5);  // one more key than there is: reads into the tensor directory
    EXPECT_FALSE(parse(bad).ok());
  }
  {
    Bytes bad = b;  // array length
    const size_t at = find_bytes(bad, "test.strings") + 12 + 4 + 4;
    ASSERT_EQ(peek<uint64_t>(bad, at), 3u);
    poke<uint64_t>(bad, at, 1ull << 61);
    expect_error(bad, "test.strings");
  }
  {
    Bytes bad = b;  // string length
    const size_t at = find_bytes(bad, "general.architecture") + 20 + 4;
    ASSERT_EQ(peek<uint64_t>(bad, at), 5u);
    poke<uint64_t>(bad, at, ~0ull);
    expect_error(bad, "general.architecture");
  }
  {
    Bytes bad = b;  // key length
    poke<uint64_t>(bad, 24, 1ull << 50);
    expect_error(bad, "metadata key #0");
  }
}

TEST(GgufReaderTest, RefusesUnsupportedTensorTypes) {
  Bytes b = bytes_of(small_writer());
  const size_t type_at = tensor_offset_field(b, "tensor.a", 2) - 4;
  ASSERT_EQ(peek<uint32_t>(b, type_at), 0u);
  // Q8_1 (9) and IQ2_XXS (16) are ggml types cleave does not read; 999 is no type at all.
  for (uint32_t t : {9u, 16u, 999u}) {
    Bytes bad = b;
    poke<uint32_t>(bad, type_at, t);
    auto r = parse(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("tensor.a"), std::string::npos);
    EXPECT_NE(r.status().message().find(std::to_string(t)), std::string::npos);
  }
  // Q8_0, Q4_1 and Q4_K with a row that is not a whole number of blocks.
  for (uint32_t t : {8u, 3u, 12u}) {
    Bytes bad = b;
    poke<uint32_t>(bad, type_at, t);
    expect_error(bad, "whole number");
  }
}

TEST(GgufReaderTest, RefusesUnknownAndNestedMetadataTypes) {
  Bytes b = bytes_of(small_writer());
  const size_t type_at = find_bytes(b, "test.count") + 10;
  ASSERT_EQ(peek<uint32_t>(b, type_at), static_cast<uint32_t>(GgufType::kUint32));
  {
    Bytes bad = b;
    poke<uint32_t>(bad, type_at, 13);
    expect_error(bad, "unknown value type 13");
  }
  const size_t elem_at = find_bytes(b, "test.strings") + 12 + 4;
  {
    Bytes bad = b;
    poke<uint32_t>(bad, elem_at, 77);
    expect_error(bad, "unknown element type 77");
  }
  {
    Bytes bad = b;
    poke<uint32_t>(bad, elem_at, static_cast<uint32_t>(GgufType::kArray));
    expect_error(bad, "array of arrays");
  }
  {
    GgufWriter w;
    w.set_bool("flag", true);
    Bytes bb = bytes_of(w);
    bb[find_bytes(bb, "flag") + 4 + 4] = std::byte(2);
    expect_error(bb, "not 0 or 1");
  }
}

TEST(GgufReaderTest, RefusesDuplicateKeysAndTensors) {
  {
    GgufWriter w;
    w.set_u32("dup.aaaa", 1);
    w.set_u32("dup.bbbb", 2);
    Bytes b = bytes_of(w);
    std::memcpy(b.data() + find_bytes(b, "dup.bbbb"), "dup.aaaa", 8);
    expect_error(b, "'dup.aaaa' appears twice");
  }
  {
    GgufWriter w;
    w.add_tensor("t.aaaa", DType::kF32, {1}, testing::floats_to_bytes({1}));
    w.add_tensor("t.bbbb", DType::kF32, {1}, testing::floats_to_bytes({2}));
    Bytes b = bytes_of(w);
    std::memcpy(b.data() + find_bytes(b, "t.bbbb"), "t.aaaa", 6);
    expect_error(b, "tensor 't.aaaa' appears twice");
  }
}

TEST(GgufReaderTest, RefusesBadAlignmentKey) {
  for (uint32_t a : {0u, 3u, 48u, 1u << 24}) {
    GgufWriter w;
    w.set_u32("general.alignment", a);
    expect_error(bytes_of(w), "general.alignment");
  }
  GgufWriter w;
  w.set_string("general.alignment", "32");
  expect_error(bytes_of(w), "general.alignment");
}

}  // namespace
}  // namespace cleave
