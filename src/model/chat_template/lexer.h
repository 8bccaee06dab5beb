// Jinja2's lexer with the environment transformers uses: default delimiters, trim_blocks=True
// (the first newline after a block or comment tag is dropped), lstrip_blocks=True (spaces and
// tabs before a block or comment tag at the start of a line are dropped), `-` / `+` whitespace
// control, {% raw %}, newlines normalised to "\n" and one trailing newline of the source dropped
// (keep_trailing_newline=False). Comments produce no tokens.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::jinja {

enum class TokenType : uint8_t {
  kData,           // template text, already whitespace-controlled
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,   // value: the unescaped text
  kInteger,  // int_value
  kFloat,    // float_value
  kOperator, // value: "+", "//", "(", "==", ...
  kEof,
};

struct Token {
  TokenType type = TokenType::kEof;
  std::string value;
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
};

// Syntax errors come back as InvalidArgument ("unexpected char '?' at line 3", ...).
Result<std::vector<Token>> tokenize(std::string_view source);

}  // namespace cleave::jinja
