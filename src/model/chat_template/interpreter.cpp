// Statements and expressions of the interpreter. operators.cpp has the arithmetic, filters*.cpp
// and tests.cpp the builtin filters and tests, methods.cpp attribute lookup, methods and globals.
#include "chat_template/interpreter.h"

#include <optional>

#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {

const Value* Scope::find(std::string_view name) const {
  for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
    for (const auto& [k, v] : s->vars) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Scope::set(std::string_view name, Value value) {
  for (auto& [k, v] : vars) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  vars.emplace_back(std::string(name), std::move(value));
}

struct Interpreter::DepthGuard {
  explicit DepthGuard(Interpreter* in) : in(in) { ++in->depth_; }
  ~DepthGuard() { --in->depth_; }
  Status check() const {
    if (in->depth_ > in->limits_.max_depth) {
      return ResourceExhausted(fmt::format(
          "template recursion deeper than {} levels", in->limits_.max_depth));
    }
    return Status::Ok();
  }
  Interpreter* in;
};

Interpreter::Interpreter(RenderLimits limits, std::function<std::string(const std::string&)> strftime)
    : limits_(limits), strftime_(std::move(strftime)) {}

Interpreter::~Interpreter() {
  // Macros hold their defining scope and namespaces may hold themselves: break such cycles.
  for (const auto& w : tracked_scopes_) {
    if (auto s = w.lock()) s->vars.clear();
  }
  for (const auto& w : tracked_dicts_) {
    if (auto d = w.lock()) d->entries.clear();
  }
}

void Interpreter::track(const DictPtr& d) { tracked_dicts_.push_back(d); }

Status Interpreter::step() {
  if (++steps_ > limits_.max_steps) {
    return ResourceExhausted(fmt::format("template exceeded {} steps (loop iterations and calls)",
                                         limits_.max_steps));
  }
  return Status::Ok();
}

Status Interpreter::check_size(size_t size) const {
  if (size > limits_.max_output_bytes) {
    return ResourceExhausted(fmt::format("template output or value larger than {} bytes",
                                         limits_.max_output_bytes));
  }
  return Status::Ok();
}

Status Interpreter::append(std::string& out, std::string_view text) const {
  CLEAVE_RETURN_IF_ERROR(check_size(out.size() + text.size()));
  out.append(text);
  return Status::Ok();
}

Status Interpreter::render(const Program& program, ScopePtr globals, std::string* out) {
  auto top = std::make_shared<Scope>();
  top->parent = std::move(globals);
  tracked_scopes_.push_back(top);
  out->clear();
  return exec_body(program.body, top, *out);
}

Status Interpreter::exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
  DepthGuard guard(this);
  CLEAVE_RETURN_IF_ERROR(guard.check());
  for (const StmtPtr& s : body) {
    CLEAVE_RETURN_IF_ERROR(exec(*s, scope, out));
    if (flow_ != Flow::kNormal) break;
  }
  return Status::Ok();
}

