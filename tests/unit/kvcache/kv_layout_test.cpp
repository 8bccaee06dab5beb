#include "cleave/kvcache/kv_layout.h"

#include <gtest/gtest.h>

namespace cleave {
namespace {

ModelConfig stories_like() {
  ModelConfig cfg;
  cfg.n_layers = 5;
  cfg.n_kv_heads = 4;
  cfg.head_dim = 8;
  return cfg;
}

TEST(KvLayoutTest, GeometryAndOffsets) {
  const KvLayout l = KvLayout::for_model(stories_like(), 16, 10);
  EXPECT_EQ(l.validate(), "");
  EXPECT_EQ(l.kv_dim(), 32);
  EXPECT_EQ(l.block_bytes(), 2u * 16 * 32 * 4);
  EXPECT_EQ(l.total_bytes(), 5u * 10 * l.block_bytes());
  EXPECT_EQ(l.offset(0, 0), 0u);
  EXPECT_EQ(l.offset(0, 1), l.block_bytes());
  EXPECT_EQ(l.offset(2, 3), (2u * 10 + 3) * l.block_bytes());
  EXPECT_EQ(l.offset(4, 9) + l.block_bytes(), l.total_bytes());
}

TEST(KvLayoutTest, BlocksForBudget) {
  const uint64_t per_block = 5u * 2 * 16 * 32 * 4;  // all layers
  EXPECT_EQ(KvLayout::blocks_for_budget(stories_like(), 16, per_block * 7 + per_block - 1), 7);
  EXPECT_EQ(KvLayout::blocks_for_budget(stories_like(), 16, per_block - 1), 0);
  EXPECT_EQ(KvLayout::blocks_for_budget(ModelConfig{}, 16, 1u << 30), 0);
}

TEST(KvLayoutTest, ValidateNamesTheProblem) {
  KvLayout l = KvLayout::for_model(stories_like(), 16, 10);
  l.block_size = 0;
  EXPECT_NE(l.validate().find("block size 0"), std::string::npos);
  l = KvLayout::for_model(stories_like(), 16, 0);
  EXPECT_NE(l.validate().find("at least one block"), std::string::npos);
  l = KvLayout::for_model(stories_like(), 16, 10);
  l.dtype = DType::kQ8_0;
  EXPECT_NE(l.validate().find("q8_0"), std::string::npos);
  for (DType d : {DType::kF16, DType::kBF16}) {
    EXPECT_EQ(KvLayout::for_model(stories_like(), 16, 10, d).validate(), "") << dtype_name(d);
    EXPECT_EQ(KvLayout::for_model(stories_like(), 16, 10, d).block_bytes(), 2u * 16 * 32 * 2);
    EXPECT_EQ(KvLayout::blocks_for_budget(stories_like(), 16, 5u * 2 * 16 * 32 * 2 * 3, d), 3);
  }
  l = KvLayout::for_model(stories_like(), 16, 10);
  l.version = 2;
  EXPECT_NE(l.validate().find("version 2"), std::string::npos);
  // Sizes whose byte count would overflow are rejected, not wrapped.
  l = KvLayout::for_model(stories_like(), 4096, int64_t{1} << 30);
  l.head_dim = int64_t{1} << 20;
  l.n_kv_heads = int64_t{1} << 20;
  EXPECT_NE(l.validate().find("over 2^56 bytes"), std::string::npos) << l.validate();
  l.head_dim = int64_t{1} << 40;
  EXPECT_NE(l.validate().find("bad KV geometry"), std::string::npos) << l.validate();
}

TEST(KvLayoutTest, IncompatibilityListsEveryDifference) {
  const KvLayout a = KvLayout::for_model(stories_like(), 16, 10);
  KvLayout b = KvLayout::for_model(stories_like(), 16, 99);
  EXPECT_EQ(a.incompatibility(b), "");  // num_blocks may differ
  b.block_size = 32;
  b.head_dim = 16;
  EXPECT_EQ(a.incompatibility(b), "block size 16 vs 32; head dim 8 vs 16");
  EXPECT_EQ(a.incompatibility(KvLayout::for_model(stories_like(), 16, 10, DType::kF16)),
            "dtype f32 vs f16");
}

// ---- pairing ----

KvLayout layout(int64_t num_blocks, int64_t block_size, int64_t n_layers = 4, int64_t n_kv_heads = 2,
                int64_t head_dim = 8) {
  KvLayout l;
  l.block_size = block_size;
  l.n_layers = n_layers;
  l.n_kv_heads = n_kv_heads;
  l.head_dim = head_dim;
  l.num_blocks = num_blocks;
  return l;
}

TEST(PairingMismatchTest, NamesEveryDifferenceWithBothValues) {
  KvLayout a = layout(10, 16), b = layout(99, 16);
  EXPECT_EQ(pairing_mismatch("fp1", a, "fp1", b), "") << "num_blocks may differ";
  b.block_size = 32;
  EXPECT_EQ(pairing_mismatch("1a2b", a, "9f8e", b),
            "model fingerprint differs (prefill 1a2b, decode 9f8e); block_size differs (prefill "
            "16, decode 32)");
  KvLayout c = layout(10, 16, 5, 4, 16);
  c.version = 2;
  std::string m = pairing_mismatch("x", a, "x", c);
  EXPECT_NE(m.find("layout version differs (prefill 1, decode 2)"), std::string::npos) << m;
  EXPECT_NE(m.find("n_layers differs (prefill 4, decode 5)"), std::string::npos) << m;
  EXPECT_NE(m.find("n_kv_heads differs (prefill 2, decode 4)"), std::string::npos) << m;
  EXPECT_NE(m.find("head_dim differs (prefill 8, decode 16)"), std::string::npos) << m;
  EXPECT_EQ(m.find("fingerprint"), std::string::npos) << m;
  KvLayout d = a;
  d.dtype = DType::kF16;
  EXPECT_EQ(pairing_mismatch("", a, "", d), "dtype differs (prefill f32, decode f16)");
  EXPECT_EQ(pairing_mismatch("", a, "abc", a), "model fingerprint differs (prefill <none>, decode abc)");
}

TEST(PairingMismatchTest, DtypeByNameAsAMessageCarriesIt) {
  const KvLayout a = layout(10, 16);
  KvLayout b = layout(99, 16);
  b.dtype = DType::kF16;  // not read: the name is
  EXPECT_EQ(pairing_mismatch("fp", a, "fp", b, "f32"), "");
  EXPECT_EQ(pairing_mismatch("fp", a, "fp", b, "F32"), "") << "names parse case-insensitively";
  EXPECT_EQ(pairing_mismatch("fp", a, "fp", b, "bf16"), "dtype differs (prefill f32, decode bf16)");
  EXPECT_EQ(pairing_mismatch("fp", a, "fp", b, "f8"), "dtype differs (prefill f32, decode 'f8')");
  EXPECT_EQ(pairing_mismatch("fp", a, "fp", b, ""), "dtype differs (prefill f32, decode '')");
  b.block_size = 32;
  EXPECT_EQ(pairing_mismatch("fp", a, "other", b, "f8"),
            "dtype differs (prefill f32, decode 'f8'); model fingerprint differs (prefill fp, "
            "decode other); block_size differs (prefill 16, decode 32)")
      << "an unknown dtype comes first, then the other differences in their order";
  EXPECT_EQ(pairing_mismatch("fp", a, "other", b, "f16"),
            pairing_mismatch("fp", a, "other", b))
      << "a known name is the layout check itself";
}

}  // namespace
}  // namespace cleave
