// Typed field readers, body parsing and the fields both OpenAI endpoints share.
#include "request_fields.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace cleave::openai::detail {
namespace {

// Deepest nesting of arrays and objects in `body`, outside strings; stops counting at
// `limit` + 1. Malformed text is left to the parser.
int nesting_depth(std::string_view body, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > deepest && (deepest = depth) > limit) return deepest;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

// An integral value of `v` as a double when it is a number; nullopt otherwise.
bool integral_value(const json& v, long double* out) {
  if (v.is_number_unsigned()) {
    *out = static_cast<long double>(v.get<uint64_t>());
    return true;
  }
  if (v.is_number_integer()) {
    *out = static_cast<long double>(v.get<int64_t>());
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::trunc(d) != d) return false;
    *out = d;
    return true;
  }
  return false;
}

Check read_seed(const json& v, std::optional<uint64_t>* out) {
  if (!v.is_number()) return type_error("seed", "an integer", v);
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return std::nullopt;
  }
  if (v.is_number_integer()) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return std::nullopt;
  }
  long double d = 0;
  if (!integral_value(v, &d)) return type_error("seed", "an integer", v);
  constexpr long double kMin = -9223372036854775808.0L, kLimit = 18446744073709551616.0L;
  if (d < kMin || d >= kLimit) return range_error("seed", v, "must fit in 64 bits");
  *out = d < 0 ? static_cast<uint64_t>(static_cast<int64_t>(d)) : static_cast<uint64_t>(d);
  return std::nullopt;
}

Check read_stop(const json& v, const RequestLimits& limits, std::vector<std::string>* out) {
  out->clear();
  if (v.is_string()) {
    if (!v.get_ref<const std::string&>().empty()) out->push_back(v.get<std::string>());
    return std::nullopt;
  }
  if (!v.is_array()) return type_error("stop", "a string or an array of strings", v);
  if (v.size() > limits.max_stop) {
    return range_error("stop", v,
                       fmt::format("allows at most {} stop strings, got {}", limits.max_stop,
                                   v.size()));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) return type_error(fmt::format("stop[{}]", i), "a string", v[i]);
    // An empty stop string matches nothing; clients send "" to mean "no stop".
    if (!v[i].get_ref<const std::string&>().empty()) out->push_back(v[i].get<std::string>());
  }
  return std::nullopt;
}

Check read_stream_options(const json& v, StreamOptions* out) {
  if (!v.is_object()) return type_error("stream_options", "an object", v);
  for (const auto& [key, value] : v.items()) {
    const std::string param = "stream_options." + key;
    if (value.is_null()) continue;
    if (key == "include_usage") {
      CLEAVE_OPENAI_CHECK(read_bool(value, param, &out->include_usage));
    } else if (key == "continuous_usage_stats") {
      bool on = false;
      CLEAVE_OPENAI_CHECK(read_bool(value, param, &on));
      if (on) return unsupported(param, value);
    } else {
      return invalid_request(fmt::format("Unrecognized stream option: '{}'", key), param);
    }
  }
  return std::nullopt;
}

// OpenAI fields that change nothing here when they ask for nothing, and are rejected when
// they ask for something this server does not do.
Check read_neutral_field(const std::string& key, const json& v, bool* handled) {
  *handled = true;
  if (key == "logit_bias") {
    if (v.is_object() && v.empty()) return std::nullopt;
    if (!v.is_object()) return type_error(key, "an object", v);
    return unsupported(key, v);
  }
  if (key == "response_format") {
    if (!v.is_object()) return type_error(key, "an object", v);
    const auto it = v.find("type");
    if (it != v.end() && *it == "text" && v.size() == 1) return std::nullopt;
    return unsupported(key, v, "only {\"type\": \"text\"} is supported");
  }
  if (key == "store") {
    bool b = false;
    return read_bool(v, key, &b);  // storage is a hosted-API feature; nothing to keep here
  }
  if (key == "metadata") {
    if (!v.is_object()) return type_error(key, "an object", v);
    return std::nullopt;
  }
  if (key == "service_tier") {
    if (v == "auto" || v == "default") return std::nullopt;
    return unsupported(key, v);
  }
  if (key == "skip_special_tokens" || key == "spaces_between_special_tokens") {
    bool b = true;
    CLEAVE_OPENAI_CHECK(read_bool(v, key, &b));
    if (!b) return unsupported(key, v);
    return std::nullopt;
  }
  if (key == "include_stop_str_in_output") {
    bool b = false;
    CLEAVE_OPENAI_CHECK(read_bool(v, key, &b));
    if (b) return unsupported(key, v);
    return std::nullopt;
  }
  *handled = false;
  return std::nullopt;
}

}  // namespace

