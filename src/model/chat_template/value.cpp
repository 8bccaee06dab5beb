#include "chat_template/value.h"

#include <cmath>

#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {

namespace {
const std::string kEmpty;
}  // namespace

Value Value::undefined(std::string hint) {
  Value v;
  v.v_ = Undefined{std::make_shared<const std::string>(std::move(hint))};
  return v;
}

Value Value::list(std::vector<Value> items) {
  auto l = std::make_shared<List>();
  l->items = std::move(items);
  return Value(ListPtr(std::move(l)));
}

Value Value::tuple(std::vector<Value> items) {
  auto l = std::make_shared<List>();
  l->items = std::move(items);
  l->type = List::Type::kTuple;
  l->is_tuple = true;
  return Value(ListPtr(std::move(l)));
}

Value Value::sequence(std::vector<Value> items, List::Type type, std::string py_type) {
  auto l = std::make_shared<List>();
  l->items = std::move(items);
  l->type = type;
  l->is_tuple = type == List::Type::kTuple;
  l->py_type = std::move(py_type);
  return Value(ListPtr(std::move(l)));
}

bool Value::is_mapping() const { return is_dict() && as_dict().type == Dict::Type::kDict; }

double Value::number_as_double() const {
  if (is_float()) return as_float();
  if (is_int()) return static_cast<double>(as_int());
  return as_bool() ? 1.0 : 0.0;
}

const std::string& Value::undefined_hint() const {
  const auto& u = std::get<Undefined>(v_);
  return u.hint ? *u.hint : kEmpty;
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.as_string()));
  auto k = hash_key(key);
  if (!k.ok()) return nullptr;
  auto it = index_.find(*k);
  return it == index_.end() ? nullptr : &entries[it->second].second;
}

const Value* Dict::find(std::string_view key) const {
  std::string k;
  k.reserve(key.size() + 1);
  k.push_back('s');
  k.append(key);
  auto it = index_.find(k);
  return it == index_.end() ? nullptr : &entries[it->second].second;
}

Status Dict::set(Value key, Value value) {
  CLEAVE_ASSIGN_OR_RETURN(std::string k, hash_key(key));
  auto [it, inserted] = index_.emplace(std::move(k), entries.size());
  if (inserted) {
    entries.emplace_back(std::move(key), std::move(value));
  } else {
    entries[it->second].second = std::move(value);
  }
  return Status::Ok();
}

Value CallArgs::take(size_t pos, std::string_view name, Value fallback) {
  for (auto it = keyword.begin(); it != keyword.end(); ++it) {
    if (it->first == name) {
      Value v = std::move(it->second);
      keyword.erase(it);
      return v;
    }
  }
  if (pos < positional.size()) return positional[pos];
  return fallback;
}

bool CallArgs::has(size_t pos, std::string_view name) const {
  if (pos < positional.size()) return true;
  for (const auto& [k, v] : keyword) {
    if (k == name) return true;
  }
  return false;
}

Status TemplateError(std::string message) { return InvalidArgument(std::move(message)); }

Status check_no_extra(const CallArgs& a, size_t max_positional, std::string_view function) {
  if (!a.keyword.empty()) {
    return TemplateError(fmt::format("{}() got an unexpected keyword argument '{}'", function,
                                     a.keyword.front().first));
  }
  if (a.positional.size() > max_positional) {
    return TemplateError(
        fmt::format("{}() takes at most {} argument(s)", function, max_positional + 1));
  }
  return Status::Ok();
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.as_bool();
    case Value::Kind::kInt:
      return v.as_int() != 0;
    case Value::Kind::kFloat:
      return v.as_float() != 0.0;
    case Value::Kind::kString:
      return !v.as_string().empty();
    case Value::Kind::kList:
      return v.as_list().type == List::Type::kIterator || !v.as_list().items.empty();
    case Value::Kind::kDict:
      return v.as_dict().type != Dict::Type::kDict || v.as_dict().size() > 0;
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList:
      switch (v.as_list().type) {
        case List::Type::kList: return "list";
        case List::Type::kTuple: return "tuple";
        case List::Type::kRange: return "range";
        default: return v.as_list().py_type;
      }
    case Value::Kind::kDict:
      switch (v.as_dict().type) {
        case Dict::Type::kDict: return "dict";
        case Dict::Type::kNamespace: return "Namespace";
        case Dict::Type::kLoop: return "LoopContext";
      }
      return "dict";
    case Value::Kind::kCallable: return v.as_callable().type_name;
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_dict() && v.as_dict().type == Dict::Type::kNamespace) {
    return "jinja2.utils.Namespace object";
  }
  if (v.is_dict() && v.as_dict().type == Dict::Type::kLoop) return "jinja2.runtime.LoopContext object";
  if (v.is_undefined()) return "jinja2.runtime.Undefined object";
  return type_name(v) + " object";
}

