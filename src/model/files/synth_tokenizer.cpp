// The byte-level BPE vocabulary of synthetic models (see synth.h).
#include <algorithm>
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cleave/model/synth.h"
#include "fmt/format.h"

namespace cleave {
namespace {

constexpr std::string_view kTrainingText =
    "Once upon a time there was a small town at the edge of a quiet forest. Every morning the "
    "baker opened his shop, and the smell of fresh bread filled the street. Children walked to "
    "school, talking about the games they would play in the afternoon. The teacher was kind and "
    "patient; she read them stories about brave sailors, clever animals and distant mountains. "
    "In the evening the families gathered for dinner, and the old clock in the square struck "
    "seven. People said that the town had not changed in a hundred years, and they were proud "
    "of it. One day a stranger arrived with a heavy bag and a map. He asked where he could find "
    "the river that ran under the hill. Nobody knew the answer, but the youngest girl in the "
    "town remembered a song her grandmother used to sing. The song spoke of water that sang in "
    "the dark and of a door made of stone. Together they searched the hill, and after many hours "
    "they found the door, covered with moss and roots. Behind it the river was singing, just as "
    "the song had said. The stranger thanked her, wrote something in his notebook, and walked "
    "on. The town kept its secret, and the children still sing the song today. It was 2024, "
    "and the year had 365 days, 12 months and 52 weeks.";

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 upwards.
std::vector<std::string> byte_spellings() {
  std::vector<int> cs(256, -1);
  for (int b = '!'; b <= '~'; ++b) cs[b] = b;
  for (int b = 0xA1; b <= 0xAC; ++b) cs[b] = b;
  for (int b = 0xAE; b <= 0xFF; ++b) cs[b] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (cs[b] < 0) cs[b] = 256 + n++;
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b) {
    const auto cp = static_cast<uint32_t>(cs[b]);
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    out[static_cast<size_t>(b)] = std::move(s);
  }
  return out;
}

bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Words as a GPT-2 style pre-tokenizer splits them: an optional leading space, then letters,
// up to three digits, or other non-space characters.
std::vector<std::string> split_words(std::string_view text) {
  std::vector<std::string> words;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i;
    if (text[j] == ' ' && j + 1 < text.size() && text[j + 1] != ' ') ++j;
    const size_t start = j;
    if (is_alpha(text[j])) {
      while (j < text.size() && is_alpha(text[j])) ++j;
    } else if (is_digit(text[j])) {
      while (j < text.size() && is_digit(text[j]) && j - start < 3) ++j;
    } else if (text[j] == ' ') {
      ++j;
    } else {
      while (j < text.size() && !is_alpha(text[j]) && !is_digit(text[j]) && text[j] != ' ') ++j;
    }
    words.emplace_back(text.substr(i, j - i));
    i = j;
  }
  return words;
}

// A token made only of letters, optionally after the space marker "Ġ" (U+0120).
bool word_like(const std::string& t) {
  std::string_view v = t;
  if (v.starts_with("\xC4\xA0")) v.remove_prefix(2);
  if (v.empty() || v.size() > 12) return false;
  return std::all_of(v.begin(), v.end(), is_alpha);
}

}  // namespace

Result<TokenizerSpec> synth_tokenizer(int64_t vocab) {
  if (vocab < 258 || vocab > (1 << 22))
    return InvalidArgument(fmt::format("--vocab {} must be in 258..{} (256 byte tokens and 2 "
                                       "specials at least)", vocab, 1 << 22));
  const size_t n_merges = static_cast<size_t>(vocab - 258);
  const auto bytes = byte_spellings();
  TokenizerSpec spec;
  spec.model = "gpt2";
  spec.pre = "llama-bpe";
  spec.tokens = bytes;
  std::unordered_set<std::string> have(bytes.begin(), bytes.end());
  auto add_merge = [&](const std::string& a, const std::string& b) {
    spec.merges.push_back(a + " " + b);
    spec.tokens.push_back(a + b);
    have.insert(a + b);
  };

  // BPE training on the paragraph: words as token sequences with counts.
  std::map<std::string, int> word_counts;
  for (const auto& w : split_words(kTrainingText)) ++word_counts[w];
  std::vector<std::pair<std::vector<std::string>, int>> words;
  for (const auto& [w, n] : word_counts) {
    std::vector<std::string> seq;
    for (unsigned char ch : w) seq.push_back(bytes[ch]);
    words.emplace_back(std::move(seq), n);
  }
  while (spec.merges.size() < n_merges) {
    std::map<std::pair<std::string, std::string>, int> pairs;  // ordered: ties break by spelling
    for (const auto& [seq, n] : words)
      for (size_t i = 0; i + 1 < seq.size(); ++i) pairs[{seq[i], seq[i + 1]}] += n;
    const std::pair<std::string, std::string>* best = nullptr;
    int best_n = 1;
    for (const auto& [p, n] : pairs)
      if (n > best_n && !have.count(p.first + p.second)) best = &p, best_n = n;
    if (!best) break;
    const auto [a, b] = *best;
    add_merge(a, b);
    for (auto& [seq, n] : words) {
      std::vector<std::string> next;
      for (size_t i = 0; i < seq.size(); ++i) {
        if (i + 1 < seq.size() && seq[i] == a && seq[i + 1] == b) {
          next.push_back(a + b);
          ++i;
        } else {
          next.push_back(seq[i]);
        }
      }
      seq = std::move(next);
    }
  }
  // Continue deterministically: extend word-like tokens, in id order, by one lowercase letter.
  for (size_t i = 0; spec.merges.size() < n_merges && i < spec.tokens.size(); ++i) {
    const std::string base = spec.tokens[i];
    if (!word_like(base)) continue;
    for (char c = 'a'; c <= 'z' && spec.merges.size() < n_merges; ++c) {
      const std::string& letter = bytes[static_cast<unsigned char>(c)];
      if (!have.count(base + letter)) add_merge(base, letter);
    }
  }
  if (spec.merges.size() != n_merges)
    return Internal(fmt::format("could only derive {} merges for a vocabulary of {}",
                                spec.merges.size(), vocab));
  spec.tokens.push_back("<|begin_of_text|>");
  spec.tokens.push_back("<|end_of_text|>");
  spec.token_types.assign(spec.tokens.size(), TokenType::kNormal);
  spec.token_types[spec.tokens.size() - 2] = TokenType::kControl;
  spec.token_types[spec.tokens.size() - 1] = TokenType::kControl;
  spec.bos_id = static_cast<int32_t>(vocab - 2);
  spec.eos_id = static_cast<int32_t>(vocab - 1);
  spec.add_bos = true;
  spec.add_eos = false;
  spec.add_space_prefix = false;
  return spec;
}

}  // namespace cleave
