// StreamDecoder: token pieces are concatenated and released as complete UTF-8 only.
#include "cleave/model/tokenizer.h"
#include "unicode.h"

namespace cleave {
namespace {

// Length of the valid UTF-8 sequence that `s[i]` starts if it is complete (> 0), 0 when it is a
// valid but incomplete prefix running to the end of `s`, -1 when it is invalid.
int utf8_sequence_status(std::string_view s, size_t i) {
  tok::Utf8Char ch = tok::decode_utf8(s, i);
  if (ch.cp != tok::kReplacementChar || ch.len > 1) return static_cast<int>(ch.len);
  const auto c = static_cast<unsigned char>(s[i]);
  // Could the bytes up to the end be the start of a valid sequence?
  size_t need = (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3
                : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
  if (need == 0) return -1;
  size_t have = s.size() - i;
  if (have >= need) return -1;
  for (size_t k = 1; k < have; ++k) {
    auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return -1;
    if (k == 1) {  // second-byte limits of E0, ED, F0, F4
      if (c == 0xE0 && b < 0xA0) return -1;
      if (c == 0xED && b > 0x9F) return -1;
      if (c == 0xF0 && b < 0x90) return -1;
      if (c == 0xF4 && b > 0x8F) return -1;
    }
  }
  return 0;
}

}  // namespace

std::string StreamDecoder::push(int32_t id) {
  std::string piece = tok_.token_to_piece(id);
  if (first_ && !tok_.is_control(id) && !piece.empty()) {
    if (tok_.spec().model == "llama" && tok_.spec().add_space_prefix && piece[0] == ' ')
      piece.erase(0, 1);
    first_ = false;
  }
  pending_ += piece;
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    int st = utf8_sequence_status(pending_, i);
    if (st == 0) break;  // hold the incomplete tail
    if (st < 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(pending_, i, static_cast<size_t>(st));
      i += static_cast<size_t>(st);
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  for (size_t i = 0; i < pending_.size();) {
    tok::Utf8Char ch = tok::decode_utf8(pending_, i);
    if (ch.cp == tok::kReplacementChar && ch.len == 1) out += "\xEF\xBF\xBD";
    else out.append(pending_, i, ch.len);
    i += ch.len;
  }
  pending_.clear();
  return out;
}

}  // namespace cleave
