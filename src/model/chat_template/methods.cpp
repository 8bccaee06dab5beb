// Attribute and item lookup (Jinja2's sandboxed getattr / getitem), the str / dict / list methods
// templates call, and the global functions.
#include <algorithm>

#include "chat_template/interpreter.h"
#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

using MethodImpl = Result<Value> (*)(Interpreter&, const Value& self, CallArgs& args);

Value bind_method(const Value& self, const std::string& name, MethodImpl impl) {
  return Value(CallablePtr(std::make_shared<Callable>(Callable{
      name, "builtin_function_or_method",
      [self, impl](Interpreter& in, CallArgs& args) { return impl(in, self, args); }})));
}

Value unsafe(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name,
                                      type_name(obj)));
}

// An optional str argument; `error` is CPython's message for another type ({} = its type).
Result<std::optional<std::string>> opt_str(const Value& v, std::string_view error) {
  if (v.is_none()) return std::optional<std::string>();
  if (!v.is_string()) return TemplateError(fmt::format(fmt::runtime(error), type_name(v)));
  return std::optional<std::string>(v.as_string());
}

Result<std::string> need_str(const Value& v, std::string_view method) {
  if (v.is_string()) return v.as_string();
  if (method == "replace") {
    return TemplateError(fmt::format("replace() argument must be str, not {}", type_name(v)));
  }
  return TemplateError(fmt::format("must be str, not {}", type_name(v)));
}

Result<int64_t> need_int(const Value& v, std::string_view /*method*/) {
  if (v.is_int()) return v.as_int();
  if (v.is_bool()) return static_cast<int64_t>(v.as_bool());
  return TemplateError(
      fmt::format("'{}' object cannot be interpreted as an integer", type_name(v)));
}

Status need_args(const CallArgs& a, size_t n, std::string_view method) {
  if (a.positional.size() + a.keyword.size() < n) {
    return TemplateError(fmt::format("{}() takes at least {} argument ({} given)", method, n,
                                     a.positional.size() + a.keyword.size()));
  }
  return Status::Ok();
}

Result<Value> affix_test(const Value& self, CallArgs& a, bool prefix) {
  const char* name = prefix ? "startswith" : "endswith";
  CLEAVE_RETURN_IF_ERROR(need_args(a, 1, name));
  const Value arg = a.take(0, "prefix");
  std::vector<Value> options;
  if (arg.is_list() && arg.as_list().is_tuple) {
    options = arg.as_list().items;
  } else if (arg.is_string()) {
    options.push_back(arg);
  } else {
    return TemplateError(fmt::format("{} first arg must be str or a tuple of str, not {}", name,
                                     type_name(arg)));
  }
  const std::string& s = self.as_string();
  for (const Value& o : options) {
    if (!o.is_string()) {
      return TemplateError(fmt::format("tuple for {} must only contain str, not {}", name,
                                       type_name(o)));
    }
    const std::string& x = o.as_string();
    if (x.size() <= s.size() &&
        (prefix ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0)) {
      return Value(true);
    }
  }
  return Value(false);
}

Result<Value> strip_method(const Value& self, CallArgs& a, StripSide side) {
  const char* error = side == StripSide::kBoth   ? "strip arg must be None or str"
                      : side == StripSide::kLeft ? "lstrip arg must be None or str"
                                                 : "rstrip arg must be None or str";
  CLEAVE_ASSIGN_OR_RETURN(std::optional<std::string> chars,
                          opt_str(a.take(0, "chars", Value::none()), error));
  return Value(py_strip(self.as_string(), side, chars));
}

Result<Value> split_method(const Value& self, CallArgs& a, bool reverse) {
  CLEAVE_ASSIGN_OR_RETURN(std::optional<std::string> sep,
                          opt_str(a.take(0, "sep", Value::none()), "must be str or None, not {}"));
  if (sep && sep->empty()) return TemplateError("empty separator");
  const Value max = a.take(1, "maxsplit", Value(int64_t{-1}));
  CLEAVE_ASSIGN_OR_RETURN(int64_t maxsplit, need_int(max, "split"));
  std::vector<std::string> parts = reverse ? py_rsplit(self.as_string(), sep, maxsplit)
                                           : py_split(self.as_string(), sep, maxsplit);
  std::vector<Value> out;
  out.reserve(parts.size());
  for (std::string& p : parts) out.emplace_back(std::move(p));
  return Value::list(std::move(out));
}

