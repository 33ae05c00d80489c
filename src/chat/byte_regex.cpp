#include "chat/byte_regex.h"

#include <algorithm>
#include <utility>

namespace m3 {
namespace {

using Range = std::pair<uint32_t, uint32_t>;  // code points, inclusive
constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// The parsed pattern: a tree whose sets hold code point ranges.
struct Ast {
  enum Kind { kEmpty, kSet, kBytes, kConcat, kAlt, kRepeat };
  Kind kind = kEmpty;
  std::vector<Range> set;
  std::string bytes;
  std::vector<int> kids;
  int min = 0, max = -1;  // kRepeat: max -1 = unbounded
};

std::vector<Range> normalize(std::vector<Range> r) {
  std::sort(r.begin(), r.end());
  std::vector<Range> out;
  for (const Range& x : r) {
    if (!out.empty() && x.first <= out.back().second + 1) out.back().second = std::max(out.back().second, x.second);
    else out.push_back(x);
  }
  return out;
}

std::vector<Range> complement(const std::vector<Range>& sorted) {
  std::vector<Range> out;
  uint32_t from = 0;
  for (const Range& x : sorted) {
    if (x.first > from) out.emplace_back(from, x.first - 1);
    from = x.second + 1;
  }
  if (from <= kMaxCodePoint) out.emplace_back(from, kMaxCodePoint);
  return out;
}

const std::vector<Range> kDigit = {{'0', '9'}};
const std::vector<Range> kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const std::vector<Range> kSpace = {{'\t', '\r'}, {' ', ' '}};

class Parser {
 public:
  explicit Parser(std::string_view p) : p_(p) {}

  Result<int> parse(std::vector<Ast>& ast) {
    ast_ = &ast;
    if (at_end()) return Status::error("the pattern is empty");
    size_t end = p_.size();
    if (p_[0] == '^') ++pos_;
    // A final unescaped '$' anchors the end, which a full match already does.
    if (end > pos_ && p_[end - 1] == '$' && !escaped_at(end - 1)) p_ = p_.substr(0, end - 1);
    int root = alternation(0);
    if (!error_.empty()) return Status::error(error_);
    if (!at_end()) return Status::error(fail(p_[pos_] == ')' ? "unbalanced ')'" : "unexpected character"));
    return root;
  }

 private:
  bool at_end() const { return pos_ >= p_.size(); }
  bool escaped_at(size_t i) const {  // an odd run of backslashes before i
    size_t n = 0;
    while (i > n && p_[i - n - 1] == '\\') ++n;
    return n % 2 == 1;
  }
  std::string fail(const std::string& what) {
    if (error_.empty()) error_ = what + " at offset " + std::to_string(pos_);
    return error_;
  }
  int add(Ast a) {
    ast_->push_back(std::move(a));
    return int(ast_->size()) - 1;
  }
  int set_node(std::vector<Range> r) {
    Ast a;
    a.kind = Ast::kSet;
    a.set = normalize(std::move(r));
    return add(std::move(a));
  }

  int alternation(int depth) {
    if (depth > 200) {
      fail("groups nested too deeply");
      return add(Ast{});
    }
    std::vector<int> alts{concat(depth)};
    while (error_.empty() && !at_end() && p_[pos_] == '|') {
      ++pos_;
      alts.push_back(concat(depth));
    }
    if (alts.size() == 1) return alts[0];
    Ast a;
    a.kind = Ast::kAlt;
    a.kids = std::move(alts);
    return add(std::move(a));
  }

  int concat(int depth) {
    Ast a;
    a.kind = Ast::kConcat;
    while (error_.empty() && !at_end() && p_[pos_] != '|' && p_[pos_] != ')') {
      int atom_node = atom(depth);
      if (!error_.empty()) break;
      a.kids.push_back(quantified(atom_node));
    }
    if (a.kids.empty()) return add(Ast{});
    if (a.kids.size() == 1) return a.kids[0];
    return add(std::move(a));
  }

