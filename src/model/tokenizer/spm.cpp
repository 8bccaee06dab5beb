// SentencePiece-style tokenizer (GGUF model "llama"), as llama.cpp's llm_tokenizer_spm: the text
// (with a leading space when add_space_prefix, spaces as U+2581) is split into UTF-8 characters,
// then the adjacent pair whose concatenation is the vocabulary entry with the highest score is
// merged, repeatedly (ties: leftmost first). Characters that end up in no token become byte
// tokens <0xNN> (or the unknown token when the vocabulary has no byte tokens).
#include <fmt/format.h>

#include <cstdio>
#include <queue>

#include "tokenizer_impl.h"
#include "unicode.h"

namespace cleave::tok {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581

class SpmTokenizer final : public TokenizerBase {
 public:
  explicit SpmTokenizer(TokenizerSpec spec) : TokenizerBase(std::move(spec)) {}

  Status init() {
    CLEAVE_RETURN_IF_ERROR(init_common());
    int found = 0;
    std::string missing;
    for (int b = 0; b < 256; ++b) {
      int32_t id = find_token(byte_token_text(static_cast<uint8_t>(b)));
      byte_tokens_[b] = id;
      if (id >= 0) ++found;
      else if (missing.empty()) missing = byte_token_text(static_cast<uint8_t>(b));
    }
    if (found == 0) {
      if (spec_.unk_id < 0)
        return InvalidArgument(
            "SentencePiece vocabulary has neither byte tokens <0x00>..<0xFF> nor an unknown "
            "token: text outside the vocabulary could not be encoded");
    } else if (found < 256) {
      return InvalidArgument(fmt::format(
          "SentencePiece vocabulary has {} of the 256 byte tokens; '{}' is missing", found,
          missing));
    }
    has_scores_ = !spec_.scores.empty();
    has_byte_tokens_ = found == 256;
    return Status::Ok();
  }

  std::string piece_text(int32_t id, const std::string& text) const override {
    switch (type_of(id)) {
      case TokenType::kByte: {
        unsigned v = 0;
        if (text.size() == 6 && std::sscanf(text.c_str(), "<0x%02X>", &v) == 1)
          return std::string(1, static_cast<char>(v));
        return text;
      }
      case TokenType::kUnknown: return "\xE2\x96\x85";  // U+2585, as llama.cpp renders it
      default: break;
    }
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      if (text.compare(i, kSpace.size(), kSpace) == 0) {
        out.push_back(' ');
        i += kSpace.size();
      } else {
        out.push_back(text[i++]);
      }
    }
    return out;
  }

 protected:
  void encode_fragment(std::string_view raw, bool after_special,
                       std::vector<int32_t>* out) const override {
    std::string text;
    text.reserve(raw.size() * 2 + 3);
    if (spec_.add_space_prefix && after_special) text.append(kSpace);
    for (char c : raw) {
      if (c == ' ') text.append(kSpace);
      else text.push_back(c);
    }
    if (text.empty()) return;

    struct Symbol {
      int prev, next;
      size_t start, len;  // bytes in text; len 0 once merged away
    };
    std::vector<Symbol> symbols;
    for (size_t off = 0; off < text.size();) {
      // One symbol per UTF-8 character; an invalid byte is a symbol of its own (llama.cpp
      // trusts the lead byte instead, which can swallow the U+2581 that follows it).
      size_t len = decode_utf8(text, off).len;
      int idx = static_cast<int>(symbols.size());
      symbols.push_back({idx - 1, off + len == text.size() ? -1 : idx + 1, off, len});
      off += len;
    }
    struct Bigram {
      float score;
      int left, right;
      size_t size;
    };
    auto worse = [](const Bigram& a, const Bigram& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
    auto try_add = [&](int left, int right) {
      if (left < 0 || right < 0) return;
      std::string_view pair(text.data() + symbols[left].start,
                            symbols[left].len + symbols[right].len);
      int32_t id = find_token(pair);
      if (id < 0) return;
      queue.push({has_scores_ ? spec_.scores[id] : 0.0f, left, right, pair.size()});
    };
    for (int i = 1; i < static_cast<int>(symbols.size()); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
      Bigram b = queue.top();
      queue.pop();
      Symbol& l = symbols[b.left];
      Symbol& r = symbols[b.right];
      if (l.len == 0 || r.len == 0 || l.len + r.len != b.size) continue;
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (r.next >= 0) symbols[r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    for (int i = 0; i != -1; i = symbols[i].next) {
      const Symbol& s = symbols[i];
      int32_t id = find_token(std::string_view(text.data() + s.start, s.len));
      if (id >= 0) {
        out->push_back(id);
        continue;
      }
      // Only single characters can be missing (every merge forms a vocabulary entry).
      if (!has_byte_tokens_) {
        out->push_back(spec_.unk_id);  // SentencePiece without byte fallback
        continue;
      }
      for (size_t k = 0; k < s.len; ++k) {
        int32_t byte_id = byte_tokens_[static_cast<unsigned char>(text[s.start + k])];
        out->push_back(byte_id >= 0 ? byte_id : spec_.unk_id);
      }
    }
  }

 private:
  int32_t byte_tokens_[256] = {};
  bool has_scores_ = false;
  bool has_byte_tokens_ = false;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> create_spm_tokenizer(const TokenizerSpec& spec) {
  auto t = std::make_unique<SpmTokenizer>(spec);
  CLEAVE_RETURN_IF_ERROR(t->init().with_context("SentencePiece tokenizer"));
  return std::unique_ptr<Tokenizer>(std::move(t));
}

}  // namespace cleave::tok