Result<Value> pad_method(Interpreter& in, const Value& self, CallArgs& a, int where) {
  CLEAVE_RETURN_IF_ERROR(need_args(a, 1, "center"));
  CLEAVE_ASSIGN_OR_RETURN(int64_t width, need_int(a.take(0, "width"), "center"));
  CLEAVE_ASSIGN_OR_RETURN(std::string fill, need_str(a.take(1, "fillchar", Value(" ")), "center"));
  if (utf8_length(fill) != 1) {
    return TemplateError("The fill character must be exactly one character long");
  }
  const std::string& s = self.as_string();
  const auto len = static_cast<int64_t>(utf8_length(s));
  if (width <= len) return self;
  CLEAVE_RETURN_IF_ERROR(in.check_size(static_cast<size_t>(width) * fill.size()));
  const int64_t total = width - len;
  int64_t left = 0;
  if (where < 0) {
    left = 0;
  } else if (where > 0) {
    left = total;
  } else {
    left = total / 2 + (total & width & 1);  // CPython's centering rule
  }
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < total - left; ++i) out += fill;
  return Value(std::move(out));
}

// A small str.format: {} / {0} / {name} fields with optional !r / !s, without format specs.
Result<Value> format_method(Interpreter& in, const Value& self, CallArgs& a) {
  const std::string& f = self.as_string();
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    const char c = f[i];
    if (c == '}' ) {
      if (i + 1 < f.size() && f[i + 1] == '}') ++i;
      out.push_back('}');
      continue;
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < f.size() && f[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    const size_t close = f.find('}', i);
    if (close == std::string::npos) return TemplateError("Single '{' encountered in format string");
    std::string field = f.substr(i + 1, close - i - 1);
    i = close;
    char conversion = 's';
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 's';
      field.resize(bang);
    }
    if (field.find(':') != std::string::npos) {
      return TemplateError("format specs are not supported in str.format");
    }
    Value v;
    if (field.empty() || std::all_of(field.begin(), field.end(), ::isdigit)) {
      const size_t idx = field.empty() ? auto_index++ : std::stoul(field);
      if (idx >= a.positional.size()) {
        return TemplateError(fmt::format("Replacement index {} out of range for positional args tuple", idx));
      }
      v = a.positional[idx];
    } else {
      bool found = false;
      for (const auto& [k, val] : a.keyword) {
        if (k == field) {
          v = val;
          found = true;
        }
      }
      if (!found) return TemplateError(fmt::format("'{}'", field));
    }
    out += conversion == 'r' ? repr(v) : to_str(v);
    CLEAVE_RETURN_IF_ERROR(in.check_size(out.size()));
  }
  return Value(std::move(out));
}

