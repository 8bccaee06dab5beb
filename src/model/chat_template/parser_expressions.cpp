// Expressions: Jinja2's precedence climbing (jinja2/parser.py, parse_tuple ... parse_primary).
#include "chat_template/parser_internal.h"

namespace cleave::jinja {
namespace {

const char* kBinaryOps1[] = {"+", "-"};
const char* kBinaryOps2[] = {"*", "/", "//", "%"};

}  // namespace

bool ExpressionParser::is_tuple_end(std::string_view extra_end) const {
  return at(TokenType::kVariableEnd) || at(TokenType::kBlockEnd) || at_op(")") ||
         (!extra_end.empty() && at_name(extra_end));
}

Result<ExprPtr> ExpressionParser::parse_tuple(TupleMode mode, std::string_view extra_end, bool explicit_parens) {
  const int line = cur().line;
  std::vector<ExprPtr> items;
  bool is_tuple = false;
  while (true) {
    if (!items.empty()) CLEAVE_RETURN_IF_ERROR(expect_op(","));
    if (is_tuple_end(extra_end)) break;
    ExprPtr e;
    if (mode == TupleMode::kSimplified) {
      CLEAVE_ASSIGN_OR_RETURN(e, parse_primary());
    } else {
      CLEAVE_ASSIGN_OR_RETURN(e, parse_expression(mode == TupleMode::kFull));
    }
    items.push_back(std::move(e));
    if (at_op(",")) {
      is_tuple = true;
    } else {
      break;
    }
  }
  if (!is_tuple) {
    if (!items.empty()) return std::move(items[0]);
    if (!explicit_parens) return fail(fmt::format("Expected an expression, got {}", describe(cur())));
  }
  ExprPtr t = make(ExprKind::kTuple, line);
  t->args = std::move(items);
  return tall(std::move(t));
}

Result<ExprPtr> ExpressionParser::parse_expression(bool with_condexpr) {
  DepthGuard guard(this);
  CLEAVE_RETURN_IF_ERROR(check_depth());
  if (!with_condexpr) return parse_or();
  const int line = cur().line;
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr expr1, parse_or());
  while (skip_name("if")) {
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr cond, parse_or());
    ExprPtr node = make(ExprKind::kCondExpr, line);
    node->args.push_back(std::move(cond));
    node->args.push_back(std::move(expr1));
    if (skip_name("else")) {
      CLEAVE_ASSIGN_OR_RETURN(ExprPtr other, parse_expression(true));
      node->args.push_back(std::move(other));
    } else {
      node->args.push_back(nullptr);
    }
    CLEAVE_ASSIGN_OR_RETURN(expr1, tall(std::move(node)));
  }
  return expr1;
}

Result<ExprPtr> ExpressionParser::binary(ExprKind kind, std::string op, ExprPtr l, ExprPtr r, int line) {
  ExprPtr n = make(kind, line);
  n->name = std::move(op);
  n->args.push_back(std::move(l));
  n->args.push_back(std::move(r));
  return tall(std::move(n));
}

Result<ExprPtr> ExpressionParser::parse_or() {
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr left, parse_and());
  while (at_name("or")) {
    const int line = cur().line;
    next();
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr right, parse_and());
    CLEAVE_ASSIGN_OR_RETURN(left, binary(ExprKind::kOr, "or", std::move(left), std::move(right), line));
  }
  return left;
}

Result<ExprPtr> ExpressionParser::parse_and() {
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr left, parse_not());
  while (at_name("and")) {
    const int line = cur().line;
    next();
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr right, parse_not());
    CLEAVE_ASSIGN_OR_RETURN(left, binary(ExprKind::kAnd, "and", std::move(left), std::move(right), line));
  }
  return left;
}

Result<ExprPtr> ExpressionParser::parse_not() {
  if (at_name("not")) {
    const int line = cur().line;
    next();
    DepthGuard guard(this);
    CLEAVE_RETURN_IF_ERROR(check_depth());
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr operand, parse_not());
    ExprPtr n = make(ExprKind::kNot, line);
    n->args.push_back(std::move(operand));
    return tall(std::move(n));
  }
  return parse_compare();
}

Result<ExprPtr> ExpressionParser::parse_compare() {
  const int line = cur().line;
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr expr, parse_math1());
  ExprPtr cmp;
  while (true) {
    std::string op;
    if (at(TokenType::kOperator) && (cur().value == "==" || cur().value == "!=" ||
                                     cur().value == "<" || cur().value == "<=" ||
                                     cur().value == ">" || cur().value == ">=")) {
      op = cur().value;
      next();
    } else if (at_name("in")) {
      op = "in";
      next();
    } else if (at_name("not") && look().type == TokenType::kName && look().value == "in") {
      op = "notin";
      next();
      next();
    } else {
      break;
    }
    if (!cmp) {
      cmp = make(ExprKind::kCompare, line);
      cmp->args.push_back(std::move(expr));
    }
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr rhs, parse_math1());
    cmp->ops.push_back(std::move(op));
    cmp->args.push_back(std::move(rhs));
  }
  if (cmp) return tall(std::move(cmp));
  return expr;
}

