// The syntax tree of a parsed template (Jinja2's nodes, reduced to what the interpreter needs).
// A Program is immutable once parsed and may be rendered from many threads at once.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat_template/value.h"

namespace cleave::jinja {

// A filter or test implementation; `args` holds the call's arguments after the operand.
using FilterFn = Result<Value> (*)(Interpreter&, const Value& operand, CallArgs& args);
using TestFn = Result<bool> (*)(Interpreter&, const Value& operand, CallArgs& args);
FilterFn find_filter(std::string_view name);         // every builtin filter (filters.cpp)
FilterFn find_scalar_filter(std::string_view name);  // those on strings and numbers
TestFn find_test(std::string_view name);

enum class ExprKind : uint8_t {
  kConst,      // constant
  kName,       // name
  kList,       // args: items
  kTuple,      // args: items
  kDict,       // args: key0, value0, key1, value1, ...
  kGetattr,    // args[0].name
  kGetitem,    // args[0][args[1]]
  kSlice,      // args[0][args[1]:args[2]:args[3]] (null parts allowed)
  kCall,       // args[0](args[1..], kwargs, *dyn_args, **dyn_kwargs)
  kFilter,     // args[0] | name(args[1..], kwargs); args[0] null inside {% filter %} / set blocks
  kTest,       // args[0] is name(args[1..], kwargs)
  kNot,        // not args[0]
  kNeg,        // -args[0]
  kPos,        // +args[0]
  kBinary,     // args[0] <name> args[1] for + - * / // % **
  kAnd,        // args[0] and args[1]
  kOr,         // args[0] or args[1]
  kConcat,     // args[0] ~ args[1] ~ ...
  kCompare,    // args[0] ops[0] args[1] ops[1] args[2] ... (ops: == != < <= > >= in notin)
  kCondExpr,   // args[1] if args[0] else args[2] (args[2] null: undefined)
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind = ExprKind::kConst;
  int line = 0;
  int height = 1;  // 1 + the tallest operand: bounds the evaluator's recursion
  Value constant;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr dyn_args;
  ExprPtr dyn_kwargs;
  std::vector<std::string> ops;
  FilterFn filter = nullptr;
  TestFn test = nullptr;
};

// Where an assignment or a loop stores its value.
struct Target {
  enum class Kind : uint8_t { kName, kTuple, kNamespaceAttr };
  Kind kind = Kind::kName;
  std::string name;            // kName; kNamespaceAttr: the namespace variable
  std::string attr;            // kNamespaceAttr
  std::vector<Target> items;   // kTuple
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class StmtKind : uint8_t {
  kOutput,       // text
  kPrint,        // {{ expr }}
  kIf,           // branches (test, body), else_body
  kFor,          // target in expr [if test] [recursive]: body, else_body
  kSet,          // target = expr
  kSetBlock,     // {% set target [| filters] %}body{% endset %}; expr: filter chain or null
  kMacro,        // macro name(params = defaults): body
  kCallBlock,    // {% call(params) expr %}body{% endcall %}
  kFilterBlock,  // {% filter expr %}body{% endfilter %}
  kWith,         // {% with assigns %}body{% endwith %}
  kBreak,
  kContinue,
  kScope,        // a body rendered in place ({% generation %})
};

struct MacroSignature {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() params
  bool catch_varargs = false;     // the body uses `varargs`
  bool catch_kwargs = false;      // the body uses `kwargs`
  bool uses_caller = false;       // the body uses `caller`
};

struct Stmt {
  StmtKind kind = StmtKind::kOutput;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr test;
  Target target;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  bool recursive = false;
  MacroSignature macro;
  std::vector<std::pair<Target, ExprPtr>> assigns;
};

struct Program {
  Body body;
};

}  // namespace cleave::jinja
