// JSON escaping (with UTF-8 repair), number formatting and the comma-placing writer.
#include "cleave/router/json_writer.h"

#include <cassert>
#include <charconv>
#include <cmath>

namespace cleave::openai {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is invalid; `*consumed`
// is then the length of the maximal invalid subpart (the lead byte plus any continuation bytes
// that a valid sequence could still have had), at least 1.
size_t utf8_sequence(std::string_view s, size_t i, size_t* consumed) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlong forms
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *consumed = 1;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) {
      *consumed = k;
      return 0;
    }
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char min = k == 1 ? lo : 0x80;
    const unsigned char max = k == 1 ? hi : 0xBF;
    if (b < min || b > max) {
      *consumed = k;
      return 0;
    }
  }
  *consumed = len;
  return len;
}

bool needs_attention(unsigned char c) { return c < 0x20 || c == '"' || c == '\\' || c >= 0x80; }

}  // namespace

void append_utf8_replacing(std::string& out, std::string_view text) {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    size_t run = i;
    while (run < n && static_cast<unsigned char>(text[run]) < 0x80) ++run;
    out.append(text.data() + i, run - i);
    i = run;
    if (i >= n) break;
    size_t consumed = 0;
    const size_t len = utf8_sequence(text, i, &consumed);
    if (len) out.append(text.data() + i, len);
    else out.append(kReplacement);
    i += consumed;
  }
}

void append_json_escaped(std::string& out, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    size_t run = i;
    while (run < n && !needs_attention(static_cast<unsigned char>(text[run]))) ++run;
    out.append(text.data() + i, run - i);
    i = run;
    if (i >= n) break;
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      size_t consumed = 0;
      const size_t len = utf8_sequence(text, i, &consumed);
      if (len) out.append(text.data() + i, len);
      else out.append(kReplacement);
      i += consumed;
      continue;
    }
    switch (c) {
      case '"': out.append("\\\""); break;
      case '\\': out.append("\\\\"); break;
      case '\b': out.append("\\b"); break;
      case '\f': out.append("\\f"); break;
      case '\n': out.append("\\n"); break;
      case '\r': out.append("\\r"); break;
      case '\t': out.append("\\t"); break;
      default: {
        const char esc[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]};
        out.append(esc, 6);
      }
    }
    ++i;
  }
}

void append_json_string(std::string& out, std::string_view text) {
  out.push_back('"');
  append_json_escaped(out, text);
  out.push_back('"');
}

void append_json_int(std::string& out, int64_t value) {
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, r.ptr);
}

void append_json_double(std::string& out, double value) {
  if (!std::isfinite(value)) {
    out.append("null");
    return;
  }
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, r.ptr);
}

void append_json_logprob(std::string& out, float value) {
  if (!std::isfinite(value)) {
    // +inf cannot be a log-probability either; every non-finite value is "impossible".
    out.append("-9999.0");
    return;
  }
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, r.ptr);
}

int64_t utf8_code_points(std::string_view text) {
  int64_t count = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
    } else {
      size_t consumed = 0;
      (void)utf8_sequence(text, i, &consumed);
      i += consumed;
    }
    ++count;
  }
  return count;
}

void JsonWriter::before_value() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (depth_ > 0) {
    const uint64_t bit = uint64_t{1} << (depth_ - 1);
    if (has_members_ & bit) out_.push_back(',');
    has_members_ |= bit;
  }
}

JsonWriter& JsonWriter::begin_object() {
  before_value();
  out_.push_back('{');
  assert(depth_ < 64);
  ++depth_;
  has_members_ &= ~(uint64_t{1} << (depth_ - 1));
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  assert(depth_ > 0 && !after_key_);
  --depth_;
  out_.push_back('}');
  return *this;
}

JsonWriter& JsonWriter::begin_array() {
  before_value();
  out_.push_back('[');
  assert(depth_ < 64);
  ++depth_;
  has_members_ &= ~(uint64_t{1} << (depth_ - 1));
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  assert(depth_ > 0 && !after_key_);
  --depth_;
  out_.push_back(']');
  return *this;
}

JsonWriter& JsonWriter::key(std::string_view name) {
  assert(depth_ > 0 && !after_key_);
  before_value();
  append_json_string(out_, name);
  out_.push_back(':');
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::string(std::string_view value) {
  before_value();
  append_json_string(out_, value);
  return *this;
}

JsonWriter& JsonWriter::integer(int64_t value) {
  before_value();
  append_json_int(out_, value);
  return *this;
}

JsonWriter& JsonWriter::number(double value) {
  before_value();
  append_json_double(out_, value);
  return *this;
}

JsonWriter& JsonWriter::logprob(float value) {
  before_value();
  append_json_logprob(out_, value);
  return *this;
}

JsonWriter& JsonWriter::boolean(bool value) {
  before_value();
  out_.append(value ? "true" : "false");
  return *this;
}

JsonWriter& JsonWriter::null() {
  before_value();
  out_.append("null");
  return *this;
}

JsonWriter& JsonWriter::raw(std::string_view json) {
  before_value();
  out_.append(json);
  return *this;
}

JsonWriter& JsonWriter::string_or_null(std::string_view value) {
  return value.empty() ? null() : string(value);
}

}  // namespace cleave::openai
