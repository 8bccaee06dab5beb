// A request migrated mid-stream (EngineRequest::resume_tokens): resumed after any k of its
// tokens, it gives exactly the rest of the undisturbed run's tokens, text, logprobs, finish
// reason and stop string, greedy and seeded, with penalties, min_tokens, a stop string that
// the resume point splits and a multi-byte character it splits; its usage counts the whole
// request. Bad resume tokens are refused
// at submit().
#include <future>
#include <map>
#include <mutex>

#include "engine_test_util.h"

namespace cleave {
namespace {

using namespace testing_engine;
using namespace std::chrono_literals;

// One request's events, as they came.
struct Events {
  std::vector<int32_t> tokens;
  std::vector<std::string> texts;  // the text of each token event
  std::vector<float> logprobs;
  std::string tail_text;  // text of a finished event without a token
  bool finished = false;
  FinishReason reason = FinishReason::kLength;
  std::string stop_string;
  Status error;
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;
  int64_t generated_tokens = 0;

  std::string text_from(size_t k) const {
    std::string s;
    for (size_t i = k; i < texts.size(); ++i) s += texts[i];
    return s + tail_text;
  }
};

class Runs {
 public:
  EngineEventCallback callback(RequestId id) {
    return [this, id](const EngineEvent& ev) {
      std::lock_guard<std::mutex> lk(mu_);
      Events& r = runs_[id];
      EXPECT_FALSE(r.finished) << "an event after the finished event of request " << id;
      if (ev.has_token) {
        r.tokens.push_back(ev.token);
        r.texts.push_back(ev.text);
        r.logprobs.push_back(ev.sample.logprob);
      } else {
        r.tail_text += ev.text;
      }
      if (ev.finished) {
        r.finished = true;
        r.reason = ev.finish_reason;
        r.stop_string = ev.stop_string;
        r.error = ev.error;
        r.prompt_tokens = ev.prompt_tokens;
        r.cached_prompt_tokens = ev.cached_prompt_tokens;
        r.generated_tokens = ev.generated_tokens;
        cv_.notify_all();
      }
    };
  }
  Events wait(RequestId id) {
    std::unique_lock<std::mutex> lk(mu_);
    EXPECT_TRUE(cv_.wait_for(lk, 60s, [&] { return runs_[id].finished; }))
        << "request " << id << " did not finish";
    return runs_[id];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, Events> runs_;
};

EngineRequest request(RequestId id, const std::vector<int32_t>& prompt, const SamplingParams& p) {
  EngineRequest r;
  r.id = id;
  r.prompt = prompt;
  r.params = p;
  return r;
}

class ResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    m_ = ModelUnderTest::load(synth_path());
    ASSERT_TRUE(m_.file);
    EngineLoopOptions o;
    o.block_size = 16;
    o.num_blocks = 512;
    o.scheduler.max_tokens_per_step = 40;  // longer known prefixes are chunked
    o.scheduler.max_num_seqs = 64;
    engine_ = m_.engine(o);
    ASSERT_TRUE(engine_);
  }
  static void TearDownTestSuite() { remove_synth_dir(); }

  Events run(const std::vector<int32_t>& prompt, const SamplingParams& p,
          std::vector<int32_t> resume = {}) {
    const RequestId id = next_id_++;
    EngineRequest r = request(id, prompt, p);
    r.resume_tokens = std::move(resume);
    const Status st = engine_->submit(std::move(r), runs_.callback(id));
    EXPECT_TRUE(st.ok()) << st.to_string();
    if (!st.ok()) return Events{};
    return runs_.wait(id);
  }

  // Where resume points fell: after a token whose text the reference held back (a token event
  // without text), and among those, inside a multi-byte UTF-8 character (the text released
  // next starts with a continuation of it: a byte >= 0x80).
  struct Splits {
    int held = 0;
    int utf8 = 0;
  };

