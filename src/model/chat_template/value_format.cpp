// str(), repr() and json.dumps() of template values, as CPython prints them.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <vector>

#include "chat_template/pystr.h"
#include "chat_template/value.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

// Containers nested deeper than this print as "..." (repr) or fail (json); sane data never gets
// near it, and it keeps the recursion bounded for data a template built on purpose.
constexpr int kMaxFormatDepth = 200;

void repr_string(std::string& out, const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  out.push_back(quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!py_isprintable(c)) {
      if (c < 0x100) {
        out += fmt::format("\\x{:02x}", static_cast<uint32_t>(c));
      } else if (c < 0x10000) {
        out += fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
      } else {
        out += fmt::format("\\U{:08x}", static_cast<uint32_t>(c));
      }
    } else {
      utf8_append(out, c);
    }
  }
  out.push_back(quote);
}

void repr_into(std::string& out, const Value& v, std::vector<const void*>& active, int depth);

void repr_dict_body(std::string& out, const Dict& d, std::vector<const void*>& active, int depth) {
  if (std::find(active.begin(), active.end(), &d) != active.end()) {
    out += "{...}";
    return;
  }
  active.push_back(&d);
  out.push_back('{');
  bool first = true;
  for (const auto& [k, val] : d.entries) {
    if (!first) out += ", ";
    first = false;
    repr_into(out, k, active, depth + 1);
    out += ": ";
    repr_into(out, val, active, depth + 1);
  }
  out.push_back('}');
  active.pop_back();
}

void repr_into(std::string& out, const Value& v, std::vector<const void*>& active, int depth) {
  if (depth > kMaxFormatDepth) {
    out += "...";
    return;
  }
  switch (v.kind()) {
    case Value::Kind::kString:
      repr_string(out, v.as_string());
      return;
    case Value::Kind::kList: {
      const List& l = v.as_list();
      if (l.type == List::Type::kIterator) {
        out += fmt::format("<{} object>", l.py_type);
        return;
      }
      if (l.type == List::Type::kRange) {
        out += l.range_step == 1 ? fmt::format("range({}, {})", l.range_start, l.range_stop)
                                 : fmt::format("range({}, {}, {})", l.range_start, l.range_stop,
                                               l.range_step);
        return;
      }
      if (l.type == List::Type::kView) out += l.py_type + "(";
      out.push_back(l.is_tuple ? '(' : '[');
      for (size_t i = 0; i < l.items.size(); ++i) {
        if (i > 0) out += ", ";
        repr_into(out, l.items[i], active, depth + 1);
      }
      if (l.is_tuple && l.items.size() == 1) out.push_back(',');
      out.push_back(l.is_tuple ? ')' : ']');
      if (l.type == List::Type::kView) out.push_back(')');
      return;
    }
    case Value::Kind::kDict: {
      const Dict& d = v.as_dict();
      if (d.type == Dict::Type::kNamespace) {
        out += "<Namespace ";
        repr_dict_body(out, d, active, depth);
        out.push_back('>');
      } else if (d.type == Dict::Type::kLoop) {
        const Value* index = d.find("index");
        const Value* len = d.find("length");
        out += fmt::format("<LoopContext {}/{}>", index ? to_str(*index) : "?",
                           len ? to_str(*len) : "?");
      } else {
        repr_dict_body(out, d, active, depth);
      }
      return;
    }
    case Value::Kind::kUndefined:
      out += "Undefined";
      return;
    case Value::Kind::kCallable: {
      const Callable& c = v.as_callable();
      if (c.type_name == "Macro") {
        out += fmt::format("<Macro '{}'>", c.name);
      } else {
        out += fmt::format("<built-in function {}>", c.name);
      }
      return;
    }
    default:
      out += to_str(v);
      return;
  }
}

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out.push_back('"');
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ensure_ascii && c == 0x7F)) {
      out += fmt::format("\\u{:04x}", c);
    } else if (c >= 0x80 && ensure_ascii) {
      size_t j = i + 1;
      while (j < s.size() && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) ++j;
      for (char32_t cp : utf8_decode(std::string_view(s).substr(i, j - i))) {
        if (cp >= 0x10000) {
          const char32_t v = cp - 0x10000;
          out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        } else {
          out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
        }
      }
      i = j - 1;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out.push_back('"');
}

std::string json_float(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  return format_float(f);
}

