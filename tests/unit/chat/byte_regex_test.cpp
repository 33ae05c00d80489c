// The byte regex against std::regex (ECMAScript) on ASCII patterns, its UTF-8 classes, the
// refusals, and the property a masked decoder relies on: every state it can reach still has a
// way to a match.
#include "chat/byte_regex.h"

#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace m3 {
namespace {

std::shared_ptr<const RegexNfa> must(const std::string& pattern) {
  auto r = RegexNfa::compile(pattern);
  EXPECT_TRUE(r.is_ok()) << pattern << ": " << (r.is_ok() ? "" : r.error());
  return r.is_ok() ? *r : RegexNfa::choice({""});
}

TEST(ByteRegex, AgreesWithStdRegexOnAsciiPatterns) {
  // Patterns whose meaning is the same in Python's re and ECMAScript.
  const std::vector<std::string> patterns = {
      "abc", "a|b|cd", "a*", "a+b?", "(ab)*c", "(a|b)+", "[a-c]+x", "[^ab]*", "a{3}", "a{2,4}", "a{2,}",
      "(ab|a)(c|bc)", "\\d{3}-\\d{4}", "\\w+@\\w+\\.com", "\\s*x\\s*", "(?:a|bc)*d", "[0-9]+(\\.[0-9]+)?",
      "(a*)*b", "((a|b)c)?", "x[\\d\\-]+y", ".b.", "[a\\]]+", "a.*z", "(yes|no|maybe)", "\\D\\W\\S",
      "-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?", "a{0,2}b{1,3}", "[.]+", "\\.+", "(a|)b"};
  const std::string alphabet = "abcdz0159-.@ xy_\nmoen";
  std::mt19937 rng(5);
  std::vector<std::string> texts = {"", "abc", "a", "aa", "aaa", "ab", "abab", "abc", "123-4567", "me@x.com",
                                    "yes", "no", "maybe", "-0.5e+3", "12.", "b", "ab", "aab", "cabx", "x1-5y"};
  for (int i = 0; i < 1500; ++i) {
    std::string t;
    const int len = int(rng() % 9);
    for (int k = 0; k < len; ++k) t += alphabet[rng() % alphabet.size()];
    texts.push_back(t);
  }
  for (const auto& p : patterns) {
    const auto nfa = must(p);
    const std::regex oracle(p, std::regex::ECMAScript);
    int matched = 0;
    for (const auto& t : texts) {
      const bool want = std::regex_match(t, oracle);
      matched += want;
      ASSERT_EQ(regex_full_match(nfa, t), want) << "pattern /" << p << "/ text '" << t << "'";
      if (!want) continue;
      LazyDfa dfa(nfa);  // a match's every prefix is alive
      int32_t s = dfa.start();
      for (char c : t) {
        s = dfa.next(s, uint8_t(c));
        ASSERT_GE(s, 0) << p << " died inside its match '" << t << "'";
      }
      EXPECT_TRUE(dfa.accepting(s));
    }
    EXPECT_GT(matched, 0) << "pattern /" << p << "/ matched none of the texts: a weak check";
  }
}

// Every state reachable from the start can still reach a match (no dead ends for a mask), and
// can_continue says exactly whether some byte continues.
TEST(ByteRegex, NoReachableDeadEnds) {
  for (const std::string p : {"(ab[^\\s\\S]|ac)d", "(ab[^\\s\\S]|a)", "(a|b)*c{2,3}", "[\\u00e9-\\u00ff]?x", ".{2}", "(é|ü)+!", "\\d{1,3}(,\\d{3})*", "[^a]"}) {
    LazyDfa dfa(must(p));
    std::vector<int32_t> todo{dfa.start()};
    std::set<int32_t> seen{dfa.start()};
    while (!todo.empty() && seen.size() < 2000) {
      const int32_t s = todo.back();
      todo.pop_back();
      bool any = false;
      for (int b = 0; b < 256; ++b) {
        const int32_t t = dfa.next(s, uint8_t(b));
        if (t < 0) continue;
        any = true;
        if (seen.insert(t).second) todo.push_back(t);
      }
      EXPECT_EQ(any, dfa.can_continue(s)) << p;
      EXPECT_TRUE(any || dfa.accepting(s)) << p << ": a state with no way to a match";
    }
  }
}

TEST(ByteRegex, Utf8CodePoints) {
  const auto dot = must("a.b");
  EXPECT_TRUE(regex_full_match(dot, "axb"));
  EXPECT_TRUE(regex_full_match(dot, "a\xc3\xa9" "b"));          // é: 2 bytes
  EXPECT_TRUE(regex_full_match(dot, "a\xe2\x82\xac" "b"));      // €: 3 bytes
  EXPECT_TRUE(regex_full_match(dot, "a\xf0\x9f\x98\x80" "b"));  // 😀: 4 bytes
  EXPECT_FALSE(regex_full_match(dot, "a\nb"));
  EXPECT_FALSE(regex_full_match(dot, "a\xc3\xa9\xa9" "b"));     // a stray continuation byte
  EXPECT_FALSE(regex_full_match(dot, "a\xff" "b"));             // never UTF-8
  EXPECT_FALSE(regex_full_match(dot, "a\xed\xa0\x80" "b"));     // a surrogate's encoding
  const auto range = must("[à-ÿ]+");
  EXPECT_TRUE(regex_full_match(range, "\xc3\xa0\xc3\xa9\xc3\xbf"));
  EXPECT_FALSE(regex_full_match(range, "\xc3\x9f"));  // ß is below à
  const auto neg = must("[^aé]");
  EXPECT_TRUE(regex_full_match(neg, "b"));
  EXPECT_TRUE(regex_full_match(neg, "\xc3\xa8"));   // è
  EXPECT_FALSE(regex_full_match(neg, "\xc3\xa9"));  // é
  EXPECT_TRUE(regex_full_match(must("\\u00e9\\x41\\U0001F600"), "\xc3\xa9" "A\xf0\x9f\x98\x80"));
  EXPECT_TRUE(regex_full_match(must("caf\xc3\xa9"), "caf\xc3\xa9"));
  EXPECT_TRUE(regex_full_match(must("^ab$"), "ab"));  // the anchors a full match implies
  EXPECT_TRUE(regex_full_match(must("a\\$"), "a$"));
  EXPECT_TRUE(regex_full_match(must("(?P<year>\\d{4})-(?<m>\\d\\d)"), "2026-12"));
  EXPECT_TRUE(regex_full_match(must("a{,2}"), "aa"));
  EXPECT_TRUE(regex_full_match(must("a{x"), "a{x"));  // not a quantifier: literal, as in Python
  EXPECT_TRUE(regex_full_match(must("a*?b+?"), "aabb"));  // lazy forms: the same language
}

TEST(ByteRegex, RefusesWhatItCannotEnforce) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"(a", "missing ')'"}, {"a)", "unbalanced"}, {"a{3,1}", "m < n"}, {"(a)\\1", "back-references"},
      {"(?=a)b", "look-around"}, {"(?<!a)b", "look-around"}, {"(?i)a", "inline flags"}, {"a**", "multiple repeat"},
      {"*a", "nothing to repeat"}, {"[ab", "unterminated"}, {"a{1001}", "above 1000"}, {"\\bword", "\\b"},
      {"a^b", "anchor"}, {"a$b", "anchor"}, {"a++", "possessive"}, {"[z-a]", "range"}, {"\\q", "unknown escape"},
      {"(a{1000}){1000}", "automaton states"}, {"[^\\s\\S]", "matches no string"}, {"", "empty"},
      {"\xff", "UTF-8"}, {"\\x4", "hex"}};
  for (const auto& [p, why] : bad) {
    auto r = RegexNfa::compile(p);
    ASSERT_FALSE(r.is_ok()) << "/" << p << "/ compiled";
    EXPECT_NE(r.error().find(why), std::string::npos) << "/" << p << "/: " << r.error();
  }
}

