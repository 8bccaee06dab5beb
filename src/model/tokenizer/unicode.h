// UTF-8 and Unicode helpers for the tokenizers: lenient UTF-8 decoding (invalid bytes become
// single U+FFFD code points, never an error), general categories and White_Space from ICU, and
// GPT-2's byte <-> unicode mapping used by byte-level BPE.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cleave::tok {

inline constexpr uint32_t kReplacementChar = 0xFFFD;

struct Utf8Char {
  uint32_t cp;   // kReplacementChar for an invalid sequence
  uint32_t len;  // bytes consumed (1 for an invalid byte)
};
// Decodes the character starting at s[i] (i < s.size()). Overlong forms, surrogates and
// truncated sequences are invalid: one byte is consumed.
Utf8Char decode_utf8(std::string_view s, size_t i);
void append_utf8(std::string* out, uint32_t cp);

// The ICU general category (UCharCategory value, 0..29) of a code point.
uint8_t general_category(uint32_t cp);
bool is_white_space(uint32_t cp);

// A text decoded to code points, with per-code-point byte offsets and cached properties.
struct CodepointText {
  std::vector<uint32_t> cps;
  std::vector<uint8_t> cats;        // general category
  std::vector<uint8_t> spaces;      // White_Space
  std::vector<size_t> byte_offset;  // size cps.size() + 1; last = text size
  static CodepointText from_utf8(std::string_view text);
};

// GPT-2 bytes_to_unicode: every byte maps to a printable code point.
const std::array<uint32_t, 256>& byte_to_unicode();
// The byte for a code point of that mapping, or -1.
int unicode_to_byte(uint32_t cp);
// Maps raw bytes to the byte-level alphabet (UTF-8 encoded).
std::string bytes_to_byte_level(std::string_view bytes);

}  // namespace cleave::tok