Status Interpreter::exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
  switch (s.kind) {
    case StmtKind::kOutput:
      return append(out, s.text);
    case StmtKind::kPrint: {
      CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*s.expr, scope));
      return append(out, v.is_string() ? v.as_string() : to_str(v));
    }
    case StmtKind::kIf:
      for (const auto& [test, body] : s.branches) {
        CLEAVE_ASSIGN_OR_RETURN(Value t, eval(*test, scope));
        if (truthy(t)) return exec_body(body, scope, out);
      }
      return exec_body(s.else_body, scope, out);
    case StmtKind::kFor: {
      CLEAVE_ASSIGN_OR_RETURN(Value iterable, eval(*s.expr, scope));
      return exec_for(s, scope, iterable, 0, out);
    }
    case StmtKind::kSet: {
      if (s.target.kind == Target::Kind::kNamespaceAttr) {  // Jinja2 checks the target first
        const Value* ns = scope->find(s.target.name);
        if (ns == nullptr || !ns->is_dict() || ns->as_dict().type != Dict::Type::kNamespace) {
          return TemplateError("cannot assign attribute on non-namespace object");
        }
      }
      CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*s.expr, scope));
      return assign(s.target, std::move(v), scope);
    }
    case StmtKind::kSetBlock: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      std::string text;
      CLEAVE_RETURN_IF_ERROR(exec_body(s.body, inner, text));
      Value v(std::move(text));
      if (s.expr) {
        Value saved = std::move(filter_hole_);
        filter_hole_ = std::move(v);
        auto r = eval(*s.expr, scope);
        filter_hole_ = std::move(saved);
        CLEAVE_ASSIGN_OR_RETURN(v, std::move(r));
      }
      return assign(s.target, std::move(v), scope);
    }
    case StmtKind::kMacro:
      tracked_scopes_.push_back(scope);
      scope->set(s.macro.name, make_macro(s, scope, Value()));
      return Status::Ok();
    case StmtKind::kCallBlock: {
      tracked_scopes_.push_back(scope);
      Value caller = make_macro(s, scope, Value());
      CLEAVE_ASSIGN_OR_RETURN(CallArgs args, eval_call_args(*s.expr, 1, scope));
      args.keyword.emplace_back("caller", std::move(caller));
      CLEAVE_ASSIGN_OR_RETURN(Value callee, eval(*s.expr->args[0], scope));
      CLEAVE_ASSIGN_OR_RETURN(Value r, call(callee, args));
      return append(out, to_str(r));
    }
    case StmtKind::kFilterBlock: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      std::string text;
      CLEAVE_RETURN_IF_ERROR(exec_body(s.body, inner, text));
      Value saved = std::move(filter_hole_);
      filter_hole_ = Value(std::move(text));
      auto r = eval(*s.expr, scope);
      filter_hole_ = std::move(saved);
      CLEAVE_ASSIGN_OR_RETURN(Value v, std::move(r));
      return append(out, to_str(v));
    }
    case StmtKind::kWith: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      std::vector<Value> values;
      for (const auto& [target, expr] : s.assigns) {
        CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*expr, scope));
        values.push_back(std::move(v));
      }
      for (size_t i = 0; i < values.size(); ++i) {
        CLEAVE_RETURN_IF_ERROR(assign(s.assigns[i].first, std::move(values[i]), inner));
      }
      return exec_body(s.body, inner, out);
    }
    case StmtKind::kScope: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      return exec_body(s.body, inner, out);
    }
    case StmtKind::kBreak:
      flow_ = Flow::kBreak;
      return Status::Ok();
    case StmtKind::kContinue:
      flow_ = Flow::kContinue;
      return Status::Ok();
  }
  return Internal("unknown statement");
}

Status Interpreter::assign(const Target& t, Value v, const ScopePtr& scope) {
  switch (t.kind) {
    case Target::Kind::kName:
      scope->set(t.name, std::move(v));
      return Status::Ok();
    case Target::Kind::kNamespaceAttr: {
      const Value* ns = scope->find(t.name);
      if (ns == nullptr || !ns->is_dict() || ns->as_dict().type != Dict::Type::kNamespace) {
        return TemplateError("cannot assign attribute on non-namespace object");
      }
      return ns->as_dict().set(Value(t.attr), std::move(v));
    }
    case Target::Kind::kTuple: {
      CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, iterate(v));
      if (items.size() < t.items.size()) {
        return TemplateError(fmt::format("not enough values to unpack (expected {}, got {})",
                                         t.items.size(), items.size()));
      }
      if (items.size() > t.items.size()) {
        return TemplateError(
            fmt::format("too many values to unpack (expected {})", t.items.size()));
      }
      for (size_t i = 0; i < items.size(); ++i) {
        CLEAVE_RETURN_IF_ERROR(assign(t.items[i], std::move(items[i]), scope));
      }
      return Status::Ok();
    }
  }
  return Status::Ok();
}

