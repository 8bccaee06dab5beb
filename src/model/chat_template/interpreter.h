// Renders a parsed Program: Jinja2's runtime semantics (scoping, loops, macros, attribute and item
// lookup through the immutable sandbox) over the values of value.h.
//
// One Interpreter renders one template once, on the calling thread; it is not shared. Limits
// bound the work a template can cause: output and intermediate string size, loop iterations and
// calls (steps), and recursion depth; crossing one is ResourceExhausted, never a crash or hang.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chat_template/ast.h"

namespace cleave::jinja {

struct RenderLimits {
  size_t max_output_bytes = 64u << 20;  // also bounds any one string or list built on the way
  int64_t max_steps = 1'000'000;        // loop iterations + calls + filter applications
  int max_depth = 256;                  // nested macro calls, loops and expression evaluation
};

// A variable scope: a template's top level, one loop iteration, a macro call, a with block.
struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(std::string_view name) const;
  void set(std::string_view name, Value value);
};
using ScopePtr = std::shared_ptr<Scope>;

class Interpreter {
 public:
  // strftime formats the render's "now" (strftime_now's clock).
  Interpreter(RenderLimits limits, std::function<std::string(const std::string&)> strftime);
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  // Renders `program` with `globals` (the render context, already holding the builtin globals
  // of make_globals()) into *out.
  Status render(const Program& program, ScopePtr globals, std::string* out);

  Result<Value> eval(const Expr& e, const ScopePtr& scope);
  Result<Value> call(const Value& callee, CallArgs& args);
  // Jinja2's sandboxed getattr (obj.name) and getitem (obj[key]).
  Result<Value> getattr(const Value& obj, const std::string& name);
  Result<Value> getitem(const Value& obj, const Value& key);

  // Counts one unit of work; ResourceExhausted past max_steps.
  Status step();
  // ResourceExhausted when a string or collection of `size` bytes / items would exceed the limit.
  Status check_size(size_t size) const;
  const std::function<std::string(const std::string&)>& strftime() const { return strftime_; }
  // Remembers a namespace so that the reference cycles a template can build through it
  // (ns.self = ns) are broken when the render ends.
  void track(const DictPtr& d);

 private:
  enum class Flow : uint8_t { kNormal, kBreak, kContinue };
  struct DepthGuard;

  Status exec_body(const Body& body, const ScopePtr& scope, std::string& out);
  Status exec(const Stmt& s, const ScopePtr& scope, std::string& out);
  Status exec_for(const Stmt& s, const ScopePtr& scope, const Value& iterable, int depth,
                  std::string& out);
  Status assign(const Target& t, Value v, const ScopePtr& scope);
  Status append(std::string& out, std::string_view text) const;
  Value make_macro(const Stmt& s, const ScopePtr& scope, Value caller);
  Result<Value> call_macro(const Stmt& s, const ScopePtr& def_scope, const Value& caller,
                           CallArgs& args);
  Result<CallArgs> eval_call_args(const Expr& e, size_t first_arg, const ScopePtr& scope);
  Result<Value> eval_slice(const Expr& e, const ScopePtr& scope);
  Result<Value> eval_compare(const Expr& e, const ScopePtr& scope);

  RenderLimits limits_;
  std::function<std::string(const std::string&)> strftime_;
  int64_t steps_ = 0;
  int depth_ = 0;
  Flow flow_ = Flow::kNormal;
  Value filter_hole_;  // the operand of a {% filter %} / {% set x | f %} chain
  std::vector<std::weak_ptr<Scope>> tracked_scopes_;  // scopes that macros captured
  std::vector<std::weak_ptr<Dict>> tracked_dicts_;    // namespaces
};

// --- builtins (operators.cpp, methods.cpp) ----------------------------------------------------------

// The globals every template sees: range, dict, namespace, cycler, joiner, raise_exception,
// strftime_now.
void add_globals(Scope& scope);
// Arithmetic of the binary operators + - * / // % ** with Python semantics.
Result<Value> binary_op(Interpreter& in, std::string_view op, const Value& a, const Value& b);
// The bound method `obj.name` (str, dict and list methods), or undefined when there is none
// (an unsafe one, such as list.append, is an undefined that raises the sandbox's SecurityError).
Value find_method(const Value& obj, const std::string& name);
// Python's `fmt % args` for str.
Result<std::string> percent_format(Interpreter& in, const std::string& fmt, const Value& args);

}  // namespace cleave::jinja
