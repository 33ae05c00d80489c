// chat/json_prefix.h against nlohmann's parser: every prefix of a valid document is accepted and
// only the whole one is complete; a bad byte is refused exactly where the document goes wrong;
// the whitespace and depth caps hold.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/json_prefix.h"

namespace m3 {
namespace {

// The number of leading bytes JsonPrefix accepts (s.size() when all), and whether it completed.
std::pair<size_t, bool> run(const std::string& s, bool object_only = true) {
  JsonPrefix p(object_only);
  for (size_t i = 0; i < s.size(); ++i)
    if (!p.feed(uint8_t(s[i]))) return {i, false};
  return {s.size(), p.complete()};
}

TEST(JsonPrefix, AcceptsValidObjectsAndCompletesOnlyAtTheEnd) {
  const std::vector<std::string> docs = {
      "{}",
      " {\"a\":1}",
      "{\"a\": [1, -2, 0, 3.25, -0.5e-3, 1E+9, 7e2], \"b\": {\"c\": null, \"d\": [true, false, []]}}",
      "{\"s\": \"tab\\tquote\\\" back\\\\ slash\\/ \\u00e9\\uD83D\\uDE00 caf\xc3\xa9\"}",
      "{\n  \"nested\": {\"x\": {\"y\": [[[{}]]]}}\n}",
      "{\"\": \"\", \"k\": \"{[,:]}\"}",
  };
  for (const auto& d : docs) {
    ASSERT_TRUE(nlohmann::json::accept(d)) << d;
    JsonPrefix p;
    for (size_t i = 0; i < d.size(); ++i) {
      ASSERT_FALSE(p.complete()) << d << " complete early at " << i;
      ASSERT_TRUE(p.feed(uint8_t(d[i]))) << d << " refused at " << i;
    }
    EXPECT_TRUE(p.complete()) << d;
    EXPECT_FALSE(p.feed(uint8_t(' '))) << "nothing may follow the object";
  }
}

TEST(JsonPrefix, RefusesTheFirstBadByte) {
  struct Case {
    std::string text;
    size_t bad_at;
  };
  const std::vector<Case> cases = {
      {"[1]", 0},               // json_object mode: an object only
      {"\"x\"", 0},
      {"{a", 1},                // keys are strings
      {"{\"a\" 1", 5},          // a colon must follow the key
      {"{\"a\":}", 5},          // a value must come
      {"{\"a\":1,}", 7},        // no trailing comma
      {"{\"a\":01}", 6},        // no leading zeros
      {"{\"a\":-}", 6},
      {"{\"a\":1.}", 7},
      {"{\"a\":1e}", 7},
      {"{\"a\":tru}", 8},
      {"{\"a\":nul,", 8},
      {"{\"a\":\"\x01\"}", 6},  // control bytes inside strings
      {"{\"a\":\"\\x\"}", 7},   // unknown escape
      {"{\"a\":\"\\u12g4\"}", 10},
      {"{\"a\":[1}", 7},        // mismatched bracket
      {"{\"a\":1}}", 7},        // nothing after the end
      {"{\"a\":+1}", 5},
  };
  for (const auto& c : cases) {
    const auto [n, done] = run(c.text);
    EXPECT_EQ(n, c.bad_at) << c.text;
    if (c.text[0] == '{') {  // the others are JSON, only not objects
      EXPECT_FALSE(nlohmann::json::accept(c.text)) << c.text;
    }
  }
  // Without object_only a top-level array is fine.
  EXPECT_EQ(run("[1, {\"a\": 2}]", false), std::make_pair(size_t(13), true));
}

TEST(JsonPrefix, CapsWhitespaceRunsAndDepth) {
  // "{" + n spaces + "}", built in place ("{" + std::string(...) trips gcc 12's -Wrestrict).
  auto spaced = [](size_t n) {
    std::string s(1, '{');
    s.append(n, ' ');
    s += '}';
    return s;
  };
  EXPECT_TRUE(run(spaced(JsonPrefix::kMaxWhitespaceRun)).second);
  EXPECT_EQ(run(spaced(JsonPrefix::kMaxWhitespaceRun + 1)).first, 1 + size_t(JsonPrefix::kMaxWhitespaceRun));
  EXPECT_TRUE(run("{\r\n  \"a\": 1\n}").second);
  EXPECT_EQ(run("{\n\n\n\"a\": 1}").first, 3u);  // a third line break in a row
  std::string in_string = "{\"";  // spaces inside strings do not count
  in_string.append(200, ' ');
  in_string += "\": 1}";
  EXPECT_TRUE(run(in_string).second);
  std::string deep = "{\"a\":";
  deep.append(JsonPrefix::kMaxDepth - 1, '[');
  EXPECT_EQ(run(deep).first, deep.size());
  EXPECT_EQ(run(deep + "[").first, deep.size());
}

// Random byte strings: JsonPrefix accepts a string whole and complete exactly when nlohmann
// accepts it as an object document (no trailing whitespace: the mode ends at the object).
TEST(JsonPrefix, AgreesWithAParserOnRandomStrings) {
  const std::string alphabet = "{}[]:,\"\\ 0123456789-+.eEtrufalsn";
  std::mt19937 rng(3);
  int completes = 0;
  for (int trial = 0; trial < 50000; ++trial) {
    std::string s = "{";
    const int len = 1 + int(rng() % 12);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
    const auto [n, done] = run(s);
    const bool whole = n == s.size() && done;
    bool parser = false;
    if (s.back() != ' ') {
      try {
        parser = nlohmann::json::parse(s).is_object();
      } catch (...) {
      }
    }
    ASSERT_EQ(whole, parser) << s;
    completes += whole;
  }
  EXPECT_GT(completes, 10);
}

}  // namespace
}  // namespace m3
