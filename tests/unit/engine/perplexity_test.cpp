// Scoring: every token's logits (BatchSequence::all_logits) against the last-token logits of
// token-by-token forward passes, bit for bit; token_logprob against a log-softmax in double; and
// compute_perplexity on stories260K against a perplexity computed here from the engine's
// last-token logits, with its errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cleave/engine/llama_model.h"
#include "cleave/engine/perplexity.h"
#include "cleave/engine/sampler.h"
#include "cleave/model/synth.h"
#include "cleave/model/tokenizer.h"

namespace cleave {
namespace {

namespace fs = std::filesystem;

std::string models_dir() { return std::string(CLEAVE_SOURCE_DIR) + "/../shared/models"; }

std::shared_ptr<const ModelFile> load(const std::string& path) {
  auto m = load_model(path);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? std::shared_ptr<const ModelFile>(std::move(*m)) : nullptr;
}

std::unique_ptr<LlamaModel> make(std::shared_ptr<const ModelFile> f, int64_t max_batch,
                                 int64_t max_context) {
  EngineOptions o;
  o.threads = 2;
  o.max_batch_tokens = max_batch;
  o.max_context = max_context;
  auto m = LlamaModel::create(std::move(f), o);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? std::move(*m) : nullptr;
}

struct Pool {
  std::unique_ptr<KvBlockPool> kv;
  std::vector<BlockId> table;
};

Pool make_pool(const LlamaModel& m, int64_t positions) {
  Pool p;
  const int64_t blocks = (positions + 15) / 16;
  auto kv = KvBlockPool::create(m.kv_layout(16, blocks));
  EXPECT_TRUE(kv.ok()) << kv.status().to_string();
  p.kv = std::move(*kv);
  EXPECT_TRUE(p.kv->allocate(blocks, p.table).ok());
  return p;
}

// The logits after each of `tokens`, one forward pass per token (last-token logits).
std::vector<std::vector<float>> stepwise_logits(LlamaModel& m, const std::vector<int32_t>& tokens) {
  Pool p = make_pool(m, static_cast<int64_t>(tokens.size()));
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::vector<float> logits(static_cast<size_t>(m.config().vocab_size));
    EXPECT_TRUE(m.forward(std::span<const int32_t>(&tokens[i], 1), static_cast<int64_t>(i),
                          p.table, *p.kv, logits)
                    .ok());
    out.push_back(std::move(logits));
  }
  return out;
}

std::string synth_model(const std::string& tag) {
  SynthOptions o;
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 96;
  o.vocab = 300;
  o.context = 256;
  o.seed = 7;
  const std::string path =
      (fs::temp_directory_path() / ("cleave_scoring_" + tag + "_" + std::to_string(::getpid()) + ".gguf"))
          .string();
  EXPECT_TRUE(write_synth_model(o, path).ok());
  return path;
}

TEST(Scoring, AllLogitsEqualStepwiseLogitsBitForBit) {
  const std::string path = synth_model("all");
  auto file = load(path);
  ASSERT_TRUE(file);
  // Sub-batches of 5 tokens: a 23-token prompt straddles several, beside a second sequence.
  auto m = make(file, 5, 64);
  ASSERT_TRUE(m);
  std::mt19937 rng(3);
  std::vector<int32_t> a(23), b(9);
  for (auto& t : a) t = static_cast<int32_t>(rng() % 300);
  for (auto& t : b) t = static_cast<int32_t>(rng() % 300);
  const auto want_a = stepwise_logits(*m, a);
  const auto want_b = stepwise_logits(*m, b);

  // One pool for both: a's blocks then b's (separate tables).
  auto kv = KvBlockPool::create(m->kv_layout(16, 3));
  ASSERT_TRUE(kv.ok());
  std::vector<BlockId> ta, tb;
  ASSERT_TRUE((*kv)->allocate(2, ta).ok());
  ASSERT_TRUE((*kv)->allocate(1, tb).ok());
  std::vector<float> last_b(300);
  std::vector<std::vector<float>> got_a(23);
  const BatchSequence batch[] = {
      {.tokens = b, .start_pos = 0, .block_table = tb, .logits = last_b},
      {.tokens = a, .start_pos = 0, .block_table = ta, .logits = {}, .all_logits = true}};
  ForwardHooks hooks;
  int calls = 0;
  hooks.on_token_logits = [&](size_t seq, int64_t index, std::span<const float> logits) {
    EXPECT_EQ(seq, 1u);
    EXPECT_EQ(index, calls);  // in token order
    ++calls;
    got_a[static_cast<size_t>(index)].assign(logits.begin(), logits.end());
  };
  ASSERT_TRUE(m->forward_batch(batch, **kv, hooks).ok());
  EXPECT_EQ(calls, 23);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(got_a[i].size(), 300u);
    EXPECT_EQ(0, std::memcmp(got_a[i].data(), want_a[i].data(), 300 * sizeof(float))) << "token " << i;
  }
  EXPECT_EQ(0, std::memcmp(last_b.data(), want_b.back().data(), 300 * sizeof(float)));
  fs::remove(path);
}

TEST(Scoring, AllLogitsWithoutHookIsAnError) {
  const std::string path = synth_model("nohook");
  auto file = load(path);
  ASSERT_TRUE(file);
  auto m = make(file, 0, 32);
  ASSERT_TRUE(m);
  Pool p = make_pool(*m, 4);
  const std::vector<int32_t> t{1, 2, 3};
  const BatchSequence seq{.tokens = t, .start_pos = 0, .block_table = p.table, .logits = {},
                          .all_logits = true};
  const Status s = m->forward_batch(std::span<const BatchSequence>(&seq, 1), *p.kv);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("on_token_logits"), std::string::npos) << s.message();
  fs::remove(path);
}

