// SentencePiece-style tokenizer on stories260K's vocabulary, the GGUF spec reader, streaming
// decode, and the tokenizer.json round trip.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <random>
#include <sstream>

#include "cleave/model/tokenizer_json.h"
#include "tokenizer_test_util.h"

namespace cleave {
namespace {

using testing_tok::make;

#define REQUIRE_STORIES(spec)                                                        \
  TokenizerSpec spec = testing_tok::stories_spec();                                  \
  if (spec.tokens.empty()) GTEST_SKIP() << "no " << testing_tok::stories_path();

std::string reference_text() {
  std::ifstream in(std::string(CLEAVE_SOURCE_DIR) + "/../shared/models/stories260K-empty.txt");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(TokenizerSpm, GgufSpecFields) {
  REQUIRE_STORIES(spec);
  EXPECT_EQ(spec.model, "llama");
  EXPECT_EQ(spec.tokens.size(), 512u);
  EXPECT_EQ(spec.scores.size(), 512u);
  EXPECT_EQ(spec.token_types.size(), 512u);
  EXPECT_EQ(spec.bos_id, 1);
  EXPECT_EQ(spec.eos_id, 2);
  EXPECT_EQ(spec.unk_id, 0);
  EXPECT_TRUE(spec.add_bos);
  EXPECT_TRUE(spec.add_space_prefix);
}

TEST(TokenizerSpm, EncodeDecode) {
  REQUIRE_STORIES(spec);
  auto tok = make(spec);
  ASSERT_TRUE(tok);
  auto ids = tok->encode("Once upon a time", {.add_bos = true});
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(tok->token_to_piece(ids[1]), " Once");
  EXPECT_EQ(tok->decode(ids), "Once upon a time");
  const std::string ref = reference_text();
  if (!ref.empty()) EXPECT_EQ(tok->decode(tok->encode(ref, {.add_bos = true})), ref);
  // Characters outside the vocabulary fall back to byte tokens.
  auto jp = tok->encode("日本", {});
  for (int32_t id : jp) EXPECT_TRUE(spec.token_types[id] == TokenType::kByte || spec.tokens[id] == "▁");
  EXPECT_EQ(tok->decode(jp), "日本");
  // Invalid UTF-8 never crashes and comes back byte for byte.
  std::mt19937 rng(3);
  for (int round = 0; round < 100; ++round) {
    std::string s(rng() % 40, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    // U+2581 itself is SentencePiece's space: it decodes as ' ' (a known lossy spot).
    for (size_t p; (p = s.find("\xE2\x96\x81")) != std::string::npos;) s.erase(p, 3);
    EXPECT_EQ(tok->decode(tok->encode(s, {})), s);
  }
  // Control text is not parsed unless asked.
  EXPECT_NE(tok->encode("<s>", {}), std::vector<int32_t>{1});
  EXPECT_EQ(tok->encode("<s>", {.parse_special = true}), std::vector<int32_t>{1});
}

TEST(TokenizerSpm, StreamDecoderHoldsIncompleteUtf8) {
  REQUIRE_STORIES(spec);
  auto tok = make(spec);
  ASSERT_TRUE(tok);
  auto ids = tok->encode("a 日本 b", {.add_bos = true});
  StreamDecoder dec(*tok);
  std::string streamed;
  for (int32_t id : ids) {
    std::string part = dec.push(id);
    // Every chunk is valid UTF-8 on its own: no split sequences.
    for (unsigned char c : part.substr(0, 1)) EXPECT_FALSE((c & 0xC0) == 0x80) << part;
    streamed += part;
  }
  streamed += dec.flush();
  EXPECT_EQ(streamed, "a 日本 b");
  // A sequence that can never complete becomes U+FFFD at flush.
  StreamDecoder dec2(*tok);
  auto e6 = tok->encode("\xE6", {});  // first byte of a 3-byte character
  std::string out;
  for (int32_t id : e6) out += dec2.push(id);
  EXPECT_EQ(out, "");
  EXPECT_EQ(dec2.flush(), "\xEF\xBF\xBD");
}

TEST(TokenizerSpm, MalformedSpecsAreRefused) {
  REQUIRE_STORIES(spec);
  {
    auto s = spec;
    s.tokens[3 + 0x41] = "not-a-byte";  // <0x41> missing
    auto t = Tokenizer::create(s);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("<0x41>"), std::string::npos) << t.status().message();
  }
  {
    auto s = spec;
    s.scores.resize(10);
    EXPECT_FALSE(Tokenizer::create(s).ok());
  }
  {
    auto s = spec;
    s.eos_id = 600;
    EXPECT_FALSE(Tokenizer::create(s).ok());
  }
}

TEST(TokenizerSpm, LargeInputIsFast) {
  REQUIRE_STORIES(spec);
  auto tok = make(spec);
  ASSERT_TRUE(tok);
  std::string text;
  while (text.size() < 100 * 1024) text += "Lily went to the park. She saw a big dog! 日本 ";
  auto t0 = std::chrono::steady_clock::now();
  auto ids = tok->encode(text, {});
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 3.0);
  EXPECT_EQ(tok->decode(ids), text);
  const std::string one_word(100 * 1024, 'a');
  t0 = std::chrono::steady_clock::now();
  ids = tok->encode(one_word, {});
  secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 3.0);
  EXPECT_EQ(tok->decode(ids), one_word);
}

std::vector<std::string> round_trip_texts() {
  std::vector<std::string> texts = {"",
                                    " ",
                                    "  Hello  world ",
                                    "Once upon a time, there was a little girl named Lily.",
                                    "日本語 and émojis 🦙 \t\n tabs",
                                    "it's 1234567 'RE you sure?",
                                    "\xff\xfe broken \xc3"};
  texts.push_back(reference_text());
  return texts;
}

void expect_round_trip(const TokenizerSpec& spec, const std::string& dir) {
  ASSERT_TRUE(write_hf_tokenizer(spec, dir).ok());
  auto back = tokenizer_spec_from_hf_dir(dir);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->model, spec.model);
  EXPECT_EQ(back->bos_id, spec.bos_id);
  EXPECT_EQ(back->eos_id, spec.eos_id);
  EXPECT_EQ(back->add_bos, spec.add_bos);
  EXPECT_EQ(back->add_space_prefix, spec.add_space_prefix);
  EXPECT_EQ(back->chat_template, spec.chat_template);
  auto a = make(spec);
  auto b = make(*back);
  ASSERT_TRUE(a && b);
  for (const auto& t : round_trip_texts()) {
    for (bool special : {false, true}) {
      EncodeOptions o{.add_bos = true, .parse_special = special};
      EXPECT_EQ(a->encode(t, o), b->encode(t, o)) << "'" << t << "'";
    }
  }
}