  // Reads {n}, {n,}, {,m}, {n,m} at pos_ ('{'); false (pos_ unchanged) if it is a literal '{'.
  bool braces(int& lo, int& hi) {
    size_t i = pos_ + 1;
    auto number = [&](int& v) {
      size_t s = i;
      long long x = 0;
      while (i < p_.size() && p_[i] >= '0' && p_[i] <= '9' && x <= 1000000) x = x * 10 + (p_[i++] - '0');
      v = int(std::min<long long>(x, 1000001));
      return i > s;
    };
    bool has_lo = number(lo);
    if (!has_lo) lo = 0;
    if (i < p_.size() && p_[i] == '}') {
      if (!has_lo) return false;
      hi = lo;
    } else if (i < p_.size() && p_[i] == ',') {
      ++i;
      if (!number(hi)) hi = -1;
      if (i >= p_.size() || p_[i] != '}') return false;
    } else {
      return false;
    }
    pos_ = i + 1;
    return true;
  }

  int quantified(int node) {
    bool repeated = false;
    while (error_.empty() && !at_end()) {
      int lo = 0, hi = -1;
      const char c = p_[pos_];
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        lo = 1, ++pos_;
      } else if (c == '?') {
        hi = 1, ++pos_;
      } else if (c == '{' && braces(lo, hi)) {
        if (lo > RegexNfa::kMaxRepeat || hi > RegexNfa::kMaxRepeat) {
          fail("repetition count above " + std::to_string(RegexNfa::kMaxRepeat));
          return node;
        }
        if (hi >= 0 && hi < lo) {
          fail("repetition {n,m} with m < n");
          return node;
        }
      } else {
        break;
      }
      if (repeated) {
        fail("multiple repeat");
        return node;
      }
      repeated = true;
      if (!at_end() && p_[pos_] == '?') ++pos_;  // lazy: the same language
      else if (!at_end() && p_[pos_] == '+') {
        fail("possessive quantifiers are not supported");
        return node;
      }
      Ast a;
      a.kind = Ast::kRepeat;
      a.kids = {node};
      a.min = lo;
      a.max = hi;
      node = add(std::move(a));
    }
    return node;
  }

  // One UTF-8 code point of the pattern.
  bool code_point(uint32_t& cp) {
    const auto b0 = uint8_t(p_[pos_]);
    int n = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 14 ? 3 : (b0 >> 3) == 30 ? 4 : 0;
    if (n == 0 || pos_ + size_t(n) > p_.size()) return fail("invalid UTF-8 in the pattern"), false;
    cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1Fu) : n == 3 ? (b0 & 0x0Fu) : (b0 & 0x07u);
    for (int k = 1; k < n; ++k) {
      const auto b = uint8_t(p_[pos_ + size_t(k)]);
      if ((b >> 6) != 2) return fail("invalid UTF-8 in the pattern"), false;
      cp = (cp << 6) | (b & 0x3Fu);
    }
    pos_ += size_t(n);
    return true;
  }

  bool hex(int digits, uint32_t& cp) {
    if (pos_ + size_t(digits) > p_.size()) return fail("incomplete hex escape"), false;
    cp = 0;
    for (int k = 0; k < digits; ++k) {
      const char c = p_[pos_ + size_t(k)];
      const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (v < 0) return fail("bad hex escape"), false;
      cp = cp * 16 + uint32_t(v);
    }
    pos_ += size_t(digits);
    if (cp > kMaxCodePoint) return fail("code point above U+10FFFF"), false;
    return true;
  }

