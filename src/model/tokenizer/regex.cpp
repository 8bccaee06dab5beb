#include "regex.h"

#include <fmt/format.h>
#include <unicode/uchar.h>

#include <cstdint>
#include <limits>
#include <utility>

namespace cleave::tok {
namespace {

constexpr int kInfinite = std::numeric_limits<int>::max();
// Bound on the work of one match attempt, so that a pathological pattern cannot hang encode.
constexpr uint64_t kStepBudget = 50'000'000;
constexpr int kMaxDepth = 20'000;

struct CharSet {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  uint32_t cat_mask = 0;      // matches when U_MASK(category) & cat_mask
  uint32_t not_cat_mask = 0;  // \P{..}: matches when the category is outside (each item)
  std::vector<uint32_t> not_cat_items;
  bool space = false, not_space = false;
  bool digit = false, not_digit = false;
  bool word = false, not_word = false;
  bool dot = false;  // anything but \n
  bool negated = false;

  bool matches(uint32_t cp, uint8_t cat, bool ws) const {
    bool m = false;
    if (dot && cp != '\n') m = true;
    if (!m && (cat_mask & U_MASK(cat))) m = true;
    if (!m) {
      for (uint32_t mask : not_cat_items)
        if (!(mask & U_MASK(cat))) { m = true; break; }
    }
    if (!m && ((space && ws) || (not_space && !ws))) m = true;
    if (!m && (digit || not_digit)) {
      bool d = cp >= '0' && cp <= '9';
      if ((digit && d) || (not_digit && !d)) m = true;
    }
    if (!m && (word || not_word)) {
      bool w = (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
               cp == '_';
      if ((word && w) || (not_word && !w)) m = true;
    }
    if (!m) {
      for (const auto& r : ranges)
        if (cp >= r.first && cp <= r.second) { m = true; break; }
    }
    return m != negated;
  }
};

enum class Kind { kSet, kSeq, kAlt, kRepeat, kLook, kBegin, kEnd, kEmpty };
enum class RepeatMode { kGreedy, kLazy, kPossessive };

struct Node {
  Kind kind = Kind::kEmpty;
  std::vector<int> children;  // seq, alt
  int child = -1;             // repeat, look
  int set = -1;               // set
  int min = 0, max = 0;       // repeat
  RepeatMode mode = RepeatMode::kGreedy;
  bool negate = false;        // look
};

uint32_t category_mask(std::string_view name, bool* ok) {
  *ok = true;
  struct Entry { const char* name; uint32_t mask; };
  static const Entry kTable[] = {
      {"L", U_GC_L_MASK},   {"Lu", U_GC_LU_MASK}, {"Ll", U_GC_LL_MASK}, {"Lt", U_GC_LT_MASK},
      {"Lm", U_GC_LM_MASK}, {"Lo", U_GC_LO_MASK}, {"M", U_GC_M_MASK},   {"Mn", U_GC_MN_MASK},
      {"Mc", U_GC_MC_MASK}, {"Me", U_GC_ME_MASK}, {"N", U_GC_N_MASK},   {"Nd", U_GC_ND_MASK},
      {"Nl", U_GC_NL_MASK}, {"No", U_GC_NO_MASK}, {"P", U_GC_P_MASK},   {"Pc", U_GC_PC_MASK},
      {"Pd", U_GC_PD_MASK}, {"Ps", U_GC_PS_MASK}, {"Pe", U_GC_PE_MASK}, {"Pi", U_GC_PI_MASK},
      {"Pf", U_GC_PF_MASK}, {"Po", U_GC_PO_MASK}, {"S", U_GC_S_MASK},   {"Sm", U_GC_SM_MASK},
      {"Sc", U_GC_SC_MASK}, {"Sk", U_GC_SK_MASK}, {"So", U_GC_SO_MASK}, {"Z", U_GC_Z_MASK},
      {"Zs", U_GC_ZS_MASK}, {"Zl", U_GC_ZL_MASK}, {"Zp", U_GC_ZP_MASK}, {"C", U_GC_C_MASK},
      {"Cc", U_GC_CC_MASK}, {"Cf", U_GC_CF_MASK}, {"Co", U_GC_CO_MASK}, {"Cs", U_GC_CS_MASK},
      {"Cn", U_GC_CN_MASK}, {"Letter", U_GC_L_MASK}, {"Number", U_GC_N_MASK},
      {"Punctuation", U_GC_P_MASK}, {"Symbol", U_GC_S_MASK}, {"Mark", U_GC_M_MASK},
  };
  for (const auto& e : kTable)
    if (name == e.name) return e.mask;
  *ok = false;
  return 0;
}

class Parser {
 public:
  Parser(std::string_view pattern, std::vector<Node>* nodes, std::vector<CharSet>* sets)
      : pattern_(pattern), nodes_(nodes), sets_(sets) {
    for (size_t i = 0; i < pattern.size();) {
      Utf8Char c = decode_utf8(pattern, i);
      cps_.push_back(c.cp);
      i += c.len;
    }
  }