Status Interpreter::exec_for(const Stmt& s, const ScopePtr& scope, const Value& iterable,
                             int depth, std::string& out) {
  DepthGuard guard(this);
  CLEAVE_RETURN_IF_ERROR(guard.check());
  if (iterable.is_none() || iterable.is_number() || iterable.is_callable() ||
      (iterable.is_dict() && iterable.as_dict().type != Dict::Type::kDict)) {
    return TemplateError(fmt::format("'{}' object is not iterable", type_name(iterable)));
  }
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, iterate(iterable));
  if (s.test) {
    std::vector<Value> kept;
    for (Value& item : items) {
      CLEAVE_RETURN_IF_ERROR(step());
      auto test_scope = std::make_shared<Scope>();
      test_scope->parent = scope;
      CLEAVE_RETURN_IF_ERROR(assign(s.target, item, test_scope));
      CLEAVE_ASSIGN_OR_RETURN(Value keep, eval(*s.test, test_scope));
      if (truthy(keep)) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  const auto n = static_cast<int64_t>(items.size());
  // Shared by every iteration: loop.cycle(...) and loop(...) of a recursive loop.
  auto index_cell = std::make_shared<int64_t>(0);
  Value cycle(CallablePtr(std::make_shared<Callable>(Callable{
      "cycle", "method", [index_cell](Interpreter&, CallArgs& args) -> Result<Value> {
        if (args.positional.empty()) return TemplateError("no items for cycling given");
        return args.positional[static_cast<size_t>(*index_cell) % args.positional.size()];
      }})));
  auto last_changed = std::make_shared<std::optional<Value>>();
  Value changed(CallablePtr(std::make_shared<Callable>(Callable{
      "changed", "method", [last_changed](Interpreter&, CallArgs& args) -> Result<Value> {
        Value now = Value::list(args.positional);
        if (last_changed->has_value() && equals(**last_changed, now)) return Value(false);
        *last_changed = std::move(now);
        return Value(true);
      }})));
  Value recurse;
  if (s.recursive) {
    const Stmt* stmt = &s;
    ScopePtr outer = scope;
    recurse = Value(CallablePtr(std::make_shared<Callable>(Callable{
        "loop", "LoopContext",
        [stmt, outer, depth](Interpreter& in, CallArgs& args) -> Result<Value> {
          if (args.positional.size() != 1) return TemplateError("loop() takes one argument");
          std::string text;
          CLEAVE_RETURN_IF_ERROR(in.exec_for(*stmt, outer, args.positional[0], depth + 1, text));
          return Value(std::move(text));
        }})));
  }
  for (int64_t i = 0; i < n; ++i) {
    CLEAVE_RETURN_IF_ERROR(step());
    *index_cell = i;
    auto iter_scope = std::make_shared<Scope>();
    iter_scope->parent = scope;
    CLEAVE_RETURN_IF_ERROR(assign(s.target, items[static_cast<size_t>(i)], iter_scope));
    auto loop = std::make_shared<Dict>();
    loop->type = Dict::Type::kLoop;
    loop->entries.reserve(14);
    auto put = [&](const char* k, Value v) { return loop->set(Value(k), std::move(v)); };
    CLEAVE_RETURN_IF_ERROR(put("index", Value(i + 1)));
    CLEAVE_RETURN_IF_ERROR(put("index0", Value(i)));
    CLEAVE_RETURN_IF_ERROR(put("revindex", Value(n - i)));
    CLEAVE_RETURN_IF_ERROR(put("revindex0", Value(n - i - 1)));
    CLEAVE_RETURN_IF_ERROR(put("first", Value(i == 0)));
    CLEAVE_RETURN_IF_ERROR(put("last", Value(i == n - 1)));
    CLEAVE_RETURN_IF_ERROR(put("length", Value(n)));
    CLEAVE_RETURN_IF_ERROR(put("depth", Value(static_cast<int64_t>(depth + 1))));
    CLEAVE_RETURN_IF_ERROR(put("depth0", Value(static_cast<int64_t>(depth))));
    CLEAVE_RETURN_IF_ERROR(put("previtem", i > 0 ? items[static_cast<size_t>(i - 1)]
                                                 : Value::undefined("there is no previous item")));
    CLEAVE_RETURN_IF_ERROR(put("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)]
                                                     : Value::undefined("there is no next item")));
    CLEAVE_RETURN_IF_ERROR(put("cycle", cycle));
    CLEAVE_RETURN_IF_ERROR(put("changed", changed));
    if (s.recursive) CLEAVE_RETURN_IF_ERROR(put("__call__", recurse));
    iter_scope->set("loop", Value(DictPtr(std::move(loop))));
    CLEAVE_RETURN_IF_ERROR(exec_body(s.body, iter_scope, out));
    if (flow_ == Flow::kBreak) {
      flow_ = Flow::kNormal;
      break;
    }
    flow_ = Flow::kNormal;
  }
  if (n == 0 && !s.else_body.empty()) {
    auto else_scope = std::make_shared<Scope>();
    else_scope->parent = scope;
    return exec_body(s.else_body, else_scope, out);
  }
  return Status::Ok();
}

Value Interpreter::make_macro(const Stmt& s, const ScopePtr& scope, Value caller) {
  const Stmt* stmt = &s;
  ScopePtr def_scope = scope;
  return Value(CallablePtr(std::make_shared<Callable>(Callable{
      s.macro.name, "Macro",
      [stmt, def_scope, caller](Interpreter& in, CallArgs& args) -> Result<Value> {
        return in.call_macro(*stmt, def_scope, caller, args);
      }})));
}

Result<Value> Interpreter::call_macro(const Stmt& s, const ScopePtr& def_scope,
                                      const Value& caller, CallArgs& args) {
  DepthGuard guard(this);
  CLEAVE_RETURN_IF_ERROR(guard.check());
  const MacroSignature& sig = s.macro;
  auto scope = std::make_shared<Scope>();
  scope->parent = def_scope;
  const size_t nparams = sig.params.size();
  const size_t first_default = nparams - sig.defaults.size();
  std::vector<Value> extra;
  for (size_t i = nparams; i < args.positional.size(); ++i) extra.push_back(args.positional[i]);
  if (!extra.empty() && !sig.catch_varargs) {
    return TemplateError(fmt::format("macro '{}' takes not more than {} argument(s)", sig.name,
                                     nparams));
  }
  Value caller_value = caller;
  for (size_t i = 0; i < nparams; ++i) {
    const std::string& p = sig.params[i];
    bool found = false;
    for (auto it = args.keyword.begin(); it != args.keyword.end(); ++it) {
      if (it->first == p) {
        if (i < args.positional.size()) {
          return TemplateError(fmt::format("macro '{}' got multiple values for argument '{}'",
                                           sig.name, p));
        }
        scope->set(p, std::move(it->second));
        args.keyword.erase(it);
        found = true;
        break;
      }
    }
    if (found) continue;
    if (i < args.positional.size()) {
      scope->set(p, args.positional[i]);
    } else if (i >= first_default) {
      CLEAVE_ASSIGN_OR_RETURN(Value d, eval(*sig.defaults[i - first_default], scope));
      scope->set(p, std::move(d));
    } else {
      scope->set(p, Value::undefined(fmt::format("parameter '{}' was not provided", p)));
    }
  }
  auto kwargs = std::make_shared<Dict>();
  for (auto& [k, v] : args.keyword) {
    if (k == "caller") {
      if (!sig.uses_caller) {
        return TemplateError(fmt::format(
            "macro '{}' was invoked with two values for the special caller argument. This is "
            "most likely a bug.",
            sig.name));
      }
      caller_value = std::move(v);
      continue;
    }
    if (!sig.catch_kwargs) {
      return TemplateError(fmt::format("macro '{}' takes no keyword argument '{}'", sig.name, k));
    }
    CLEAVE_RETURN_IF_ERROR(kwargs->set(Value(k), std::move(v)));
  }
  if (sig.catch_varargs) scope->set("varargs", Value::tuple(std::move(extra)));
  if (sig.catch_kwargs) scope->set("kwargs", Value(DictPtr(std::move(kwargs))));
  if (sig.uses_caller) {
    scope->set("caller", caller_value.is_undefined() ? missing_name("caller") : caller_value);
  }
  std::string text;
  CLEAVE_RETURN_IF_ERROR(exec_body(s.body, scope, text));
  return Value(std::move(text));
}

Result<CallArgs> Interpreter::eval_call_args(const Expr& e, size_t first_arg,
                                             const ScopePtr& scope) {
  CallArgs args;
  for (size_t i = first_arg; i < e.args.size(); ++i) {
    CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.args[i], scope));
    args.positional.push_back(std::move(v));
  }
  for (const auto& [k, expr] : e.kwargs) {
    CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*expr, scope));
    args.keyword.emplace_back(k, std::move(v));
  }
  if (e.dyn_args) {
    CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.dyn_args, scope));
    CLEAVE_ASSIGN_OR_RETURN(std::vector<Value> items, iterate(v));
    for (Value& item : items) args.positional.push_back(std::move(item));
  }
  if (e.dyn_kwargs) {
    CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.dyn_kwargs, scope));
    if (!v.is_mapping()) return TemplateError("argument after ** must be a mapping");
    for (const auto& [k, val] : v.as_dict().entries) {
      if (!k.is_string()) return TemplateError("keywords must be strings");
      args.keyword.emplace_back(k.as_string(), val);
    }
  }
  return args;
}

