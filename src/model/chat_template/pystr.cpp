#include "chat_template/pystr.h"

#include <algorithm>

#include "unicode/uchar.h"
#include "unicode/unistr.h"
#include "unicode/brkiter.h"
#include "unicode/locid.h"

namespace cleave::jinja {
namespace {

bool is_ascii(std::string_view s) {
  for (unsigned char c : s) {
    if (c >= 0x80) return false;
  }
  return true;
}

// Decodes one code point at s[i], advancing i; U+FFFD for a malformed sequence (one byte).
char32_t decode_one(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  int n = 0;
  char32_t c = 0;
  if ((b0 & 0xE0) == 0xC0) {
    n = 1;
    c = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 2;
    c = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 3;
    c = b0 & 0x07;
  } else {
    ++i;
    return 0xFFFD;
  }
  if (i + n >= s.size()) {
    ++i;
    return 0xFFFD;
  }
  for (int k = 1; k <= n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) {
      ++i;
      return 0xFFFD;
    }
    c = (c << 6) | (b & 0x3F);
  }
  i += n + 1;
  return c;
}

bool char_in(char32_t c, const std::u32string& set) {
  return set.find(c) != std::u32string::npos;
}

std::string icu_map(std::string_view s, bool upper) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(
      icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (upper) {
    u.toUpper(icu::Locale::getRoot());
  } else {
    u.toLower(icu::Locale::getRoot());
  }
  std::string out;
  u.toUTF8String(out);
  return out;
}

std::string map_char(char32_t c, bool upper) {
  std::string one;
  utf8_append(one, c);
  if (c < 0x80) {
    char ch = static_cast<char>(c);
    if (upper && ch >= 'a' && ch <= 'z') ch = static_cast<char>(ch - 32);
    if (!upper && ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch + 32);
    return std::string(1, ch);
  }
  return icu_map(one, upper);
}

// Full titlecase mapping of one character (U+00DF -> "Ss"), as str.title() uses.
std::string title_char(char32_t c) {
  if (c < 0x80) return map_char(c, true);
  icu::UnicodeString u(static_cast<UChar32>(c));
  u.toTitle(nullptr, icu::Locale::getRoot(), U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT);
  std::string out;
  u.toUTF8String(out);
  return out;
}

bool is_cased(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED); }

}  // namespace

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) out.push_back(decode_one(s, i));
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  size_t i = 0;
  while (i < s.size()) {
    decode_one(s, i);
    ++n;
  }
  return n;
}

std::vector<std::string> utf8_chars(std::string_view s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t start = i;
    const char32_t c = decode_one(s, i);
    if (c == 0xFFFD && i - start == 1 && static_cast<unsigned char>(s[start]) >= 0x80) {
      out.emplace_back("\xEF\xBF\xBD");
    } else {
      out.emplace_back(s.substr(start, i - start));
    }
  }
  return out;
}

bool py_isspace(char32_t c) {
  switch (c) {
    case ' ': case '\t': case '\n': case '\v': case '\f': case '\r':
    case 0x1C: case 0x1D: case 0x1E: case 0x1F: case 0x85: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool py_isprintable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x7F) return c >= 0x20;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR: case U_FORMAT_CHAR: case U_SURROGATE: case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED: case U_LINE_SEPARATOR: case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

SliceBounds slice_indices(int64_t len, std::optional<int64_t> start, std::optional<int64_t> stop,
                          int64_t step) {
  SliceBounds b{0, 0, step, 0};
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) {
      x += len;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= len) {
      x = step < 0 ? len - 1 : len;
    }
    return x;
  };
  b.start = clamp(start, step < 0 ? len - 1 : 0);
  b.stop = clamp(stop, step < 0 ? -1 : len);
  if (step > 0) {
    b.count = b.stop > b.start ? (b.stop - b.start + step - 1) / step : 0;
  } else {
    b.count = b.start > b.stop ? (b.start - b.stop + (-step) - 1) / (-step) : 0;
  }
  return b;
}

std::string py_slice(std::string_view s, const SliceBounds& b) {
  if (is_ascii(s)) {
    std::string out;
    out.reserve(static_cast<size_t>(b.count));
    for (int64_t k = 0, i = b.start; k < b.count; ++k, i += b.step) out.push_back(s[i]);
    return out;
  }
  const std::u32string u = utf8_decode(s);
  std::string out;
  for (int64_t k = 0, i = b.start; k < b.count; ++k, i += b.step) utf8_append(out, u[i]);
  return out;
}

std::string py_strip(std::string_view s, StripSide side, const std::optional<std::string>& chars) {
  const std::u32string u = utf8_decode(s);
  const std::u32string set = chars ? utf8_decode(*chars) : std::u32string();
  auto strip_it = [&](char32_t c) { return chars ? char_in(c, set) : py_isspace(c); };
  size_t b = 0;
  size_t e = u.size();
  if (side != StripSide::kRight) {
    while (b < e && strip_it(u[b])) ++b;
  }
  if (side != StripSide::kLeft) {
    while (e > b && strip_it(u[e - 1])) --e;
  }
  return utf8_encode(std::u32string_view(u).substr(b, e - b));
}

