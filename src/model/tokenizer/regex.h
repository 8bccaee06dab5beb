// A small backtracking regular-expression matcher over Unicode code points, enough for the
// pre-tokenizer patterns of GPT-2 style BPE tokenizers (std::regex cannot match \p{L}).
//
// Supported: literals and escapes (\r \n \t \f \v \xHH \x{H..} \uHHHH, escaped punctuation),
// '.', classes [...] with ranges, negation, \s \S \d \D \w \W and \p{X} / \P{X} (general
// categories L Lu Ll Lt Lm Lo M Mn Mc Me N Nd Nl No P Pc Pd Ps Pe Pi Pf Po S Sm Sc Sk So Z Zs Zl
// Zp C Cc Cf Co Cs Cn), groups ( ), (?: ), (?i: ) (ASCII case folding), look-ahead (?= ) (?! ),
// alternation (ordered, first alternative wins, as in Perl/Oniguruma/ECMAScript), quantifiers
// ? * + {n} {n,} {n,m} with lazy '?' and possessive '+' suffixes, anchors ^ and $ (start and end
// of the subject only). \s is Unicode White_Space; \d and \w are ASCII (as std::regex).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"
#include "unicode.h"

namespace cleave::tok {

class CodepointRegex {
 public:
  static Result<CodepointRegex> compile(std::string_view pattern);

  // Leftmost match in text[from, end) with the subject being text[begin, end) (anchors and
  // look-ahead see only the subject). On success sets *match_begin/*match_end (code point
  // indices) and returns true.
  bool search(const CodepointText& text, size_t begin, size_t end, size_t from,
              size_t* match_begin, size_t* match_end) const;

  const std::string& pattern() const;

 private:
  struct Program;
  std::shared_ptr<const Program> prog_;
};

}  // namespace cleave::tok
