// Prompt log-probabilities through the engine loop (SamplingParams::prompt_logprobs): one entry
// per prompt token from the second on, on the first token event, equal to a log-softmax in
// double of the logits that token-by-token forward passes give, whatever the chunking, with a
// prefix cache that holds the prompt, and beside another request.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "engine_test_util.h"

namespace cleave {
namespace {

using namespace testing_engine;

struct Scored {
  std::vector<SampleResult> prompt_logprobs;
  int events_with_prompt_logprobs = 0;
  std::vector<int32_t> tokens;
  bool finished = false;
  Status error;
};

class PromptLogprobsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string path = GetParam() == "stories260K" ? stories_path() : synth_path();
    m_ = ModelUnderTest::load(path);
    if (!m_.file) GTEST_SKIP() << path << " is absent (../shared/models is needed for stories260K)";
    ASSERT_TRUE(m_.tok);
  }

  Scored run(EngineLoop& engine, RequestId id, const std::vector<int32_t>& prompt,
             int32_t prompt_logprobs, int32_t max_tokens = 3) {
    auto out = std::make_shared<Scored>();
    auto mu = std::make_shared<std::mutex>();
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    p.prompt_logprobs = prompt_logprobs;
    const Status st = engine.submit(EngineRequest{.id = id, .prompt = prompt, .params = p}, [out, mu](const EngineEvent& ev) {
      std::lock_guard<std::mutex> lk(*mu);
      if (!ev.prompt_logprobs.empty()) {
        ++out->events_with_prompt_logprobs;
        out->prompt_logprobs = ev.prompt_logprobs;
      }
      if (ev.has_token) out->tokens.push_back(ev.token);
      if (ev.finished) {
        out->finished = true;
        out->error = ev.error;
      }
    });
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(engine.wait_idle(std::chrono::seconds(60)));
    std::lock_guard<std::mutex> lk(*mu);
    return *out;
  }

  // Log-softmax in double of the logits after each prompt token, one forward pass per token.
  std::vector<std::vector<double>> reference(const std::vector<int32_t>& prompt) {
    auto model = m_.model();
    const int64_t vocab = model->config().vocab_size;
    const int64_t blocks = (static_cast<int64_t>(prompt.size()) + 15) / 16;
    auto kv = KvBlockPool::create(model->kv_layout(16, blocks));
    EXPECT_TRUE(kv.ok());
    std::vector<BlockId> table;
    EXPECT_TRUE((*kv)->allocate(blocks, table).ok());
    std::vector<std::vector<double>> out;
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (size_t i = 0; i + 1 < prompt.size(); ++i) {
      EXPECT_TRUE(model->forward(std::span<const int32_t>(&prompt[i], 1), static_cast<int64_t>(i),
                                 table, **kv, logits)
                      .ok());
      double mx = -INFINITY;
      for (float v : logits) mx = std::max(mx, static_cast<double>(v));
      double s = 0;
      for (float v : logits) s += std::exp(static_cast<double>(v) - mx);
      std::vector<double> lp(logits.size());
      for (size_t k = 0; k < logits.size(); ++k) lp[k] = logits[k] - mx - std::log(s);
      out.push_back(std::move(lp));
    }
    return out;
  }