std::optional<Value> string_method(const Value& self, const std::string& name) {
  using S = StripSide;
  static const std::pair<const char*, MethodImpl> kMethods[] = {
      {"startswith", [](Interpreter&, const Value& s, CallArgs& a) { return affix_test(s, a, true); }},
      {"endswith", [](Interpreter&, const Value& s, CallArgs& a) { return affix_test(s, a, false); }},
      {"strip", [](Interpreter&, const Value& s, CallArgs& a) { return strip_method(s, a, S::kBoth); }},
      {"lstrip", [](Interpreter&, const Value& s, CallArgs& a) { return strip_method(s, a, S::kLeft); }},
      {"rstrip", [](Interpreter&, const Value& s, CallArgs& a) { return strip_method(s, a, S::kRight); }},
      {"split", [](Interpreter&, const Value& s, CallArgs& a) { return split_method(s, a, false); }},
      {"rsplit", [](Interpreter&, const Value& s, CallArgs& a) { return split_method(s, a, true); }},
      {"splitlines", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         std::vector<Value> out;
         for (std::string& l : py_splitlines(s.as_string(), truthy(a.take(0, "keepends", Value(false))))) {
           out.emplace_back(std::move(l));
         }
         return Value::list(std::move(out));
       }},
      {"upper", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_upper(s.as_string())); }},
      {"lower", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_lower(s.as_string())); }},
      {"casefold", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_lower(s.as_string())); }},
      {"title", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_title(s.as_string())); }},
      {"capitalize", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_capitalize(s.as_string())); }},
      {"replace", [](Interpreter& in, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_RETURN_IF_ERROR(need_args(a, 2, "replace"));
         CLEAVE_ASSIGN_OR_RETURN(std::string from, need_str(a.take(0, "old"), "replace"));
         CLEAVE_ASSIGN_OR_RETURN(std::string to, need_str(a.take(1, "new"), "replace"));
         CLEAVE_ASSIGN_OR_RETURN(int64_t count, need_int(a.take(2, "count", Value(int64_t{-1})), "replace"));
         const int64_t n = from.empty() ? static_cast<int64_t>(utf8_length(s.as_string())) + 1
                                        : py_count(s.as_string(), from);
         CLEAVE_RETURN_IF_ERROR(in.check_size(s.as_string().size() + static_cast<size_t>(n) * to.size()));
         return Value(py_replace(s.as_string(), from, to, count));
       }},
      {"find", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sub, need_str(a.take(0, "sub"), "find"));
         return Value(py_find(s.as_string(), sub, false));
       }},
      {"rfind", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sub, need_str(a.take(0, "sub"), "rfind"));
         return Value(py_find(s.as_string(), sub, true));
       }},
      {"index", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sub, need_str(a.take(0, "sub"), "index"));
         const int64_t i = py_find(s.as_string(), sub, false);
         if (i < 0) return TemplateError("substring not found");
         return Value(i);
       }},
      {"rindex", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sub, need_str(a.take(0, "sub"), "rindex"));
         const int64_t i = py_find(s.as_string(), sub, true);
         if (i < 0) return TemplateError("substring not found");
         return Value(i);
       }},
      {"count", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sub, need_str(a.take(0, "sub"), "count"));
         return Value(py_count(s.as_string(), sub));
       }},
      {"join", [](Interpreter& in, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, iterate(a.take(0, "iterable")));
         std::string out;
         for (size_t i = 0; i < items.size(); ++i) {
           if (!items[i].is_string()) {
             return TemplateError(fmt::format("sequence item {}: expected str instance, {} found", i,
                                              type_name(items[i])));
           }
           if (i > 0) out += s.as_string();
           out += items[i].as_string();
           CLEAVE_RETURN_IF_ERROR(in.check_size(out.size()));
         }
         return Value(std::move(out));
       }},
      {"isalpha", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kAlpha)); }},
      {"isdigit", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kDigit)); }},
      {"isdecimal", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kDigit)); }},
      {"isnumeric", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kDigit)); }},
      {"isalnum", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kAlnum)); }},
      {"isspace", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kSpace)); }},
      {"islower", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kLower)); }},
      {"isupper", [](Interpreter&, const Value& s, CallArgs&) -> Result<Value> { return Value(py_is(s.as_string(), CharClass::kUpper)); }},
      {"center", [](Interpreter& in, const Value& s, CallArgs& a) { return pad_method(in, s, a, 0); }},
      {"ljust", [](Interpreter& in, const Value& s, CallArgs& a) { return pad_method(in, s, a, -1); }},
      {"rjust", [](Interpreter& in, const Value& s, CallArgs& a) { return pad_method(in, s, a, 1); }},
      {"zfill", [](Interpreter& in, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(int64_t width, need_int(a.take(0, "width"), "zfill"));
         std::string str = s.as_string();
         const auto len = static_cast<int64_t>(utf8_length(str));
         if (width <= len) return s;
         CLEAVE_RETURN_IF_ERROR(in.check_size(static_cast<size_t>(width)));
         const size_t at = !str.empty() && (str[0] == '-' || str[0] == '+') ? 1 : 0;
         str.insert(at, static_cast<size_t>(width - len), '0');
         return Value(std::move(str));
       }},
      {"removeprefix", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string p, need_str(a.take(0, "prefix"), "removeprefix"));
         const std::string& str = s.as_string();
         if (str.compare(0, p.size(), p) == 0) return Value(str.substr(p.size()));
         return s;
       }},
      {"removesuffix", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string p, need_str(a.take(0, "suffix"), "removesuffix"));
         const std::string& str = s.as_string();
         if (!p.empty() && p.size() <= str.size() && str.compare(str.size() - p.size(), p.size(), p) == 0) {
           return Value(str.substr(0, str.size() - p.size()));
         }
         return s;
       }},
      {"partition", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sep, need_str(a.take(0, "sep"), "partition"));
         if (sep.empty()) return TemplateError("empty separator");
         const std::string& str = s.as_string();
         const size_t p = str.find(sep);
         if (p == std::string::npos) return Value::tuple({s, Value(""), Value("")});
         return Value::tuple({Value(str.substr(0, p)), Value(sep), Value(str.substr(p + sep.size()))});
       }},
      {"rpartition", [](Interpreter&, const Value& s, CallArgs& a) -> Result<Value> {
         CLEAVE_ASSIGN_OR_RETURN(std::string sep, need_str(a.take(0, "sep"), "rpartition"));
         if (sep.empty()) return TemplateError("empty separator");
         const std::string& str = s.as_string();
         const size_t p = str.rfind(sep);
         if (p == std::string::npos) return Value::tuple({Value(""), Value(""), s});
         return Value::tuple({Value(str.substr(0, p)), Value(sep), Value(str.substr(p + sep.size()))});
       }},
      {"format", format_method},
  };
  for (const auto& [n, impl] : kMethods) {
    if (name == n) return bind_method(self, name, impl);
  }
  return std::nullopt;
}

