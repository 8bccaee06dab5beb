// Jinja2's builtin filters on strings and numbers (jinja2/filters.py), with transformers'
// tojson (json.dumps(x, ensure_ascii=False, indent=, separators=, sort_keys=)).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "chat_template/interpreter.h"
#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

// --- string filters -----------------------------------------------------------------------------

Result<Value> f_upper(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "upper"));
  return Value(py_upper(to_str(v)));
}
Result<Value> f_lower(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "lower"));
  return Value(py_lower(to_str(v)));
}
Result<Value> f_capitalize(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "capitalize"));
  return Value(py_capitalize(to_str(v)));
}
Result<Value> f_title(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "title"));
  // "".join(w[0].upper() + w[1:].lower() for w in re.split(r"([-\s({\[<]+)", s) if w)
  const std::u32string s = utf8_decode(to_str(v));
  auto is_sep = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
  };
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    const bool sep = is_sep(s[i]);
    while (j < s.size() && is_sep(s[j]) == sep) ++j;
    const std::string word = utf8_encode(std::u32string_view(s).substr(i, j - i));
    const std::string first = utf8_encode(std::u32string_view(s).substr(i, 1));
    out += py_upper(first) + py_lower(std::string_view(word).substr(first.size()));
    i = j;
  }
  return Value(std::move(out));
}
Result<Value> f_trim(Interpreter&, const Value& v, CallArgs& a) {
  const Value chars = a.take(0, "chars", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 1, "trim"));
  std::optional<std::string> c;
  if (chars.is_string()) {
    c = chars.as_string();
  } else if (!chars.is_none()) {
    return TemplateError("strip arg must be None or str");
  }
  return Value(py_strip(to_str(v), StripSide::kBoth, c));
}
Result<Value> f_replace(Interpreter& in, const Value& v, CallArgs& a) {
  const Value from = a.take(0, "old");
  const Value to = a.take(1, "new");
  const Value count = a.take(2, "count", Value::none());
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 3, "replace"));
  // Jinja2: str(s).replace(str(old), str(new), count)
  const std::string s = to_str(v);
  const std::string old_text = to_str(from);
  const std::string new_text = to_str(to);
  if (!count.is_none() && !count.is_int() && !count.is_bool()) {
    return TemplateError(
        fmt::format("'{}' object cannot be interpreted as an integer", type_name(count)));
  }
  const int64_t n = old_text.empty() ? static_cast<int64_t>(utf8_length(s)) + 1
                                     : py_count(s, old_text);
  CLEAVE_RETURN_IF_ERROR(in.check_size(s.size() + static_cast<size_t>(n) * new_text.size()));
  const int64_t limit = count.is_int() ? count.as_int() : (count.is_bool() ? count.as_bool() : -1);
  return Value(py_replace(s, old_text, new_text, limit));
}
Result<Value> f_string(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "string"));
  return Value(to_str(v));
}
Result<Value> f_escape(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "escape"));
  std::string out;
  for (char c : to_str(v)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return Value(std::move(out));
}
Result<Value> f_center(Interpreter& in, const Value& v, CallArgs& a) {
  const Value width = a.take(0, "width", Value(int64_t{80}));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 1, "center"));
  CallArgs args;
  args.positional.push_back(width);
  return in.call(find_method(Value(to_str(v)), "center"), args);
}
Result<Value> f_indent(Interpreter& in, const Value& v, CallArgs& a) {
  const Value width = a.take(0, "width", Value(int64_t{4}));
  const bool first = truthy(a.take(1, "first", Value(false)));
  const bool blank = truthy(a.take(2, "blank", Value(false)));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 3, "indent"));
  std::string indention;
  if (width.is_string()) {
    indention = width.as_string();
  } else if (width.is_int() || width.is_bool()) {
    const int64_t n = width.is_int() ? width.as_int() : width.as_bool();
    CLEAVE_RETURN_IF_ERROR(in.check_size(static_cast<size_t>(std::max<int64_t>(n, 0))));
    indention.assign(static_cast<size_t>(std::max<int64_t>(n, 0)), ' ');
  } else {
    return TemplateError(
        fmt::format("can't multiply sequence by non-int of type '{}'", type_name(width)));
  }
  const std::vector<std::string> lines = py_splitlines(to_str(v) + "\n", false);
  std::string rv;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      rv += "\n";
      if (blank || !lines[i].empty()) rv += indention;
    }
    rv += lines[i];
    CLEAVE_RETURN_IF_ERROR(in.check_size(rv.size()));
  }
  if (first) rv = indention + rv;
  return Value(std::move(rv));
}
Result<Value> f_wordcount(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "wordcount"));
  int64_t n = 0;
  bool in_word = false;
  for (char32_t c : utf8_decode(to_str(v))) {
    const bool w = c == '_' || (c < 0x80 ? std::isalnum(static_cast<int>(c)) != 0 : !py_isspace(c));
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value(n);
}
Result<Value> f_truncate(Interpreter&, const Value& v, CallArgs& a) {
  const Value length_v = a.take(0, "length", Value(int64_t{255}));
  const bool killwords = truthy(a.take(1, "killwords", Value(false)));
  const Value end_v = a.take(2, "end", Value("..."));
  const Value leeway_v = a.take(3, "leeway", Value(int64_t{5}));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 4, "truncate"));
  if (!length_v.is_int() || !leeway_v.is_int() || !end_v.is_string()) {
    return TemplateError("truncate() expects integer length and leeway and a string end");
  }
  const std::string& end = end_v.as_string();
  const int64_t length = length_v.as_int();
  const auto end_len = static_cast<int64_t>(utf8_length(end));
  if (length < end_len) return TemplateError(fmt::format("expected length >= {}, got {}", end_len, length));
  if (!v.is_string()) {  // Jinja2 measures and slices the value itself
    CLEAVE_ASSIGN_OR_RETURN(int64_t n, cleave::jinja::length(v));
    if (n <= length + leeway_v.as_int()) return v;
    return TemplateError(killwords ? fmt::format("can only concatenate {} (not \"str\") to {}",
                                                 type_name(v), type_name(v))
                                   : fmt::format("'{}' object has no attribute 'rsplit'", type_name(v)));
  }
  const std::string& s = v.as_string();
  if (static_cast<int64_t>(utf8_length(s)) <= length + leeway_v.as_int()) return Value(s);
  std::string head = py_slice(s, slice_indices(static_cast<int64_t>(utf8_length(s)), 0, length - end_len, 1));
  if (killwords) return Value(head + end);
  return Value(py_rsplit(head, std::string(" "), 1)[0] + end);
}
Result<Value> f_format(Interpreter& in, const Value& v, CallArgs& a) {
  if (!a.positional.empty() && !a.keyword.empty()) {
    return TemplateError("can't handle positional and keyword arguments at the same time");
  }
  Value args;
  if (!a.keyword.empty()) {
    auto d = std::make_shared<Dict>();
    for (auto& [k, val] : a.keyword) CLEAVE_RETURN_IF_ERROR(d->set(Value(k), val));
    args = Value(DictPtr(std::move(d)));
  } else {
    args = Value::tuple(a.positional);
  }
  CLEAVE_ASSIGN_OR_RETURN(std::string s, percent_format(in, to_str(v), args));
  return Value(std::move(s));
}
Result<Value> f_safe(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "safe"));
  return v.is_string() ? v : Value(to_str(v));
}