  // After a backslash: a class (\d ...) into `set`, or one code point into `cp` (returns false
  // for a class). in_class: \b is backspace there.
  bool escape(bool in_class, uint32_t& cp, std::vector<Range>& set) {
    if (at_end()) return fail("pattern ends with a backslash"), true;
    const char c = p_[pos_++];
    switch (c) {
      case 'd': set = kDigit; return false;
      case 'D': set = complement(kDigit); return false;
      case 'w': set = kWord; return false;
      case 'W': set = complement(normalize(kWord)); return false;
      case 's': set = kSpace; return false;
      case 'S': set = complement(normalize(kSpace)); return false;
      case 'n': cp = '\n'; return true;
      case 't': cp = '\t'; return true;
      case 'r': cp = '\r'; return true;
      case 'f': cp = '\f'; return true;
      case 'v': cp = '\v'; return true;
      case 'a': cp = 7; return true;
      case '0': cp = 0; return true;
      case 'x': hex(2, cp); return true;
      case 'u': hex(4, cp); return true;
      case 'U': hex(8, cp); return true;
      default: break;
    }
    if (c == 'b' && in_class) {
      cp = 8;
      return true;
    }
    if (c >= '1' && c <= '9') return fail("back-references are not supported"), true;
    if (c == 'b' || c == 'B' || c == 'A' || c == 'Z' || c == 'z' || c == 'G')
      return fail(std::string("the anchor \\") + c + " is not supported"), true;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || uint8_t(c) >= 0x80)
      return fail(std::string("unknown escape \\") + c), true;
    cp = uint8_t(c);
    return true;
  }

  int char_class() {
    ++pos_;  // '['
    bool negate = false;
    if (!at_end() && p_[pos_] == '^') negate = true, ++pos_;
    std::vector<Range> ranges;
    bool first = true;
    for (;;) {
      if (at_end()) return fail("unterminated character class"), add(Ast{});
      if (p_[pos_] == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      uint32_t lo = 0;
      std::vector<Range> cls;
      if (!item(lo, cls)) {
        if (!error_.empty()) return add(Ast{});
        ranges.insert(ranges.end(), cls.begin(), cls.end());
        continue;
      }
      // A range lo-hi (a '-' before ']' is a literal).
      if (pos_ + 1 < p_.size() && p_[pos_] == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        uint32_t hi = 0;
        std::vector<Range> cls2;
        if (!item(hi, cls2)) return fail("bad range in character class"), add(Ast{});
        if (hi < lo) return fail("bad range in character class (end before start)"), add(Ast{});
        ranges.emplace_back(lo, hi);
      } else {
        ranges.emplace_back(lo, lo);
      }
    }
    auto set = normalize(std::move(ranges));
    return set_node(negate ? complement(set) : set);
  }

  // A class item: one code point (true) or a class escape into cls (false).
  bool item(uint32_t& cp, std::vector<Range>& cls) {
    if (p_[pos_] == '\\') {
      ++pos_;
      return escape(true, cp, cls);
    }
    return code_point(cp);
  }

  int atom(int depth) {
    const char c = p_[pos_];
    if (c == '(') {
      ++pos_;
      if (!at_end() && p_[pos_] == '?') {
        ++pos_;
        if (!at_end() && p_[pos_] == ':') {
          ++pos_;
        } else if (p_.substr(pos_, 2) == "P<" || (!at_end() && p_[pos_] == '<' && p_.substr(pos_, 2) != "<=" &&
                                                   p_.substr(pos_, 2) != "<!")) {
          const size_t close = p_.find('>', pos_);
          if (close == std::string_view::npos) return fail("unterminated group name"), add(Ast{});
          pos_ = close + 1;
        } else {
          const bool look = !at_end() && (p_[pos_] == '=' || p_[pos_] == '!' || p_[pos_] == '<');
          const bool backref = p_.substr(pos_, 2) == "P=";
          return fail(look ? "look-around groups are not supported"
                      : backref ? "back-references are not supported"
                                : "inline flags and other (?...) groups are not supported"),
                 add(Ast{});
        }
      }
      int inner = alternation(depth + 1);
      if (!error_.empty()) return inner;
      if (at_end() || p_[pos_] != ')') return fail("missing ')'"), inner;
      ++pos_;
      return inner;
    }
    if (c == '[') return char_class();
    if (c == '.') {
      ++pos_;
      return set_node(complement({{'\n', '\n'}}));
    }
    if (c == '*' || c == '+' || c == '?') return fail("nothing to repeat"), add(Ast{});
    if (c == '{') {
      int lo, hi;
      if (braces(lo, hi)) return fail("nothing to repeat"), add(Ast{});
    }
    if (c == '^' || c == '$') return fail(std::string("the anchor ") + c + " inside the pattern is not supported"), add(Ast{});
    uint32_t cp = 0;
    std::vector<Range> cls;
    if (c == '\\') {
      ++pos_;
      if (!escape(false, cp, cls)) return set_node(std::move(cls));
      if (!error_.empty()) return add(Ast{});
    } else if (!code_point(cp)) {
      return add(Ast{});
    }
    return set_node({{cp, cp}});
  }

  std::string_view p_;
  size_t pos_ = 0;
  std::vector<Ast>* ast_ = nullptr;
  std::string error_;
};