std::string show(const json& value) {
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr size_t kMax = 80;
  if (s.size() > kMax) {
    size_t cut = kMax;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
    s.resize(cut);
    s += "...";
  }
  return s;
}

std::string_view type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "an unknown value";
  }
}

ApiError type_error(std::string_view param, std::string_view expected, const json& value) {
  return invalid_request(fmt::format("Invalid type for '{}': expected {}, but got {} ({}).",
                                     param, expected, type_name(value), show(value)),
                         std::string(param));
}

ApiError range_error(std::string_view param, const json& value, std::string_view rule) {
  return invalid_request(fmt::format("Invalid value for '{}': {} ({}).", param, show(value), rule),
                         std::string(param));
}

ApiError unsupported(std::string_view param, const json& value, std::string_view why) {
  return invalid_request(
      why.empty() ? fmt::format("'{}' is not supported by this server (got {}).", param,
                                show(value))
                  : fmt::format("'{}' is not supported by this server (got {}): {}.", param,
                                show(value), why),
      std::string(param));
}

ApiError unknown_field(std::string_view param) {
  return invalid_request(fmt::format("Unrecognized request argument supplied: {}", param),
                         std::string(param));
}

Check read_bool(const json& v, std::string_view param, bool* out) {
  if (!v.is_boolean()) return type_error(param, "a boolean", v);
  *out = v.get<bool>();
  return std::nullopt;
}

Check read_string(const json& v, std::string_view param, std::string* out) {
  if (!v.is_string()) return type_error(param, "a string", v);
  *out = v.get<std::string>();
  return std::nullopt;
}

Check read_int(const json& v, std::string_view param, int64_t lo, int64_t hi, int64_t* out) {
  long double d = 0;
  if (!integral_value(v, &d)) return type_error(param, "an integer", v);
  if (d < static_cast<long double>(lo) || d > static_cast<long double>(hi)) {
    std::string rule;
    if (hi == std::numeric_limits<int32_t>::max() || hi == std::numeric_limits<int64_t>::max())
      rule = fmt::format("must be >= {}", lo);
    else
      rule = fmt::format("must be in [{}, {}]", lo, hi);
    return range_error(param, v, rule);
  }
  *out = static_cast<int64_t>(d);
  return std::nullopt;
}

Check read_int32(const json& v, std::string_view param, int64_t lo, int64_t hi, int32_t* out) {
  int64_t x = 0;
  CLEAVE_OPENAI_CHECK(read_int(v, param, lo, hi, &x));
  *out = static_cast<int32_t>(x);
  return std::nullopt;
}

Check read_float(const json& v, std::string_view param, double lo, double hi, bool lo_open,
                 float* out) {
  if (!v.is_number()) return type_error(param, "a number", v);
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi || (lo_open && d == lo)) {
    std::string rule;
    if (std::isinf(hi)) rule = fmt::format("must be {} {}", lo_open ? ">" : ">=", lo);
    else rule = fmt::format("must be in {}{}, {}]", lo_open ? "(" : "[", lo, hi);
    return range_error(param, v, rule);
  }
  *out = static_cast<float>(d);
  return std::nullopt;
}

Check read_token_ids(const json& v, std::string_view param, int32_t vocab_size,
                     std::vector<int32_t>* out) {
  if (!v.is_array()) return type_error(param, "an array of token ids", v);
  const int64_t hi = vocab_size > 0 ? vocab_size - 1 : std::numeric_limits<int32_t>::max();
  out->clear();
  out->reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    int32_t id = 0;
    const std::string p = fmt::format("{}[{}]", param, i);
    if (!v[i].is_number()) return type_error(p, "a token id (an integer)", v[i]);
    long double d = 0;
    if (!integral_value(v[i], &d)) return type_error(p, "a token id (an integer)", v[i]);
    if (d < 0 || d > static_cast<long double>(hi)) {
      return range_error(p, v[i],
                         vocab_size > 0
                             ? fmt::format("not a token id of this model's vocabulary [0, {})",
                                           vocab_size)
                             : std::string("must be a non-negative 32-bit integer"));
    }
    id = static_cast<int32_t>(d);
    out->push_back(id);
  }
  return std::nullopt;
}

