// The generation loop on stories260K: the llama2.c golden text, streaming, stop conditions,
// seeded and resumable sampling, logprobs, and errors.
#include "cleave/engine/generator.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace cleave {
namespace {

namespace fs = std::filesystem;

std::string models_dir() { return std::string(CLEAVE_SOURCE_DIR) + "/../shared/models"; }

class GeneratorTest : public testing::Test {
 protected:
  void SetUp() override {
    const std::string path = models_dir() + "/stories260K.gguf";
    if (!fs::exists(path)) GTEST_SKIP() << "../shared/models/stories260K.gguf is absent";
    auto f = load_model(path);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    file_ = std::shared_ptr<const ModelFile>(std::move(*f));
    auto t = Tokenizer::create(file_->tokenizer());
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tok_ = std::move(*t);
    model_ = make_model(0);
    ASSERT_TRUE(model_);
    gen_ = std::make_unique<Generator>(*model_, *tok_);
  }
  std::unique_ptr<LlamaModel> make_model(int64_t max_context) {
    EngineOptions o;
    o.threads = 2;
    o.max_context = max_context;
    auto m = LlamaModel::create(file_, o);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    return m.ok() ? std::move(*m) : nullptr;
  }
  static SamplingParams greedy(int32_t max_tokens) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    return p;
  }
  GenerationResult run(std::vector<int32_t> prompt, const SamplingParams& p,
                       const Generator::TokenCallback& cb = {}) {
    auto r = gen_->generate(prompt, p, cb);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? std::move(*r) : GenerationResult{};
  }
  std::string golden() {
    std::ifstream in(models_dir() + "/stories260K-empty.txt", std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  std::shared_ptr<const ModelFile> file_;
  std::unique_ptr<Tokenizer> tok_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Generator> gen_;
};

TEST_F(GeneratorTest, GreedyFromBosMatchesLlama2cReference) {
  std::string streamed;
  int calls = 0;
  GenerationResult r = run({tok_->bos_id()}, greedy(200), [&](const GeneratedToken& t) {
    streamed += t.text;
    ++calls;
    return true;
  });
  EXPECT_EQ(r.text, golden());
  EXPECT_EQ(streamed, r.text);
  EXPECT_EQ(calls, 200);
  EXPECT_EQ(r.tokens.size(), 200u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(r.stats.prompt_tokens, 1);
  EXPECT_EQ(r.stats.generated_tokens, 200);
  EXPECT_EQ(r.stats.decode_steps, 199);
  EXPECT_TRUE(r.logprobs.empty());
  // The same generator again gives the same text (the KV cache is simply overwritten).
  EXPECT_EQ(run({tok_->bos_id()}, greedy(200)).text, golden());
}

TEST_F(GeneratorTest, StopStringCutsTheText) {
  SamplingParams p = greedy(200);
  p.stop = {"Lily"};
  GenerationResult r = run({tok_->bos_id()}, p);
  const std::string g = golden();
  EXPECT_EQ(r.text, g.substr(0, g.find("Lily")));
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(r.stop_string, "Lily");
}

TEST_F(GeneratorTest, StopTokenIdEndsGeneration) {
  GenerationResult full = run({tok_->bos_id()}, greedy(20));
  ASSERT_EQ(full.tokens.size(), 20u);
  const int32_t stop_id = full.tokens[6];
  const auto first = std::find(full.tokens.begin(), full.tokens.end(), stop_id) - full.tokens.begin();
  SamplingParams p = greedy(20);
  p.stop_token_ids = {stop_id};
  GenerationResult r = run({tok_->bos_id()}, p);
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  ASSERT_EQ(static_cast<long>(r.tokens.size()), first + 1);
  EXPECT_EQ(r.tokens.back(), stop_id);
  // min_tokens suppresses it until then.
  p.min_tokens = static_cast<int32_t>(first) + 2;
  GenerationResult later = run({tok_->bos_id()}, p);
  EXPECT_GE(static_cast<int32_t>(later.tokens.size()), p.min_tokens);
  for (int32_t i = 0; i + 1 < p.min_tokens; ++i) EXPECT_NE(later.tokens[i], stop_id) << i;
}

TEST_F(GeneratorTest, MaxTokensAndCancellation) {
  GenerationResult r = run({tok_->bos_id()}, greedy(10));
  EXPECT_EQ(r.tokens.size(), 10u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(golden().rfind(r.text, 0), 0u) << r.text;
  int n = 0;
  GenerationResult c = run({tok_->bos_id()}, greedy(50), [&](const GeneratedToken&) { return ++n < 3; });
  EXPECT_EQ(c.tokens.size(), 3u);
  EXPECT_EQ(c.finish_reason, FinishReason::kCancelled);
}

TEST_F(GeneratorTest, SeededSamplingIsDeterministicAndResumable) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.95f;
  p.seed = 1234;
  p.max_tokens = 40;
  const std::vector<int32_t> prompt = tok_->encode("Once upon a time", {.add_bos = true});
  GenerationResult a = run(prompt, p);
  GenerationResult b = run(prompt, p);
  EXPECT_EQ(a.tokens, b.tokens);
  p.seed = 99;
  EXPECT_NE(run(prompt, p).tokens, a.tokens);
  // Resume after 15 tokens (as another worker would): the rest is the same.
  p.seed = 1234;
  std::vector<int32_t> resumed_prompt = prompt;
  resumed_prompt.insert(resumed_prompt.end(), a.tokens.begin(), a.tokens.begin() + 15);
  p.max_tokens = 25;
  GenerationResult rest = run(resumed_prompt, p);
  EXPECT_EQ(rest.tokens, std::vector<int32_t>(a.tokens.begin() + 15, a.tokens.end()));
}

TEST_F(GeneratorTest, TextAfterANonBosPromptKeepsItsLeadingSpace) {
  const std::vector<int32_t> prompt = tok_->encode("Once upon a time, there was", {.add_bos = true});
  GenerationResult r = run(prompt, greedy(12));
  std::string pieces;
  for (int32_t id : r.tokens) pieces += tok_->token_to_piece(id);
  EXPECT_EQ(r.text, pieces);
  EXPECT_EQ(r.text.substr(0, 1), " ");
}

TEST_F(GeneratorTest, LogprobsReportTheChosenTokenAndAlternatives) {
  SamplingParams p = greedy(8);
  p.logprobs = 3;
  GenerationResult r = run({tok_->bos_id()}, p);
  ASSERT_EQ(r.logprobs.size(), r.tokens.size());
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    EXPECT_EQ(r.logprobs[i].token, r.tokens[i]);
    EXPECT_LE(r.logprobs[i].logprob, 0.0f);
    ASSERT_EQ(r.logprobs[i].top.size(), 3u);
    EXPECT_EQ(r.logprobs[i].top[0].token, r.tokens[i]);  // greedy picks the most likely
  }
}

TEST_F(GeneratorTest, EndOfGenerationStopsUnlessIgnored) {
  // stories260K separates stories with BOS (llama2.c stops on BOS) and never samples its EOS, so
  // the tokenizer is rebuilt with "." as an extra end-of-generation token.
  TokenizerSpec spec = file_->tokenizer();
  const auto dot = std::find(spec.tokens.begin(), spec.tokens.end(), ".") - spec.tokens.begin();
  ASSERT_LT(dot, static_cast<long>(spec.tokens.size()));
  spec.eot_ids.push_back(static_cast<int32_t>(dot));
  auto t = Tokenizer::create(spec);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  Generator g(*model_, **t);
  auto r = g.generate(std::vector<int32_t>{tok_->bos_id()}, greedy(200));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const std::string gold = golden();
  EXPECT_EQ(r->finish_reason, FinishReason::kStop);
  EXPECT_EQ(r->tokens.back(), dot);
  EXPECT_EQ(r->text, gold.substr(0, gold.find('.')));  // the end token's text is not output
  SamplingParams p = greedy(200);
  p.ignore_eos = true;
  auto all = g.generate(std::vector<int32_t>{tok_->bos_id()}, p);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ(all->finish_reason, FinishReason::kLength);
  EXPECT_EQ(all->text, gold);
}

TEST_F(GeneratorTest, ContextLimitAndBadPrompts) {
  auto small = make_model(8);
  ASSERT_TRUE(small);
  Generator g(*small, *tok_);
  auto r = g.generate(std::vector<int32_t>{1, 2, 3}, greedy(100));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  EXPECT_EQ(r->tokens.size(), 6u);  // positions 3..7 run, the token sampled at 8 is the last
  EXPECT_EQ(g.generate(std::vector<int32_t>(9, 5), greedy(1)).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(g.generate(std::vector<int32_t>{}, greedy(1)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.generate(std::vector<int32_t>{1, 600}, greedy(1)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cleave
