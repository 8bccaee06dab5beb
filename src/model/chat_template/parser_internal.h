// The expression half of the parser (Jinja2's parse_tuple ... parse_primary), which the
// statement parser of parser.cpp extends: the token stream, error reporting and nesting bounds.
#pragma once

#include <algorithm>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "chat_template/ast.h"
#include "chat_template/lexer.h"
#include "fmt/format.h"

namespace cleave::jinja {

class ExpressionParser {
 public:
  ExpressionParser(std::vector<Token> tokens, int max_nesting)
      : toks_(std::move(tokens)), max_nesting_(max_nesting) {}

 protected:
  // --- token stream ------------------------------------------------------------------------
  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[i_ + 1 < toks_.size() ? i_ + 1 : i_]; }
  void next() {
    if (i_ + 1 < toks_.size()) ++i_;
  }
  bool at(TokenType t) const { return cur().type == t; }
  bool at_op(std::string_view op) const { return at(TokenType::kOperator) && cur().value == op; }
  bool at_name(std::string_view n) const { return at(TokenType::kName) && cur().value == n; }
  bool skip_op(std::string_view op) {
    if (!at_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!at_name(n)) return false;
    next();
    return true;
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::kData: return "template data";
      case TokenType::kVariableBegin: return "begin of print statement";
      case TokenType::kVariableEnd: return "end of print statement";
      case TokenType::kBlockBegin: return "begin of statement block";
      case TokenType::kBlockEnd: return "end of statement block";
      case TokenType::kName: return "'" + t.value + "'";
      case TokenType::kString: return "string";
      case TokenType::kInteger: return "integer";
      case TokenType::kFloat: return "float";
      case TokenType::kOperator: return "'" + t.value + "'";
      case TokenType::kEof: return "end of template";
    }
    return "token";
  }

  Status fail(std::string_view msg) const {
    return InvalidArgument(fmt::format("{} (line {})", msg, cur().line));
  }
  Status expect(TokenType t, std::string_view what) {
    if (!at(t)) return fail(fmt::format("expected {}, got {}", what, describe(cur())));
    next();
    return Status::Ok();
  }
  Status expect_op(std::string_view op) {
    if (!skip_op(op)) return fail(fmt::format("expected '{}', got {}", op, describe(cur())));
    return Status::Ok();
  }
  Result<std::string> expect_name() {
    if (!at(TokenType::kName)) return fail(fmt::format("expected name, got {}", describe(cur())));
    std::string n = cur().value;
    next();
    return n;
  }

  struct DepthGuard {
    explicit DepthGuard(ExpressionParser* p) : p(p) { ++p->depth_; }
    ~DepthGuard() { --p->depth_; }
    ExpressionParser* p;
  };
  Status check_depth() const {
    if (depth_ > max_nesting_) {
      return fail(fmt::format("template nesting deeper than {} levels", max_nesting_));
    }
    return Status::Ok();
  }

  // Records n's height; left-deep chains (a + b + c ..., a.b.c ..., x|f|g ...) are bounded here.
  Result<ExprPtr> tall(ExprPtr n) {
    int h = 0;
    for (const ExprPtr& a : n->args) {
      if (a) h = std::max(h, a->height);
    }
    for (const auto& kw : n->kwargs) h = std::max(h, kw.second->height);
    if (n->dyn_args) h = std::max(h, n->dyn_args->height);
    if (n->dyn_kwargs) h = std::max(h, n->dyn_kwargs->height);
    n->height = h + 1;
    if (n->height > max_nesting_) {
      return fail(fmt::format("expression nested deeper than {} levels", max_nesting_));
    }
    return n;
  }

  ExprPtr make(ExprKind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // --- expressions ---------------------------------------------------------------------------
  enum class TupleMode { kFull, kNoCondExpr, kSimplified };
  bool is_tuple_end(std::string_view extra_end) const;
  Result<ExprPtr> parse_tuple(TupleMode mode, std::string_view extra_end, bool explicit_parens);
  Result<ExprPtr> parse_expression(bool with_condexpr);
  Result<ExprPtr> binary(ExprKind kind, std::string op, ExprPtr l, ExprPtr r, int line);
  Result<ExprPtr> parse_or();
  Result<ExprPtr> parse_and();
  Result<ExprPtr> parse_not();
  Result<ExprPtr> parse_compare();
  template <size_t N>
  bool at_any(const char* const (&ops)[N]) const {
    for (const char* op : ops) {
      if (at_op(op)) return true;
    }
    return false;
  }
  Result<ExprPtr> parse_math1();
  Result<ExprPtr> parse_concat();
  Result<ExprPtr> parse_math2();
  Result<ExprPtr> parse_pow();
  Result<ExprPtr> parse_unary(bool with_filter);
  Result<ExprPtr> parse_primary();
  Result<ExprPtr> parse_list();
  Result<ExprPtr> parse_dict();
  Result<ExprPtr> parse_postfix(ExprPtr node);
  Result<ExprPtr> parse_filter_expr(ExprPtr node);
  Result<ExprPtr> parse_subscript(ExprPtr node);
  // An index or a slice [start:stop:step]; a slice comes back as kSlice with args[0] empty.
  Result<ExprPtr> parse_subscribed();
  Status parse_call_args(Expr* n);
  Result<ExprPtr> parse_call(ExprPtr callee);
  // `| name(args) | name2 ...`; with start_inline the first '|' is absent ({% filter %}).
  Result<ExprPtr> parse_filter(ExprPtr node, bool start_inline);
  Result<ExprPtr> parse_test(ExprPtr node);

  std::vector<Token> toks_;
  size_t i_ = 0;
  int depth_ = 0;
  int max_nesting_;
  int loop_depth_ = 0;
  std::vector<std::set<std::string>*> used_names_;
};

}  // namespace cleave::jinja