  void expect_matches(const Scored& got, const std::vector<int32_t>& prompt,
                      const std::vector<std::vector<double>>& want, int32_t n,
                      const std::string& what) {
    ASSERT_TRUE(got.finished && got.error.ok()) << what << ": " << got.error.to_string();
    EXPECT_EQ(got.events_with_prompt_logprobs, 1) << what;
    ASSERT_EQ(got.prompt_logprobs.size(), prompt.size() - 1) << what;
    for (size_t q = 1; q < prompt.size(); ++q) {
      const SampleResult& r = got.prompt_logprobs[q - 1];
      const std::vector<double>& lp = want[q - 1];
      EXPECT_EQ(r.token, prompt[q]) << what << " position " << q;
      EXPECT_NEAR(r.logprob, lp[static_cast<size_t>(prompt[q])], 1e-5) << what << " position " << q;
      ASSERT_EQ(r.top.size(), static_cast<size_t>(n)) << what;
      for (int k = 0; k < n; ++k) {
        // The k-th most likely token: no token above it is missing from the list.
        EXPECT_NEAR(r.top[k].logprob, lp[static_cast<size_t>(r.top[k].token)], 1e-5) << what;
        if (k > 0) {
          EXPECT_GE(r.top[k - 1].logprob, r.top[k].logprob) << what;
        }
      }
      if (n == 0) continue;
      const double kth = lp[static_cast<size_t>(r.top[n - 1].token)];
      int above = 0;
      for (double v : lp) above += v > kth + 1e-9;
      EXPECT_LE(above, n - 1) << what << " position " << q;
    }
  }

  ModelUnderTest m_;
};

TEST_P(PromptLogprobsTest, EqualADirectComputationWhateverTheChunking) {
  std::mt19937 rng(5);
  const int64_t vocab = m_.file->config().vocab_size;
  const std::vector<int32_t> prompt = random_prompt(rng, *m_.tok, vocab, 53);
  const std::vector<int32_t> other = random_prompt(rng, *m_.tok, vocab, 40);
  const auto want = reference(prompt);

  for (int64_t budget : {int64_t{16}, int64_t{7}, int64_t{256}}) {
    EngineLoopOptions o;
    o.block_size = 16;
    o.num_blocks = 64;
    o.scheduler.max_tokens_per_step = budget;
    auto engine = m_.engine(o);
    ASSERT_TRUE(engine);
    // The prompt is in the prefix cache first: it is computed whole all the same.
    const Scored warm = run(*engine, 1, prompt, -1);
    EXPECT_TRUE(warm.prompt_logprobs.empty());
    // Beside another request in the same steps.
    auto beside = std::make_shared<std::atomic<bool>>(false);
    SamplingParams p;
    p.max_tokens = 8;
    ASSERT_TRUE(engine->submit(EngineRequest{.id = 9, .prompt = other, .params = p}, [beside](const EngineEvent& ev) {
                  if (ev.finished) *beside = true;
                }).ok());
    const Scored got = run(*engine, 2, prompt, 4);
    EXPECT_TRUE(beside->load());
    expect_matches(got, prompt, want, 4, "budget " + std::to_string(budget));
    EXPECT_EQ(got.tokens, warm.tokens);  // scoring changes nothing of the generation
    expect_all_blocks_back(*engine);
  }
}

TEST_P(PromptLogprobsTest, ZeroTopAndOneTokenPrompt) {
  EngineLoopOptions o;
  o.block_size = 16;
  o.num_blocks = 16;
  auto engine = m_.engine(o);
  ASSERT_TRUE(engine);
  std::mt19937 rng(8);
  const std::vector<int32_t> prompt = random_prompt(rng, *m_.tok, m_.file->config().vocab_size, 9);
  const Scored got = run(*engine, 1, prompt, 0);
  expect_matches(got, prompt, reference(prompt), 0, "top 0");
  const Scored one = run(*engine, 2, {prompt[0]}, 2);
  EXPECT_TRUE(one.finished && one.error.ok());
  EXPECT_TRUE(one.prompt_logprobs.empty());  // a one-token prompt has nothing to score
  SamplingParams bad;
  bad.prompt_logprobs = kMaxLogprobs + 1;
  const Status st = engine->submit(EngineRequest{.id = 3, .prompt = prompt, .params = bad}, {});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("prompt_logprobs"), std::string::npos) << st.message();
}

INSTANTIATE_TEST_SUITE_P(Models, PromptLogprobsTest, ::testing::Values("stories260K", "synth"),
                         [](const auto& info) { return info.param; });

class CleanUp : public ::testing::Environment {
 public:
  void TearDown() override { remove_synth_dir(); }
};
const auto* const kCleanUp = ::testing::AddGlobalTestEnvironment(new CleanUp);

}  // namespace
}  // namespace cleave