  Result<int> parse() {
    auto root = parse_alt();
    if (!root.ok()) return root;
    if (pos_ != cps_.size()) return error("unbalanced ')'");
    return root;
  }

 private:
  Status error(std::string_view what) const {
    return InvalidArgument(
        fmt::format("regex '{}': {} at character {}", pattern_, what, pos_));
  }
  bool at_end() const { return pos_ >= cps_.size(); }
  uint32_t peek(size_t k = 0) const { return pos_ + k < cps_.size() ? cps_[pos_ + k] : 0; }

  int add_node(Node n) {
    nodes_->push_back(std::move(n));
    return static_cast<int>(nodes_->size() - 1);
  }
  int add_set(CharSet s) {
    sets_->push_back(std::move(s));
    Node n;
    n.kind = Kind::kSet;
    n.set = static_cast<int>(sets_->size() - 1);
    return add_node(std::move(n));
  }

  Result<int> parse_alt() {
    std::vector<int> alts;
    while (true) {
      auto seq = parse_seq();
      if (!seq.ok()) return seq;
      alts.push_back(*seq);
      if (!at_end() && peek() == '|') {
        ++pos_;
        continue;
      }
      break;
    }
    if (alts.size() == 1) return alts[0];
    Node n;
    n.kind = Kind::kAlt;
    n.children = std::move(alts);
    return add_node(std::move(n));
  }

  Result<int> parse_seq() {
    std::vector<int> items;
    while (!at_end() && peek() != '|' && peek() != ')') {
      auto atom = parse_atom();
      if (!atom.ok()) return atom;
      auto q = parse_quantifier(*atom);
      if (!q.ok()) return q;
      items.push_back(*q);
    }
    if (items.size() == 1) return items[0];
    Node n;
    n.kind = items.empty() ? Kind::kEmpty : Kind::kSeq;
    n.children = std::move(items);
    return add_node(std::move(n));
  }

  bool parse_int(int* out) {
    size_t start = pos_;
    int64_t v = 0;
    while (!at_end() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > 100000) return false;
      ++pos_;
    }
    *out = static_cast<int>(v);
    return pos_ > start;
  }

  Result<int> parse_quantifier(int atom) {
    if (at_end()) return atom;
    int min = 0, max = 0;
    uint32_t c = peek();
    if (c == '?') { min = 0; max = 1; ++pos_; }
    else if (c == '*') { min = 0; max = kInfinite; ++pos_; }
    else if (c == '+') { min = 1; max = kInfinite; ++pos_; }
    else if (c == '{') {
      size_t save = pos_;
      ++pos_;
      if (!parse_int(&min)) { pos_ = save; return atom; }  // a literal '{'
      if (peek() == ',') {
        ++pos_;
        if (peek() == '}') max = kInfinite;
        else if (!parse_int(&max)) { pos_ = save; return atom; }
      } else {
        max = min;
      }
      if (peek() != '}') { pos_ = save; return atom; }
      ++pos_;
      if (max < min) return error("quantifier {n,m} with m < n");
    } else {
      return atom;
    }
    Node n;
    n.kind = Kind::kRepeat;
    n.child = atom;
    n.min = min;
    n.max = max;
    if (!at_end() && peek() == '?') { n.mode = RepeatMode::kLazy; ++pos_; }
    else if (!at_end() && peek() == '+') { n.mode = RepeatMode::kPossessive; ++pos_; }
    if (!at_end() && (peek() == '*' || peek() == '+' || peek() == '?'))
      return error("nested quantifier");
    return add_node(std::move(n));
  }