// UTF-8 encodings of the code points in [lo, hi] as sequences of byte ranges (the classic split:
// first by encoded length, then until every continuation byte spans its whole range or a single
// prefix).
}  // namespace

void utf8_ranges(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  for (uint32_t edge : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= edge && hi > edge) {
      utf8_ranges(lo, edge, out);
      utf8_ranges(edge + 1, hi, out);
      return;
    }
  }
  if (hi <= 0x7F) {
    out.push_back({{uint8_t(lo), uint8_t(hi)}});
    return;
  }
  const int n = lo <= 0x7FF ? 2 : lo <= 0xFFFF ? 3 : 4;
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_ranges(lo, lo | m, out);
        utf8_ranges((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_ranges(lo, (hi & ~m) - 1, out);
        utf8_ranges(hi & ~m, hi, out);
        return;
      }
    }
  }
  auto encode = [n](uint32_t cp, uint8_t* b) {
    if (n == 2) b[0] = uint8_t(0xC0 | (cp >> 6)), b[1] = uint8_t(0x80 | (cp & 0x3F));
    if (n == 3) b[0] = uint8_t(0xE0 | (cp >> 12)), b[1] = uint8_t(0x80 | ((cp >> 6) & 0x3F)), b[2] = uint8_t(0x80 | (cp & 0x3F));
    if (n == 4)
      b[0] = uint8_t(0xF0 | (cp >> 18)), b[1] = uint8_t(0x80 | ((cp >> 12) & 0x3F)),
      b[2] = uint8_t(0x80 | ((cp >> 6) & 0x3F)), b[3] = uint8_t(0x80 | (cp & 0x3F));
  };
  uint8_t a[4], b[4];
  encode(lo, a);
  encode(hi, b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (int k = 0; k < n; ++k) seq.emplace_back(a[k], b[k]);
  out.push_back(std::move(seq));
}

namespace {

// Builds the NFA backwards: each node is compiled with its continuation known, so no patch lists.
class Builder {
 public:
  Builder(const std::vector<Ast>& ast, RegexNfa& nfa) : ast_(ast), nfa_(nfa) {
    nfa_.states.emplace_back();  // [0]: accept
  }
  bool overflow() const { return overflow_; }

  int32_t state(bool byte, uint8_t lo, uint8_t hi, std::vector<int32_t> out) {
    if (nfa_.states.size() >= size_t(RegexNfa::kMaxStates)) {
      overflow_ = true;
      return 0;
    }
    RegexNfa::State s;
    s.byte = byte, s.lo = lo, s.hi = hi, s.out = std::move(out);
    nfa_.states.push_back(std::move(s));
    return int32_t(nfa_.states.size()) - 1;
  }
  int32_t eps(std::vector<int32_t> out) { return state(false, 1, 0, std::move(out)); }

  int32_t bytes(std::string_view b, int32_t next) {
    for (size_t k = b.size(); k-- > 0 && !overflow_;) next = state(true, uint8_t(b[k]), uint8_t(b[k]), {next});
    return next;
  }

