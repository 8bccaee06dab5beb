// The arithmetic operators and printf-style str formatting, with CPython's results and messages.
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "chat_template/interpreter.h"
#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

bool is_integral(const Value& v) { return v.is_int() || v.is_bool(); }
int64_t as_integral(const Value& v) { return v.is_int() ? v.as_int() : (v.as_bool() ? 1 : 0); }

Status unsupported(std::string_view op, const Value& a, const Value& b) {
  if (a.is_undefined()) return TemplateError(a.undefined_hint());
  if (b.is_undefined()) return TemplateError(b.undefined_hint());
  return TemplateError(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op,
                                   type_name(a), type_name(b)));
}

Status overflow() { return TemplateError("integer overflow (beyond 64 bits)"); }

Result<Value> repeat(Interpreter& in, const Value& seq, int64_t n) {
  if (n <= 0) {
    if (seq.is_string()) return Value("");
    return seq.as_list().is_tuple ? Value::tuple({}) : Value::list({});
  }
  if (seq.is_string()) {
    const std::string& s = seq.as_string();
    size_t total = 0;
    if (__builtin_mul_overflow(s.size(), static_cast<size_t>(n), &total)) total = SIZE_MAX;
    CLEAVE_RETURN_IF_ERROR(in.check_size(total));
    std::string out;
    out.reserve(s.size() * static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out += s;
    return Value(std::move(out));
  }
  const auto& items = seq.as_list().items;
  size_t total = 0;
  if (__builtin_mul_overflow(items.size(), static_cast<size_t>(n), &total)) total = SIZE_MAX;
  CLEAVE_RETURN_IF_ERROR(in.check_size(total));
  std::vector<Value> out;
  out.reserve(items.size() * static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), items.begin(), items.end());
  return seq.as_list().is_tuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

bool is_plain_sequence(const Value& v) {
  return v.is_list() && (v.as_list().type == List::Type::kList || v.as_list().type == List::Type::kTuple);
}

Result<Value> add(Interpreter& in, const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return Value(a.number_as_double() + b.number_as_double());
    int64_t r = 0;
    if (__builtin_add_overflow(as_integral(a), as_integral(b), &r)) return overflow();
    return Value(r);
  }
  if (a.is_undefined() || b.is_undefined()) return unsupported("+", a, b);
  if (a.is_string()) {
    if (!b.is_string()) {
      return TemplateError(fmt::format("can only concatenate str (not \"{}\") to str", type_name(b)));
    }
    CLEAVE_RETURN_IF_ERROR(in.check_size(a.as_string().size() + b.as_string().size()));
    return Value(a.as_string() + b.as_string());
  }
  if (is_plain_sequence(a)) {
    if (!b.is_list() || b.as_list().type != a.as_list().type) {
      return TemplateError(fmt::format("can only concatenate {} (not \"{}\") to {}", type_name(a),
                                       type_name(b), type_name(a)));
    }
    CLEAVE_RETURN_IF_ERROR(in.check_size(a.as_list().items.size() + b.as_list().items.size()));
    std::vector<Value> items = a.as_list().items;
    items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
    return a.as_list().is_tuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
  }
  return unsupported("+", a, b);
}

Result<Value> multiply(Interpreter& in, const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return Value(a.number_as_double() * b.number_as_double());
    int64_t r = 0;
    if (__builtin_mul_overflow(as_integral(a), as_integral(b), &r)) return overflow();
    return Value(r);
  }
  if (a.is_undefined() || b.is_undefined()) return unsupported("*", a, b);
  const Value* seq = (a.is_string() || is_plain_sequence(a)) ? &a : nullptr;
  const Value* count = seq ? &b : &a;
  if (!seq && (b.is_string() || is_plain_sequence(b))) seq = &b;
  if (seq != nullptr) {
    if (!is_integral(*count)) {
      return TemplateError(fmt::format("can't multiply sequence by non-int of type '{}'",
                                       type_name(*count)));
    }
    return repeat(in, *seq, as_integral(*count));
  }
  return unsupported("*", a, b);
}