TEST(TokenizerJson, SpmRoundTrip) {
  REQUIRE_STORIES(spec);
  spec.chat_template = "{{ messages }}";
  expect_round_trip(spec, ::testing::TempDir() + "/cleave_tok_spm");
}

TEST(TokenizerJson, ByteLevelRoundTrip) {
  for (const char* pre : {"gpt-2", "llama-bpe", "deepseek-llm", "falcon"}) {
    auto spec = testing_tok::tiny_bpe_spec(pre);
    expect_round_trip(spec, ::testing::TempDir() + "/cleave_tok_bpe_" + pre);
  }
  // A suite vocabulary when an intact copy is available.
  const char* dir = std::getenv("CLEAVE_TOKENIZER_SUITE_DIR");
  std::string path = std::string(dir ? dir : std::string(CLEAVE_SOURCE_DIR) + "/../shared/tokenizer-suite") +
                     "/ggml-vocab-gpt-2.gguf";
  auto g = GgufFile::open(path);
  if (!g.ok()) return;
  auto spec = tokenizer_spec_from_gguf(*g);
  ASSERT_TRUE(spec.ok());
  expect_round_trip(*spec, ::testing::TempDir() + "/cleave_tok_gpt2");
}

TEST(TokenizerJson, ReadsHandWrittenFiles) {
  const std::string dir = ::testing::TempDir() + "/cleave_tok_hand";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/tokenizer.json") << R"({
      "added_tokens": [{"id": 5, "content": "<|end|>", "special": true}],
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
      "decoder": {"type": "ByteLevel"},
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "1": 3, "2": 4},
                "merges": [["a", "b"]]}})";
    std::ofstream(dir + "/tokenizer_config.json")
        << R"({"eos_token": {"content": "<|end|>"}, "chat_template": "T"})";
  }
  auto spec = tokenizer_spec_from_hf_dir(dir);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_EQ(spec->model, "gpt2");
  EXPECT_EQ(spec->pre, "custom");
  EXPECT_EQ(spec->merges, std::vector<std::string>{"a b"});
  EXPECT_EQ(spec->eos_id, 5);
  EXPECT_EQ(spec->chat_template, "T");
  EXPECT_EQ(spec->token_types[5], TokenType::kControl);
  // The spec is not usable (no byte alphabet), and says why.
  auto t = Tokenizer::create(*spec);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("byte-level"), std::string::npos);

  std::ofstream(dir + "/tokenizer.json") << R"({"model": {"type": "Unigram", "vocab": []}})";
  auto bad = tokenizer_spec_from_hf_dir(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("Unigram"), std::string::npos);
  std::ofstream(dir + "/tokenizer.json") << "{ not json";
  EXPECT_FALSE(tokenizer_spec_from_hf_dir(dir).ok());
  EXPECT_FALSE(tokenizer_spec_from_hf_dir(dir + "/missing").ok());
}

}  // namespace
}  // namespace cleave
