// Synthetic models: deterministic for a seed, consistent tokenizer, loadable by load_model.
#include <cmath>
#include <set>
#include <unordered_set>

#include "cleave/model/gguf.h"
#include "cleave/model/model_file.h"
#include "cleave/model/synth.h"
#include "cleave/model/tokenizer.h"
#include "gtest/gtest.h"
#include "modelfiles_test_util.h"

namespace cleave {
namespace {

SynthOptions tiny(DType dt = DType::kF16) {
  SynthOptions o;
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 96;
  o.vocab = 600;
  o.dtype = dt;
  o.seed = 42;
  o.context = 256;
  return o;
}

std::vector<std::byte> synth_bytes(const SynthOptions& o) {
  auto w = synth_gguf(o);
  EXPECT_TRUE(w.ok()) << w.status().to_string();
  if (!w.ok()) return {};
  auto b = w->to_bytes();
  EXPECT_TRUE(b.ok());
  return b.ok() ? *b : std::vector<std::byte>{};
}

TEST(SynthTest, SameSeedSameBytesOtherSeedOtherWeights) {
  auto a = synth_bytes(tiny());
  auto b = synth_bytes(tiny());
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  SynthOptions o = tiny();
  o.seed = 43;
  auto c = synth_bytes(o);
  ASSERT_EQ(a.size(), c.size());  // same layout, different weights (the seed key differs too)
  EXPECT_NE(a, c);
  auto ga = GgufFile::parse(a);
  auto gc = GgufFile::parse(c);
  ASSERT_TRUE(ga.ok() && gc.ok());
  const auto* ta = ga->find_tensor("blk.1.ffn_up.weight");
  const auto* tc = gc->find_tensor("blk.1.ffn_up.weight");
  EXPECT_NE(std::memcmp(ta->data, tc->data, ta->nbytes), 0);
}

TEST(SynthTest, TokenizerHasExactlyVocabTokensAndConsistentMerges) {
  for (int64_t v : {258, 300, 600, 5000, 40000}) {
    auto spec = synth_tokenizer(v);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    ASSERT_EQ(static_cast<int64_t>(spec->tokens.size()), v);
    ASSERT_EQ(spec->token_types.size(), spec->tokens.size());
    EXPECT_EQ(static_cast<int64_t>(spec->merges.size()), v - 258);
    std::unordered_set<std::string> vocab(spec->tokens.begin(), spec->tokens.end());
    EXPECT_EQ(vocab.size(), spec->tokens.size()) << "tokens are unique";
    for (const auto& m : spec->merges) {
      const auto sp = m.find(' ');
      ASSERT_NE(sp, std::string::npos) << m;
      const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
      ASSERT_EQ(b.find(' '), std::string::npos) << m;
      ASSERT_TRUE(vocab.count(a) && vocab.count(b) && vocab.count(a + b)) << m;
    }
    EXPECT_EQ(spec->model, "gpt2");
    EXPECT_EQ(spec->pre, "llama-bpe");
    EXPECT_EQ(spec->bos_id, v - 2);
    EXPECT_EQ(spec->eos_id, v - 1);
    EXPECT_EQ(spec->tokens[static_cast<size_t>(v - 2)], "<|begin_of_text|>");
    EXPECT_EQ(spec->tokens[static_cast<size_t>(v - 1)], "<|end_of_text|>");
    EXPECT_EQ(spec->token_types[static_cast<size_t>(v - 1)], TokenType::kControl);
    EXPECT_EQ(spec->token_types[0], TokenType::kNormal);
  }
  // GPT-2 byte spellings: space is U+0120 "Ġ", 'A' is itself, byte 0 is U+0100.
  auto spec = synth_tokenizer(300);
  EXPECT_EQ(spec->tokens[' '], "\xC4\xA0");
  EXPECT_EQ(spec->tokens['A'], "A");
  EXPECT_EQ(spec->tokens[0], "\xC4\x80");
  // The first merges come from the training paragraph (the most frequent pair first).
  EXPECT_EQ(spec->merges[0], "h e");
  EXPECT_FALSE(synth_tokenizer(257).ok());
}

TEST(SynthTest, TokenizerEncodesEnglishCompactlyAndRoundTrips) {
  auto spec = synth_tokenizer(2048);
  ASSERT_TRUE(spec.ok());
  auto tok = Tokenizer::create(*spec);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::string text = "Once upon a time the children walked to the old town.";
  auto ids = (*tok)->encode(text, {});
  EXPECT_LT(ids.size(), text.size() / 2);
  EXPECT_EQ((*tok)->decode(ids), text);
  auto with_bos = (*tok)->encode(text, {.add_bos = true});
  EXPECT_EQ(with_bos.front(), 2046);
}

TEST(SynthTest, LoadsWithTheRequestedGeometryAndDtypes) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0}) {
    SynthOptions o = tiny(dt);
    if (dt == DType::kQ8_0) o.ffn = 128;
    testing::TempDir dir("synth");
    ASSERT_TRUE(write_synth_model(o, dir.file("m.gguf")).ok());
    auto m = load_model(dir.file("m.gguf"));
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    const ModelConfig& c = (*m)->config();
    EXPECT_EQ(c.arch, "llama");
    EXPECT_EQ(c.n_layers, o.layers);
    EXPECT_EQ(c.dim, o.dim);
    EXPECT_EQ(c.n_heads, o.heads);
    EXPECT_EQ(c.n_kv_heads, o.kv_heads);
    EXPECT_EQ(c.head_dim, o.dim / o.heads);
    EXPECT_EQ(c.ffn_dim, o.ffn);
    EXPECT_EQ(c.vocab_size, o.vocab);
    EXPECT_EQ(c.context_length, o.context);
    EXPECT_FALSE(c.tied_embeddings);
    EXPECT_EQ(c.rope_style, RopeStyle::kNormal);
    EXPECT_EQ((*m)->tensor("blk.0.attn_q.weight")->dtype, dt);
    EXPECT_EQ((*m)->tensor("blk.0.attn_norm.weight")->dtype, DType::kF32);
    EXPECT_EQ((*m)->tokenizer().tokens.size(), static_cast<size_t>(o.vocab));
  }
}

