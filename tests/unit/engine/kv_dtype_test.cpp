// The KV pool in f16 and bf16 (engine.kv_dtype): the layout's byte sizes follow the dtype, the
// pool holds exactly the rounded K/V of an f32 pool, logits stay close to f32's, and batch
// invariance holds for each dtype: a sequence's logits are bit-identical alone, chunked, and
// batched beside another sequence in shuffled blocks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cleave/engine/llama_model.h"
#include "cleave/model/synth.h"

namespace cleave {
namespace {

namespace fs = std::filesystem;

std::string stories_path() { return std::string(CLEAVE_SOURCE_DIR) + "/../shared/models/stories260K.gguf"; }

std::string synth_path() {
  static const std::string path = [] {
    SynthOptions o;
    o.layers = 2;
    o.dim = 64;
    o.heads = 4;
    o.kv_heads = 2;
    o.ffn = 96;
    o.vocab = 300;
    o.context = 256;
    o.seed = 11;
    const std::string p =
        (fs::temp_directory_path() / ("cleave_kv_dtype_" + std::to_string(::getpid()) + ".gguf")).string();
    EXPECT_TRUE(write_synth_model(o, p).ok());
    return p;
  }();
  return path;
}

class KvDtypeTest : public ::testing::TestWithParam<std::tuple<std::string, DType>> {
 protected:
  void SetUp() override {
    const std::string path = std::get<0>(GetParam()) == "stories260K" ? stories_path() : synth_path();
    if (!fs::exists(path)) GTEST_SKIP() << path << " is absent";
    auto f = load_model(path);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    file_ = std::shared_ptr<const ModelFile>(std::move(*f));
    EngineOptions o;
    o.threads = 2;
    o.max_context = 128;
    o.max_batch_tokens = 16;  // longer chunks run as sub-batches
    auto m = LlamaModel::create(file_, o);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = std::move(*m);
    dtype_ = std::get<1>(GetParam());
    vocab_ = model_->config().vocab_size;
  }

  std::unique_ptr<KvBlockPool> pool(int64_t blocks, DType dtype) {
    auto kv = KvBlockPool::create(model_->kv_layout(8, blocks, dtype));
    EXPECT_TRUE(kv.ok()) << kv.status().to_string();
    return kv.ok() ? std::move(*kv) : nullptr;
  }

  std::vector<int32_t> prompt(uint32_t seed, int n) {
    std::mt19937 rng(seed);
    std::vector<int32_t> t{1};
    while (static_cast<int>(t.size()) < n) t.push_back(static_cast<int32_t>(rng() % vocab_));
    return t;
  }

  // The last logits of `tokens` run in chunks of `chunk` (0: at once) then `decode` greedy steps,
  // beside `other` in the same calls when it is not empty; blocks taken in shuffled order.
  std::vector<float> run(const std::vector<int32_t>& tokens, int64_t chunk, int decode,
                         const std::vector<int32_t>& other, DType dtype, uint32_t shuffle) {
    auto kv = pool(32, dtype);
    std::vector<BlockId> ids(32);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(shuffle));
    const std::vector<BlockId> ta(ids.begin(), ids.begin() + 16), tb(ids.begin() + 16, ids.end());
    std::vector<int32_t> seq = tokens;
    std::vector<float> logits(static_cast<size_t>(vocab_)), other_logits(static_cast<size_t>(vocab_));
    int64_t pos = 0;
    auto step = [&](int64_t n) {
      std::vector<BatchSequence> batch;
      if (!other.empty() && pos < static_cast<int64_t>(other.size())) {
        const int64_t m = std::min<int64_t>(n, static_cast<int64_t>(other.size()) - pos);
        batch.push_back({.tokens = std::span<const int32_t>(other).subspan(pos, m), .start_pos = pos,
                         .block_table = tb, .logits = other_logits});
      }
      batch.push_back({.tokens = std::span<const int32_t>(seq).subspan(pos, n), .start_pos = pos,
                       .block_table = ta, .logits = logits});
      EXPECT_TRUE(model_->forward_batch(batch, *kv).ok());
      pos += n;
    };
    const auto n = static_cast<int64_t>(tokens.size());
    while (pos < n) step(std::min(chunk == 0 ? n : chunk, n - pos));
    for (int d = 0; d < decode; ++d) {
      seq.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
      step(1);
    }
    return logits;
  }

