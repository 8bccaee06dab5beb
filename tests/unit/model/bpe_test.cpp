// Byte-level BPE, special tokens, robustness and speed on a synthetic vocabulary.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "tokenizer_test_util.h"

namespace cleave {
namespace {

using testing_tok::make;
using testing_tok::tiny_bpe_spec;

int32_t id_of(const TokenizerSpec& s, const std::string& text) {
  for (size_t i = 0; i < s.tokens.size(); ++i)
    if (s.tokens[i] == text) return static_cast<int32_t>(i);
  return -1;
}

TEST(TokenizerBpe, MergesByRank) {
  auto spec = tiny_bpe_spec();
  auto tok = make(spec);
  ASSERT_TRUE(tok);
  auto ids = tok->encode("hello world", {});
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0], id_of(spec, "hello"));
  EXPECT_EQ(ids[1], id_of(spec, "Ġworld"));
  EXPECT_EQ(tok->decode(ids), "hello world");
  // Pre-tokenization keeps "hello" and "world" apart even without the space.
  ids = tok->encode("helloworld", {});
  EXPECT_EQ(ids.front(), id_of(spec, "hello"));
  EXPECT_EQ(tok->decode(ids), "helloworld");
}

TEST(TokenizerBpe, SpecialTokensOnlyWhenParsed) {
  auto spec = tiny_bpe_spec();
  auto tok = make(spec);
  ASSERT_TRUE(tok);
  const int32_t im_end = id_of(spec, "<|im_end|>");
  auto plain = tok->encode("hello<|im_end|>", {});
  EXPECT_EQ(std::count(plain.begin(), plain.end(), im_end), 0);
  auto parsed = tok->encode("hello<|im_end|>", {.parse_special = true});
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed[1], im_end);
  EXPECT_TRUE(tok->is_end_of_generation(im_end));
  EXPECT_TRUE(tok->is_control(im_end));
  EXPECT_EQ(tok->token_to_piece(im_end), "");
  EXPECT_EQ(tok->token_to_piece(im_end, true), "<|im_end|>");
  // User-defined tokens are always split out and decode to their text.
  auto user = tok->encode("a<tool>b", {});
  ASSERT_EQ(user.size(), 3u);
  EXPECT_EQ(user[1], id_of(spec, "<tool>"));
  EXPECT_EQ(tok->decode(user), "a<tool>b");
}

TEST(TokenizerBpe, BosAndEos) {
  auto spec = tiny_bpe_spec();
  auto tok = make(spec);
  ASSERT_TRUE(tok);
  auto ids = tok->encode("hello", {.add_bos = true, .add_eos = true});
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids.front(), spec.bos_id);
  EXPECT_EQ(ids.back(), spec.eos_id);
  EXPECT_TRUE(tok->encode("", {}).empty());
}

TEST(TokenizerBpe, ArbitraryBytesRoundTrip) {
  auto tok = make(tiny_bpe_spec());
  ASSERT_TRUE(tok);
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    EXPECT_EQ(tok->decode(tok->encode(s, {})), s) << "round " << round;
  }
  // Invalid UTF-8 in the middle of letters.
  std::string bad = "hel\xff\xfelo \xc3 w\xe2\x82orld\xf0";
  EXPECT_EQ(tok->decode(tok->encode(bad, {})), bad);
}

TEST(TokenizerBpe, EveryPreTokenizerHandlesMixedText) {
  const std::string text =
      "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～ ------======= нещо \t\n\n  x  ";
  for (const char* pre : {"default", "gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-v3",
                          "deepseek-coder", "falcon", "starcoder", "bloom", "viking", "tekken",
                          "gpt-4o", "seed-coder", "refact", "command-r", "smollm", "mpt"}) {
    auto tok = make(tiny_bpe_spec(pre));
    ASSERT_TRUE(tok) << pre;
    EXPECT_EQ(tok->decode(tok->encode(text, {})), text) << pre;
  }
}

TEST(TokenizerBpe, MalformedSpecsAreRefused) {
  {
    auto s = tiny_bpe_spec();
    s.merges.push_back("nope zzz");
    auto t = Tokenizer::create(s);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("'nope'"), std::string::npos) << t.status().message();
  }
  {
    auto s = tiny_bpe_spec();
    s.merges.push_back("nomerge");
    EXPECT_FALSE(Tokenizer::create(s).ok());
  }
  {
    auto s = tiny_bpe_spec();
    s.bos_id = static_cast<int32_t>(s.tokens.size());
    auto t = Tokenizer::create(s);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("BOS"), std::string::npos);
  }
  {
    auto s = tiny_bpe_spec();
    s.token_types.pop_back();
    EXPECT_FALSE(Tokenizer::create(s).ok());
  }
  {
    auto s = tiny_bpe_spec("no-such-pre");
    auto t = Tokenizer::create(s);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("no-such-pre"), std::string::npos);
  }
  {
    auto s = tiny_bpe_spec();
    s.tokens.erase(s.tokens.begin() + 1, s.tokens.begin() + 200);  // most byte tokens gone
    s.merges.clear();
    s.token_types.clear();
    s.bos_id = s.eos_id = -1;
    s.eot_ids.clear();
    EXPECT_FALSE(Tokenizer::create(s).ok());
  }
  {
    auto s = tiny_bpe_spec();
    s.model = "t5";
    EXPECT_FALSE(Tokenizer::create(s).ok());
  }
}

TEST(TokenizerBpe, LargeInputsAreFast) {
  auto tok = make(tiny_bpe_spec());
  ASSERT_TRUE(tok);
  std::string words;
  while (words.size() < 100 * 1024) words += "hello world, it's 2024! 你好 ";
  const std::string spaces(100 * 1024, ' ');
  const std::string letters(100 * 1024, 'x');
  const std::string newlines(100 * 1024, '\n');
  for (const std::string* s : std::vector<const std::string*>{&words, &spaces, &letters, &newlines}) {
    auto t0 = std::chrono::steady_clock::now();
    auto ids = tok->encode(*s, {});
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(secs, 3.0) << "encode of 100 KB took " << secs << " s";
    EXPECT_EQ(tok->decode(ids), *s);
  }
}

}  // namespace
}  // namespace cleave
