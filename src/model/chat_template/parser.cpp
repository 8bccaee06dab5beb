#include "chat_template/parser.h"

#include <algorithm>
#include <initializer_list>
#include <set>

#include "chat_template/parser_internal.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

class Parser : public ExpressionParser {
 public:
  using ExpressionParser::ExpressionParser;

  Result<std::shared_ptr<const Program>> run() {
    auto program = std::make_shared<Program>();
    std::string stopped_at;
    CLEAVE_RETURN_IF_ERROR(subparse({}, &program->body, &stopped_at));
    return std::shared_ptr<const Program>(std::move(program));
  }

 private:
  // --- statements ----------------------------------------------------------------------------

  // Parses template content until `{% <one of end_names>`; consumes that `{%` and name and
  // stores the name in *stopped_at ("" at the end of the template, allowed only when end_names
  // is empty).
  Status subparse(std::initializer_list<std::string_view> end_names, Body* body,
                  std::string* stopped_at) {
    DepthGuard guard(this);
    CLEAVE_RETURN_IF_ERROR(check_depth());
    while (true) {
      const Token& t = cur();
      if (t.type == TokenType::kEof) {
        if (end_names.size() == 0) {
          *stopped_at = "";
          return Status::Ok();
        }
        std::string names;
        for (std::string_view n : end_names) names += (names.empty() ? "'" : ", '") + std::string(n) + "'";
        return fail("Unexpected end of template. Jinja was looking for the following tags: " + names);
      }
      if (t.type == TokenType::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = t.line;
        s->text = t.value;
        body->push_back(std::move(s));
        next();
      } else if (t.type == TokenType::kVariableBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kPrint;
        s->line = t.line;
        next();
        CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_tuple(TupleMode::kFull, {}, false));
        CLEAVE_RETURN_IF_ERROR(expect(TokenType::kVariableEnd, "end of print statement"));
        body->push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        if (at(TokenType::kName)) {
          for (std::string_view n : end_names) {
            if (cur().value == n) {
              *stopped_at = cur().value;
              next();
              return Status::Ok();
            }
          }
        }
        CLEAVE_RETURN_IF_ERROR(parse_statement(body));
        CLEAVE_RETURN_IF_ERROR(expect(TokenType::kBlockEnd, "end of statement block"));
      } else {
        return fail(fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  // After a statement's header: optional ':' then '%}', then the body up to an end tag.
  Status parse_statements(std::initializer_list<std::string_view> end_names, Body* body,
                          std::string* stopped_at) {
    skip_op(":");
    CLEAVE_RETURN_IF_ERROR(expect(TokenType::kBlockEnd, "end of statement block"));
    return subparse(end_names, body, stopped_at);
  }

  Status parse_statement(Body* body) {
    if (!at(TokenType::kName)) return fail("tag name expected");
    const std::string tag = cur().value;
    const int line = cur().line;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    next();
    std::string end;
    if (tag == "if") {
      s->kind = StmtKind::kIf;
      while (true) {
        CLEAVE_ASSIGN_OR_RETURN(ExprPtr test, parse_tuple(TupleMode::kNoCondExpr, {}, false));
        Body branch;
        CLEAVE_RETURN_IF_ERROR(parse_statements({"elif", "else", "endif"}, &branch, &end));
        s->branches.emplace_back(std::move(test), std::move(branch));
        if (end == "elif") continue;
        if (end == "else") {
          CLEAVE_RETURN_IF_ERROR(parse_statements({"endif"}, &s->else_body, &end));
        }
        break;
      }
    } else if (tag == "for") {
      s->kind = StmtKind::kFor;
      CLEAVE_ASSIGN_OR_RETURN(s->target, parse_assign_target(true, false, "in"));
      if (!skip_name("in")) return fail(fmt::format("expected 'in', got {}", describe(cur())));
      CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_tuple(TupleMode::kNoCondExpr, "recursive", false));
      if (skip_name("if")) {
        CLEAVE_ASSIGN_OR_RETURN(s->test, parse_expression(true));
      }
      s->recursive = skip_name("recursive");
      ++loop_depth_;
      Status st = parse_statements({"endfor", "else"}, &s->body, &end);
      --loop_depth_;
      CLEAVE_RETURN_IF_ERROR(st);
      if (end == "else") CLEAVE_RETURN_IF_ERROR(parse_statements({"endfor"}, &s->else_body, &end));
    } else if (tag == "set") {
      CLEAVE_ASSIGN_OR_RETURN(s->target, parse_assign_target(true, true, ""));
      if (skip_op("=")) {
        s->kind = StmtKind::kSet;
        CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_tuple(TupleMode::kFull, {}, false));
      } else {
        s->kind = StmtKind::kSetBlock;
        if (at_op("|")) {
          CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_filter(nullptr, false));
        }
        CLEAVE_RETURN_IF_ERROR(parse_statements({"endset"}, &s->body, &end));
      }
    } else if (tag == "macro") {
      s->kind = StmtKind::kMacro;
      CLEAVE_ASSIGN_OR_RETURN(s->macro.name, expect_name());
      CLEAVE_RETURN_IF_ERROR(parse_signature(&s->macro));
      CLEAVE_RETURN_IF_ERROR(parse_macro_body({"endmacro"}, s.get()));
    } else if (tag == "call") {
      s->kind = StmtKind::kCallBlock;
      if (at_op("(")) CLEAVE_RETURN_IF_ERROR(parse_signature(&s->macro));
      s->macro.name = "caller";
      CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_expression(true));
      if (s->expr->kind != ExprKind::kCall) return fail("expected call");
      CLEAVE_RETURN_IF_ERROR(parse_macro_body({"endcall"}, s.get()));
    } else if (tag == "filter") {
      s->kind = StmtKind::kFilterBlock;
      CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_filter(nullptr, true));
      CLEAVE_RETURN_IF_ERROR(parse_statements({"endfilter"}, &s->body, &end));
    } else if (tag == "with") {
      s->kind = StmtKind::kWith;
      while (!at(TokenType::kBlockEnd)) {
        if (!s->assigns.empty()) CLEAVE_RETURN_IF_ERROR(expect_op(","));
        CLEAVE_ASSIGN_OR_RETURN(Target t, parse_assign_target(true, false, ""));
        CLEAVE_RETURN_IF_ERROR(expect_op("="));
        CLEAVE_ASSIGN_OR_RETURN(ExprPtr value, parse_expression(true));
        s->assigns.emplace_back(std::move(t), std::move(value));
      }
      CLEAVE_RETURN_IF_ERROR(parse_statements({"endwith"}, &s->body, &end));
    } else if (tag == "block") {
      s->kind = StmtKind::kScope;
      CLEAVE_RETURN_IF_ERROR(expect_name().status());
      skip_name("scoped");
      skip_name("required");
      CLEAVE_RETURN_IF_ERROR(parse_statements({"endblock"}, &s->body, &end));
      if (at(TokenType::kName)) next();
    } else if (tag == "generation") {
      s->kind = StmtKind::kScope;
      CLEAVE_RETURN_IF_ERROR(parse_statements({"endgeneration"}, &s->body, &end));
    } else if (tag == "print") {
      s->kind = StmtKind::kPrint;
      CLEAVE_ASSIGN_OR_RETURN(s->expr, parse_tuple(TupleMode::kFull, {}, false));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) return fail(fmt::format("'{}' outside of a loop", tag));
      s->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
    } else {
      return InvalidArgument(fmt::format("Encountered unknown tag '{}' (line {})", tag, line));
    }
    body->push_back(std::move(s));
    return Status::Ok();
  }

  Status parse_signature(MacroSignature* sig) {
    CLEAVE_RETURN_IF_ERROR(expect_op("("));
    while (!at_op(")")) {
      if (!sig->params.empty()) CLEAVE_RETURN_IF_ERROR(expect_op(","));
      CLEAVE_ASSIGN_OR_RETURN(std::string name, expect_name());
      if (skip_op("=")) {
        CLEAVE_ASSIGN_OR_RETURN(ExprPtr d, parse_expression(true));
        sig->defaults.push_back(std::move(d));
      } else if (!sig->defaults.empty()) {
        return fail("non-default argument follows default argument");
      }
      sig->params.push_back(std::move(name));
    }
    return expect_op(")");
  }

  Status parse_macro_body(std::initializer_list<std::string_view> end_names, Stmt* s) {
    std::set<std::string> used;
    used_names_.push_back(&used);
    const int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;
    std::string end;
    Status st = parse_statements(end_names, &s->body, &end);
    loop_depth_ = saved_loop_depth;
    used_names_.pop_back();
    CLEAVE_RETURN_IF_ERROR(st);
    s->macro.catch_varargs = used.count("varargs") > 0;
    s->macro.catch_kwargs = used.count("kwargs") > 0;
    s->macro.uses_caller = used.count("caller") > 0;
    if (!used_names_.empty()) used_names_.back()->insert(used.begin(), used.end());
    return Status::Ok();
  }

  // for / set / with targets: a name, `ns.attr` (set only), or a tuple of names.
  Result<Target> parse_assign_target(bool with_tuple, bool with_namespace,
                                     std::string_view extra_end) {
    Target t;
    auto one = [&]() -> Result<Target> {
      Target x;
      if (at_op("(")) {
        next();
        CLEAVE_ASSIGN_OR_RETURN(x, parse_assign_target(true, false, ""));
        CLEAVE_RETURN_IF_ERROR(expect_op(")"));
        return x;
      }
      if (!at(TokenType::kName)) return fail(fmt::format("can't assign to {}", describe(cur())));
      const std::string& n = cur().value;
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" ||
          n == "None") {
        return fail("can't assign to 'const'");
      }
      x.name = n;
      next();
      if (with_namespace && at_op(".")) {
        next();
        x.kind = Target::Kind::kNamespaceAttr;
        CLEAVE_ASSIGN_OR_RETURN(x.attr, expect_name());
      }
      return x;
    };
    CLEAVE_ASSIGN_OR_RETURN(Target first, one());
    if (!with_tuple || !at_op(",")) return first;
    t.kind = Target::Kind::kTuple;
    t.items.push_back(std::move(first));
    while (skip_op(",")) {
      if (at(TokenType::kBlockEnd) || at_op("=") || at_op(")") ||
          (!extra_end.empty() && at_name(extra_end))) {
        break;
      }
      CLEAVE_ASSIGN_OR_RETURN(Target item, one());
      t.items.push_back(std::move(item));
    }
    for (const Target& item : t.items) {
      if (item.kind == Target::Kind::kNamespaceAttr) return fail("can't assign to 'tuple'");
    }
    return t;
  }

};

}  // namespace

Result<std::shared_ptr<const Program>> parse_program(std::string_view source, int max_nesting) {
  CLEAVE_ASSIGN_OR_RETURN(std::vector<Token> tokens, tokenize(source));
  return Parser(std::move(tokens), max_nesting).run();
}

}  // namespace cleave::jinja
