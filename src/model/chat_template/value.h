// The value type of the chat-template interpreter: what a Jinja2 template sees of Python objects.
//
// Kinds: undefined, none, bool, int (int64), float (double), str (UTF-8), list / tuple
// (immutable, shared), dict (insertion-ordered, shared; also the attribute objects Namespace and
// LoopContext), and callables (builtins, bound methods, macros). Semantics follow Python where
// templates rely on them: truthiness, ==, ordering, `in`, str() and repr(), json.dumps.
// Errors carry the message Python / Jinja2 would raise (no prefix), as StatusCode kInvalidArgument.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::jinja {

class Value;
class Interpreter;
struct List;
struct Dict;
struct Callable;
using ListPtr = std::shared_ptr<const List>;
using DictPtr = std::shared_ptr<Dict>;
using CallablePtr = std::shared_ptr<const Callable>;

// An undefined value remembers the message Jinja2's Undefined raises when it is used for more
// than rendering or testing (e.g. "'dict object' has no attribute 'content'").
struct Undefined {
  std::shared_ptr<const std::string> hint;
};
struct NoneType {};

// A sequence. Besides list and tuple, it stands for the other iterables templates meet: a
// generator (what Jinja2's map / select / selectattr / items / unique filters return: no len(),
// always true, not subscriptable), a dict view (dict.items(), keys(), values(): len() but not
// subscriptable) and range(). `py_type` is the Python type name for messages.
struct List {
  enum class Type : uint8_t { kList, kTuple, kIterator, kView, kRange };
  std::vector<Value> items;
  Type type = Type::kList;
  bool is_tuple = false;              // type == kTuple
  std::string py_type;                // kIterator / kView: "generator", "dict_items", ...
  int64_t range_start = 0, range_stop = 0, range_step = 1;  // kRange, for repr
};

class Value {
 public:
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };

  Value() : v_(Undefined{}) {}
  Value(NoneType) : v_(NoneType{}) {}                     // NOLINT
  Value(bool b) : v_(b) {}                                // NOLINT
  Value(int64_t i) : v_(i) {}                             // NOLINT
  Value(int i) : v_(static_cast<int64_t>(i)) {}           // NOLINT
  Value(double f) : v_(f) {}                              // NOLINT
  Value(std::string s) : v_(std::move(s)) {}              // NOLINT
  Value(std::string_view s) : v_(std::string(s)) {}       // NOLINT
  Value(const char* s) : v_(std::string(s)) {}            // NOLINT
  Value(ListPtr l) : v_(std::move(l)) {}                  // NOLINT
  Value(DictPtr d) : v_(std::move(d)) {}                  // NOLINT
  Value(CallablePtr c) : v_(std::move(c)) {}              // NOLINT

  static Value undefined(std::string hint);
  static Value none() { return Value(NoneType{}); }
  static Value list(std::vector<Value> items);
  static Value tuple(std::vector<Value> items);
  // A generator / list_reverseiterator (kIterator) or dict view (kView) named py_type.
  static Value sequence(std::vector<Value> items, List::Type type, std::string py_type);

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_undefined() const { return kind() == Kind::kUndefined; }
  bool is_none() const { return kind() == Kind::kNone; }
  bool is_bool() const { return kind() == Kind::kBool; }
  bool is_int() const { return kind() == Kind::kInt; }
  bool is_float() const { return kind() == Kind::kFloat; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }  // Python numbers.Number
  bool is_string() const { return kind() == Kind::kString; }
  bool is_list() const { return kind() == Kind::kList; }  // list or tuple
  bool is_dict() const { return kind() == Kind::kDict; }  // dict, Namespace or LoopContext
  bool is_mapping() const;                                // a real dict
  bool is_callable() const { return kind() == Kind::kCallable; }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  // int, bool or float as a double / an int64 (bool as 0/1); callers check is_number().
  double number_as_double() const;
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const List& as_list() const { return *std::get<ListPtr>(v_); }
  const ListPtr& list_ptr() const { return std::get<ListPtr>(v_); }
  Dict& as_dict() const { return *std::get<DictPtr>(v_); }
  const DictPtr& dict_ptr() const { return std::get<DictPtr>(v_); }
  const Callable& as_callable() const { return *std::get<CallablePtr>(v_); }
  // The message raised when this undefined value is used ("'x' is undefined").
  const std::string& undefined_hint() const;

 private:
  std::variant<Undefined, NoneType, bool, int64_t, double, std::string, ListPtr, DictPtr,
               CallablePtr>
      v_;
};