Result<ExprPtr> ExpressionParser::parse_math1() {
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr left, parse_concat());
  while (at_any(kBinaryOps1)) {
    const std::string op = cur().value;
    const int line = cur().line;
    next();
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr right, parse_concat());
    CLEAVE_ASSIGN_OR_RETURN(left, binary(ExprKind::kBinary, op, std::move(left), std::move(right), line));
  }
  return left;
}

Result<ExprPtr> ExpressionParser::parse_concat() {
  const int line = cur().line;
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr first, parse_math2());
  if (!at_op("~")) return first;
  ExprPtr n = make(ExprKind::kConcat, line);
  n->args.push_back(std::move(first));
  while (skip_op("~")) {
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr e, parse_math2());
    n->args.push_back(std::move(e));
  }
  return tall(std::move(n));
}

Result<ExprPtr> ExpressionParser::parse_math2() {
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr left, parse_pow());
  while (at_any(kBinaryOps2)) {
    const std::string op = cur().value;
    const int line = cur().line;
    next();
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr right, parse_pow());
    CLEAVE_ASSIGN_OR_RETURN(left, binary(ExprKind::kBinary, op, std::move(left), std::move(right), line));
  }
  return left;
}

Result<ExprPtr> ExpressionParser::parse_pow() {
  CLEAVE_ASSIGN_OR_RETURN(ExprPtr left, parse_unary(true));
  while (at_op("**")) {
    const int line = cur().line;
    next();
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr right, parse_unary(true));
    CLEAVE_ASSIGN_OR_RETURN(left, binary(ExprKind::kBinary, "**", std::move(left), std::move(right), line));
  }
  return left;
}

Result<ExprPtr> ExpressionParser::parse_unary(bool with_filter) {
  DepthGuard guard(this);
  CLEAVE_RETURN_IF_ERROR(check_depth());
  const int line = cur().line;
  ExprPtr node;
  if (at_op("-") || at_op("+")) {
    const bool neg = at_op("-");
    next();
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr operand, parse_unary(false));
    node = make(neg ? ExprKind::kNeg : ExprKind::kPos, line);
    node->args.push_back(std::move(operand));
    CLEAVE_ASSIGN_OR_RETURN(node, tall(std::move(node)));
  } else {
    CLEAVE_ASSIGN_OR_RETURN(node, parse_primary());
  }
  CLEAVE_ASSIGN_OR_RETURN(node, parse_postfix(std::move(node)));
  if (with_filter) {
    CLEAVE_ASSIGN_OR_RETURN(node, parse_filter_expr(std::move(node)));
  }
  return node;
}

Result<ExprPtr> ExpressionParser::parse_primary() {
  const Token& t = cur();
  const int line = t.line;
  ExprPtr node;
  switch (t.type) {
    case TokenType::kName: {
      node = make(ExprKind::kConst, line);
      if (t.value == "true" || t.value == "True") {
        node->constant = Value(true);
      } else if (t.value == "false" || t.value == "False") {
        node->constant = Value(false);
      } else if (t.value == "none" || t.value == "None") {
        node->constant = Value::none();
      } else {
        node->kind = ExprKind::kName;
        node->name = t.value;
        if (!used_names_.empty()) used_names_.back()->insert(t.value);
      }
      next();
      return node;
    }
    case TokenType::kString: {
      std::string s;
      while (at(TokenType::kString)) {
        s += cur().value;
        next();
      }
      node = make(ExprKind::kConst, line);
      node->constant = Value(std::move(s));
      return node;
    }
    case TokenType::kInteger:
      node = make(ExprKind::kConst, line);
      node->constant = Value(t.int_value);
      next();
      return node;
    case TokenType::kFloat:
      node = make(ExprKind::kConst, line);
      node->constant = Value(t.float_value);
      next();
      return node;
    case TokenType::kOperator:
      if (t.value == "(") {
        next();
        CLEAVE_ASSIGN_OR_RETURN(node, parse_tuple(TupleMode::kFull, {}, true));
        CLEAVE_RETURN_IF_ERROR(expect_op(")"));
        return node;
      }
      if (t.value == "[") return parse_list();
      if (t.value == "{") return parse_dict();
      break;
    default:
      break;
  }
  return fail(fmt::format("unexpected {}", describe(t)));
}

