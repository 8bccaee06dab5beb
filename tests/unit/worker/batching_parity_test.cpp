// Continuous batching gives every request exactly what Generator gives it alone: 32 concurrent
// prompts of mixed lengths (greedy, and with mixed sampling parameters), with chunked prefill,
// with a pool small enough to force preemption, on stories260K (when ../shared is present) and a
// synthetic model. After every run all blocks are back in the pool.
#include <thread>

#include "engine_test_util.h"

namespace cleave {
namespace {

using namespace testing_engine;

struct Case {
  std::vector<int32_t> prompt;
  SamplingParams params;
};

class BatchingParityTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string path = GetParam() == "stories260K" ? stories_path() : synth_path();
    m_ = ModelUnderTest::load(path);
    if (!m_.file) GTEST_SKIP() << path << " is absent (../shared/models is needed for stories260K)";
    ASSERT_TRUE(m_.tok);
    reference_model_ = m_.model();
    ASSERT_TRUE(reference_model_);
  }

  int64_t vocab() const { return m_.file->config().vocab_size; }

  std::vector<Case> greedy_cases(int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<Case> cases;
    for (int i = 0; i < n; ++i) {
      Case c;
      c.prompt = random_prompt(rng, *m_.tok, vocab(), 1 + static_cast<int64_t>(rng() % 120));
      c.params.temperature = 0;
      c.params.max_tokens = 1 + static_cast<int32_t>(rng() % 48);
      cases.push_back(std::move(c));
    }
    return cases;
  }

  std::vector<Case> sampling_cases(int n, uint32_t seed) {
    std::vector<Case> cases = greedy_cases(n, seed);
    std::mt19937 rng(seed + 1);
    for (size_t i = 0; i < cases.size(); ++i) {
      SamplingParams& p = cases[i].params;
      p.seed = rng();
      switch (i % 8) {
        case 0: p.temperature = 0.8f; break;
        case 1: p.temperature = 1.0f; p.top_k = 20; p.top_p = 0.9f; break;
        case 2: p.temperature = 0.7f; p.min_p = 0.05f; p.logprobs = 3; break;
        case 3: p.temperature = 0; p.repetition_penalty = 1.3f; p.frequency_penalty = 0.5f; break;
        case 4: p.temperature = 0.9f; p.stop = {"e", "th"}; p.max_tokens = 40; break;
        case 5: p.temperature = 1.2f; p.min_tokens = std::min(5, p.max_tokens); p.ignore_eos = true; break;
        case 6: p.temperature = 0; p.logprobs = 0; p.stop_token_ids = {static_cast<int32_t>(rng() % 64)}; break;
        default: p.temperature = 0.5f; p.presence_penalty = 1.0f; break;
      }
    }
    return cases;
  }

  // Runs the cases through one engine, submitted from `threads` threads at once, and compares
  // each with Generator alone.
  EngineStats run_and_compare(const std::vector<Case>& cases, const EngineLoopOptions& opts,
                              int threads = 4) {
    std::vector<GenerationResult> want;
    for (const Case& c : cases) want.push_back(generate_alone(*reference_model_, *m_.tok, c.prompt, c.params));
    auto engine = m_.engine(opts);
    EXPECT_TRUE(engine);
    if (!engine) return {};
    EventSink sink;
    std::vector<std::thread> submitters;
    for (int t = 0; t < threads; ++t) {
      submitters.emplace_back([&, t] {
        for (size_t i = static_cast<size_t>(t); i < cases.size(); i += static_cast<size_t>(threads)) {
          EngineRequest req{static_cast<RequestId>(i), cases[i].prompt, cases[i].params};
          const Status st = engine->submit(std::move(req), sink.callback());
          EXPECT_TRUE(st.ok()) << st.to_string();
        }
      });
    }
    for (auto& t : submitters) t.join();
    expect_all_blocks_back(*engine);
    for (size_t i = 0; i < cases.size(); ++i) {
      expect_same(sink.get(static_cast<RequestId>(i)), want[i],
                  fmt::format("{} request {} (prompt {} tokens)", GetParam(), i, cases[i].prompt.size()));
    }
    const EngineStats s = engine->stats();
    EXPECT_EQ(s.requests_finished, cases.size());
    EXPECT_EQ(s.requests_failed, 0u);
    return s;
  }

  ModelUnderTest m_;
  std::unique_ptr<LlamaModel> reference_model_;
};

EngineLoopOptions options(int64_t num_blocks, int64_t budget, int64_t max_seqs = 64) {
  EngineLoopOptions o;
  o.block_size = 16;
  o.num_blocks = num_blocks;
  o.scheduler.max_tokens_per_step = budget;
  o.scheduler.max_num_seqs = max_seqs;
  return o;
}

TEST_P(BatchingParityTest, ThirtyTwoConcurrentGreedyPromptsMatchGeneratorAlone) {
  const EngineStats s = run_and_compare(greedy_cases(32, 1), options(512, 64));
  EXPECT_EQ(s.scheduler.preemptions, 0u);
  // Chunked prefill happened: more steps than the longest request needs tokens.
  EXPECT_GT(s.scheduler.steps, 48u);
}

TEST_P(BatchingParityTest, SmallPoolForcesPreemptionAndKeepsOutputs) {
  // 32 requests of up to 167 tokens (11 blocks) each in 24 blocks.
  const EngineStats s = run_and_compare(greedy_cases(32, 2), options(24, 96));
  EXPECT_GT(s.scheduler.preemptions, 0u);
  EXPECT_GT(s.scheduler.generated_tokens_computed, s.tokens_generated - 32u);
}

TEST_P(BatchingParityTest, MixedSamplingParametersMatchGeneratorAlone) {
  run_and_compare(sampling_cases(32, 3), options(512, 128));
}

TEST_P(BatchingParityTest, MixedSamplingParametersSurvivePreemption) {
  const EngineStats s = run_and_compare(sampling_cases(32, 4), options(24, 48, 16));
  EXPECT_GT(s.scheduler.preemptions, 0u);
}

TEST_P(BatchingParityTest, TinyBudgetAndSmallBlocksStillMatch) {
  EngineLoopOptions o = options(0, 7, 8);
  o.block_size = 4;
  o.kv_cache_bytes = 64ull << 20;
  run_and_compare(greedy_cases(12, 5), o, 2);
}

INSTANTIATE_TEST_SUITE_P(Models, BatchingParityTest, ::testing::Values("stories260K", "synth"),
                         [](const auto& info) { return info.param; });

class CleanUp : public ::testing::Environment {
 public:
  void TearDown() override { remove_synth_dir(); }
};
const auto* const kCleanUp = ::testing::AddGlobalTestEnvironment(new CleanUp);

}  // namespace
}  // namespace cleave
