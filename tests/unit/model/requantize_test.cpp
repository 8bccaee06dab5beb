// `cleave convert --to gguf`: requantize_gguf, and loading the files it writes.
#include "cleave/model/requantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cleave/model/gguf.h"
#include "cleave/model/gguf_writer.h"
#include "cleave/model/model_file.h"
#include "cleave/model/quants.h"
#include "cleave/model/synth.h"
#include "modelfiles_test_util.h"

namespace cleave {
namespace {

using testing::TempDir;

SynthOptions geometry(int64_t dim, int64_t ffn) {
  SynthOptions o;
  o.layers = 2;
  o.dim = dim;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = ffn;
  o.vocab = 300;
  o.dtype = DType::kF32;
  o.seed = 11;
  o.context = 256;
  return o;
}

TEST(RequantizeTest, MatricesTakeTheDtypeOrLlamaCppsFallbackAndVectorsStay) {
  TempDir dir("requant");
  // dim 96 is no multiple of 256: every matrix with 96 columns falls back (q4_k -> q5_0); the
  // ffn_down rows (512 columns) are whole super-blocks.
  ASSERT_TRUE(write_synth_model(geometry(96, 512), dir.file("f32.gguf")).ok());
  auto r = requantize_gguf(dir.file("f32.gguf"), dir.file("q4k.gguf"), DType::kQ4_K);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->converted, 2);  // blk.{0,1}.ffn_down
  EXPECT_EQ(r->fell_back, 2 * 6 + 2);  // q, k, v, o, gate, up per layer; token_embd, output
  EXPECT_EQ(r->kept, 2 * 2 + 1);  // the norms
  auto in = GgufFile::open(dir.file("f32.gguf"));
  auto out = GgufFile::open(dir.file("q4k.gguf"));
  ASSERT_TRUE(in.ok() && out.ok());
  EXPECT_EQ(out->find_tensor("blk.0.ffn_down.weight")->dtype, DType::kQ4_K);
  EXPECT_EQ(out->find_tensor("blk.0.ffn_up.weight")->dtype, DType::kQ5_0);
  EXPECT_EQ(out->find_tensor("blk.0.attn_norm.weight")->dtype, DType::kF32);
  EXPECT_EQ(out->get_uint_or("general.file_type", 0), 14u);  // LLAMA_FTYPE_MOSTLY_Q4_K_S
  EXPECT_EQ(in->metadata().size(), out->metadata().size());
  // The values are the f32 ones, quantised: close, never equal everywhere.
  const auto* a = in->find_tensor("blk.1.ffn_down.weight");
  const auto* b = out->find_tensor("blk.1.ffn_down.weight");
  std::vector<float> x(static_cast<size_t>(a->elements())), y(x.size());
  decode_row(a->dtype, a->data, a->elements(), x.data());
  decode_row(b->dtype, b->data, b->elements(), y.data());
  double err = 0, sig = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (x[i] - y[i]) * (x[i] - y[i]);
    sig += x[i] * x[i];
  }
  EXPECT_GT(err, 0.0);
  EXPECT_LT(std::sqrt(err / sig), 0.1);
  // The file loads as a model.
  auto m = load_model(dir.file("q4k.gguf"));
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE((*m)->validate_tensors().ok());
}

TEST(RequantizeTest, DecodingToF32GivesTheDecodedValuesExactly) {
  TempDir dir("requant2");
  SynthOptions o = geometry(256, 512);
  o.dtype = DType::kQ6_K;
  ASSERT_TRUE(write_synth_model(o, dir.file("q6k.gguf")).ok());
  ASSERT_TRUE(requantize_gguf(dir.file("q6k.gguf"), dir.file("f32.gguf"), DType::kF32).ok());
  auto q = GgufFile::open(dir.file("q6k.gguf"));
  auto f = GgufFile::open(dir.file("f32.gguf"));
  ASSERT_TRUE(q.ok() && f.ok());
  const auto* a = q->find_tensor("blk.0.attn_q.weight");
  const auto* b = f->find_tensor("blk.0.attn_q.weight");
  ASSERT_EQ(a->dtype, DType::kQ6_K);
  ASSERT_EQ(b->dtype, DType::kF32);
  std::vector<float> x(static_cast<size_t>(a->elements()));
  decode_row(a->dtype, a->data, a->elements(), x.data());
  EXPECT_EQ(std::memcmp(x.data(), b->data, b->nbytes), 0);
}

TEST(RequantizeTest, AQuantisedNormVectorIsRefusedByName) {
  TempDir dir("requant3");
  SynthOptions o = geometry(256, 512);
  ASSERT_TRUE(write_synth_model(o, dir.file("f32.gguf")).ok());
  auto in = GgufFile::open(dir.file("f32.gguf"));
  ASSERT_TRUE(in.ok());
  GgufWriter w(in->alignment());
  for (const auto& [k, v] : in->metadata()) w.set(k, v);
  for (const auto& t : in->tensors()) {
    if (t.name == "blk.1.ffn_norm.weight") {
      std::vector<std::byte> q(*dtype_row_bytes(DType::kQ4_K, 256));
      encode_row(DType::kQ4_K, reinterpret_cast<const float*>(t.data), 256, q.data());
      w.add_tensor(t.name, DType::kQ4_K, t.shape, std::move(q));
    } else {
      w.add_tensor(t.name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes));
    }
  }
  ASSERT_TRUE(w.write(dir.file("bad.gguf")).ok());
  auto m = load_model(dir.file("bad.gguf"));
  Status s = m.ok() ? (*m)->validate_tensors() : m.status();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("blk.1.ffn_norm.weight"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("q4_k"), std::string::npos) << s.to_string();
}

TEST(RequantizeTest, AMissingInputIsAnError) {
  TempDir dir("requant4");
  auto r = requantize_gguf(dir.file("absent.gguf"), dir.file("out.gguf"), DType::kQ4_0);
  EXPECT_FALSE(r.ok());
}

}  // namespace
}  // namespace cleave