TEST(SynthTest, WeightsLookLikeARealInit) {
  SynthOptions o = tiny(DType::kF32);
  o.dim = 256;
  o.heads = 8;
  o.kv_heads = 8;
  auto b = synth_bytes(o);
  auto g = GgufFile::parse(b);
  ASSERT_TRUE(g.ok());
  auto stats = [&](const char* name) {
    const auto* t = g->find_tensor(name);
    std::vector<float> x(static_cast<size_t>(t->elements()));
    std::memcpy(x.data(), t->data, t->nbytes);
    double s = 0, s2 = 0;
    for (float v : x) s += v, s2 += double(v) * v;
    const double mean = s / x.size();
    return std::pair{mean, std::sqrt(s2 / x.size() - mean * mean)};
  };
  auto [mq, sq] = stats("blk.0.attn_q.weight");
  EXPECT_NEAR(mq, 0.0, 1e-3);
  EXPECT_NEAR(sq, 0.02, 1e-3);
  auto [md, sd] = stats("blk.0.ffn_down.weight");
  EXPECT_NEAR(sd, 0.02 / std::sqrt(4.0), 1e-3);
  auto [mn, sn] = stats("blk.1.ffn_norm.weight");
  EXPECT_EQ(mn, 1.0);
  EXPECT_EQ(sn, 0.0);
}

TEST(SynthTest, TiedEmbeddingsDropTheOutputMatrix) {
  SynthOptions o = tiny();
  o.tied_embeddings = true;
  testing::TempDir dir("synth");
  ASSERT_TRUE(write_synth_model(o, dir.file("m.gguf")).ok());
  auto m = load_model(dir.file("m.gguf"));
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE((*m)->config().tied_embeddings);
  EXPECT_EQ((*m)->tensor("output.weight"), nullptr);
}

TEST(SynthTest, BadOptionsNameTheFlag) {
  auto msg = [](auto edit) {
    SynthOptions o = tiny();
    edit(o);
    return validate_synth_options(o);
  };
  EXPECT_EQ(msg([](SynthOptions&) {}), "");
  EXPECT_NE(msg([](SynthOptions& o) { o.dim = 66; }).find("--dim 66"), std::string::npos);
  EXPECT_NE(msg([](SynthOptions& o) { o.kv_heads = 3; }).find("--kv-heads 3"), std::string::npos);
  EXPECT_NE(msg([](SynthOptions& o) { o.layers = 0; }).find("--layers 0"), std::string::npos);
  EXPECT_NE(msg([](SynthOptions& o) { o.vocab = 10; }).find("--vocab 10"), std::string::npos);
  EXPECT_NE(msg([](SynthOptions& o) { o.heads = 64; o.kv_heads = 64; }).find("odd head size"),
            std::string::npos);
  EXPECT_NE(msg([](SynthOptions& o) { o.dtype = DType::kQ8_0; o.ffn = 100; }).find("q8_0"),
            std::string::npos);
  auto w = synth_gguf([] { SynthOptions o = tiny(); o.ffn = 0; return o; }());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("--ffn 0"), std::string::npos);
}

}  // namespace
}  // namespace cleave