Result<Value> divide(const Value& a, const Value& b, bool floor_div) {
  if (!a.is_number() || !b.is_number()) return unsupported(floor_div ? "//" : "/", a, b);
  const bool both_int = is_integral(a) && is_integral(b);
  if (!floor_div) {
    if (b.number_as_double() == 0.0) {
      return TemplateError(both_int ? "division by zero" : "float division by zero");
    }
    return Value(a.number_as_double() / b.number_as_double());
  }
  if (both_int) {
    const int64_t x = as_integral(a);
    const int64_t y = as_integral(b);
    if (y == 0) return TemplateError("integer division or modulo by zero");
    if (x == INT64_MIN && y == -1) return overflow();
    int64_t q = x / y;
    if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
    return Value(q);
  }
  const double y = b.number_as_double();
  if (y == 0.0) return TemplateError("float floor division by zero");
  const double x = a.number_as_double();
  const double m = std::fmod(x, y);  // CPython's float_floor_div
  double q = (x - m) / y;
  if (m != 0.0 && ((y < 0) != (m < 0))) q -= 1.0;
  if (q == 0.0) return Value(std::copysign(0.0, x / y));
  double fq = std::floor(q);
  if (q - fq > 0.5) fq += 1.0;
  return Value(fq);
}

Result<Value> modulo(Interpreter& in, const Value& a, const Value& b) {
  if (a.is_string()) {
    CLEAVE_ASSIGN_OR_RETURN(std::string s, percent_format(in, a.as_string(), b));
    return Value(std::move(s));
  }
  if (!a.is_number() || !b.is_number()) return unsupported("%", a, b);
  if (is_integral(a) && is_integral(b)) {
    const int64_t x = as_integral(a);
    const int64_t y = as_integral(b);
    if (y == 0) return TemplateError("integer modulo by zero");
    if (y == -1) return Value(int64_t{0});
    int64_t r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    return Value(r);
  }
  const double y = b.number_as_double();
  if (y == 0.0) return TemplateError("float modulo");
  double r = std::fmod(a.number_as_double(), y);
  if (r != 0.0 && ((r < 0) != (y < 0))) r += y;
  if (r == 0.0) r = std::copysign(0.0, y);
  return Value(r);
}

Result<Value> power(const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) return unsupported("** or pow()", a, b);
  if (is_integral(a) && is_integral(b) && as_integral(b) >= 0) {
    int64_t base = as_integral(a);
    int64_t e = as_integral(b);
    int64_t r = 1;
    while (e > 0) {
      if (e & 1) {
        if (__builtin_mul_overflow(r, base, &r)) return overflow();
      }
      e >>= 1;
      if (e > 0 && __builtin_mul_overflow(base, base, &base)) return overflow();
    }
    return Value(r);
  }
  const double x = a.number_as_double();
  const double y = b.number_as_double();
  if (x == 0.0 && y < 0) return TemplateError("0.0 cannot be raised to a negative power");
  if (x < 0 && y != std::floor(y)) {
    return TemplateError("complex results of ** are not supported");
  }
  return Value(std::pow(x, y));
}

}  // namespace

Result<Value> binary_op(Interpreter& in, std::string_view op, const Value& a, const Value& b) {
  if (op == "+") return add(in, a, b);
  if (op == "-") {
    if (!a.is_number() || !b.is_number()) return unsupported("-", a, b);
    if (a.is_float() || b.is_float()) return Value(a.number_as_double() - b.number_as_double());
    int64_t r = 0;
    if (__builtin_sub_overflow(as_integral(a), as_integral(b), &r)) return overflow();
    return Value(r);
  }
  if (op == "*") return multiply(in, a, b);
  if (op == "/") return divide(a, b, false);
  if (op == "//") return divide(a, b, true);
  if (op == "%") return modulo(in, a, b);
  if (op == "**") return power(a, b);
  return Internal(fmt::format("unknown operator {}", op));
}