std::optional<Value> dict_method(const Value& self, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    const int which = name == "items" ? 0 : (name == "keys" ? 1 : 2);
    return bind_method(self, name, which == 0 ? MethodImpl([](Interpreter&, const Value& d, CallArgs&) -> Result<Value> {
      std::vector<Value> out;
      for (const auto& [k, v] : d.as_dict().entries) out.push_back(Value::tuple({k, v}));
      return Value::sequence(std::move(out), List::Type::kView, "dict_items");
    }) : which == 1 ? MethodImpl([](Interpreter&, const Value& d, CallArgs&) -> Result<Value> {
      std::vector<Value> out;
      for (const auto& [k, v] : d.as_dict().entries) out.push_back(k);
      return Value::sequence(std::move(out), List::Type::kView, "dict_keys");
    }) : MethodImpl([](Interpreter&, const Value& d, CallArgs&) -> Result<Value> {
      std::vector<Value> out;
      for (const auto& [k, v] : d.as_dict().entries) out.push_back(v);
      return Value::sequence(std::move(out), List::Type::kView, "dict_values");
    }));
  }
  if (name == "get") {
    return bind_method(self, name, [](Interpreter&, const Value& d, CallArgs& a) -> Result<Value> {
      CLEAVE_RETURN_IF_ERROR(need_args(a, 1, "get"));
      const Value key = a.take(0, "key");
      CLEAVE_RETURN_IF_ERROR(hash_key(key).status());
      const Value* v = d.as_dict().find(key);
      return v != nullptr ? *v : a.take(1, "default", Value::none());
    });
  }
  if (name == "copy") {
    return bind_method(self, name, [](Interpreter&, const Value& d, CallArgs&) -> Result<Value> {
      auto copy = std::make_shared<Dict>();
      for (const auto& [k, v] : d.as_dict().entries) CLEAVE_RETURN_IF_ERROR(copy->set(k, v));
      return Value(DictPtr(std::move(copy)));
    });
  }
  if (name == "clear" || name == "pop" || name == "popitem" || name == "setdefault" ||
      name == "update") {
    return unsafe(self, name);
  }
  return std::nullopt;
}