// An insertion-ordered dict (Python 3.7+ semantics). Also the attribute bag of Jinja2's
// Namespace (the only object a template may mutate, via `set ns.attr`) and of LoopContext.
struct Dict {
  enum class Type : uint8_t { kDict, kNamespace, kLoop };
  Type type = Type::kDict;
  std::vector<std::pair<Value, Value>> entries;

  // nullptr when absent. Keys compare as Python dict keys do (1 == 1.0 == True).
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  const Value* find(const char* key) const { return find(std::string_view(key)); }
  const Value* find(const std::string& key) const { return find(std::string_view(key)); }
  // Inserts or replaces. InvalidArgument ("unhashable type: 'list'") for a list or dict key.
  Status set(Value key, Value value);
  size_t size() const { return entries.size(); }

 private:
  std::unordered_map<std::string, size_t> index_;  // hash_key(key) -> position in entries
};

// Arguments of a call: f(a, b, k=v).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The argument at position `pos` or named `name` (removed from the keyword list), or
  // `fallback` when neither was given.
  Value take(size_t pos, std::string_view name, Value fallback = Value());
  bool has(size_t pos, std::string_view name) const;
};

// TypeError unless, after take()s, no keyword and at most max_positional positional arguments
// remain ("upper() got an unexpected keyword argument 'x'").
Status check_no_extra(const CallArgs& a, size_t max_positional, std::string_view function);

using NativeFunction = std::function<Result<Value>(Interpreter&, CallArgs&)>;

struct Callable {
  std::string name;       // for messages: "range", "startswith", the macro's name
  std::string type_name;  // Python's type name: "builtin_function_or_method", "Macro", ...
  NativeFunction fn;
};

// --- Python semantics (value.cpp) ---------------------------------------------------------------

// A template runtime error: InvalidArgument carrying exactly `message`.
Status TemplateError(std::string message);

bool truthy(const Value& v);
// Python's type(v).__name__: "str", "int", "NoneType", "list", "tuple", "dict", "Namespace", ...
std::string type_name(const Value& v);
// Jinja2's object_type_repr: "None", "dict object", "str object", ...
std::string object_type_repr(const Value& v);
// The undefined value of a missing attribute / item: the hint Jinja2's Undefined would raise.
Value missing_attribute(const Value& obj, const Value& name);
Value missing_name(std::string_view name);

bool equals(const Value& a, const Value& b);
// Python's `a < b`, `a <= b`, ... (op is "<", "<=", ">", ">="); TypeError when not comparable.
Result<bool> compare(const Value& a, const Value& b, std::string_view op);
// The canonical dict-key string of v; InvalidArgument for unhashable values.
Result<std::string> hash_key(const Value& v);
// Python's `a in b`.
Result<bool> contains(const Value& container, const Value& item);
// Python's iter(v) materialised: list items, str characters, dict keys; undefined iterates as
// empty; TypeError ("'int' object is not iterable") otherwise.
Result<std::vector<Value>> iterate(const Value& v);
// Python's len(v) (undefined: 0).
Result<int64_t> length(const Value& v);

// --- Formatting (value_format.cpp) ---------------------------------------------------------------

// Python's str(v) (what `{{ v }}` prints; undefined prints as "").
std::string to_str(const Value& v);
// Python's repr(v).
std::string repr(const Value& v);
// Python's repr(float): shortest round-trip digits, "1.0", "1e+16", "1.5e-05", "inf", "nan".
std::string format_float(double f);

struct JsonDumpOptions {
  bool ensure_ascii = false;  // transformers' tojson keeps non-ASCII characters
  bool sort_keys = false;
  bool has_indent = false;
  std::string indent;                 // newline + this per level when has_indent
  std::string item_separator = ", ";  // Python's defaults; "," when an indent is given
  std::string key_separator = ": ";
};
// Python's json.dumps(v, ...). TypeError for undefined, callables and objects.
Result<std::string> json_dumps(const Value& v, const JsonDumpOptions& opts);

}  // namespace cleave::jinja
