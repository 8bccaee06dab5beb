#include "chat_template/lexer.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "chat_template/pystr.h"
#include "fmt/format.h"

namespace cleave::jinja {
namespace {

constexpr const char* kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*",
                                      "%",  "~",  "[",  "]",  "(",  ")",  "{", "}", ">", "<",
                                      "=",  ".",  ":",  "|",  ",",  ";"};

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {}

  Result<std::vector<Token>> run() {
    const size_t n = src_.size();
    while (pos_ < n) {
      const size_t tag = find_tag(pos_);
      if (tag == std::string::npos) {
        emit_data(src_.substr(pos_));
        pos_ = n;
        break;
      }
      std::string text = src_.substr(pos_, tag - pos_);
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      size_t raw_end = 0;
      const bool raw = kind == '%' && match_raw_begin(tag, &raw_end);
      const char sign = tag + 2 < n && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
      apply_lstrip(text, sign, kind == '{');
      emit_data(std::move(text));
      count_lines(pos_, tag);
      pos_ = tag;
      if (raw) {
        CLEAVE_RETURN_IF_ERROR(lex_raw(raw_end));
      } else if (kind == '#') {
        CLEAVE_RETURN_IF_ERROR(lex_comment(tag + 2 + (sign ? 1 : 0)));
      } else {
        CLEAVE_RETURN_IF_ERROR(lex_tag(kind, tag + 2 + (sign ? 1 : 0)));
      }
    }
    Token eof;
    eof.type = TokenType::kEof;
    eof.line = line_;
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t from) const {
    size_t p = from;
    while ((p = src_.find('{', p)) != std::string::npos) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
        return p;
      }
      ++p;
    }
    return std::string::npos;
  }

  size_t skip_space(size_t p) const {
    while (p < src_.size()) {
      const auto b = static_cast<unsigned char>(src_[p]);
      if (b < 0x80) {
        if (!py_isspace(b)) break;
        ++p;
        continue;
      }
      size_t len = 1;
      while (p + len < src_.size() && (static_cast<unsigned char>(src_[p + len]) & 0xC0) == 0x80) {
        ++len;
      }
      const std::u32string cp = utf8_decode(std::string_view(src_).substr(p, len));
      if (cp.size() != 1 || !py_isspace(cp[0])) break;
      p += len;
    }
    return p;
  }

  bool starts_with_at(size_t p, std::string_view s) const {
    return src_.compare(p, s.size(), s) == 0;
  }

  // {%(-|+|)\s*raw\s*(-%}\s*|%}) at p; *end is the position after it.
  bool match_raw_begin(size_t p, size_t* end) const {
    size_t q = p + 2;
    if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) ++q;
    q = skip_space(q);
    if (!starts_with_at(q, "raw")) return false;
    q = skip_space(q + 3);
    if (starts_with_at(q, "-%}")) {
      *end = skip_space(q + 3);
      return true;
    }
    if (starts_with_at(q, "%}")) {
      *end = q + 2;
      return true;
    }
    return false;
  }

  void apply_lstrip(std::string& text, char sign, bool variable) const {
    if (sign == '-') {
      text = py_strip(text, StripSide::kRight, std::nullopt);
    } else if (sign != '+' && !variable) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if (l_pos > 0 || line_starting_) {
        const std::string_view tail = std::string_view(text).substr(l_pos);
        if (!tail.empty() && py_strip(tail, StripSide::kLeft, std::nullopt).empty()) {
          text.resize(l_pos);
        }
      }
    }
  }

  void emit_data(std::string text) {
    if (text.empty()) return;
    Token t;
    t.type = TokenType::kData;
    t.value = std::move(text);
    t.line = line_;
    tokens_.push_back(std::move(t));
  }

  void count_lines(size_t from, size_t to) {
    for (size_t i = from; i < to && i < src_.size(); ++i) {
      if (src_[i] == '\n') ++line_;
    }
  }

  // Matches a block-style end ("+%}", "-%}\s*", "%}\n?") at p for `close` ("%}" or "#}").
  bool match_block_end(size_t p, std::string_view close, size_t* end) const {
    if (src_[p] == '+' && starts_with_at(p + 1, close)) {
      *end = p + 1 + close.size();
      return true;
    }
    if (src_[p] == '-' && starts_with_at(p + 1, close)) {
      *end = skip_space(p + 1 + close.size());
      return true;
    }
    if (starts_with_at(p, close)) {
      *end = p + close.size();
      if (*end < src_.size() && src_[*end] == '\n') ++*end;  // trim_blocks
      return true;
    }
    return false;
  }

  void finish_tag(size_t end) {
    line_starting_ = end > 0 && src_[end - 1] == '\n';
    count_lines(pos_, end);
    pos_ = end;
  }

  Status lex_comment(size_t p) {
    size_t end = 0;
    for (size_t q = p; q < src_.size(); ++q) {
      if ((src_[q] == '+' || src_[q] == '-' || src_[q] == '#') && match_block_end(q, "#}", &end)) {
        finish_tag(end);
        return Status::Ok();
      }
    }
    return InvalidArgument(fmt::format("Missing end of comment tag (line {})", line_));
  }

  Status lex_raw(size_t p) {
    for (size_t q = p; q < src_.size(); ++q) {
      if (src_[q] != '{' || !starts_with_at(q, "{%")) continue;
      size_t r = q + 2;
      const char sign = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r] : 0;
      if (sign) ++r;
      r = skip_space(r);
      if (!starts_with_at(r, "endraw")) continue;
      r = skip_space(r + 6);
      size_t end = 0;
      if (r >= src_.size() || !match_block_end(r, "%}", &end)) continue;
      std::string text = src_.substr(p, q - p);
      apply_lstrip(text, sign, false);
      emit_data(std::move(text));
      finish_tag(end);
      return Status::Ok();
    }
    return InvalidArgument(fmt::format("Missing end of raw directive (line {})", line_));
  }

  Status lex_tag(char kind, size_t p) {
    Token begin;
    begin.type = kind == '%' ? TokenType::kBlockBegin : TokenType::kVariableBegin;
    begin.line = line_;
    tokens_.push_back(begin);
    std::string balancing;
    while (true) {
      if (p >= src_.size()) {
        return InvalidArgument(fmt::format("unexpected end of template, expected '{}' (line {})",
                                           kind == '%' ? "%}" : "}}", line_));
      }
      if (balancing.empty()) {
        size_t end = 0;
        bool matched = false;
        if (kind == '%') {
          matched = match_block_end(p, "%}", &end);
        } else if (src_[p] == '-' && starts_with_at(p + 1, "}}")) {
          end = skip_space(p + 3);
          matched = true;
        } else if (starts_with_at(p, "}}")) {
          end = p + 2;
          matched = true;
        }
        if (matched) {
          Token t;
          t.type = kind == '%' ? TokenType::kBlockEnd : TokenType::kVariableEnd;
          t.line = line_;
          tokens_.push_back(t);
          line_starting_ = src_[end - 1] == '\n';
          for (size_t i = p; i < end; ++i) {
            if (src_[i] == '\n') ++line_;
          }
          pos_ = end;
          return Status::Ok();
        }
      }
      const size_t after_space = skip_space(p);
      if (after_space != p) {
        for (size_t i = p; i < after_space; ++i) {
          if (src_[i] == '\n') ++line_;
        }
        p = after_space;
        continue;
      }
      const char c = src_[p];
      Token t;
      t.line = line_;
      if (is_digit(c)) {
        CLEAVE_RETURN_IF_ERROR(lex_number(p, &t));
      } else if (is_name_start(c)) {
        size_t q = p;
        while (q < src_.size() && is_name_char(src_[q])) ++q;
        t.type = TokenType::kName;
        t.value = src_.substr(p, q - p);
        p = q;
      } else if (c == '\'' || c == '"') {
        CLEAVE_RETURN_IF_ERROR(lex_string(p, &t));
      } else {
        std::string_view op;
        for (const char* candidate : kOperators) {
          if (starts_with_at(p, candidate)) {
            op = candidate;
            break;
          }
        }
        if (op.empty()) {
          const std::vector<std::string> ch = utf8_chars(std::string_view(src_).substr(p, 4));
          return InvalidArgument(fmt::format("unexpected char '{}' at line {}",
                                             ch.empty() ? std::string(1, c) : ch[0], line_));
        }
        if (op == "(" || op == "[" || op == "{") {
          balancing.push_back(op == "(" ? ')' : (op == "[" ? ']' : '}'));
        } else if (op == ")" || op == "]" || op == "}") {
          if (balancing.empty()) {
            return InvalidArgument(fmt::format("unexpected '{}' at line {}", op, line_));
          }
          if (balancing.back() != op[0]) {
            return InvalidArgument(fmt::format("unexpected '{}', expected '{}' at line {}", op,
                                               balancing.back(), line_));
          }
          balancing.pop_back();
        }
        t.type = TokenType::kOperator;
        t.value = std::string(op);
        p += op.size();
      }
      tokens_.push_back(std::move(t));
    }
  }

  Status lex_number(size_t& p, Token* t) {
    const size_t start = p;
    auto digits = [&](auto pred) {
      // (\d+_)*\d+ style: digits with single underscores between them.
      size_t q = p;
      if (q >= src_.size() || !pred(src_[q])) return false;
      while (q < src_.size()) {
        if (pred(src_[q])) {
          ++q;
        } else if (src_[q] == '_' && q + 1 < src_.size() && pred(src_[q + 1])) {
          ++q;
        } else {
          break;
        }
      }
      p = q;
      return true;
    };
    auto strip_underscores = [](std::string s) {
      std::string out;
      for (char ch : s) {
        if (ch != '_') out.push_back(ch);
      }
      return out;
    };
    const bool after_dot = start > 0 && src_[start - 1] == '.';
    if (src_[p] == '0' && p + 1 < src_.size() &&
        (src_[p + 1] == 'x' || src_[p + 1] == 'X' || src_[p + 1] == 'o' || src_[p + 1] == 'O' ||
         src_[p + 1] == 'b' || src_[p + 1] == 'B')) {
      const char base_char = static_cast<char>(src_[p + 1] | 0x20);
      const int base = base_char == 'x' ? 16 : (base_char == 'o' ? 8 : 2);
      p += 2;
      if (p < src_.size() && src_[p] == '_') ++p;
      auto pred = [base](char ch) {
        if (base == 16) return std::isxdigit(static_cast<unsigned char>(ch)) != 0;
        return ch >= '0' && ch < static_cast<char>('0' + base);
      };
      if (!digits(pred)) return InvalidArgument(fmt::format("invalid number at line {}", line_));
      const std::string body = strip_underscores(src_.substr(start + 2, p - start - 2));
      errno = 0;
      const unsigned long long v = std::strtoull(body.c_str(), nullptr, base);
      if (errno != 0 || v > static_cast<unsigned long long>(INT64_MAX)) {
        return InvalidArgument(fmt::format("integer literal too large at line {}", line_));
      }
      t->type = TokenType::kInteger;
      t->int_value = static_cast<int64_t>(v);
      return Status::Ok();
    }
    digits(is_digit);
    bool is_float = false;
    if (!after_dot) {
      const size_t int_end = p;
      if (p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
        ++p;
        digits(is_digit);
        is_float = true;
      }
      if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
        size_t q = p + 1;
        if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (q < src_.size() && is_digit(src_[q])) {
          p = q;
          digits(is_digit);
          is_float = true;
        }
      }
      if (!is_float) p = int_end;
    }
    const std::string text = strip_underscores(src_.substr(start, p - start));
    if (is_float) {
      t->type = TokenType::kFloat;
      t->float_value = std::strtod(text.c_str(), nullptr);
      return Status::Ok();
    }
    errno = 0;
    const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
    if (errno != 0 || v > static_cast<unsigned long long>(INT64_MAX)) {
      return InvalidArgument(fmt::format("integer literal too large at line {}", line_));
    }
    t->type = TokenType::kInteger;
    t->int_value = static_cast<int64_t>(v);
    return Status::Ok();
  }

  // A quoted string with Python's unicode-escape rules.
  Status lex_string(size_t& p, Token* t) {
    const char quote = src_[p];
    size_t q = p + 1;
    std::string out;
    auto hex = [&](size_t at, int count, uint32_t* value) {
      if (at + count > src_.size()) return false;
      *value = 0;
      for (int i = 0; i < count; ++i) {
        const char h = src_[at + i];
        if (!std::isxdigit(static_cast<unsigned char>(h))) return false;
        *value = *value * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                          ? h - '0'
                                                          : (h | 0x20) - 'a' + 10);
      }
      return true;
    };
    while (true) {
      if (q >= src_.size()) {
        return InvalidArgument(fmt::format("unterminated string at line {}", line_));
      }
      const char c = src_[q];
      if (c == quote) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        out.push_back(c);
        ++q;
        continue;
      }
      if (q + 1 >= src_.size()) {
        return InvalidArgument(fmt::format("unterminated string at line {}", line_));
      }
      const char e = src_[q + 1];
      q += 2;
      switch (e) {
        case '\n': ++line_; break;
        case '\\': out.push_back('\\'); break;
        case '\'': out.push_back('\''); break;
        case '"': out.push_back('"'); break;
        case 'a': out.push_back('\a'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'v': out.push_back('\v'); break;
        case 'x': case 'u': case 'U': {
          const int count = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          uint32_t v = 0;
          if (!hex(q, count, &v) || v > 0x10FFFF) {
            return InvalidArgument(fmt::format("invalid \\{} escape in string at line {}", e, line_));
          }
          utf8_append(out, static_cast<char32_t>(v));
          q += count;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && q < src_.size() && src_[q] >= '0' && src_[q] <= '7'; ++i, ++q) {
              v = v * 8 + static_cast<uint32_t>(src_[q] - '0');
            }
            utf8_append(out, static_cast<char32_t>(v));
          } else {
            out.push_back('\\');
            out.push_back(e);
          }
          break;
      }
    }
    t->type = TokenType::kString;
    t->value = std::move(out);
    p = q + 1;
    return Status::Ok();
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

Result<std::vector<Token>> tokenize(std::string_view source) {
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src.push_back(source[i]);
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();  // keep_trailing_newline=False
  return Lexer(std::move(src)).run();
}

}  // namespace cleave::jinja
