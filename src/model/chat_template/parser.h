// Jinja2's grammar (jinja2/parser.py) over the tokens of lexer.h: statements if / for (with else,
// a filtering `if` and `recursive`) / set (plain, namespace attribute, block) / macro / call /
// filter / with / block / print, the loopcontrols extension's break and continue, and
// transformers' {% generation %}; expressions with Jinja2's precedence (filters bind tighter than
// arithmetic, `not` looser than comparisons). Unknown filters and tests are errors at parse
// time, as Jinja2 reports them when it compiles.
#pragma once

#include <memory>
#include <string_view>

#include "chat_template/ast.h"

namespace cleave::jinja {

// max_nesting bounds the depth of nested blocks and sub-expressions (InvalidArgument beyond).
Result<std::shared_ptr<const Program>> parse_program(std::string_view source, int max_nesting);

}  // namespace cleave::jinja