  // Resumes the request after every k in [0, n) of the reference's n tokens, all at once on one
  // engine, and checks each against the reference's rest.
  Splits check_every_resume_point(const std::string& what, const std::vector<int32_t>& prompt,
                               const SamplingParams& p, const Events& ref) {
    EXPECT_TRUE(ref.finished && ref.error.ok()) << what << ": " << ref.error.to_string();
    const size_t n = ref.tokens.size();
    std::vector<RequestId> ids;
    for (size_t k = 0; k < n; ++k) {
      const RequestId id = next_id_++;
      EngineRequest r = request(id, prompt, p);
      r.resume_tokens.assign(ref.tokens.begin(), ref.tokens.begin() + static_cast<long>(k));
      const Status st = engine_->submit(std::move(r), runs_.callback(id));
      EXPECT_TRUE(st.ok()) << what << " k=" << k << ": " << st.to_string();
      ids.push_back(st.ok() ? id : 0);
    }
    Splits splits;
    for (size_t k = 0; k < n; ++k) {
      if (ids[k] == 0) continue;
      const Events got = runs_.wait(ids[k]);
      const std::string at = fmt::format("{}, resumed after {} of {} tokens", what, k, n);
      EXPECT_TRUE(got.error.ok()) << at << ": " << got.error.to_string();
      EXPECT_EQ(got.tokens, std::vector<int32_t>(ref.tokens.begin() + static_cast<long>(k),
                                                 ref.tokens.end()))
          << at;
      EXPECT_EQ(got.text_from(0), ref.text_from(k)) << at;
      EXPECT_EQ(got.logprobs, std::vector<float>(ref.logprobs.begin() + static_cast<long>(k),
                                                 ref.logprobs.end()))
          << at;
      EXPECT_EQ(got.reason, ref.reason) << at;
      EXPECT_EQ(got.stop_string, ref.stop_string) << at;
      // Usage: the whole request.
      EXPECT_EQ(got.generated_tokens, ref.generated_tokens) << at;
      EXPECT_EQ(got.prompt_tokens, static_cast<int64_t>(prompt.size())) << at;
      EXPECT_LE(got.cached_prompt_tokens, got.prompt_tokens) << at;
      if (k > 0 && ref.texts[k - 1].empty()) {
        ++splits.held;
        const std::string next = ref.text_from(k);
        if (!next.empty() && static_cast<unsigned char>(next[0]) >= 0x80) ++splits.utf8;
      }
    }
    return splits;
  }

