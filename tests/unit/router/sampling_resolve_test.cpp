// resolve_sampling_params: context length, default max_tokens, min_tokens, seeds, and the
// SamplingParams::validate backstop.
#include <set>

#include <gtest/gtest.h>

#include "cleave/router/openai_request.h"

namespace cleave::openai {
namespace {

SamplingFields fields_with_max(std::optional<int32_t> max_tokens) {
  SamplingFields f;
  f.max_tokens = max_tokens;
  return f;
}

TEST(SamplingResolveTest, DefaultMaxTokensPerEndpoint) {
  auto comp = resolve_sampling_params(fields_with_max({}), Endpoint::kCompletions, 10, 512, 0, 9);
  ASSERT_TRUE(comp.ok());
  EXPECT_EQ(comp->max_tokens, 16);  // OpenAI's completions default
  auto chat =
      resolve_sampling_params(fields_with_max({}), Endpoint::kChatCompletions, 10, 512, 0, 9);
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ(chat->max_tokens, 502);  // all the room left
  // The completions default is capped at the room left.
  auto tight = resolve_sampling_params(fields_with_max({}), Endpoint::kCompletions, 500, 512, 0, 9);
  ASSERT_TRUE(tight.ok());
  EXPECT_EQ(tight->max_tokens, 12);
  auto exact = resolve_sampling_params(fields_with_max(12), Endpoint::kCompletions, 500, 512, 0, 9);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->max_tokens, 12);
}

TEST(SamplingResolveTest, ContextLengthExceeded) {
  auto over = resolve_sampling_params(fields_with_max(13), Endpoint::kChatCompletions, 500, 512,
                                      0, 9);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.error().http_status, 400);
  EXPECT_EQ(over.error().code, "context_length_exceeded");
  EXPECT_EQ(over.error().param, "messages");
  EXPECT_NE(over.error().message.find("maximum context length is 512 tokens"), std::string::npos);
  EXPECT_NE(over.error().message.find("you requested 513 tokens (500 in the messages, 13 in the "
                                      "completion)"),
            std::string::npos)
      << over.error().message;

  auto full = resolve_sampling_params(fields_with_max({}), Endpoint::kCompletions, 512, 512, 0, 9);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, "context_length_exceeded");
  EXPECT_EQ(full.error().param, "prompt");
  EXPECT_NE(full.error().message.find("your prompt resulted in 512 tokens"), std::string::npos)
      << full.error().message;

  auto both = resolve_sampling_params(fields_with_max(5), Endpoint::kCompletions, 600, 512, 0, 9);
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.error().message.find("(600 in your prompt; 5 for the completion)"),
            std::string::npos)
      << both.error().message;
}

TEST(SamplingResolveTest, MinTokensAgainstTheResolvedMaximum) {
  SamplingFields f;
  f.params.min_tokens = 20;
  auto r = resolve_sampling_params(f, Endpoint::kCompletions, 10, 512, 0, 9);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().param, "min_tokens");
  EXPECT_NE(r.error().message.find("max_tokens = 16, the default"), std::string::npos)
      << r.error().message;
  f.max_tokens = 30;
  EXPECT_TRUE(resolve_sampling_params(f, Endpoint::kCompletions, 10, 512, 0, 9).ok());
}

TEST(SamplingResolveTest, SeedsAndOtherParamsCarryOver) {
  SamplingFields f;
  f.params.temperature = 0.7f;
  f.params.stop = {"x"};
  auto assigned = resolve_sampling_params(f, Endpoint::kChatCompletions, 1, 64, 0, 1234);
  ASSERT_TRUE(assigned.ok());
  EXPECT_EQ(assigned->seed, 1234u);
  EXPECT_FLOAT_EQ(assigned->temperature, 0.7f);
  EXPECT_EQ(assigned->stop, std::vector<std::string>{"x"});
  f.seed = 42;
  auto own = resolve_sampling_params(f, Endpoint::kChatCompletions, 1, 64, 0, 1234);
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->seed, 42u);
}

TEST(SamplingResolveTest, ValidateBackstopWithTheVocabulary) {
  // Parsed without a vocabulary size, checked once the model is known.
  SamplingFields f;
  f.params.stop_token_ids = {3, 600};
  auto r = resolve_sampling_params(f, Endpoint::kCompletions, 1, 64, 512, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().http_status, 400);
  EXPECT_EQ(r.error().param, "stop_token_ids");
  EXPECT_NE(r.error().message.find("600"), std::string::npos);
  EXPECT_TRUE(resolve_sampling_params(f, Endpoint::kCompletions, 1, 64, 0, 0).ok());
}

TEST(SamplingResolveTest, ChoiceSeedsDifferAndAreStable) {
  EXPECT_EQ(choice_seed(99, 0), 99u);
  std::set<uint64_t> seen;
  for (int i = 0; i < 16; ++i) seen.insert(choice_seed(99, i));
  EXPECT_EQ(seen.size(), 16u);
  EXPECT_EQ(choice_seed(99, 5), choice_seed(99, 5));
  EXPECT_NE(choice_seed(99, 5), choice_seed(100, 5));
}

}  // namespace
}  // namespace cleave::openai