Result<ExprPtr> ExpressionParser::parse_list() {
  ExprPtr node = make(ExprKind::kList, cur().line);
  next();
  while (!at_op("]")) {
    if (!node->args.empty()) CLEAVE_RETURN_IF_ERROR(expect_op(","));
    if (at_op("]")) break;
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr e, parse_expression(true));
    node->args.push_back(std::move(e));
  }
  CLEAVE_RETURN_IF_ERROR(expect_op("]"));
  return tall(std::move(node));
}

Result<ExprPtr> ExpressionParser::parse_dict() {
  ExprPtr node = make(ExprKind::kDict, cur().line);
  next();
  while (!at_op("}")) {
    if (!node->args.empty()) CLEAVE_RETURN_IF_ERROR(expect_op(","));
    if (at_op("}")) break;
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr k, parse_expression(true));
    CLEAVE_RETURN_IF_ERROR(expect_op(":"));
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr v, parse_expression(true));
    node->args.push_back(std::move(k));
    node->args.push_back(std::move(v));
  }
  CLEAVE_RETURN_IF_ERROR(expect_op("}"));
  return tall(std::move(node));
}

Result<ExprPtr> ExpressionParser::parse_postfix(ExprPtr node) {
  while (true) {
    if (at_op(".") || at_op("[")) {
      CLEAVE_ASSIGN_OR_RETURN(node, parse_subscript(std::move(node)));
    } else if (at_op("(")) {
      CLEAVE_ASSIGN_OR_RETURN(node, parse_call(std::move(node)));
    } else {
      return node;
    }
  }
}

Result<ExprPtr> ExpressionParser::parse_filter_expr(ExprPtr node) {
  while (true) {
    if (at_op("|")) {
      CLEAVE_ASSIGN_OR_RETURN(node, parse_filter(std::move(node), false));
    } else if (at_name("is")) {
      CLEAVE_ASSIGN_OR_RETURN(node, parse_test(std::move(node)));
    } else if (at_op("(")) {
      CLEAVE_ASSIGN_OR_RETURN(node, parse_call(std::move(node)));
    } else {
      return node;
    }
  }
}

Result<ExprPtr> ExpressionParser::parse_subscript(ExprPtr node) {
  const int line = cur().line;
  if (skip_op(".")) {
    if (at(TokenType::kName)) {
      ExprPtr n = make(ExprKind::kGetattr, line);
      n->name = cur().value;
      n->args.push_back(std::move(node));
      next();
      return tall(std::move(n));
    }
    if (!at(TokenType::kInteger)) return fail("expected name or number");
    ExprPtr idx = make(ExprKind::kConst, line);
    idx->constant = Value(cur().int_value);
    next();
    ExprPtr n = make(ExprKind::kGetitem, line);
    n->args.push_back(std::move(node));
    n->args.push_back(std::move(idx));
    return tall(std::move(n));
  }
  next();  // '['
  std::vector<ExprPtr> args;
  while (!at_op("]")) {
    if (!args.empty()) CLEAVE_RETURN_IF_ERROR(expect_op(","));
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr a, parse_subscribed());
    args.push_back(std::move(a));
  }
  CLEAVE_RETURN_IF_ERROR(expect_op("]"));
  if (args.size() == 1 && args[0]->kind == ExprKind::kSlice) {
    args[0]->args[0] = std::move(node);
    return tall(std::move(args[0]));
  }
  ExprPtr n = make(ExprKind::kGetitem, line);
  n->args.push_back(std::move(node));
  if (args.size() == 1) {
    n->args.push_back(std::move(args[0]));
  } else {
    for (const ExprPtr& a : args) {
      if (a->kind == ExprKind::kSlice) return fail("multi-dimensional slices are not supported");
    }
    ExprPtr t = make(ExprKind::kTuple, line);
    t->args = std::move(args);
    n->args.push_back(std::move(t));
  }
  return tall(std::move(n));
}

// An index or a slice [start:stop:step]; a slice comes back as kSlice with args[0] empty.
Result<ExprPtr> ExpressionParser::parse_subscribed() {
  const int line = cur().line;
  std::vector<ExprPtr> parts;
  if (at_op(":")) {
    next();
    parts.push_back(nullptr);
  } else {
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr e, parse_expression(true));
    if (!at_op(":")) return e;
    next();
    parts.push_back(std::move(e));
  }
  if (at_op(":") || at_op("]") || at_op(",")) {
    parts.push_back(nullptr);
  } else {
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr e, parse_expression(true));
    parts.push_back(std::move(e));
  }
  if (skip_op(":")) {
    if (at_op("]") || at_op(",")) {
      parts.push_back(nullptr);
    } else {
      CLEAVE_ASSIGN_OR_RETURN(ExprPtr e, parse_expression(true));
      parts.push_back(std::move(e));
    }
  } else {
    parts.push_back(nullptr);
  }
  ExprPtr n = make(ExprKind::kSlice, line);
  n->args.push_back(nullptr);
  for (ExprPtr& p : parts) n->args.push_back(std::move(p));
  return n;
}

