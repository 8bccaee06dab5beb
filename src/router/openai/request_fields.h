// Readers of typed request fields from parsed JSON, shared by the two request parsers. Each
// returns std::nullopt on success or the 400 that names the field and the value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cleave/router/openai_error.h"
#include "cleave/router/openai_request.h"

namespace cleave::openai::detail {

using json = nlohmann::json;
using Check = std::optional<ApiError>;

// Returns from the calling function when `expr` yields an error.
#define CLEAVE_OPENAI_CHECK(expr)                         \
  do {                                                    \
    ::cleave::openai::detail::Check cleave_check_ = (expr); \
    if (cleave_check_) return std::move(*cleave_check_);  \
  } while (0)

// The value as the message shows it: compact JSON, cut at 80 characters.
std::string show(const json& value);
// "a string", "an integer", "an object"...
std::string_view type_name(const json& value);

ApiError type_error(std::string_view param, std::string_view expected, const json& value);
ApiError range_error(std::string_view param, const json& value, std::string_view rule);
ApiError unsupported(std::string_view param, const json& value, std::string_view why = {});
ApiError unknown_field(std::string_view param);

Check read_bool(const json& v, std::string_view param, bool* out);
Check read_string(const json& v, std::string_view param, std::string* out);
// An integer (or an integral float) in [lo, hi].
Check read_int(const json& v, std::string_view param, int64_t lo, int64_t hi, int64_t* out);
Check read_int32(const json& v, std::string_view param, int64_t lo, int64_t hi, int32_t* out);
// A finite number in [lo, hi] (or (lo, hi] when lo_open).
Check read_float(const json& v, std::string_view param, double lo, double hi, bool lo_open,
                 float* out);

// Parses the body; 400 for malformed JSON, nesting deeper than max_depth, or a non-object.
ApiResult<json> parse_body(std::string_view body, int max_depth);

// A field both endpoints share (sampling, n, stream, user, ignored OpenAI fields). Sets
// *handled when `key` is one of them. `stream_options_seen` is set when stream_options was
// given non-null, for the cross-check with `stream`.
struct CommonFields {
  SamplingFields* sampling = nullptr;
  int32_t* n = nullptr;
  bool* stream = nullptr;
  StreamOptions* stream_options = nullptr;
  std::string* user = nullptr;
  std::string* model = nullptr;
  bool stream_options_seen = false;
  bool min_tokens_seen = false;
  bool max_completion_tokens_seen = false;
};
Check parse_common_field(const std::string& key, const json& value, const RequestLimits& limits,
                         CommonFields* fields, bool* handled);

// Cross-field checks both endpoints share, after every field was read.
Check finish_common(const CommonFields& fields);

// A list of token ids in [0, vocab) (or [0, INT32_MAX] when vocab_size <= 0).
Check read_token_ids(const json& v, std::string_view param, int32_t vocab_size,
                     std::vector<int32_t>* out);

}  // namespace cleave::openai::detail