  CharSet literal_set(uint32_t cp) const {
    CharSet s;
    s.ranges.push_back({cp, cp});
    if (icase_ && cp < 0x80) {
      if (cp >= 'a' && cp <= 'z') s.ranges.push_back({cp - 32, cp - 32});
      if (cp >= 'A' && cp <= 'Z') s.ranges.push_back({cp + 32, cp + 32});
    }
    return s;
  }

  Status parse_hex(int digits, uint32_t* out) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      uint32_t c = peek();
      int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10
              : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
      if (d < 0) return error("bad hexadecimal escape");
      v = v * 16 + d;
      ++pos_;
    }
    *out = v;
    return Status::Ok();
  }

  // Parses an escape after '\'. Either fills *cp (a single character) or adds items to *set.
  Status parse_escape(CharSet* set, bool* is_char, uint32_t* cp) {
    if (at_end()) return error("trailing backslash");
    uint32_t c = peek();
    ++pos_;
    *is_char = false;
    switch (c) {
      case 's': set->space = true; return Status::Ok();
      case 'S': set->not_space = true; return Status::Ok();
      case 'd': set->digit = true; return Status::Ok();
      case 'D': set->not_digit = true; return Status::Ok();
      case 'w': set->word = true; return Status::Ok();
      case 'W': set->not_word = true; return Status::Ok();
      case 'p':
      case 'P': {
        std::string name;
        if (peek() == '{') {
          ++pos_;
          while (!at_end() && peek() != '}') name.push_back(static_cast<char>(peek())), ++pos_;
          if (at_end()) return error("unterminated \\p{...}");
          ++pos_;
        } else if (!at_end()) {
          name.push_back(static_cast<char>(peek()));
          ++pos_;
        }
        bool ok = false;
        uint32_t mask = category_mask(name, &ok);
        if (!ok) return error(fmt::format("unsupported Unicode property '{}'", name));
        if (c == 'p') set->cat_mask |= mask;
        else set->not_cat_items.push_back(mask);
        return Status::Ok();
      }
      default: break;
    }
    *is_char = true;
    switch (c) {
      case 'r': *cp = '\r'; break;
      case 'n': *cp = '\n'; break;
      case 't': *cp = '\t'; break;
      case 'f': *cp = '\f'; break;
      case 'v': *cp = '\v'; break;
      case '0': *cp = 0; break;
      case 'x':
        if (peek() == '{') {
          ++pos_;
          uint32_t v = 0;
          int n = 0;
          while (!at_end() && peek() != '}') {
            uint32_t d;
            CLEAVE_RETURN_IF_ERROR(parse_hex(1, &d));
            v = v * 16 + d;
            if (++n > 6) return error("hexadecimal escape too long");
          }
          if (at_end()) return error("unterminated \\x{...}");
          ++pos_;
          *cp = v;
        } else {
          CLEAVE_RETURN_IF_ERROR(parse_hex(2, cp));
        }
        break;
      case 'u': CLEAVE_RETURN_IF_ERROR(parse_hex(4, cp)); break;
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
          return error(fmt::format("unsupported escape '\\{}'", static_cast<char>(c)));
        *cp = c;  // escaped punctuation or any other character stands for itself
    }
    return Status::Ok();
  }

