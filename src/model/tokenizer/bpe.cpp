// Byte-level BPE (GGUF model "gpt2"), as llama.cpp's llm_tokenizer_bpe: the text is split by the
// pre-tokenizer's regexes, each piece's bytes are mapped to GPT-2's printable alphabet, and the
// adjacent pair with the lowest merge rank is merged, repeatedly (ties: leftmost first).
#include <fmt/format.h>

#include <queue>
#include <unordered_map>

#include "tokenizer_impl.h"
#include "unicode.h"

namespace cleave::tok {
namespace {

class BpeTokenizer final : public TokenizerBase {
 public:
  explicit BpeTokenizer(TokenizerSpec spec) : TokenizerBase(std::move(spec)) {}

  Status init() {
    CLEAVE_RETURN_IF_ERROR(init_common());
    const std::vector<std::string>* regexes = spec_.pre_regexes.empty()
                                                  ? pre_tokenizer_regexes(spec_.pre)
                                                  : &spec_.pre_regexes;
    if (regexes == nullptr)
      return InvalidArgument(fmt::format("unknown pre-tokenizer '{}' (known: {})", spec_.pre,
                                         known_pre_tokenizer_names()));
    CLEAVE_ASSIGN_OR_RETURN(pre_, PreTokenizer::from_regexes(*regexes));
    ignore_merges_ = spec_.pre == "llama-bpe" || spec_.pre == "llama3" ||
                     spec_.pre == "llama-v3" || spec_.ignore_merges;

    // Real vocabularies may lack a few byte tokens (bytes that never occur in UTF-8 text, or
    // control characters); such bytes are dropped from the output, as llama.cpp does. A
    // vocabulary with few of them is not byte-level at all.
    const auto& b2u = byte_to_unicode();
    int found = 0;
    std::string first_missing;
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      append_utf8(&ch, b2u[b]);
      byte_tokens_[b] = find_token(ch);
      if (byte_tokens_[b] >= 0) ++found;
      else if (first_missing.empty()) first_missing = fmt::format("'{}' (byte 0x{:02X})", ch, b);
    }
    if (found < 128)
      return InvalidArgument(fmt::format(
          "vocabulary has only {} of the 256 byte-level tokens (first missing: {}); it is not a "
          "byte-level BPE vocabulary",
          found, first_missing));
    merges_.reserve(spec_.merges.size() * 2);
    for (size_t rank = 0; rank < spec_.merges.size(); ++rank) {
      const std::string& m = spec_.merges[rank];
      size_t sp = m.find(' ', 1);
      std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
      int32_t l = find_token(left), r = find_token(right);
      if (l < 0 || r < 0)
        return InvalidArgument(fmt::format("merge #{} '{}' names '{}', which is not a token",
                                           rank, m, l < 0 ? left : right));
      int32_t merged = find_token(std::string(left) + std::string(right));
      if (merged < 0)
        return InvalidArgument(fmt::format(
            "merge #{} '{}' makes '{}{}', which is not a token", rank, m, left, right));
      merges_.emplace(key(l, r), Merge{static_cast<int32_t>(rank), merged});  // first wins
    }
    return Status::Ok();
  }

  std::string piece_text(int32_t /*id*/, const std::string& text) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      Utf8Char ch = decode_utf8(text, i);
      int b = unicode_to_byte(ch.cp);
      if (b >= 0) out.push_back(static_cast<char>(b));
      else out.append(text, i, ch.len);
      i += ch.len;
    }
    return out;
  }

 protected:
  void encode_fragment(std::string_view text, bool /*after_special*/,
                       std::vector<int32_t>* out) const override {
    std::unordered_map<std::string_view, std::vector<int32_t>> cache;
    for (auto [b, e] : pre_.split(text)) {
      std::string_view word = text.substr(b, e - b);
      if (word.empty()) continue;
      auto it = cache.find(word);
      if (it == cache.end()) it = cache.emplace(word, encode_word(word)).first;
      out->insert(out->end(), it->second.begin(), it->second.end());
    }
  }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t key(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }

  std::vector<int32_t> encode_word(std::string_view word) const {
    if (ignore_merges_) {
      int32_t id = find_token(bytes_to_byte_level(word));
      if (id >= 0) return {id};
    }
    struct Symbol {
      int prev, next;
      int32_t id;  // -1: a byte without a token, or merged away (then unlinked)
    };
    std::vector<Symbol> symbols(word.size());
    for (size_t i = 0; i < word.size(); ++i) {
      int idx = static_cast<int>(i);
      symbols[i] = {idx - 1, i + 1 == word.size() ? -1 : idx + 1,
                    byte_tokens_[static_cast<unsigned char>(word[i])]};
    }
    struct Bigram {
      int32_t rank;
      int left, right;
      int32_t left_id, right_id, result;
    };
    auto worse = [](const Bigram& a, const Bigram& b) {
      return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    };
    std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
    auto try_add = [&](int left, int right) {
      if (left < 0 || right < 0) return;
      auto it = merges_.find(key(symbols[left].id, symbols[right].id));
      if (it == merges_.end()) return;
      queue.push({it->second.rank, left, right, symbols[left].id, symbols[right].id,
                  it->second.result});
    };
    for (int i = 1; i < static_cast<int>(symbols.size()); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
      Bigram bg = queue.top();
      queue.pop();
      Symbol& l = symbols[bg.left];
      Symbol& r = symbols[bg.right];
      if (l.id != bg.left_id || r.id != bg.right_id || l.next != bg.right) continue;  // stale
      l.id = bg.result;
      l.next = r.next;
      if (r.next >= 0) symbols[r.next].prev = bg.left;
      r.id = -1;
      r.prev = r.next = -2;  // unlinked
      try_add(l.prev, bg.left);
      try_add(bg.left, l.next);
    }
    std::vector<int32_t> ids;
    for (int i = 0; i != -1; i = symbols[i].next)
      if (symbols[i].id >= 0) ids.push_back(symbols[i].id);  // < 0: a byte without a token
    return ids;
  }

  PreTokenizer pre_;
  bool ignore_merges_ = false;
  int32_t byte_tokens_[256] = {};
  std::unordered_map<uint64_t, Merge> merges_;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> create_bpe_tokenizer(const TokenizerSpec& spec) {
  auto t = std::make_unique<BpeTokenizer>(spec);
  CLEAVE_RETURN_IF_ERROR(t->init().with_context("byte-level BPE tokenizer"));
  return std::unique_ptr<Tokenizer>(std::move(t));
}

}  // namespace cleave::tok