Result<Value> f_tojson(Interpreter& in, const Value& v, CallArgs& a) {
  JsonDumpOptions o;
  o.ensure_ascii = truthy(a.take(0, "ensure_ascii", Value(false)));
  const Value indent = a.take(1, "indent", Value::none());
  const Value separators = a.take(2, "separators", Value::none());
  o.sort_keys = truthy(a.take(3, "sort_keys", Value(false)));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 4, "tojson"));
  if (!indent.is_none()) {
    o.has_indent = true;
    o.item_separator = ",";
    if (indent.is_string()) {
      o.indent = indent.as_string();
    } else if (indent.is_int()) {
      CLEAVE_RETURN_IF_ERROR(in.check_size(static_cast<size_t>(std::max<int64_t>(indent.as_int(), 0))));
      o.indent.assign(static_cast<size_t>(std::max<int64_t>(indent.as_int(), 0)), ' ');
    } else if (indent.is_bool()) {
      o.indent.assign(indent.as_bool() ? 1 : 0, ' ');
    } else {
      return TemplateError(
          fmt::format("can't multiply sequence by non-int of type '{}'", type_name(indent)));
    }
  }
  if (!separators.is_none()) {
    if (!separators.is_list() || separators.as_list().items.size() != 2 ||
        !separators.as_list().items[0].is_string() || !separators.as_list().items[1].is_string()) {
      return TemplateError("tojson separators must be a pair of strings");
    }
    o.item_separator = separators.as_list().items[0].as_string();
    o.key_separator = separators.as_list().items[1].as_string();
  }
  CLEAVE_ASSIGN_OR_RETURN(std::string s, json_dumps(v, o));
  CLEAVE_RETURN_IF_ERROR(in.check_size(s.size()));
  return Value(std::move(s));
}

// --- numbers --------------------------------------------------------------------------------------