std::optional<Value> list_method(const Value& self, const std::string& name) {
  const List::Type t = self.as_list().type;
  if (t != List::Type::kList && t != List::Type::kTuple) return std::nullopt;
  if (name == "index") {
    return bind_method(self, name, [](Interpreter&, const Value& l, CallArgs& a) -> Result<Value> {
      const Value x = a.take(0, "value");
      const auto& items = l.as_list().items;
      for (size_t i = 0; i < items.size(); ++i) {
        if (equals(items[i], x)) return Value(static_cast<int64_t>(i));
      }
      return TemplateError(fmt::format("{} is not in list", repr(x)));
    });
  }
  if (name == "count") {
    return bind_method(self, name, [](Interpreter&, const Value& l, CallArgs& a) -> Result<Value> {
      const Value x = a.take(0, "value");
      int64_t n = 0;
      for (const Value& item : l.as_list().items) n += equals(item, x) ? 1 : 0;
      return Value(n);
    });
  }
  if (t == List::Type::kList &&
      (name == "append" || name == "clear" || name == "extend" || name == "insert" ||
       name == "pop" || name == "remove" || name == "reverse" || name == "sort")) {
    return unsafe(self, name);
  }
  return std::nullopt;
}

}  // namespace

Value find_method(const Value& obj, const std::string& name) {
  std::optional<Value> m;
  if (obj.is_string()) m = string_method(obj, name);
  if (obj.is_mapping()) m = dict_method(obj, name);
  if (obj.is_list()) m = list_method(obj, name);
  return m ? *m : Value();
}

Result<Value> Interpreter::getattr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) return TemplateError(obj.undefined_hint());
  Value m = find_method(obj, name);
  if (m.is_callable() || (m.is_undefined() && !m.undefined_hint().empty())) return m;
  if (obj.is_dict()) {
    const Value* v = obj.as_dict().find(std::string_view(name));
    if (v != nullptr) return *v;
  }
  return missing_attribute(obj, Value(name));
}

Result<Value> Interpreter::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) return TemplateError(obj.undefined_hint());
  const bool int_key = key.is_int() || key.is_bool();
  const int64_t index = key.is_int() ? key.as_int() : (key.is_bool() && key.as_bool() ? 1 : 0);
  if (obj.is_list() && int_key &&
      (obj.as_list().type == List::Type::kList || obj.as_list().type == List::Type::kTuple ||
       obj.as_list().type == List::Type::kRange)) {
    const auto& items = obj.as_list().items;
    const int64_t i = index < 0 ? index + static_cast<int64_t>(items.size()) : index;
    if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[static_cast<size_t>(i)];
    return missing_attribute(obj, key);
  }
  if (obj.is_string() && int_key) {
    const std::vector<std::string> chars = utf8_chars(obj.as_string());
    const int64_t i = index < 0 ? index + static_cast<int64_t>(chars.size()) : index;
    if (i >= 0 && i < static_cast<int64_t>(chars.size())) return Value(chars[static_cast<size_t>(i)]);
    return missing_attribute(obj, key);
  }
  if (obj.is_mapping()) {
    const Value* v = obj.as_dict().find(key);
    if (v != nullptr) return *v;
  }
  if (key.is_string()) {
    Value m = find_method(obj, key.as_string());
    if (m.is_callable() || (m.is_undefined() && !m.undefined_hint().empty())) return m;
    if (obj.is_dict() && !obj.is_mapping()) {
      const Value* v = obj.as_dict().find(key);
      if (v != nullptr) return *v;
    }
  }
  return missing_attribute(obj, key);
}