  Result<int> parse_class() {
    CharSet set;
    if (peek() == '^') { set.negated = true; ++pos_; }
    bool first = true;
    while (true) {
      if (at_end()) return error("unterminated character class");
      uint32_t c = peek();
      if (c == ']' && !first) { ++pos_; break; }
      first = false;
      uint32_t lo;
      bool is_char = true;
      ++pos_;
      if (c == '\\') {
        CLEAVE_RETURN_IF_ERROR(parse_escape(&set, &is_char, &lo));
        if (!is_char) continue;
      } else if (c == '[' && peek() == ':') {
        return error("POSIX character classes are not supported");
      } else {
        lo = c;
      }
      uint32_t hi = lo;
      if (peek() == '-' && peek(1) != ']' && pos_ + 1 < cps_.size()) {
        ++pos_;
        uint32_t c2 = peek();
        ++pos_;
        if (c2 == '\\') {
          bool is_char2 = true;
          CLEAVE_RETURN_IF_ERROR(parse_escape(&set, &is_char2, &hi));
          if (!is_char2) return error("a range ends with a class escape");
        } else {
          hi = c2;
        }
        if (hi < lo) return error("character range out of order");
      }
      set.ranges.push_back({lo, hi});
      if (icase_) {
        for (uint32_t x = std::max<uint32_t>(lo, 'A'); x <= std::min<uint32_t>(hi, 'Z'); ++x)
          set.ranges.push_back({x + 32, x + 32});
        for (uint32_t x = std::max<uint32_t>(lo, 'a'); x <= std::min<uint32_t>(hi, 'z'); ++x)
          set.ranges.push_back({x - 32, x - 32});
      }
    }
    return add_set(std::move(set));
  }

  Result<int> parse_atom() {
    uint32_t c = peek();
    ++pos_;
    switch (c) {
      case '(': {
        bool saved_icase = icase_;
        Node look;
        bool is_look = false;
        if (peek() == '?') {
          ++pos_;
          uint32_t k = peek();
          ++pos_;
          if (k == ':') {
          } else if (k == '=' || k == '!') {
            is_look = true;
            look.kind = Kind::kLook;
            look.negate = k == '!';
          } else if (k == 'i' && peek() == ':') {
            ++pos_;
            icase_ = true;
          } else if (k == 'i' && peek() == ')') {
            ++pos_;  // (?i) applies to the rest of the enclosing group
            icase_ = true;
            Node e;
            e.kind = Kind::kEmpty;
            return add_node(std::move(e));
          } else {
            return error("unsupported group syntax '(?'");
          }
        }
        auto inner = parse_alt();
        if (!inner.ok()) return inner;
        if (at_end() || peek() != ')') return error("missing ')'");
        ++pos_;
        icase_ = saved_icase;
        if (!is_look) return inner;
        look.child = *inner;
        return add_node(std::move(look));
      }
      case '[': return parse_class();
      case '.': {
        CharSet s;
        s.dot = true;
        return add_set(std::move(s));
      }
      case '^': {
        Node n;
        n.kind = Kind::kBegin;
        return add_node(std::move(n));
      }
      case '$': {
        Node n;
        n.kind = Kind::kEnd;
        return add_node(std::move(n));
      }
      case '\\': {
        CharSet s;
        bool is_char = true;
        uint32_t cp = 0;
        CLEAVE_RETURN_IF_ERROR(parse_escape(&s, &is_char, &cp));
        if (is_char) return add_set(literal_set(cp));
        return add_set(std::move(s));
      }
      case '*': case '+': case '?':
        return error("quantifier without anything to repeat");
      default:
        return add_set(literal_set(c));
    }
  }

  std::string_view pattern_;
  std::vector<uint32_t> cps_;
  size_t pos_ = 0;
  bool icase_ = false;
  std::vector<Node>* nodes_;
  std::vector<CharSet>* sets_;
};

// A non-owning reference to a callable bool(size_t).
class Cont {
 public:
  template <typename F>
  Cont(const F& f)  // NOLINT: implicit by design
      : obj_(&f), call_([](const void* o, size_t p) { return (*static_cast<const F*>(o))(p); }) {}
  bool operator()(size_t p) const { return call_(obj_, p); }

 private:
  const void* obj_;
  bool (*call_)(const void*, size_t);
};

}  // namespace

struct CodepointRegex::Program {
  std::string pattern;
  std::vector<Node> nodes;
  std::vector<CharSet> sets;
  int root = -1;
};

namespace {

class Matcher {
 public:
  Matcher(const std::vector<Node>& nodes, const std::vector<CharSet>& sets,
          const CodepointText& text, size_t begin, size_t end)
      : nodes_(nodes), sets_(sets), text_(text), begin_(begin), end_(end) {}

  bool aborted() const { return aborted_; }
  void reset_budget() { steps_ = 0; }