TEST(ByteRegex, ChoiceIsExactlyTheOptions) {
  const auto c = RegexNfa::choice({"yes", "no", "yesterday", "naïve"});
  for (const std::string t : {"yes", "no", "yesterday", "naïve"}) EXPECT_TRUE(regex_full_match(c, t)) << t;
  for (const std::string t : {"", "y", "ye", "yesterda", "noo", "Yes", "naive"}) EXPECT_FALSE(regex_full_match(c, t)) << t;
  LazyDfa dfa(c);
  int32_t s = dfa.start();
  for (char ch : std::string("yes")) s = dfa.next(s, uint8_t(ch));
  EXPECT_TRUE(dfa.accepting(s));
  EXPECT_TRUE(dfa.can_continue(s));  // "yesterday" may still come
  s = dfa.start();
  for (char ch : std::string("no")) s = dfa.next(s, uint8_t(ch));
  EXPECT_TRUE(dfa.accepting(s));
  EXPECT_FALSE(dfa.can_continue(s));
}

// A long match through more states than the cache keeps: rebasing between bytes bounds the
// cache and keeps the meaning.
TEST(ByteRegex, RebaseBoundsTheCache) {
  const auto nfa = must("[a-z]{0,900}x[a-z]{0,900}");
  LazyDfa dfa(nfa);
  int32_t s = dfa.start();
  const std::string text = std::string(900, 'a') + "x" + std::string(900, 'b');
  size_t most = 0;
  for (char c : text) {
    s = dfa.rebase(s);
    s = dfa.next(s, uint8_t(c));
    ASSERT_GE(s, 0);
    most = std::max(most, dfa.size());
  }
  EXPECT_TRUE(dfa.accepting(s));
  EXPECT_LE(most, LazyDfa::kMaxCachedStates + 2);
  EXPECT_GT(most, 1000u);  // the cache did grow and get rebased
  EXPECT_FALSE(regex_full_match(nfa, text + "b"));
}

}  // namespace
}  // namespace m3
