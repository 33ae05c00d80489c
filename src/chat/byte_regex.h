#pragma once
// Regular expressions over the UTF-8 bytes of an output, for structured output (vLLM's
// guided_regex / guided_choice, structured_outputs.regex / .choice). A pattern compiles to a
// byte NFA (RegexNfa, immutable, shared by the requests that use it); each request follows it
// with a LazyDfa, whose states are built on first use, so a mask that walks a vocabulary trie
// pays one table look-up per byte once the states it meets exist.
//
// The whole output must match (as Python's re.fullmatch; a leading ^ and trailing $ are
// accepted and change nothing). Syntax: literals (UTF-8), escapes \n \t \r \f \v \0 \xHH
// \uHHHH \U0010FFFF and escaped punctuation, classes [...] / [^...] with ranges over code
// points, \d \w \s and their negations (ASCII: [0-9], [A-Za-z0-9_], [ \t\n\r\f\v]), '.' (any
// code point but \n), groups (...), (?:...), (?P<name>...), (?<name>...), alternation, and the
// quantifiers * + ? {n} {n,} {n,m} (lazy forms match the same language). What would change the
// language and is not supported (back-references, look-around, inline flags, \b, possessive
// quantifiers) is refused by name with its offset.
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace m3 {

class RegexNfa {
 public:
  static constexpr int kMaxStates = 50000;   // after {n,m} copies: bounds the memory a request can ask for
  static constexpr int kMaxRepeat = 1000;    // the largest n or m in {n,m}

  static Result<std::shared_ptr<const RegexNfa>> compile(std::string_view pattern);
  // The language of exactly these strings (guided_choice); at least one.
  static std::shared_ptr<const RegexNfa> choice(const std::vector<std::string>& options);

  struct State {
    uint8_t lo = 1, hi = 0;       // a byte state: any byte in [lo, hi] moves to out[0]
    bool byte = false;
    std::vector<int32_t> out;     // epsilon edges (not a byte state) or the one successor
  };
  // [0]: the accepting state. States that cannot reach it are never entered (alive[s] == 0).
  std::vector<State> states;
  std::vector<char> alive;
  int32_t start = 0;
};

class LazyDfa {
 public:
  static constexpr size_t kMaxCachedStates = 2048;  // past this, rebase() starts the cache again

  explicit LazyDfa(std::shared_ptr<const RegexNfa> nfa);
  int32_t start() const { return 0; }
  // The state after byte b, or -1 when no completion of the output could match.
  int32_t next(int32_t s, uint8_t b) {
    int32_t t = trans_[size_t(s)][b];
    return t != kUnknown ? t : compute(s, b);
  }
  bool accepting(int32_t s) const { return states_[size_t(s)].accept; }
  // Some byte continues the output (false: only the end may come).
  bool can_continue(int32_t s);
  // Some code point in [lo, hi] (its UTF-8 bytes) can follow state s.
  bool reaches_any(int32_t s, uint32_t lo, uint32_t hi);
  // When the cache has grown past kMaxCachedStates: drop it, keep s (returns its new id).
  int32_t rebase(int32_t s);
  size_t size() const { return states_.size(); }
  // How many times rebase() dropped the cache (state ids from before are meaningless).
  uint32_t rebuilds() const { return rebuilds_; }

 private:
  static constexpr int32_t kUnknown = -2;
  struct DState {
    std::vector<int32_t> nfa;  // the closure's byte states (and 0 when accepting), sorted
    bool accept = false;
    int8_t continues = -1;     // -1: not computed yet
  };
  int32_t intern(std::vector<int32_t> set);
  void close(std::vector<int32_t>& todo, std::vector<int32_t>& set);
  int32_t compute(int32_t s, uint8_t b);

  std::shared_ptr<const RegexNfa> nfa_;
  std::vector<DState> states_;
  std::vector<std::array<int32_t, 256>> trans_;
  std::map<std::vector<int32_t>, int32_t> index_;
  std::vector<uint32_t> mark_;  // closure's visited marks (epoch_ per call)
  uint32_t epoch_ = 0;
  uint32_t rebuilds_ = 0;
};

// The UTF-8 encodings of the code points in [lo, hi] (surrogates included: callers exclude
// them) as sequences of byte ranges.
void utf8_ranges(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out);

// Whether `text` matches the whole pattern (tests and the route's examples).
bool regex_full_match(const std::shared_ptr<const RegexNfa>& nfa, std::string_view text);

}  // namespace m3