  std::shared_ptr<const ModelFile> file_;
  std::unique_ptr<LlamaModel> model_;
  DType dtype_ = DType::kF32;
  int64_t vocab_ = 0;
};

TEST_P(KvDtypeTest, LayoutBytesFollowTheDtype) {
  const KvLayout f32 = model_->kv_layout(8, 4, DType::kF32);
  const KvLayout l = model_->kv_layout(8, 4, dtype_);
  EXPECT_EQ(l.validate(), "");
  EXPECT_EQ(l.dtype, dtype_);
  EXPECT_EQ(l.block_bytes(), 2u * 8 * static_cast<uint64_t>(l.kv_dim()) *
                                 static_cast<uint64_t>(dtype_ == DType::kF32 ? 4 : 2));
  EXPECT_EQ(l.total_bytes() * (dtype_ == DType::kF32 ? 1 : 2), f32.total_bytes());
  if (dtype_ != DType::kF32) {
    EXPECT_NE(l.incompatibility(f32).find("dtype"), std::string::npos) << l.incompatibility(f32);
  }
}

TEST_P(KvDtypeTest, AloneChunkedAndBatchedAreBitIdentical) {
  const auto p = prompt(3, 37);
  const auto other = prompt(4, 29);
  const std::vector<float> alone = run(p, 0, 6, {}, dtype_, 1);
  const std::vector<float> chunked = run(p, 5, 6, {}, dtype_, 2);
  const std::vector<float> batched = run(p, 7, 6, other, dtype_, 3);
  EXPECT_EQ(0, std::memcmp(alone.data(), chunked.data(), alone.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(alone.data(), batched.data(), alone.size() * sizeof(float)));
  // Close to the f32 pool's logits (f16 keeps 11 bits of mantissa, bf16 8).
  const std::vector<float> ref = run(p, 0, 6, {}, DType::kF32, 1);
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(alone[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  EXPECT_LT(max_diff, (dtype_ == DType::kBF16 ? 0.05 : 0.01) * std::max(1.0, max_ref));
}

TEST_P(KvDtypeTest, PoolHoldsTheRoundedKvOfAnF32Pool) {
  if (dtype_ == DType::kF32) GTEST_SKIP() << "f32 is the reference";
  const auto p = prompt(5, 16);
  auto ref = pool(2, DType::kF32);
  auto kv = pool(2, dtype_);
  const std::vector<BlockId> table{0, 1};
  std::vector<float> logits(static_cast<size_t>(vocab_));
  ASSERT_TRUE(model_->forward(p, 0, table, *ref, logits).ok());
  ASSERT_TRUE(model_->forward(p, 0, table, *kv, logits).ok());
  // Layer 0's K/V depend on the embeddings alone: the same floats, rounded to dtype.
  const KvLayout& l = kv->layout();
  const auto* src = reinterpret_cast<const float*>(ref->data());
  const auto* dst = reinterpret_cast<const uint16_t*>(kv->data());
  const uint64_t elems = 2 * l.block_bytes() / 2;  // layer 0: blocks 0 and 1, K and V
  for (uint64_t i = 0; i < elems; ++i) {
    const uint16_t want = dtype_ == DType::kF16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
    ASSERT_EQ(dst[i], want) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, KvDtypeTest,
    ::testing::Combine(::testing::Values("synth", "stories260K"),
                       ::testing::Values(DType::kF32, DType::kF16, DType::kBF16)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::string(dtype_name(std::get<1>(info.param)));
    });

class CleanUp : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove(fs::temp_directory_path() / ("cleave_kv_dtype_" + std::to_string(::getpid()) + ".gguf"), ec);
  }
};
const auto* const kCleanUp = ::testing::AddGlobalTestEnvironment(new CleanUp);

}  // namespace
}  // namespace cleave