  bool set_at(int set, size_t pos) const {
    return pos < end_ &&
           sets_[set].matches(text_.cps[pos], text_.cats[pos], text_.spaces[pos] != 0);
  }

  bool match(int id, size_t pos, Cont k) {
    if (++steps_ > kStepBudget || depth_ > kMaxDepth) {
      aborted_ = true;
      return false;
    }
    const Node& n = nodes_[id];
    switch (n.kind) {
      case Kind::kEmpty: return k(pos);
      case Kind::kSet: return set_at(n.set, pos) && k(pos + 1);
      case Kind::kBegin: return pos == begin_ && k(pos);
      case Kind::kEnd: return pos == end_ && k(pos);
      case Kind::kSeq: return seq(n, 0, pos, k);
      case Kind::kAlt:
        for (int c : n.children)
          if (match(c, pos, k)) return true;
        return false;
      case Kind::kLook: {
        auto accept = [](size_t) { return true; };
        ++depth_;
        bool found = match(n.child, pos, accept);
        --depth_;
        if (aborted_) return false;
        return found != n.negate && k(pos);
      }
      case Kind::kRepeat: {
        const Node& child = nodes_[n.child];
        if (child.kind == Kind::kSet) {
          size_t count = 0;
          while (count < static_cast<size_t>(n.max) && set_at(child.set, pos + count)) ++count;
          if (count < static_cast<size_t>(n.min)) return false;
          if (n.mode == RepeatMode::kPossessive) return k(pos + count);
          if (n.mode == RepeatMode::kGreedy) {
            for (size_t c = count + 1; c-- > static_cast<size_t>(n.min);)
              if (k(pos + c)) return true;
          } else {
            for (size_t c = n.min; c <= count; ++c)
              if (k(pos + c)) return true;
          }
          return false;
        }
        ++depth_;
        bool r = repeat(n, 0, pos, k);
        --depth_;
        return r;
      }
    }
    return false;
  }

 private:
  bool seq(const Node& n, size_t i, size_t pos, Cont k) {
    if (i == n.children.size()) return k(pos);
    auto next = [&](size_t p) { return seq(n, i + 1, p, k); };
    ++depth_;
    bool r = match(n.children[i], pos, next);
    --depth_;
    return r;
  }

  bool repeat(const Node& n, int count, size_t pos, Cont k) {
    if (depth_ > kMaxDepth) {
      aborted_ = true;
      return false;
    }
    auto next = [&](size_t p) {
      if (p == pos && count >= n.min) return false;  // an empty iteration makes no progress
      ++depth_;
      bool r = repeat(n, count + 1, p, k);
      --depth_;
      return r;
    };
    if (n.mode == RepeatMode::kLazy) {
      if (count >= n.min && k(pos)) return true;
      return count < n.max && match(n.child, pos, next);
    }
    if (count < n.max && match(n.child, pos, next)) return true;
    return count >= n.min && k(pos);
  }

  const std::vector<Node>& nodes_;
  const std::vector<CharSet>& sets_;
  const CodepointText& text_;
  size_t begin_, end_;
  uint64_t steps_ = 0;
  int depth_ = 0;
  bool aborted_ = false;
};

}  // namespace

Result<CodepointRegex> CodepointRegex::compile(std::string_view pattern) {
  auto prog = std::make_shared<Program>();
  prog->pattern = std::string(pattern);
  Parser parser(prog->pattern, &prog->nodes, &prog->sets);
  CLEAVE_ASSIGN_OR_RETURN(prog->root, parser.parse());
  CodepointRegex re;
  re.prog_ = std::move(prog);
  return re;
}

const std::string& CodepointRegex::pattern() const { return prog_->pattern; }

bool CodepointRegex::search(const CodepointText& text, size_t begin, size_t end, size_t from,
                            size_t* match_begin, size_t* match_end) const {
  Matcher m(prog_->nodes, prog_->sets, text, begin, end);
  size_t found_end = 0;
  auto accept = [&](size_t p) {
    found_end = p;
    return true;
  };
  for (size_t start = from; start < end; ++start) {
    m.reset_budget();
    if (m.match(prog_->root, start, accept)) {
      *match_begin = start;
      *match_end = found_end;
      return true;
    }
  }
  return false;
}

}  // namespace cleave::tok
