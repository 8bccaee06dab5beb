// TokenFinisher on a small byte-level BPE vocabulary: end ids, suppression before min_tokens,
// max_tokens and a full context, stop strings (also across a replayed token and in the text
// flushed at the end), and held-back UTF-8.
#include "cleave/engine/token_finisher.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../model/tokenizer_test_util.h"

namespace cleave {
namespace {

// tiny_bpe_spec: a printable ASCII byte is its own id ('a' = 97); 0xC3 and 0xA9 are ids 195 and
// 169; <|endoftext|> (BOS and EOS) is 266, <|im_end|> (end of turn) 267.
constexpr int32_t kEos = 266;
constexpr int32_t kEot = 267;
constexpr int32_t kA = 'a', kB = 'b', kC = 'c', kX = 'x';
const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD

class TokenFinisherTest : public testing::Test {
 protected:
  void SetUp() override {
    tok_ = testing_tok::make(testing_tok::tiny_bpe_spec());
    ASSERT_TRUE(tok_);
    eos_ = TokenFinisher::end_of_generation_ids(*tok_, tok_->vocab_size());
  }
  TokenFinisher make(const SamplingParams& p, int32_t last_prompt_token = kEos) const {
    return TokenFinisher(*tok_, p, eos_, last_prompt_token);
  }
  std::unique_ptr<Tokenizer> tok_;
  std::vector<int32_t> eos_;
};

std::vector<int32_t> ids(std::span<const int32_t> s) { return {s.begin(), s.end()}; }

TEST_F(TokenFinisherTest, EndOfGenerationIdsWithinTheModelsVocabulary) {
  EXPECT_EQ(eos_, (std::vector<int32_t>{kEos, kEot}));
  EXPECT_EQ(TokenFinisher::end_of_generation_ids(*tok_, kEot), (std::vector<int32_t>{kEos}));
}

TEST_F(TokenFinisherTest, EndTokenStopsWithoutItsText) {
  SamplingParams p;
  TokenFinisher f = make(p);
  TokenFinisher::Outcome a = f.push(kA, 1, false);
  EXPECT_EQ(a.text, "a");
  EXPECT_FALSE(a.finished);
  TokenFinisher::Outcome end = f.push(kEot, 2, false);
  EXPECT_TRUE(end.finished);
  EXPECT_EQ(end.finish_reason, FinishReason::kStop);
  EXPECT_EQ(end.text, "");
  EXPECT_EQ(end.stop_string, "");
}

TEST_F(TokenFinisherTest, StopTokenIdsEndAndIgnoreEosDropsOnlyTheEosIds) {
  SamplingParams p;
  p.stop_token_ids = {kX};
  p.ignore_eos = true;
  TokenFinisher f = make(p);
  EXPECT_FALSE(f.push(kEos, 1, false).finished) << "EOS is ignored";
  TokenFinisher::Outcome x = f.push(kX, 2, false);
  EXPECT_TRUE(x.finished);
  EXPECT_EQ(x.finish_reason, FinishReason::kStop);
  EXPECT_EQ(x.text, "") << "a stop token's text is not output";
}

TEST_F(TokenFinisherTest, EndIdsAreSuppressedBeforeMinTokens) {
  SamplingParams p;
  p.min_tokens = 2;
  p.stop_token_ids = {kX};
  TokenFinisher f = make(p);
  EXPECT_EQ(ids(f.suppressed(0)), (std::vector<int32_t>{kX, kEos, kEot}));
  EXPECT_EQ(ids(f.suppressed(1)), (std::vector<int32_t>{kX, kEos, kEot}));
  EXPECT_TRUE(f.suppressed(2).empty());
  p.ignore_eos = true;
  EXPECT_EQ(ids(make(p).suppressed(0)), (std::vector<int32_t>{kX}));
  p.stop_token_ids = {kEos};  // listed once, though it is also an EOS id
  p.ignore_eos = false;
  EXPECT_EQ(ids(make(p).suppressed(0)), (std::vector<int32_t>{kEos, kEot}));
}

TEST_F(TokenFinisherTest, MaxTokensAndAFullContextEndWithLength) {
  SamplingParams p;
  p.max_tokens = 2;
  TokenFinisher f = make(p);
  EXPECT_FALSE(f.push(kA, 1, false).finished);
  TokenFinisher::Outcome last = f.push(kB, 2, false);
  EXPECT_TRUE(last.finished);
  EXPECT_EQ(last.finish_reason, FinishReason::kLength);
  EXPECT_EQ(last.text, "b");
  TokenFinisher g = make(p);
  TokenFinisher::Outcome full = g.push(kA, 1, true);
  EXPECT_TRUE(full.finished);
  EXPECT_EQ(full.finish_reason, FinishReason::kLength);
  EXPECT_EQ(full.text, "a");
}

TEST_F(TokenFinisherTest, StopStringIsCutAndHeldTextIsFlushedAtTheEnd) {
  SamplingParams p;
  p.stop = {"bc"};
  TokenFinisher f = make(p);
  EXPECT_EQ(f.push(kA, 1, false).text, "a");
  EXPECT_EQ(f.push(kB, 2, false).text, "") << "'b' may start the stop string";
  TokenFinisher::Outcome c = f.push(kC, 3, false);
  EXPECT_TRUE(c.finished);
  EXPECT_EQ(c.finish_reason, FinishReason::kStop);
  EXPECT_EQ(c.stop_string, "bc");
  EXPECT_EQ(c.text, "");

  p.max_tokens = 2;
  TokenFinisher g = make(p);
  EXPECT_EQ(g.push(kA, 1, false).text, "a");
  TokenFinisher::Outcome last = g.push(kB, 2, false);
  EXPECT_TRUE(last.finished);
  EXPECT_EQ(last.finish_reason, FinishReason::kLength);
  EXPECT_EQ(last.text, "b") << "the held-back 'b' is flushed";
}

TEST_F(TokenFinisherTest, IncompleteUtf8IsHeldThenCompletedOrFlushed) {
  SamplingParams p;
  TokenFinisher f = make(p);
  EXPECT_EQ(f.push(0xC3, 1, false).text, "");
  EXPECT_EQ(f.push(0xA9, 2, false).text, "\xC3\xA9");
  TokenFinisher g = make(p);
  EXPECT_EQ(g.push(0xC3, 1, false).text, "");
  TokenFinisher::Outcome end = g.push(kEos, 2, false);
  EXPECT_TRUE(end.finished);
  EXPECT_EQ(end.text, kReplacement);
}

TEST_F(TokenFinisherTest, StopStringInTheTextFlushedAtTheEnd) {
  SamplingParams p;
  p.stop = {kReplacement};
  TokenFinisher f = make(p);
  EXPECT_EQ(f.push(0xC3, 1, false).text, "");
  TokenFinisher::Outcome end = f.push(kEos, 2, false);
  EXPECT_TRUE(end.finished);
  EXPECT_EQ(end.finish_reason, FinishReason::kStop);
  EXPECT_EQ(end.stop_string, kReplacement);
  EXPECT_EQ(end.text, "");
}

TEST_F(TokenFinisherTest, PrimingTokenAndReplayedTokenAreNotOutput) {
  SamplingParams p;
  p.stop = {"ab"};
  TokenFinisher f = make(p, /*last_prompt_token=*/kA);
  EXPECT_EQ(f.push(kC, 1, false).text, "c") << "the prompt's last token only primes the decoder";
  TokenFinisher g = make(p);
  g.replay(kA);  // the first token, generated and sent by another worker
  TokenFinisher::Outcome b = g.push(kB, 2, false);
  EXPECT_TRUE(b.finished) << "the stop string spans the replayed token";
  EXPECT_EQ(b.finish_reason, FinishReason::kStop);
  EXPECT_EQ(b.stop_string, "ab");
  EXPECT_EQ(b.text, "");
}

}  // namespace
}  // namespace cleave