TEST(Scoring, TokenLogprobIsLogSoftmaxInDouble) {
  std::vector<float> logits{1.5f, -2.0f, 3.25f, 3.25f, 0.0f, -INFINITY};
  double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v));
  for (int32_t t = 0; t < 5; ++t) {
    const SampleResult r = token_logprob(logits, t, 3);
    EXPECT_EQ(r.token, t);
    EXPECT_FLOAT_EQ(r.logprob, static_cast<float>(logits[t] - std::log(sum)));
    ASSERT_EQ(r.top.size(), 3u);
    EXPECT_EQ(r.top[0].token, 2);  // ties by id ascending
    EXPECT_EQ(r.top[1].token, 3);
    EXPECT_EQ(r.top[2].token, 0);
    EXPECT_FLOAT_EQ(r.top[2].logprob, static_cast<float>(1.5 - std::log(sum)));
  }
  EXPECT_TRUE(token_logprob(logits, 1, 0).top.empty());
}

// ---- perplexity on stories260K.

class PerplexityTest : public testing::Test {
 protected:
  void SetUp() override {
    const std::string path = models_dir() + "/stories260K.gguf";
    if (!fs::exists(path)) GTEST_SKIP() << "../shared/models/stories260K.gguf is absent";
    file_ = load(path);
    ASSERT_TRUE(file_);
    auto tok = Tokenizer::create(file_->tokenizer());
    ASSERT_TRUE(tok.ok());
    tok_ = std::move(*tok);
    std::ifstream in(models_dir() + "/stories260K-empty.txt", std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    tokens_ = tok_->encode(ss.str(), EncodeOptions{.add_bos = true});
  }
  std::shared_ptr<const ModelFile> file_;
  std::unique_ptr<Tokenizer> tok_;
  std::vector<int32_t> tokens_;
};

// The same figure computed independently: each window token by token through forward(), the
// window's first token replaced by BOS, the second half scored by a log-softmax in double.
double reference_ppl(LlamaModel& m, const std::vector<int32_t>& tokens, int64_t ctx, int32_t bos,
                     int64_t* scored) {
  double nll = 0;
  *scored = 0;
  for (size_t w = 0; (w + 1) * ctx <= tokens.size(); ++w) {
    std::vector<int32_t> win(tokens.begin() + w * ctx, tokens.begin() + (w + 1) * ctx);
    win[0] = bos;
    const auto logits = stepwise_logits(m, win);
    for (int64_t p = ctx / 2; p + 1 < ctx; ++p) {
      const auto& l = logits[static_cast<size_t>(p)];
      double mx = -INFINITY;
      for (float v : l) mx = std::max(mx, static_cast<double>(v));
      double s = 0;
      for (float v : l) s += std::exp(static_cast<double>(v) - mx);
      nll -= static_cast<double>(l[static_cast<size_t>(win[p + 1])]) - mx - std::log(s);
      ++*scored;
    }
  }
  return std::exp(nll / static_cast<double>(*scored));
}

TEST_F(PerplexityTest, MatchesAnIndependentComputation) {
  ASSERT_GT(tokens_.size(), 100u);
  auto m = make(file_, 0, 48);
  ASSERT_TRUE(m);
  int64_t scored = 0;
  const double want = reference_ppl(*m, tokens_, 48, tok_->bos_id(), &scored);
  std::vector<int64_t> progress;
  for (int64_t batch : {int64_t{0}, int64_t{7}}) {  // the batch size changes nothing
    progress.clear();
    auto r = compute_perplexity(*m, tokens_, {.ctx = 48, .batch = batch, .bos_id = tok_->bos_id()},
                                [&](const PerplexityResult& so_far, int64_t total) {
                                  EXPECT_EQ(total, static_cast<int64_t>(tokens_.size() / 48));
                                  progress.push_back(so_far.windows);
                                });
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->windows, static_cast<int64_t>(tokens_.size() / 48));
    EXPECT_EQ(r->scored_tokens, scored);
    EXPECT_EQ(r->scored_tokens, r->windows * (48 - 24 - 1));
    EXPECT_NEAR(r->ppl, want, want * 1e-6) << "batch " << batch;
    EXPECT_GT(r->ppl, 1.0);
    EXPECT_GT(r->ppl_error, 0.0);
    EXPECT_EQ(progress.size(), static_cast<size_t>(r->windows));
  }
  // A trained model on its own kind of text is far better than uniform over 512 tokens.
  EXPECT_LT(want, 30.0);
}

TEST_F(PerplexityTest, Errors) {
  auto m = make(file_, 0, 64);
  ASSERT_TRUE(m);
  auto short_text = compute_perplexity(*m, std::span<const int32_t>(tokens_).first(10), {.ctx = 32});
  EXPECT_EQ(short_text.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_text.status().message().find("10 tokens"), std::string::npos);
  auto too_long = compute_perplexity(*m, tokens_, {.ctx = 128});
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("128"), std::string::npos);
  EXPECT_FALSE(compute_perplexity(*m, tokens_, {.ctx = 2}).ok());
  EXPECT_FALSE(compute_perplexity(*m, tokens_, {.ctx = 32, .batch = -1}).ok());
  std::vector<int32_t> bad(tokens_.begin(), tokens_.begin() + 40);
  bad[5] = 512;
  EXPECT_FALSE(compute_perplexity(*m, bad, {.ctx = 32}).ok());
}

}  // namespace
}  // namespace cleave
