// JSON text output for the router's responses: string escaping that always yields valid JSON
// (invalid UTF-8 becomes U+FFFD), numbers in their shortest round-trip form, and a small
// append-only writer that places the commas. Everything appends to a caller-owned std::string,
// so a per-token caller that reuses its buffer allocates nothing once the buffer has grown.
//
// Thread-safety: free functions are pure; a JsonWriter is used by one thread at a time.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace cleave::openai {

// Appends `text` as the inside of a JSON string literal (no quotes): `"` and `\` escaped,
// \b \f \n \r \t by name, other bytes below 0x20 as \u00XX; valid UTF-8 copied as is; each
// maximal invalid UTF-8 subsequence (a stray continuation byte, a truncated sequence, an
// overlong form, a surrogate, a code point above U+10FFFF) replaced by U+FFFD, as Python's
// bytes.decode(errors="replace") does.
void append_json_escaped(std::string& out, std::string_view text);

// Appends `text` with each maximal invalid UTF-8 subsequence replaced by U+FFFD (the rule
// above) and nothing escaped: valid UTF-8 for protobuf string fields.
void append_utf8_replacing(std::string& out, std::string_view text);

// `"` + append_json_escaped(text) + `"`.
void append_json_string(std::string& out, std::string_view text);

void append_json_int(std::string& out, int64_t value);

// Shortest text that reads back as the same double; NaN and infinities (not JSON) as null.
void append_json_double(std::string& out, double value);

// A log-probability: the float's shortest round-trip text; -inf and NaN (no JSON spelling) as
// -9999.0, as vLLM reports them.
void append_json_logprob(std::string& out, float value);

// Number of Unicode code points in `text` (what Python's len() gives for the decoded str), with
// each invalid subsequence counted as the one U+FFFD it becomes.
int64_t utf8_code_points(std::string_view text);

// Builds one JSON value into `out`, inserting commas between members and elements. Misuse (a
// value where a key is due, unbalanced ends) is a programming error, checked by assert only.
class JsonWriter {
 public:
  explicit JsonWriter(std::string& out) : out_(out) {}

  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  JsonWriter& key(std::string_view name);  // name is escaped like any string
  JsonWriter& string(std::string_view value);
  JsonWriter& integer(int64_t value);
  JsonWriter& number(double value);
  JsonWriter& logprob(float value);
  JsonWriter& boolean(bool value);
  JsonWriter& null();
  // A value that is already serialized JSON, copied verbatim.
  JsonWriter& raw(std::string_view json);
  // A string value, or null when `value` is empty.
  JsonWriter& string_or_null(std::string_view value);

 private:
  void before_value();

  std::string& out_;
  uint64_t has_members_ = 0;  // bit d: the container at depth d already has a member
  int depth_ = 0;
  bool after_key_ = false;
};

}  // namespace cleave::openai