// Python's int(str, base): optional sign, whitespace and underscores; base prefixes.
std::optional<int64_t> parse_int(std::string s, int64_t base) {
  s = py_strip(s, StripSide::kBoth, std::nullopt);
  std::string digits;
  for (char c : s) {
    if (c != '_') digits.push_back(c);
  }
  if (digits.empty() || base < 0 || base == 1 || base > 36) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(digits.c_str(), &end, static_cast<int>(base));
  if (errno != 0 || end == digits.c_str() || *end != '\0') return std::nullopt;
  return static_cast<int64_t>(v);
}

Result<Value> f_int(Interpreter&, const Value& v, CallArgs& a) {
  const Value fallback = a.take(0, "default", Value(int64_t{0}));
  const Value base = a.take(1, "base", Value(int64_t{10}));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "int"));
  if (v.is_int()) return v;
  if (v.is_bool()) return Value(static_cast<int64_t>(v.as_bool()));
  if (v.is_float()) {
    const double t = std::trunc(v.as_float());
    if (!std::isfinite(t) || std::fabs(t) > 9.2e18) return TemplateError("cannot convert float to integer");
    return Value(static_cast<int64_t>(t));
  }
  if (v.is_undefined()) return TemplateError(v.undefined_hint());
  if (v.is_string()) {
    if (auto i = parse_int(v.as_string(), base.is_int() ? base.as_int() : 10)) return Value(*i);
    const std::string s = py_strip(v.as_string(), StripSide::kBoth, std::nullopt);
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end != nullptr && *end == '\0' && std::isfinite(d) && std::fabs(d) < 9.2e18) {
      return Value(static_cast<int64_t>(std::trunc(d)));
    }
  }
  return fallback;
}
Result<Value> f_float(Interpreter&, const Value& v, CallArgs& a) {
  const Value fallback = a.take(0, "default", Value(0.0));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 1, "float"));
  if (v.is_number()) return Value(v.number_as_double());
  if (v.is_undefined()) return TemplateError(v.undefined_hint());
  if (v.is_string()) {
    std::string s;
    for (char c : py_strip(v.as_string(), StripSide::kBoth, std::nullopt)) {
      if (c != '_') s.push_back(c);
    }
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end != nullptr && *end == '\0') return Value(d);
  }
  return fallback;
}
Result<Value> f_abs(Interpreter&, const Value& v, CallArgs& a) {
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 0, "abs"));
  if (v.is_int()) {
    if (v.as_int() == INT64_MIN) return TemplateError("integer overflow");
    return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (v.is_bool()) return Value(static_cast<int64_t>(v.as_bool()));
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (v.is_undefined()) return TemplateError(v.undefined_hint());
  return TemplateError(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
}
Result<Value> f_round(Interpreter&, const Value& v, CallArgs& a) {
  const Value precision_v = a.take(0, "precision", Value(int64_t{0}));
  const Value method_v = a.take(1, "method", Value("common"));
  CLEAVE_RETURN_IF_ERROR(check_no_extra(a, 2, "round"));
  const std::string method = to_str(method_v);
  if (method != "common" && method != "ceil" && method != "floor") {
    return TemplateError("method must be common, ceil or floor");
  }
  if (!v.is_number()) {
    if (v.is_undefined()) return TemplateError(v.undefined_hint());
    return TemplateError(fmt::format("type {} doesn't define __round__ method", type_name(v)));
  }
  if (!precision_v.is_int()) return TemplateError("precision must be an integer");
  const int64_t precision = std::clamp<int64_t>(precision_v.as_int(), -308, 308);
  if (method == "common") {
    if (!v.is_float()) return Value(static_cast<int64_t>(v.number_as_double()));
    // Correctly rounded to `precision` decimals (ties to even), as CPython's round().
    char buf[512];
    if (precision >= 0) {
      std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), v.as_float());
      return Value(std::strtod(buf, nullptr));
    }
    const double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value(std::nearbyint(v.as_float() / scale) * scale);
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.number_as_double() * scale;
  return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

struct FilterEntry {
  const char* name;
  FilterFn fn;
};

const FilterEntry kScalarFilters[] = {
    {"abs", f_abs}, {"capitalize", f_capitalize}, {"center", f_center},
    {"e", f_escape}, {"escape", f_escape}, {"float", f_float},
    {"forceescape", f_escape}, {"format", f_format}, {"indent", f_indent},
    {"int", f_int}, {"lower", f_lower}, {"replace", f_replace},
    {"round", f_round}, {"safe", f_safe}, {"string", f_string},
    {"title", f_title}, {"tojson", f_tojson}, {"trim", f_trim},
    {"truncate", f_truncate}, {"upper", f_upper}, {"wordcount", f_wordcount},
};

}  // namespace

FilterFn find_scalar_filter(std::string_view name) {
  for (const FilterEntry& e : kScalarFilters) {
    if (name == e.name) return e.fn;
  }
  return nullptr;
}

}  // namespace cleave::jinja