Status ExpressionParser::parse_call_args(Expr* n) {
  CLEAVE_RETURN_IF_ERROR(expect_op("("));
  bool require_comma = false;
  while (!at_op(")")) {
    if (require_comma) {
      CLEAVE_RETURN_IF_ERROR(expect_op(","));
      if (at_op(")")) break;
    }
    if (at_op("*")) {
      if (n->dyn_args || n->dyn_kwargs) return fail("invalid syntax for function call expression");
      next();
      CLEAVE_ASSIGN_OR_RETURN(n->dyn_args, parse_expression(true));
    } else if (at_op("**")) {
      if (n->dyn_kwargs) return fail("invalid syntax for function call expression");
      next();
      CLEAVE_ASSIGN_OR_RETURN(n->dyn_kwargs, parse_expression(true));
    } else if (at(TokenType::kName) && look().type == TokenType::kOperator &&
               look().value == "=") {
      if (n->dyn_kwargs) return fail("invalid syntax for function call expression");
      std::string key = cur().value;
      next();
      next();
      CLEAVE_ASSIGN_OR_RETURN(ExprPtr v, parse_expression(true));
      n->kwargs.emplace_back(std::move(key), std::move(v));
    } else {
      if (n->dyn_args || n->dyn_kwargs || !n->kwargs.empty()) {
        return fail("invalid syntax for function call expression");
      }
      CLEAVE_ASSIGN_OR_RETURN(ExprPtr v, parse_expression(true));
      n->args.push_back(std::move(v));
    }
    require_comma = true;
  }
  return expect_op(")");
}

Result<ExprPtr> ExpressionParser::parse_call(ExprPtr callee) {
  ExprPtr n = make(ExprKind::kCall, cur().line);
  n->args.push_back(std::move(callee));
  CLEAVE_RETURN_IF_ERROR(parse_call_args(n.get()));
  return tall(std::move(n));
}

// `| name(args) | name2 ...`; with start_inline the first '|' is absent ({% filter %}).
Result<ExprPtr> ExpressionParser::parse_filter(ExprPtr node, bool start_inline) {
  while (at_op("|") || start_inline) {
    if (!start_inline) next();
    start_inline = false;
    const int line = cur().line;
    CLEAVE_ASSIGN_OR_RETURN(std::string name, expect_name());
    while (skip_op(".")) {
      CLEAVE_ASSIGN_OR_RETURN(std::string part, expect_name());
      name += "." + part;
    }
    ExprPtr n = make(ExprKind::kFilter, line);
    n->filter = find_filter(name);
    if (n->filter == nullptr) {
      return InvalidArgument(fmt::format("No filter named '{}' (line {})", name, line));
    }
    n->name = std::move(name);
    n->args.push_back(std::move(node));
    if (at_op("(")) CLEAVE_RETURN_IF_ERROR(parse_call_args(n.get()));
    CLEAVE_ASSIGN_OR_RETURN(node, tall(std::move(n)));
  }
  return node;
}

Result<ExprPtr> ExpressionParser::parse_test(ExprPtr node) {
  const int line = cur().line;
  next();  // 'is'
  const bool negated = skip_name("not");
  CLEAVE_ASSIGN_OR_RETURN(std::string name, expect_name());
  while (skip_op(".")) {
    CLEAVE_ASSIGN_OR_RETURN(std::string part, expect_name());
    name += "." + part;
  }
  ExprPtr n = make(ExprKind::kTest, line);
  n->test = find_test(name);
  if (n->test == nullptr) {
    return InvalidArgument(fmt::format("No test named '{}' (line {})", name, line));
  }
  n->name = std::move(name);
  n->args.push_back(std::move(node));
  if (at_op("(")) {
    CLEAVE_RETURN_IF_ERROR(parse_call_args(n.get()));
  } else if ((at(TokenType::kName) || at(TokenType::kString) || at(TokenType::kInteger) ||
              at(TokenType::kFloat) || at_op("(") || at_op("[") || at_op("{")) &&
             !at_name("else") && !at_name("or") && !at_name("and")) {
    if (at_name("is")) return fail("You cannot chain multiple tests with is");
    CLEAVE_ASSIGN_OR_RETURN(ExprPtr arg, parse_primary());
    CLEAVE_ASSIGN_OR_RETURN(arg, parse_postfix(std::move(arg)));
    n->args.push_back(std::move(arg));
  }
  if (!negated) return tall(std::move(n));
  CLEAVE_ASSIGN_OR_RETURN(n, tall(std::move(n)));
  ExprPtr neg = make(ExprKind::kNot, line);
  neg->args.push_back(std::move(n));
  return tall(std::move(neg));
}
}  // namespace cleave::jinja
