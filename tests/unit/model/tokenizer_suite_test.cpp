// Runs every llama.cpp tokenizer suite in ../shared/tokenizer-suite through the library (the
// ctest in tests/tokenizer_suite.cmake does the same through `cleave tokenize`).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cleave/model/gguf.h"
#include "cleave/model/tokenizer.h"

namespace cleave {
namespace {

// CLEAVE_TOKENIZER_SUITE_DIR overrides the location (another copy of the suite files).
std::string suite_dir() {
  if (const char* dir = std::getenv("CLEAVE_TOKENIZER_SUITE_DIR"); dir != nullptr && *dir != 0)
    return dir;
  return std::string(CLEAVE_SOURCE_DIR) + "/../shared/tokenizer-suite";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> split_cases(const std::string& content) {
  std::vector<std::string> cases;
  const std::string sep = "\n__ggml_vocab_test__\n";
  size_t pos = 0;
  while (pos < content.size()) {
    size_t p = content.find(sep, pos);
    if (p == std::string::npos) {
      cases.push_back(content.substr(pos));
      break;
    }
    cases.push_back(content.substr(pos, p - pos));
    pos = p + sep.size();
  }
  return cases;
}

class TokenizerSuite : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerSuite, MatchesExpectedIds) {
  const std::string base = suite_dir() + "/ggml-vocab-" + GetParam() + ".gguf";
  if (!std::filesystem::exists(base)) GTEST_SKIP() << "no tokenizer suite at " << base;
  auto gguf = GgufFile::open(base);
  ASSERT_TRUE(gguf.ok()) << gguf.status().to_string();
  auto spec = tokenizer_spec_from_gguf(*gguf);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  auto tok = Tokenizer::create(*spec);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  auto cases = split_cases(slurp(base + ".inp"));
  std::istringstream expected(slurp(base + ".out"));
  size_t matched = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string want;
    ASSERT_TRUE(std::getline(expected, want)) << "fewer .out lines than cases";
    std::string got;
    for (int32_t id : (*tok)->encode(cases[i], {})) got += " " + std::to_string(id);
    EXPECT_EQ(got, want) << "case " << i << ": '" << cases[i] << "'";
    if (got == want) {
      ++matched;
      // Decoding gives the text back (these inputs are valid UTF-8; SentencePiece's decode
      // drops exactly the space its encode added).
      EXPECT_EQ((*tok)->decode((*tok)->encode(cases[i], {})), cases[i]) << "decode of case " << i;
    }
  }
  std::string extra;
  EXPECT_FALSE(std::getline(expected, extra)) << "more .out lines than cases";
  EXPECT_EQ(matched, cases.size());
}

INSTANTIATE_TEST_SUITE_P(All, TokenizerSuite,
                         ::testing::Values("llama-spm", "phi-3", "gpt-2", "starcoder",
                                           "deepseek-coder", "falcon"));

}  // namespace
}  // namespace cleave
