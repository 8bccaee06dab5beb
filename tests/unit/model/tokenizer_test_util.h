// Helpers for the tokenizer tests: a small synthetic byte-level BPE vocabulary and the
// stories260K model's SentencePiece vocabulary from ../shared.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cleave/model/gguf.h"
#include "cleave/model/tokenizer.h"

namespace cleave::testing_tok {

inline std::string stories_path() {
  return std::string(CLEAVE_SOURCE_DIR) + "/../shared/models/stories260K.gguf";
}

// Loads stories260K's tokenizer spec; empty model when ../shared is absent.
inline TokenizerSpec stories_spec() {
  if (!std::filesystem::exists(stories_path())) return {};
  auto g = GgufFile::open(stories_path());
  EXPECT_TRUE(g.ok()) << g.status().to_string();
  if (!g.ok()) return {};
  auto s = tokenizer_spec_from_gguf(*g);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? *s : TokenizerSpec{};
}

// GPT-2's byte alphabet (256 tokens) + a few merges + special tokens.
inline TokenizerSpec tiny_bpe_spec(const std::string& pre = "gpt-2") {
  TokenizerSpec s;
  s.model = "gpt2";
  s.pre = pre;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    static int extra = 0;
    if (b == 0) extra = 0;
    uint32_t cp = printable ? b : 256 + extra++;
    std::string t;
    if (cp < 0x80) t.push_back(static_cast<char>(cp));
    else { t.push_back(static_cast<char>(0xC0 | (cp >> 6))); t.push_back(static_cast<char>(0x80 | (cp & 0x3F))); }
    s.tokens.push_back(t);
  }
  // "Ġ" is U+0120 (space), "Ċ" U+010A (newline).
  const char* merges[] = {"h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l",
                          "Ġworl d", "Ġ Ġ"};
  for (const char* m : merges) {
    std::string a(m, std::string(m).find(' ')), b(std::string(m).substr(a.size() + 1));
    s.merges.push_back(m);
    s.tokens.push_back(a + b);
  }
  s.tokens.push_back("<|endoftext|>");
  s.tokens.push_back("<|im_end|>");
  s.tokens.push_back("<tool>");
  s.token_types.assign(s.tokens.size(), TokenType::kNormal);
  const int32_t n = static_cast<int32_t>(s.tokens.size());
  s.token_types[n - 3] = TokenType::kControl;
  s.token_types[n - 2] = TokenType::kControl;
  s.token_types[n - 1] = TokenType::kUserDefined;
  s.bos_id = n - 3;
  s.eos_id = n - 3;
  s.eot_ids = {n - 2};
  s.add_bos = false;
  s.add_space_prefix = false;
  return s;
}

inline std::unique_ptr<Tokenizer> make(const TokenizerSpec& s) {
  auto t = Tokenizer::create(s);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? std::move(*t) : nullptr;
}

}  // namespace cleave::testing_tok