void add_globals(Scope& scope) {
  auto fn = [&scope](const char* name, NativeFunction f) {
    scope.set(name, Value(CallablePtr(std::make_shared<Callable>(
                        Callable{name, "builtin_function_or_method", std::move(f)}))));
  };
  fn("range", [](Interpreter& in, CallArgs& a) -> Result<Value> {
    if (a.positional.empty() || a.positional.size() > 3 || !a.keyword.empty()) {
      return TemplateError("range expected 1 to 3 integer arguments");
    }
    int64_t v[3] = {0, 0, 1};
    for (size_t i = 0; i < a.positional.size(); ++i) {
      CLEAVE_ASSIGN_OR_RETURN(v[i], need_int(a.positional[i], "range"));
    }
    int64_t start = 0, stop = v[0], step = 1;
    if (a.positional.size() >= 2) {
      start = v[0];
      stop = v[1];
    }
    if (a.positional.size() == 3) step = v[2];
    if (step == 0) return TemplateError("range() arg 3 must not be zero");
    const __int128 span = step > 0 ? static_cast<__int128>(stop) - start
                                   : static_cast<__int128>(start) - stop;
    const __int128 abs_step = step > 0 ? step : -static_cast<__int128>(step);
    const __int128 count128 = span > 0 ? (span + abs_step - 1) / abs_step : 0;
    const int64_t count = count128 > 100001 ? 100001 : static_cast<int64_t>(count128);
    if (count > 100000) {
      return TemplateError(
          "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    }
    CLEAVE_RETURN_IF_ERROR(in.check_size(static_cast<size_t>(count)));
    auto l = std::make_shared<List>();
    l->type = List::Type::kRange;
    l->range_start = start;
    l->range_stop = stop;
    l->range_step = step;
    l->items.reserve(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) l->items.emplace_back(start + i * step);
    return Value(ListPtr(std::move(l)));
  });
  fn("dict", [](Interpreter&, CallArgs& a) -> Result<Value> {
    auto d = std::make_shared<Dict>();
    if (!a.positional.empty()) {
      const Value& src = a.positional[0];
      if (src.is_mapping()) {
        for (const auto& [k, v] : src.as_dict().entries) CLEAVE_RETURN_IF_ERROR(d->set(k, v));
      } else {
        CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> pairs, iterate(src));
        for (const Value& p : pairs) {
          CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> kv, iterate(p));
          if (kv.size() != 2) {
            return TemplateError("dictionary update sequence element has wrong length");
          }
          CLEAVE_RETURN_IF_ERROR(d->set(kv[0], kv[1]));
        }
      }
    }
    for (auto& [k, v] : a.keyword) CLEAVE_RETURN_IF_ERROR(d->set(Value(k), std::move(v)));
    return Value(DictPtr(std::move(d)));
  });
  fn("namespace", [](Interpreter& in, CallArgs& a) -> Result<Value> {
    auto d = std::make_shared<Dict>();
    d->type = Dict::Type::kNamespace;
    for (const Value& src : a.positional) {
      if (!src.is_mapping()) return TemplateError("namespace() expects a mapping");
      for (const auto& [k, v] : src.as_dict().entries) CLEAVE_RETURN_IF_ERROR(d->set(k, v));
    }
    for (auto& [k, v] : a.keyword) CLEAVE_RETURN_IF_ERROR(d->set(Value(k), std::move(v)));
    in.track(d);
    return Value(DictPtr(std::move(d)));
  });
  fn("joiner", [](Interpreter&, CallArgs& a) -> Result<Value> {
    const Value sep = a.take(0, "sep", Value(", "));
    auto used = std::make_shared<bool>(false);
    return Value(CallablePtr(std::make_shared<Callable>(Callable{
        "joiner", "Joiner", [sep, used](Interpreter&, CallArgs&) -> Result<Value> {
          if (!*used) {
            *used = true;
            return Value("");
          }
          return sep;
        }})));
  });
  fn("raise_exception", [](Interpreter&, CallArgs& a) -> Result<Value> {
    const Value msg = a.take(0, "message");
    return TemplateError(msg.is_string() ? msg.as_string() : to_str(msg));
  });
  fn("strftime_now", [](Interpreter& in, CallArgs& a) -> Result<Value> {
    const Value f = a.take(0, "format");
    if (!f.is_string()) {
      return TemplateError(
          fmt::format("strftime() argument 1 must be str, not {}", type_name(f)));
    }
    return Value(in.strftime()(f.as_string()));
  });
}

}  // namespace cleave::jinja