Value missing_attribute(const Value& obj, const Value& name) {
  if (name.is_string()) {
    return Value::undefined(fmt::format("{} has no attribute {}", repr(Value(object_type_repr(obj))),
                                        repr(name)));
  }
  return Value::undefined(fmt::format("{} has no element {}", object_type_repr(obj), repr(name)));
}

Value missing_name(std::string_view name) {
  return Value::undefined(fmt::format("{} is undefined", repr(Value(name))));
}

namespace {
constexpr int kMaxCompareDepth = 200;  // deeper data compares unequal / fails: bounded recursion
bool equals_at(const Value& a, const Value& b, int depth);
Result<bool> compare_at(const Value& a, const Value& b, std::string_view op, int depth);
}  // namespace

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

Result<bool> compare(const Value& a, const Value& b, std::string_view op) {
  return compare_at(a, b, op, 0);
}

namespace {

bool equals_at(const Value& a, const Value& b, int depth) {
  if (depth > kMaxCompareDepth) return false;
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.number_as_double() == b.number_as_double();
    const int64_t x = a.is_int() ? a.as_int() : (a.as_bool() ? 1 : 0);
    const int64_t y = b.is_int() ? b.as_int() : (b.as_bool() ? 1 : 0);
    return x == y;
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList: {
      const List& x = a.as_list();
      const List& y = b.as_list();
      if (x.type != y.type || x.py_type != y.py_type || x.items.size() != y.items.size()) {
        return false;
      }
      if (x.type == List::Type::kIterator) return &x == &y;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!equals_at(x.items[i], y.items[i], depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.type != Dict::Type::kDict || y.type != Dict::Type::kDict) return &x == &y;
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (other == nullptr || !equals_at(v, *other, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kCallable:
      return &a.as_callable() == &b.as_callable();
    default:
      return false;
  }
}

Result<bool> compare_at(const Value& a, const Value& b, std::string_view op, int depth) {
  if (depth > kMaxCompareDepth) return TemplateError("maximum nesting depth exceeded in comparison");
  auto result = [&](int c) {
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  };
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.number_as_double();
      const double y = b.number_as_double();
      if (std::isnan(x) || std::isnan(y)) return false;
      return result(x < y ? -1 : (x > y ? 1 : 0));
    }
    const int64_t x = a.is_int() ? a.as_int() : (a.as_bool() ? 1 : 0);
    const int64_t y = b.is_int() ? b.as_int() : (b.as_bool() ? 1 : 0);
    return result(x < y ? -1 : (x > y ? 1 : 0));
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.as_string().compare(b.as_string());  // UTF-8 byte order = code point order
    return result(c < 0 ? -1 : (c > 0 ? 1 : 0));
  }
  if (a.is_list() && b.is_list() && a.as_list().type == b.as_list().type &&
      (a.as_list().type == List::Type::kList || a.as_list().type == List::Type::kTuple)) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals_at(x[i], y[i], depth + 1)) continue;
      return compare_at(x[i], y[i], op, depth + 1);
    }
    return result(x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0));
  }
  if (a.is_undefined() || b.is_undefined()) {
    return TemplateError(a.is_undefined() ? a.undefined_hint() : b.undefined_hint());
  }
  return TemplateError(fmt::format("'{}' not supported between instances of '{}' and '{}'", op,
                                   type_name(a), type_name(b)));
}

}  // namespace

