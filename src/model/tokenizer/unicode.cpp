#include "unicode.h"

#include <unicode/uchar.h>

namespace cleave::tok {

Utf8Char decode_utf8(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const unsigned char c = p[i];
  if (c < 0x80) return {c, 1};
  auto cont = [&](size_t k) { return i + k < n && (p[i + k] & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) {
    if (cont(1)) return {static_cast<uint32_t>(((c & 0x1F) << 6) | (p[i + 1] & 0x3F)), 2};
  } else if (c >= 0xE0 && c <= 0xEF) {
    if (cont(1) && cont(2)) {
      uint32_t cp = ((c & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F);
      if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) return {cp, 3};
    }
  } else if (c >= 0xF0 && c <= 0xF4) {
    if (cont(1) && cont(2) && cont(3)) {
      uint32_t cp = ((c & 0x07) << 18) | ((p[i + 1] & 0x3F) << 12) | ((p[i + 2] & 0x3F) << 6) |
                    (p[i + 3] & 0x3F);
      if (cp >= 0x10000 && cp <= 0x10FFFF) return {cp, 4};
    }
  }
  return {kReplacementChar, 1};
}

void append_utf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

uint8_t general_category(uint32_t cp) {
  return static_cast<uint8_t>(u_charType(static_cast<UChar32>(cp)));
}

bool is_white_space(uint32_t cp) {
  return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE) != 0;
}

CodepointText CodepointText::from_utf8(std::string_view text) {
  CodepointText t;
  t.cps.reserve(text.size());
  t.byte_offset.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    Utf8Char ch = decode_utf8(text, i);
    t.cps.push_back(ch.cp);
    t.byte_offset.push_back(i);
    i += ch.len;
  }
  t.byte_offset.push_back(text.size());
  t.cats.resize(t.cps.size());
  t.spaces.resize(t.cps.size());
  for (size_t k = 0; k < t.cps.size(); ++k) {
    uint32_t cp = t.cps[k];
    if (cp < 0x80) {  // fast path for ASCII
      t.spaces[k] = (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) ? 1 : 0;
    } else {
      t.spaces[k] = is_white_space(cp) ? 1 : 0;
    }
    t.cats[k] = general_category(cp);
  }
  return t;
}

namespace {
struct ByteTables {
  std::array<uint32_t, 256> to_unicode{};
  std::array<int16_t, 324> to_byte{};  // all mapped code points are < 324
  ByteTables() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      to_unicode[b] = cp;
      to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};
const ByteTables& tables() {
  static const ByteTables t;
  return t;
}
}  // namespace

const std::array<uint32_t, 256>& byte_to_unicode() { return tables().to_unicode; }

int unicode_to_byte(uint32_t cp) { return cp < 324 ? tables().to_byte[cp] : -1; }

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  const auto& map = byte_to_unicode();
  for (char c : bytes) append_utf8(&out, map[static_cast<unsigned char>(c)]);
  return out;
}

}  // namespace cleave::tok
