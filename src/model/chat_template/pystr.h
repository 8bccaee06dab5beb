// Python str semantics over UTF-8 std::string: lengths, indices and slices count code points;
// whitespace, case mapping and printability follow Python's Unicode rules (case mapping through
// ICU's full mappings, as str.upper() / str.lower() do).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cleave::jinja {

// Decoding maps a malformed byte to U+FFFD.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);
size_t utf8_length(std::string_view s);
// Each character as its own string (iteration over a str).
std::vector<std::string> utf8_chars(std::string_view s);

bool py_isspace(char32_t c);
bool py_isprintable(char32_t c);

// Python's slice.indices(): clamps start/stop for a sequence of `len`, given step != 0.
struct SliceBounds {
  int64_t start, stop, step, count;
};
SliceBounds slice_indices(int64_t len, std::optional<int64_t> start, std::optional<int64_t> stop,
                          int64_t step);
// s[start:stop:step] by code points.
std::string py_slice(std::string_view s, const SliceBounds& b);

enum class StripSide { kBoth, kLeft, kRight };
// str.strip(chars) / lstrip / rstrip; no chars: Unicode whitespace.
std::string py_strip(std::string_view s, StripSide side, const std::optional<std::string>& chars);
// str.split(sep, maxsplit); no sep: runs of whitespace, empty strings dropped. sep must not be
// empty (the caller raises "empty separator").
std::vector<std::string> py_split(std::string_view s, const std::optional<std::string>& sep,
                                  int64_t maxsplit);
std::vector<std::string> py_rsplit(std::string_view s, const std::optional<std::string>& sep,
                                   int64_t maxsplit);
std::vector<std::string> py_splitlines(std::string_view s, bool keepends);
// str.replace(old, new, count); count < 0: all.
std::string py_replace(std::string_view s, std::string_view from, std::string_view to,
                       int64_t count);
// str.find / rfind in code points, -1 when absent.
int64_t py_find(std::string_view s, std::string_view sub, bool reverse);
int64_t py_count(std::string_view s, std::string_view sub);

std::string py_upper(std::string_view s);
std::string py_lower(std::string_view s);
std::string py_title(std::string_view s);       // str.title()
std::string py_capitalize(std::string_view s);  // str.capitalize()
enum class CharClass { kAlpha, kDigit, kAlnum, kSpace, kLower, kUpper };
// str.isalpha() etc. (islower/isupper: at least one cased character and none of the other case).
bool py_is(std::string_view s, CharClass c);

}  // namespace cleave::jinja