  int32_t build(int node, int32_t next) {
    if (overflow_) return 0;
    const Ast& a = ast_[size_t(node)];
    switch (a.kind) {
      case Ast::kEmpty: return next;
      case Ast::kBytes: return bytes(a.bytes, next);
      case Ast::kSet: {
        std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
        for (const Range& r : a.set) {
          // Surrogates have no UTF-8 encoding.
          if (r.first < 0xD800 && r.second >= 0xD800) {
            utf8_ranges(r.first, 0xD7FF, seqs);
            if (r.second > 0xDFFF) utf8_ranges(0xE000, r.second, seqs);
          } else if (r.first >= 0xD800 && r.first <= 0xDFFF) {
            if (r.second > 0xDFFF) utf8_ranges(0xE000, r.second, seqs);
          } else {
            utf8_ranges(r.first, r.second, seqs);
          }
        }
        std::vector<int32_t> starts;
        for (const auto& seq : seqs) {
          int32_t at = next;
          for (size_t k = seq.size(); k-- > 0 && !overflow_;) at = state(true, seq[k].first, seq[k].second, {at});
          starts.push_back(at);
        }
        if (starts.size() == 1) return starts[0];
        return eps(std::move(starts));  // none: a dead end (the class matches nothing)
      }
      case Ast::kConcat:
        for (size_t k = a.kids.size(); k-- > 0 && !overflow_;) next = build(a.kids[k], next);
        return next;
      case Ast::kAlt: {
        std::vector<int32_t> starts;
        for (int kid : a.kids) starts.push_back(build(kid, next));
        return eps(std::move(starts));
      }
      case Ast::kRepeat: {
        const int kid = a.kids[0];
        int32_t tail = next;
        if (a.max < 0) {
          const int32_t loop = eps({});
          if (overflow_) return 0;
          const int32_t body = build(kid, loop);
          nfa_.states[size_t(loop)].out = {body, next};
          tail = loop;
        } else {
          for (int k = 0; k < a.max - a.min && !overflow_; ++k) tail = eps({build(kid, tail), next});
        }
        for (int k = 0; k < a.min && !overflow_; ++k) tail = build(kid, tail);
        return tail;
      }
    }
    return next;
  }

 private:
  const std::vector<Ast>& ast_;
  RegexNfa& nfa_;
  bool overflow_ = false;
};

void mark_alive(RegexNfa& nfa) {
  std::vector<std::vector<int32_t>> rev(nfa.states.size());
  for (size_t s = 0; s < nfa.states.size(); ++s)
    for (int32_t t : nfa.states[s].out) rev[size_t(t)].push_back(int32_t(s));
  nfa.alive.assign(nfa.states.size(), 0);
  std::vector<int32_t> todo{0};
  nfa.alive[0] = 1;
  while (!todo.empty()) {
    const int32_t s = todo.back();
    todo.pop_back();
    for (int32_t p : rev[size_t(s)])
      if (!nfa.alive[size_t(p)]) nfa.alive[size_t(p)] = 1, todo.push_back(p);
  }
}

}  // namespace

Result<std::shared_ptr<const RegexNfa>> RegexNfa::compile(std::string_view pattern) {
  std::vector<Ast> ast;
  Parser parser(pattern);
  auto root = parser.parse(ast);
  if (!root.is_ok()) return root.status();
  auto nfa = std::make_shared<RegexNfa>();
  Builder b(ast, *nfa);
  nfa->start = b.build(*root, 0);
  if (b.overflow())
    return Status::error("the pattern expands to more than " + std::to_string(kMaxStates) +
                         " automaton states (large {n,m} repetitions)");
  mark_alive(*nfa);
  if (!nfa->alive[size_t(nfa->start)]) return Status::error("the pattern matches no string");
  return std::shared_ptr<const RegexNfa>(std::move(nfa));
}

std::shared_ptr<const RegexNfa> RegexNfa::choice(const std::vector<std::string>& options) {
  auto nfa = std::make_shared<RegexNfa>();
  std::vector<Ast> none;
  Builder b(none, *nfa);
  std::vector<int32_t> starts;
  for (const auto& o : options) starts.push_back(b.bytes(o, 0));
  nfa->start = starts.size() == 1 ? starts[0] : b.eps(std::move(starts));
  mark_alive(*nfa);
  return nfa;
}