Result<Value> Interpreter::call(const Value& callee, CallArgs& args) {
  CLEAVE_RETURN_IF_ERROR(step());
  if (callee.is_callable()) return callee.as_callable().fn(*this, args);
  if (callee.is_undefined()) return TemplateError(callee.undefined_hint());
  if (callee.is_dict() && callee.as_dict().type == Dict::Type::kLoop) {
    const Value* fn = callee.as_dict().find("__call__");
    if (fn != nullptr) return fn->as_callable().fn(*this, args);
  }
  return TemplateError(fmt::format("'{}' object is not callable", type_name(callee)));
}

// Jinja2 compiles obj[a:b:c] to Python's own subscription (not its getitem), so errors surface.
Result<Value> Interpreter::eval_slice(const Expr& e, const ScopePtr& scope) {
  CLEAVE_ASSIGN_OR_RETURN(Value obj, eval(*e.args[0], scope));
  std::optional<int64_t> parts[3];
  bool bad_index[3] = {false, false, false};
  for (int i = 0; i < 3; ++i) {
    if (!e.args[i + 1]) continue;
    CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.args[i + 1], scope));
    if (v.is_none()) continue;
    if (v.is_int() || v.is_bool()) {
      parts[i] = v.is_int() ? v.as_int() : (v.as_bool() ? 1 : 0);
    } else {
      bad_index[i] = true;
    }
  }
  if (obj.is_undefined()) return TemplateError(obj.undefined_hint());
  const bool sliceable = obj.is_string() ||
                         (obj.is_list() && (obj.as_list().type == List::Type::kList ||
                                            obj.as_list().type == List::Type::kTuple ||
                                            obj.as_list().type == List::Type::kRange));
  if (!sliceable) {
    if (obj.is_mapping()) return TemplateError("unhashable type: 'slice'");
    return TemplateError(fmt::format("'{}' object is not subscriptable", type_name(obj)));
  }
  // CPython's PySlice_Unpack order: the step, then start and stop.
  const char* kBadIndex = "slice indices must be integers or None or have an __index__ method";
  if (bad_index[2]) return TemplateError(kBadIndex);
  const int64_t step = parts[2].value_or(1);
  if (step == 0) return TemplateError("slice step cannot be zero");
  if (bad_index[0] || bad_index[1]) return TemplateError(kBadIndex);
  if (obj.is_string()) {
    const std::string& s = obj.as_string();
    const SliceBounds b = slice_indices(static_cast<int64_t>(utf8_length(s)), parts[0], parts[1], step);
    return Value(py_slice(s, b));
  }
  const auto& items = obj.as_list().items;
  const SliceBounds b = slice_indices(static_cast<int64_t>(items.size()), parts[0], parts[1], step);
  std::vector<Value> out;
  out.reserve(static_cast<size_t>(b.count));
  for (int64_t k = 0, i = b.start; k < b.count; ++k, i += b.step) {
    out.push_back(items[static_cast<size_t>(i)]);
  }
  return obj.as_list().is_tuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