std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep,
                                  int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      const size_t p = s.find(*sep, pos);
      if (p == std::string_view::npos) break;
      out.emplace_back(s.substr(pos, p - pos));
      pos = p + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  const std::u32string u = utf8_decode(s);
  size_t i = 0;
  while (i < u.size()) {
    while (i < u.size() && py_isspace(u[i])) ++i;
    if (i == u.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      size_t e = u.size();
      while (e > i && py_isspace(u[e - 1])) --e;
      out.push_back(utf8_encode(std::u32string_view(u).substr(i, e - i)));
      break;
    }
    size_t j = i;
    while (j < u.size() && !py_isspace(u[j])) ++j;
    out.push_back(utf8_encode(std::u32string_view(u).substr(i, j - i)));
    i = j;
  }
  return out;
}

std::vector<std::string> py_rsplit(std::string_view s, const std::optional<std::string>& sep,
                                   int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      if (end < sep->size()) break;
      const size_t p = s.rfind(*sep, end - sep->size());
      if (p == std::string_view::npos) break;
      out.emplace_back(s.substr(p + sep->size(), end - p - sep->size()));
      end = p;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  const std::u32string u = utf8_decode(s);
  size_t j = u.size();
  while (j > 0) {
    while (j > 0 && py_isspace(u[j - 1])) --j;
    if (j == 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      size_t b = 0;
      while (b < j && py_isspace(u[b])) ++b;
      out.push_back(utf8_encode(std::u32string_view(u).substr(b, j - b)));
      break;
    }
    size_t i = j;
    while (i > 0 && !py_isspace(u[i - 1])) --i;
    out.push_back(utf8_encode(std::u32string_view(u).substr(i, j - i)));
    j = i;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  const std::u32string u = utf8_decode(s);
  std::vector<std::string> out;
  size_t i = 0;
  while (i < u.size()) {
    size_t j = i;
    while (j < u.size()) {
      const char32_t c = u[j];
      if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1C || c == 0x1D ||
          c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029) {
        break;
      }
      ++j;
    }
    size_t eol = j;
    if (j < u.size()) {
      eol = (u[j] == '\r' && j + 1 < u.size() && u[j + 1] == '\n') ? j + 2 : j + 1;
    }
    out.push_back(utf8_encode(std::u32string_view(u).substr(i, (keepends ? eol : j) - i)));
    i = eol;
  }
  return out;
}

std::string py_replace(std::string_view s, std::string_view from, std::string_view to,
                       int64_t count) {
  std::string out;
  if (from.empty()) {
    const std::vector<std::string> chars = utf8_chars(s);
    int64_t done = 0;
    for (const std::string& c : chars) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out += c;
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t p = s.find(from, pos);
    if (p == std::string_view::npos) break;
    out.append(s.substr(pos, p - pos));
    out.append(to);
    pos = p + from.size();
    ++done;
  }
  out.append(s.substr(pos));
  return out;
}

int64_t py_find(std::string_view s, std::string_view sub, bool reverse) {
  const size_t p = reverse ? s.rfind(sub) : s.find(sub);
  if (p == std::string_view::npos) return -1;
  return static_cast<int64_t>(utf8_length(s.substr(0, p)));
}

int64_t py_count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(utf8_length(s)) + 1;
  int64_t n = 0;
  size_t pos = 0;
  while (true) {
    const size_t p = s.find(sub, pos);
    if (p == std::string_view::npos) break;
    ++n;
    pos = p + sub.size();
  }
  return n;
}

std::string py_upper(std::string_view s) {
  if (!is_ascii(s)) return icu_map(s, true);
  std::string out(s);
  for (char& c : out) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  }
  return out;
}

std::string py_lower(std::string_view s) {
  if (!is_ascii(s)) return icu_map(s, false);
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  }
  return out;
}

std::string py_title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : utf8_decode(s)) {
    out += previous_cased ? map_char(c, false) : title_char(c);
    previous_cased = is_cased(c);
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  const std::u32string u = utf8_decode(s);
  std::string out;
  for (size_t i = 0; i < u.size(); ++i) {
    if (i == 0) {
      out += title_char(u[0]);
    } else {
      out += map_char(u[i], false);
    }
  }
  return out;
}

bool py_is(std::string_view s, CharClass cls) {
  const std::u32string u = utf8_decode(s);
  if (u.empty()) return false;
  if (cls == CharClass::kLower || cls == CharClass::kUpper) {
    bool any_cased = false;
    for (char32_t c : u) {
      const auto uc = static_cast<UChar32>(c);
      const bool other_case = cls == CharClass::kLower ? (u_isupper(uc) || u_istitle(uc))
                                                       : (u_islower(uc) || u_istitle(uc));
      if (other_case) {
        return false;
      }
      if (cls == CharClass::kLower ? u_islower(uc) : u_isupper(uc)) any_cased = true;
    }
    return any_cased;
  }
  for (char32_t c : u) {
    const auto uc = static_cast<UChar32>(c);
    bool ok = false;
    switch (cls) {
      case CharClass::kAlpha: ok = u_isalpha(uc); break;
      case CharClass::kDigit: {
        const int32_t t = u_getIntPropertyValue(uc, UCHAR_NUMERIC_TYPE);
        ok = t == U_NT_DECIMAL || t == U_NT_DIGIT;
        break;
      }
      case CharClass::kAlnum:
        ok = u_isalpha(uc) || u_getIntPropertyValue(uc, UCHAR_NUMERIC_TYPE) != U_NT_NONE;
        break;
      case CharClass::kSpace: ok = py_isspace(c); break;
      default: break;
    }
    if (!ok) return false;
  }
  return true;
}

}  // namespace cleave::jinja