LazyDfa::LazyDfa(std::shared_ptr<const RegexNfa> nfa) : nfa_(std::move(nfa)) {
  mark_.assign(nfa_->states.size(), 0);
  std::vector<int32_t> todo{nfa_->start}, set;
  close(todo, set);
  intern(std::move(set));
}

void LazyDfa::close(std::vector<int32_t>& todo, std::vector<int32_t>& set) {
  if (++epoch_ == 0) std::fill(mark_.begin(), mark_.end(), 0), epoch_ = 1;
  while (!todo.empty()) {
    const int32_t s = todo.back();
    todo.pop_back();
    if (mark_[size_t(s)] == epoch_ || !nfa_->alive[size_t(s)]) continue;
    mark_[size_t(s)] = epoch_;
    const RegexNfa::State& st = nfa_->states[size_t(s)];
    if (s == 0 || st.byte) set.push_back(s);
    if (!st.byte) todo.insert(todo.end(), st.out.rbegin(), st.out.rend());
  }
  std::sort(set.begin(), set.end());
}

int32_t LazyDfa::intern(std::vector<int32_t> set) {
  auto it = index_.find(set);
  if (it != index_.end()) return it->second;
  const auto id = int32_t(states_.size());
  DState d;
  d.accept = !set.empty() && set[0] == 0;
  d.nfa = set;
  states_.push_back(std::move(d));
  trans_.emplace_back();
  trans_.back().fill(kUnknown);
  index_.emplace(std::move(set), id);
  return id;
}

int32_t LazyDfa::compute(int32_t s, uint8_t b) {
  std::vector<int32_t> todo, set;
  for (int32_t x : states_[size_t(s)].nfa) {
    const RegexNfa::State& st = nfa_->states[size_t(x)];
    if (st.byte && st.lo <= b && b <= st.hi) todo.push_back(st.out[0]);
  }
  int32_t t = -1;
  if (!todo.empty()) {
    close(todo, set);
    if (!set.empty()) t = intern(std::move(set));
  }
  trans_[size_t(s)][b] = t;
  return t;
}

bool LazyDfa::can_continue(int32_t s) {
  DState& d = states_[size_t(s)];
  if (d.continues < 0) {
    d.continues = 0;
    for (int32_t x : d.nfa)
      if (nfa_->states[size_t(x)].byte) d.continues = 1;
  }
  return d.continues == 1;
}

bool LazyDfa::reaches_any(int32_t s, uint32_t lo, uint32_t hi) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
  utf8_ranges(lo, hi, seqs);
  std::vector<std::pair<int32_t, size_t>> dead;  // (state, position) known to lead nowhere
  auto walk = [&](auto&& self, int32_t at, const std::vector<std::pair<uint8_t, uint8_t>>& seq, size_t i) -> bool {
    if (i == seq.size()) return true;
    if (std::find(dead.begin(), dead.end(), std::make_pair(at, i)) != dead.end()) return false;
    for (int b = seq[i].first; b <= seq[i].second; ++b) {
      const int32_t t = next(at, uint8_t(b));
      if (t >= 0 && self(self, t, seq, i + 1)) return true;
    }
    dead.emplace_back(at, i);
    return false;
  };
  for (const auto& seq : seqs) {
    dead.clear();
    if (walk(walk, s, seq, 0)) return true;
  }
  return false;
}

int32_t LazyDfa::rebase(int32_t s) {
  if (states_.size() <= kMaxCachedStates) return s;
  std::vector<int32_t> keep = states_[size_t(s)].nfa;
  std::vector<int32_t> first = states_[0].nfa;
  ++rebuilds_;
  states_.clear();
  trans_.clear();
  index_.clear();
  intern(std::move(first));  // the start stays 0
  return intern(std::move(keep));
}

bool regex_full_match(const std::shared_ptr<const RegexNfa>& nfa, std::string_view text) {
  LazyDfa dfa(nfa);
  int32_t s = dfa.start();
  for (char c : text) {
    s = dfa.next(s, uint8_t(c));
    if (s < 0) return false;
  }
  return dfa.accepting(s);
}

}  // namespace m3