Result<Value> Interpreter::eval_compare(const Expr& e, const ScopePtr& scope) {
  CLEAVE_ASSIGN_OR_RETURN(Value left, eval(*e.args[0], scope));
  for (size_t i = 0; i < e.ops.size(); ++i) {
    CLEAVE_ASSIGN_OR_RETURN(Value right, eval(*e.args[i + 1], scope));
    const std::string& op = e.ops[i];
    bool ok = false;
    if (op == "==") {
      ok = equals(left, right);
    } else if (op == "!=") {
      ok = !equals(left, right);
    } else if (op == "in" || op == "notin") {
      CLEAVE_ASSIGN_OR_RETURN(ok, contains(right, left));
      if (op == "notin") ok = !ok;
    } else {
      CLEAVE_ASSIGN_OR_RETURN(ok, compare(left, right, op));
    }
    if (!ok) return Value(false);
    left = std::move(right);
  }
  return Value(true);
}

Result<Value> Interpreter::eval(const Expr& e, const ScopePtr& scope) {
  DepthGuard guard(this);
  CLEAVE_RETURN_IF_ERROR(guard.check());
  switch (e.kind) {
    case ExprKind::kConst:
      return e.constant;
    case ExprKind::kName: {
      const Value* v = scope->find(e.name);
      if (v == nullptr) return missing_name(e.name);
      return *v;
    }
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const ExprPtr& a : e.args) {
        CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*a, scope));
        items.push_back(std::move(v));
      }
      return e.kind == ExprKind::kList ? Value::list(std::move(items))
                                       : Value::tuple(std::move(items));
    }
    case ExprKind::kDict: {
      auto d = std::make_shared<Dict>();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        CLEAVE_ASSIGN_OR_RETURN(Value k, eval(*e.args[i], scope));
        CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.args[i + 1], scope));
        CLEAVE_RETURN_IF_ERROR(d->set(std::move(k), std::move(v)));
      }
      return Value(DictPtr(std::move(d)));
    }
    case ExprKind::kGetattr: {
      CLEAVE_ASSIGN_OR_RETURN(Value obj, eval(*e.args[0], scope));
      return getattr(obj, e.name);
    }
    case ExprKind::kGetitem: {
      CLEAVE_ASSIGN_OR_RETURN(Value obj, eval(*e.args[0], scope));
      CLEAVE_ASSIGN_OR_RETURN(Value key, eval(*e.args[1], scope));
      return getitem(obj, key);
    }
    case ExprKind::kSlice:
      return eval_slice(e, scope);
    case ExprKind::kCall: {
      CLEAVE_ASSIGN_OR_RETURN(Value callee, eval(*e.args[0], scope));
      CLEAVE_ASSIGN_OR_RETURN(CallArgs args, eval_call_args(e, 1, scope));
      return call(callee, args);
    }
    case ExprKind::kFilter: {
      Value operand = filter_hole_;
      if (e.args[0]) {
        CLEAVE_ASSIGN_OR_RETURN(operand, eval(*e.args[0], scope));
      }
      CLEAVE_ASSIGN_OR_RETURN(CallArgs args, eval_call_args(e, 1, scope));
      CLEAVE_RETURN_IF_ERROR(step());
      return e.filter(*this, operand, args);
    }
    case ExprKind::kTest: {
      CLEAVE_ASSIGN_OR_RETURN(Value operand, eval(*e.args[0], scope));
      CLEAVE_ASSIGN_OR_RETURN(CallArgs args, eval_call_args(e, 1, scope));
      CLEAVE_ASSIGN_OR_RETURN(bool r, e.test(*this, operand, args));
      return Value(r);
    }
    case ExprKind::kNot: {
      CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.args[0], scope));
      return Value(!truthy(v));
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*e.args[0], scope));
      const bool neg = e.kind == ExprKind::kNeg;
      if (v.is_int() || v.is_bool()) {
        const int64_t x = v.is_int() ? v.as_int() : (v.as_bool() ? 1 : 0);
        if (neg && x == INT64_MIN) return TemplateError("integer overflow");
        return Value(neg ? -x : x);
      }
      if (v.is_float()) return Value(neg ? -v.as_float() : v.as_float());
      if (v.is_undefined()) return TemplateError(v.undefined_hint());
      return TemplateError(fmt::format("bad operand type for unary {}: '{}'", neg ? '-' : '+',
                                       type_name(v)));
    }
    case ExprKind::kBinary: {
      CLEAVE_ASSIGN_OR_RETURN(Value a, eval(*e.args[0], scope));
      CLEAVE_ASSIGN_OR_RETURN(Value b, eval(*e.args[1], scope));
      return binary_op(*this, e.name, a, b);
    }
    case ExprKind::kAnd:
    case ExprKind::kOr: {
      CLEAVE_ASSIGN_OR_RETURN(Value a, eval(*e.args[0], scope));
      const bool t = truthy(a);
      if (e.kind == ExprKind::kAnd ? !t : t) return a;
      return eval(*e.args[1], scope);
    }
    case ExprKind::kConcat: {
      std::string s;
      for (const ExprPtr& a : e.args) {
        CLEAVE_ASSIGN_OR_RETURN(Value v, eval(*a, scope));
        CLEAVE_RETURN_IF_ERROR(append(s, v.is_string() ? v.as_string() : to_str(v)));
      }
      return Value(std::move(s));
    }
    case ExprKind::kCompare:
      return eval_compare(e, scope);
    case ExprKind::kCondExpr: {
      CLEAVE_ASSIGN_OR_RETURN(Value c, eval(*e.args[0], scope));
      if (truthy(c)) return eval(*e.args[1], scope);
      if (e.args[2]) return eval(*e.args[2], scope);
      return Value::undefined(fmt::format(
          "the inline if-expression on line {} evaluated to false and no else section was "
          "defined.",
          e.line));
    }
  }
  return Internal("unknown expression");
}

}  // namespace cleave::jinja