namespace {
Result<std::string> hash_key_at(const Value& v, int depth);
}  // namespace

Result<std::string> hash_key(const Value& v) { return hash_key_at(v, 0); }

namespace {

Result<std::string> hash_key_at(const Value& v, int depth) {
  if (depth > kMaxCompareDepth) return TemplateError("maximum nesting depth exceeded in a key");
  switch (v.kind()) {
    case Value::Kind::kString:
      return "s" + v.as_string();
    case Value::Kind::kInt:
      return "n" + std::to_string(v.as_int());
    case Value::Kind::kBool:
      return std::string(v.as_bool() ? "n1" : "n0");
    case Value::Kind::kFloat: {
      const double f = v.as_float();
      if (std::isfinite(f) && f == std::floor(f) && std::fabs(f) < 9.2e18) {
        return "n" + std::to_string(static_cast<int64_t>(f));
      }
      return "f" + format_float(f);
    }
    case Value::Kind::kNone:
      return std::string("N");
    case Value::Kind::kList:
      if (v.as_list().is_tuple) {
        std::string k = "t(";
        for (const Value& item : v.as_list().items) {
          CLEAVE_ASSIGN_OR_RETURN(std::string ik, hash_key_at(item, depth + 1));
          k += std::to_string(ik.size()) + ":" + ik;
        }
        return k + ")";
      }
      [[fallthrough]];
    default:
      if (v.is_undefined()) return std::string("U");
      if (v.is_callable()) return "c" + std::to_string(reinterpret_cast<uintptr_t>(&v.as_callable()));
      return TemplateError(fmt::format("unhashable type: '{}'", type_name(v)));
  }
}

}  // namespace

Result<bool> contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        if (item.is_undefined()) return TemplateError(item.undefined_hint());
        return TemplateError(fmt::format("'in <string>' requires string as left operand, not {}",
                                         type_name(item)));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& v : container.as_list().items) {
        if (equals(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict: {
      const Dict& d = container.as_dict();
      if (d.type != Dict::Type::kDict) {
        return TemplateError(fmt::format("argument of type '{}' is not iterable",
                                         type_name(container)));
      }
      CLEAVE_ASSIGN_OR_RETURN(std::string unused, hash_key(item));
      (void)unused;
      return d.find(item) != nullptr;
    }
    case Value::Kind::kUndefined:
      return false;
    default:
      return TemplateError(fmt::format("argument of type '{}' is not iterable",
                                       type_name(container)));
  }
}

Result<std::vector<Value>> iterate(const Value& v) {
  std::vector<Value> out;
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return out;
    case Value::Kind::kString:
      for (std::string& c : utf8_chars(v.as_string())) out.emplace_back(std::move(c));
      return out;
    case Value::Kind::kList:
      return v.as_list().items;
    case Value::Kind::kDict:
      if (v.as_dict().type == Dict::Type::kDict) {
        out.reserve(v.as_dict().size());
        for (const auto& [k, val] : v.as_dict().entries) out.push_back(k);
        return out;
      }
      [[fallthrough]];
    default:
      return TemplateError(fmt::format("'{}' object is not iterable", type_name(v)));
  }
}

Result<int64_t> length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return int64_t{0};
    case Value::Kind::kString:
      return static_cast<int64_t>(utf8_length(v.as_string()));
    case Value::Kind::kList:
      if (v.as_list().type == List::Type::kIterator) break;
      return static_cast<int64_t>(v.as_list().items.size());
    case Value::Kind::kDict:
      if (v.as_dict().type == Dict::Type::kLoop) {
        const Value* len = v.as_dict().find("length");
        if (len != nullptr) return len->as_int();
      }
      if (v.as_dict().type == Dict::Type::kDict) return static_cast<int64_t>(v.as_dict().size());
      break;
    default:
      break;
  }
  return TemplateError(fmt::format("object of type '{}' has no len()", type_name(v)));
}

}  // namespace cleave::jinja