  ModelUnderTest m_;
  std::unique_ptr<EngineLoop> engine_;
  Runs runs_;
  RequestId next_id_ = 1;
};

TEST_F(ResumeTest, GreedyWithPenaltiesAndLogprobsResumesAtEveryToken) {
  std::mt19937 rng(3);
  for (int c = 0; c < 3; ++c) {
    const auto prompt = random_prompt(rng, *m_.tok, 512, 5 + 30 * c);  // 5, 35, 65 tokens
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = 24;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.3f;
    p.repetition_penalty = 1.2f;
    p.logprobs = 2;
    const Events ref = run(prompt, p);
    ASSERT_EQ(ref.tokens.size(), 24u);
    (void)check_every_resume_point(fmt::format("greedy case {}", c), prompt, p, ref);
  }
  expect_all_blocks_back(*engine_);
}

TEST_F(ResumeTest, SeededWithMinTokensResumesAtEveryToken) {
  std::mt19937 rng(5);
  for (int c = 0; c < 3; ++c) {
    const auto prompt = random_prompt(rng, *m_.tok, 512, 3 + 20 * c);
    SamplingParams p;
    p.temperature = 0.9f;
    p.top_p = 0.95f;
    p.top_k = 40;
    p.seed = 1000 + static_cast<uint64_t>(c);
    p.max_tokens = 28;
    p.min_tokens = 10;  // suppression of end ids counts the resumed tokens too
    p.presence_penalty = 0.4f;
    p.repetition_penalty = 1.1f;
    const Events ref = run(prompt, p);
    ASSERT_FALSE(ref.tokens.empty());
    (void)check_every_resume_point(fmt::format("seeded case {}", c), prompt, p, ref);
  }
  expect_all_blocks_back(*engine_);
}

TEST_F(ResumeTest, StopStringSplitByTheResumePointStillMatches) {
  std::mt19937 rng(9);
  int held_splits = 0;
  int stopped = 0;
  for (int c = 0; c < 4; ++c) {
    const auto prompt = random_prompt(rng, *m_.tok, 512, 4 + 11 * c);
    SamplingParams p;
    p.temperature = 0.8f;
    p.seed = 77 + static_cast<uint64_t>(c);
    p.max_tokens = 30;
    p.ignore_eos = true;
    const Events free_run = run(prompt, p);
    // A stop string made of the end of one token's text and the start of a later one's, so that
    // the tokens between are held back while it may still match.
    std::string text;
    std::vector<size_t> ends;  // where each token's text ends in `text`
    for (const std::string& t : free_run.texts) ends.push_back((text += t).size());
    if (ends.size() < 12) continue;
    const size_t from = ends[5] - 1, to = std::min(ends[8] + 1, text.size());
    if (to <= from + 2) continue;
    p.stop = {text.substr(from, to - from)};
    const Events ref = run(prompt, p);
    ASSERT_TRUE(ref.error.ok()) << ref.error.to_string();
    if (ref.reason == FinishReason::kStop && !ref.stop_string.empty()) ++stopped;
    held_splits += check_every_resume_point(fmt::format("stop case {}", c), prompt, p, ref).held;
  }
  EXPECT_GT(stopped, 0) << "no case stopped at its stop string";
  EXPECT_GT(held_splits, 0) << "no resume point fell inside held-back text";
  expect_all_blocks_back(*engine_);
}

TEST_F(ResumeTest, AResumePointInsideAMultiByteCharacterLosesNothing) {
  // Seeded runs at a high temperature draw byte tokens (<0xE2> ...) now and then; their UTF-8
  // is held back until the character is whole.
  std::mt19937 rng(13);
  int utf8_splits = 0;
  for (int c = 0; c < 12 && utf8_splits == 0; ++c) {
    const auto prompt = random_prompt(rng, *m_.tok, 512, 4 + c);
    SamplingParams p;
    p.temperature = 1.5f;
    p.seed = 500 + static_cast<uint64_t>(c);
    p.max_tokens = 40;
    p.ignore_eos = true;
    utf8_splits +=
        check_every_resume_point(fmt::format("utf-8 case {}", c), prompt, p, run(prompt, p)).utf8;
  }
  EXPECT_GT(utf8_splits, 0) << "no resume point fell inside a multi-byte character";
  expect_all_blocks_back(*engine_);
}

TEST_F(ResumeTest, StoriesTextResumesByteForByte) {
  const ModelUnderTest stories = ModelUnderTest::load(stories_path());
  if (!stories.file) GTEST_SKIP() << "no " << stories_path();
  EngineLoopOptions o;
  o.block_size = 16;
  o.num_blocks = 256;
  o.scheduler.max_tokens_per_step = 64;
  o.scheduler.max_num_seqs = 64;
  engine_ = stories.engine(o);
  ASSERT_TRUE(engine_);
  const std::vector<int32_t> prompt{stories.tok->bos_id()};
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 60;
  p.stop = {"park."};  // the golden text's first sentence ends "in the park."
  const Events ref = run(prompt, p);
  ASSERT_EQ(ref.reason, FinishReason::kStop);
  ASSERT_EQ(ref.stop_string, "park.");
  (void)check_every_resume_point("stories greedy", prompt, p, ref);
  SamplingParams seeded = p;
  seeded.stop.clear();
  seeded.temperature = 1.0f;
  seeded.seed = 42;
  (void)check_every_resume_point("stories seeded", prompt, seeded, run(prompt, seeded));
  expect_all_blocks_back(*engine_);
}

TEST_F(ResumeTest, BadResumeTokensAreRefused) {
  const std::vector<int32_t> prompt{m_.tok->bos_id(), 7, 8};
  SamplingParams p;
  p.max_tokens = 4;
  const auto submit = [&](std::vector<int32_t> resume, bool prefilled = false) {
    EngineRequest r = request(next_id_++, prompt, p);
    r.resume_tokens = std::move(resume);
    r.prefilled = prefilled;
    return engine_->submit(std::move(r), [](const EngineEvent&) {});
  };
  EXPECT_EQ(submit({5, 512}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(submit({5, -1}).code(), StatusCode::kInvalidArgument);
  // max_tokens already reached: nothing left to generate.
  EXPECT_EQ(submit({5, 6, 7, 8}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(submit({5, 6, 7}, /*prefilled=*/true).code(), StatusCode::kInvalidArgument);
  // The known prefix must fit the context (512).
  p.max_tokens = 1000;
  EXPECT_EQ(submit(std::vector<int32_t>(510, 9)).code(), StatusCode::kOutOfRange);
  // The last position of the context is left for one more token: it ends with kLength.
  const Events last = run(prompt, p, std::vector<int32_t>(509, 9));
  EXPECT_TRUE(last.error.ok()) << last.error.to_string();
  EXPECT_EQ(last.tokens.size(), 1u);
  EXPECT_EQ(last.reason, FinishReason::kLength);
  EXPECT_EQ(last.generated_tokens, 510);
  expect_all_blocks_back(*engine_);
}

}  // namespace
}  // namespace cleave