ApiResult<json> parse_body(std::string_view body, int max_depth) {
  if (nesting_depth(body, max_depth) > max_depth) {
    return invalid_request(
        fmt::format("The request body is nested more than {} levels deep.", max_depth));
  }
  json doc;
  try {
    doc = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    std::string_view what = e.what();
    // "[json.exception.parse_error.101] parse error at ...": keep what follows the tag.
    if (const size_t tag = what.find("] "); what.starts_with("[json.") && tag != what.npos)
      what.remove_prefix(tag + 2);
    return malformed_json(what);
  }
  if (!doc.is_object()) {
    return invalid_request(fmt::format("The request body must be a JSON object, but got {}.",
                                       type_name(doc)));
  }
  return doc;
}

Check parse_common_field(const std::string& key, const json& v, const RequestLimits& limits,
                         CommonFields* f, bool* handled) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  SamplingParams& p = f->sampling->params;
  *handled = true;
  if (key == "model") return read_string(v, key, f->model);
  if (key == "temperature") return read_float(v, key, 0, kInf, false, &p.temperature);
  if (key == "top_p") return read_float(v, key, 0, 1, true, &p.top_p);
  if (key == "top_k") return read_int32(v, key, -1, kI32, &p.top_k);
  if (key == "min_p") return read_float(v, key, 0, 1, false, &p.min_p);
  if (key == "presence_penalty") return read_float(v, key, -2, 2, false, &p.presence_penalty);
  if (key == "frequency_penalty") return read_float(v, key, -2, 2, false, &p.frequency_penalty);
  if (key == "repetition_penalty")
    return read_float(v, key, 0, kInf, true, &p.repetition_penalty);
  if (key == "seed") return read_seed(v, &f->sampling->seed);
  if (key == "stop") return read_stop(v, limits, &p.stop);
  if (key == "stop_token_ids") {
    if (v.is_array() && v.size() > limits.max_stop_token_ids) {
      return range_error(key, v, fmt::format("allows at most {} ids", limits.max_stop_token_ids));
    }
    return read_token_ids(v, key, limits.vocab_size, &p.stop_token_ids);
  }
  if (key == "ignore_eos") return read_bool(v, key, &p.ignore_eos);
  if (key == "min_tokens") {
    f->min_tokens_seen = true;
    return read_int32(v, key, 0, kI32, &p.min_tokens);
  }
  if (key == "max_tokens" || key == "max_completion_tokens") {
    int32_t m = 0;
    CLEAVE_OPENAI_CHECK(read_int32(v, key, 1, kI32, &m));
    // max_completion_tokens is the newer name and wins when both are given (as vLLM).
    if (key == "max_completion_tokens" || !f->max_completion_tokens_seen)
      f->sampling->max_tokens = m;
    if (key == "max_completion_tokens") f->max_completion_tokens_seen = true;
    return std::nullopt;
  }
  if (key == "n") return read_int32(v, key, 1, limits.max_n, f->n);
  if (key == "stream") return read_bool(v, key, f->stream);
  if (key == "stream_options") {
    f->stream_options_seen = true;
    return read_stream_options(v, f->stream_options);
  }
  if (key == "user") return read_string(v, key, f->user);
  return read_neutral_field(key, v, handled);
}

Check finish_common(const CommonFields& f) {
  if (f.stream_options_seen && !*f.stream) {
    return invalid_request("'stream_options' is only allowed when 'stream' is true.",
                           "stream_options");
  }
  const SamplingFields& s = *f.sampling;
  if (f.min_tokens_seen && s.max_tokens && s.params.min_tokens > *s.max_tokens) {
    return range_error("min_tokens", json(s.params.min_tokens),
                       fmt::format("must not exceed max_tokens = {}", *s.max_tokens));
  }
  return std::nullopt;
}

}  // namespace cleave::openai::detail