Status json_into(std::string& out, const Value& v, const JsonDumpOptions& o, int depth) {
  if (depth > kMaxFormatDepth) return TemplateError("maximum nesting depth exceeded in tojson");
  auto newline = [&](int level) {
    if (!o.has_indent) return;
    out.push_back('\n');
    for (int i = 0; i < level; ++i) out += o.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone: out += "null"; return Status::Ok();
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return Status::Ok();
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return Status::Ok();
    case Value::Kind::kFloat: out += json_float(v.as_float()); return Status::Ok();
    case Value::Kind::kString: json_string(out, v.as_string(), o.ensure_ascii); return Status::Ok();
    case Value::Kind::kList: {
      if (v.as_list().type != List::Type::kList && v.as_list().type != List::Type::kTuple) break;
      const auto& items = v.as_list().items;
      if (items.empty()) {
        out += "[]";
        return Status::Ok();
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += o.item_separator;
        newline(depth + 1);
        CLEAVE_RETURN_IF_ERROR(json_into(out, items[i], o, depth + 1));
      }
      newline(depth);
      out.push_back(']');
      return Status::Ok();
    }
    case Value::Kind::kDict: {
      const Dict& d = v.as_dict();
      if (d.type != Dict::Type::kDict) break;
      if (d.size() == 0) {
        out += "{}";
        return Status::Ok();
      }
      std::vector<const std::pair<Value, Value>*> entries;
      entries.reserve(d.size());
      for (const auto& kv : d.entries) entries.push_back(&kv);
      if (o.sort_keys) {  // sorted(dct.items()): by the original keys, TypeError when mixed
        Status error;
        std::stable_sort(entries.begin(), entries.end(), [&](const auto* a, const auto* b) {
          if (!error.ok()) return false;
          auto r = compare(a->first, b->first, "<");
          if (!r.ok()) {
            error = r.status();
            return false;
          }
          return *r;
        });
        CLEAVE_RETURN_IF_ERROR(error);
      }
      std::vector<std::pair<std::string, const Value*>> items;
      items.reserve(d.size());
      for (const auto* kv : entries) {
        const Value& k = kv->first;
        const Value& val = kv->second;
        std::string key;
        switch (k.kind()) {
          case Value::Kind::kString: key = k.as_string(); break;
          case Value::Kind::kInt: key = std::to_string(k.as_int()); break;
          case Value::Kind::kFloat: key = json_float(k.as_float()); break;
          case Value::Kind::kBool: key = k.as_bool() ? "true" : "false"; break;
          case Value::Kind::kNone: key = "null"; break;
          default:
            return TemplateError(fmt::format(
                "keys must be str, int, float, bool or None, not {}", type_name(k)));
        }
        items.emplace_back(std::move(key), &val);
      }
      out.push_back('{');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += o.item_separator;
        newline(depth + 1);
        json_string(out, items[i].first, o.ensure_ascii);
        out += o.key_separator;
        CLEAVE_RETURN_IF_ERROR(json_into(out, *items[i].second, o, depth + 1));
      }
      newline(depth);
      out.push_back('}');
      return Status::Ok();
    }
    default:
      break;
  }
  return TemplateError(fmt::format("Object of type {} is not JSON serializable", type_name(v)));
}

}  // namespace

std::string format_float(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  std::string out;
  if (!sci.empty() && sci[0] == '-') {
    out.push_back('-');
    sci.remove_prefix(1);
  }
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits.push_back(c);
  }
  int exp10 = 0;
  std::from_chars(sci.data() + e_pos + 1 + (sci[e_pos + 1] == '+' ? 1 : 0), sci.data() + sci.size(),
                  exp10);
  const int decpt = exp10 + 1;
  const int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out.push_back(digits[0]);
    if (n > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    out += fmt::format("e{}{:02d}", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-decpt), '0');
    out += digits;
  } else if (decpt < n) {
    out.append(digits, 0, static_cast<size_t>(decpt));
    out.push_back('.');
    out.append(digits, static_cast<size_t>(decpt), std::string::npos);
  } else {
    out += digits;
    out.append(static_cast<size_t>(decpt - n), '0');
    out += ".0";
  }
  return out;
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat: return format_float(v.as_float());
    case Value::Kind::kString: return v.as_string();
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  std::string out;
  std::vector<const void*> active;
  repr_into(out, v, active, 0);
  return out;
}

Result<std::string> json_dumps(const Value& v, const JsonDumpOptions& opts) {
  std::string out;
  CLEAVE_RETURN_IF_ERROR(json_into(out, v, opts, 0));
  return out;
}

}  // namespace cleave::jinja
