// Jinja2's builtin tests (jinja2/tests.py): `x is defined`, `x is string`, `x is equalto y`, ...
#include "chat_template/interpreter.h"
#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

Value arg0(CallArgs& a) { return a.take(0, "other"); }

bool is_iterable(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kString:
    case Value::Kind::kList:
      return true;
    case Value::Kind::kDict:
      return v.as_dict().type != Dict::Type::kNamespace;  // dict and LoopContext iterate
    default:
      return false;
  }
}

bool is_sequence(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kString:
      return true;
    case Value::Kind::kList:
      return v.as_list().type != List::Type::kIterator && v.as_list().type != List::Type::kView;
    case Value::Kind::kDict:
      return v.as_dict().type == Dict::Type::kDict;
    default:
      return false;
  }
}

Result<bool> t_defined(Interpreter&, const Value& v, CallArgs&) { return !v.is_undefined(); }
Result<bool> t_undefined(Interpreter&, const Value& v, CallArgs&) { return v.is_undefined(); }
Result<bool> t_none(Interpreter&, const Value& v, CallArgs&) { return v.is_none(); }
Result<bool> t_boolean(Interpreter&, const Value& v, CallArgs&) { return v.is_bool(); }
Result<bool> t_true(Interpreter&, const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }
Result<bool> t_false(Interpreter&, const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }
Result<bool> t_integer(Interpreter&, const Value& v, CallArgs&) { return v.is_int(); }
Result<bool> t_float(Interpreter&, const Value& v, CallArgs&) { return v.is_float(); }
Result<bool> t_number(Interpreter&, const Value& v, CallArgs&) { return v.is_number(); }
Result<bool> t_string(Interpreter&, const Value& v, CallArgs&) { return v.is_string(); }
Result<bool> t_mapping(Interpreter&, const Value& v, CallArgs&) { return v.is_mapping(); }
Result<bool> t_iterable(Interpreter&, const Value& v, CallArgs&) { return is_iterable(v); }
Result<bool> t_sequence(Interpreter&, const Value& v, CallArgs&) { return is_sequence(v); }
Result<bool> t_callable(Interpreter&, const Value& v, CallArgs&) {
  return v.is_callable() || v.is_undefined() ||
         (v.is_dict() && v.as_dict().type == Dict::Type::kLoop);
}
Result<bool> t_escaped(Interpreter&, const Value&, CallArgs&) { return false; }
Result<bool> t_lower(Interpreter&, const Value& v, CallArgs&) {
  return py_is(to_str(v), CharClass::kLower);
}
Result<bool> t_upper(Interpreter&, const Value& v, CallArgs&) {
  return py_is(to_str(v), CharClass::kUpper);
}
Result<bool> t_filter(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() && find_filter(v.as_string()) != nullptr;
}
Result<bool> t_test(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() && find_test(v.as_string()) != nullptr;
}

Result<bool> modulo_is(Interpreter& in, const Value& v, const Value& d, int64_t want) {
  CLEAVE_ASSIGN_OR_RETURN(Value r, binary_op(in, "%", v, d));
  return equals(r, Value(want));
}
Result<bool> t_odd(Interpreter& in, const Value& v, CallArgs&) { return modulo_is(in, v, Value(int64_t{2}), 1); }
Result<bool> t_even(Interpreter& in, const Value& v, CallArgs&) { return modulo_is(in, v, Value(int64_t{2}), 0); }
Result<bool> t_divisibleby(Interpreter& in, const Value& v, CallArgs& a) {
  return modulo_is(in, v, a.take(0, "num"), 0);
}

Result<bool> t_eq(Interpreter&, const Value& v, CallArgs& a) { return equals(v, arg0(a)); }
Result<bool> t_ne(Interpreter&, const Value& v, CallArgs& a) { return !equals(v, arg0(a)); }
Result<bool> t_lt(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg0(a), "<"); }
Result<bool> t_le(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg0(a), "<="); }
Result<bool> t_gt(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg0(a), ">"); }
Result<bool> t_ge(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg0(a), ">="); }
Result<bool> t_in(Interpreter&, const Value& v, CallArgs& a) { return contains(a.take(0, "seq"), v); }
Result<bool> t_sameas(Interpreter&, const Value& v, CallArgs& a) {
  const Value other = arg0(a);
  if (v.kind() != other.kind()) return false;
  switch (v.kind()) {
    case Value::Kind::kList: return v.list_ptr() == other.list_ptr();
    case Value::Kind::kDict: return v.dict_ptr() == other.dict_ptr();
    case Value::Kind::kCallable: return &v.as_callable() == &other.as_callable();
    case Value::Kind::kFloat: return false;
    default: return equals(v, other);
  }
}

struct TestEntry {
  const char* name;
  TestFn fn;
};

const TestEntry kTests[] = {
    {"defined", t_defined},   {"undefined", t_undefined}, {"none", t_none},
    {"boolean", t_boolean},   {"true", t_true},           {"false", t_false},
    {"integer", t_integer},   {"float", t_float},         {"number", t_number},
    {"string", t_string},     {"mapping", t_mapping},     {"iterable", t_iterable},
    {"sequence", t_sequence}, {"callable", t_callable},   {"escaped", t_escaped},
    {"lower", t_lower},       {"upper", t_upper},         {"filter", t_filter},
    {"test", t_test},         {"odd", t_odd},             {"even", t_even},
    {"divisibleby", t_divisibleby}, {"eq", t_eq},         {"equalto", t_eq},
    {"==", t_eq},             {"ne", t_ne},               {"!=", t_ne},
    {"lt", t_lt},             {"lessthan", t_lt},         {"<", t_lt},
    {"le", t_le},             {"<=", t_le},               {"gt", t_gt},
    {"greaterthan", t_gt},    {">", t_gt},                {"ge", t_ge},
    {">=", t_ge},             {"in", t_in},               {"sameas", t_sameas},
};

}  // namespace

TestFn find_test(std::string_view name) {
  for (const TestEntry& e : kTests) {
    if (name == e.name) return e.fn;
  }
  return nullptr;
}

}  // namespace cleave::jinja