Result<std::string> percent_format(Interpreter& in, const std::string& f, const Value& args) {
  std::vector<Value> positional;
  const Value* mapping = nullptr;
  // CPython treats any non-tuple with __getitem__ (dict, list, ...) as a possible mapping and
  // then does not complain about unused arguments.
  bool mapping_like = false;
  if (args.is_list() && args.as_list().is_tuple) {
    positional = args.as_list().items;
  } else {
    if (args.is_mapping()) mapping = &args;
    mapping_like = args.is_dict() || (args.is_list() && args.as_list().type != List::Type::kIterator);
    positional.push_back(args);
  }
  size_t next_arg = 0;
  bool used_mapping = false;
  std::string out;
  auto take = [&]() -> Result<Value> {
    if (next_arg >= positional.size()) return TemplateError("not enough arguments for format string");
    return positional[next_arg++];
  };
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out.push_back(f[i]);
      continue;
    }
    if (++i >= f.size()) return TemplateError("incomplete format");
    Value arg;
    bool have_arg = false;
    if (f[i] == '(') {
      const size_t close = f.find(')', i);
      if (close == std::string::npos) return TemplateError("incomplete format key");
      if (mapping == nullptr) return TemplateError("format requires a mapping");
      const Value* v = mapping->as_dict().find(std::string_view(f).substr(i + 1, close - i - 1));
      if (v == nullptr) return TemplateError(repr(Value(f.substr(i + 1, close - i - 1))));
      arg = *v;
      have_arg = true;
      used_mapping = true;
      i = close + 1;
    }
    std::string flags;
    while (i < f.size() && (f[i] == '-' || f[i] == '+' || f[i] == ' ' || f[i] == '#' || f[i] == '0')) {
      flags.push_back(f[i++]);
    }
    auto read_number = [&](int64_t* value) -> Status {
      if (i < f.size() && f[i] == '*') {
        ++i;
        CLEAVE_ASSIGN_OR_RETURN(Value w, take());
        if (!is_integral(w)) return TemplateError("* wants int");
        *value = as_integral(w);
        return Status::Ok();
      }
      while (i < f.size() && f[i] >= '0' && f[i] <= '9') {
        *value = *value * 10 + (f[i++] - '0');
        if (*value > 100000) return TemplateError("width or precision too big");
      }
      return Status::Ok();
    };
    int64_t width = 0;
    int64_t precision = -1;
    CLEAVE_RETURN_IF_ERROR(read_number(&width));
    if (i < f.size() && f[i] == '.') {
      ++i;
      precision = 0;
      CLEAVE_RETURN_IF_ERROR(read_number(&precision));
    }
    while (i < f.size() && (f[i] == 'h' || f[i] == 'l' || f[i] == 'L')) ++i;
    if (i >= f.size()) return TemplateError("incomplete format");
    const char type = f[i];
    if (type == '%') {
      out.push_back('%');
      continue;
    }
    if (!have_arg) {
      CLEAVE_ASSIGN_OR_RETURN(arg, take());
    }
    std::string piece;
    switch (type) {
      case 's': case 'r': case 'a': {
        piece = type == 's' ? to_str(arg) : repr(arg);
        if (precision >= 0) {
          const SliceBounds b = slice_indices(static_cast<int64_t>(utf8_length(piece)), 0, precision, 1);
          piece = py_slice(piece, b);
        }
        break;
      }
      case 'd': case 'i': case 'u': case 'o': case 'x': case 'X': case 'c': case 'e': case 'E':
      case 'f': case 'F': case 'g': case 'G': {
        const bool int_only = type == 'o' || type == 'x' || type == 'X' || type == 'c';
        if (!arg.is_number() || (int_only && arg.is_float())) {
          if (type == 'c') return TemplateError("%c requires int or char");
          if (int_only) {
            return TemplateError(fmt::format("%{} format: an integer is required, not {}", type,
                                             type_name(arg)));
          }
          if (type == 'd' || type == 'i' || type == 'u') {
            return TemplateError(fmt::format("%{} format: a real number is required, not {}",
                                             type, type_name(arg)));
          }
          return TemplateError(fmt::format("must be real number, not {}", type_name(arg)));
        }
        std::string spec = "%" + flags;
        if (width > 0) spec += std::to_string(width);
        if (precision >= 0) spec += "." + std::to_string(precision);
        char buf[512];
        if (type == 'c') {
          std::string c;
          utf8_append(c, static_cast<char32_t>(as_integral(arg)));
          piece = c;
          break;
        }
        if (type == 'e' || type == 'E' || type == 'f' || type == 'F' || type == 'g' || type == 'G') {
          spec.push_back(type);
          std::snprintf(buf, sizeof(buf), spec.c_str(), arg.number_as_double());
        } else {
          const long long v = arg.is_float() ? static_cast<long long>(std::trunc(arg.as_float()))
                                             : static_cast<long long>(as_integral(arg));
          spec += "ll";
          spec.push_back(type == 'i' || type == 'u' ? 'd' : type);
          std::snprintf(buf, sizeof(buf), spec.c_str(), v);
        }
        piece = buf;
        width = 0;  // snprintf applied it
        break;
      }
      default:
        return TemplateError(fmt::format("unsupported format character '{}'", type));
    }
    const auto len = static_cast<int64_t>(utf8_length(piece));
    if (width > len) {
      const std::string pad(static_cast<size_t>(width - len), ' ');
      piece = flags.find('-') != std::string::npos ? piece + pad : pad + piece;
    }
    out += piece;
    CLEAVE_RETURN_IF_ERROR(in.check_size(out.size()));
  }
  if (!used_mapping && !mapping_like && next_arg < positional.size()) {
    return TemplateError("not all arguments converted during string formatting");
  }
  return out;
}

}  // namespace cleave::jinja
