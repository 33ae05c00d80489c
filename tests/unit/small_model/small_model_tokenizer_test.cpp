// The committed m3-small tokenizer (models/m3-small, tools/train_tokenizer.py): fixed special
// ids and flags, and encodings recorded from HF `tokenizers` 0.23 when it was trained.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

fs::path source_dir() {
  const char* v = std::getenv("M3_SOURCE_DIR");
  return v ? fs::path(v) : fs::path(M3_SOURCE_DIR_DEFAULT);
}

class SmallModelTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(SmallModelTokenizer, SpecialsAndEncodings) {
  const fs::path dir = source_dir() / "models" / GetParam();
  // Committed files: absence is a failure.
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json")) << dir;
  auto tok = Tokenizer::from_dir(dir.string());
  ASSERT_TRUE(tok.is_ok()) << tok.error();
  const Tokenizer& t = **tok;
  EXPECT_EQ(t.vocab_size(), 6144);

  // (content, special) in id order, as in m3-architecture.md 5.1 plus the tool namespace.
  const std::vector<std::pair<std::string, bool>> added = {
      {"]!p~[", true}, {"]~b]", true}, {"[e~[", true}, {"]!d~[", true}, {"<function_call>", true},
      {"]<]speech[>[", true}, {"]<]image[>[", true}, {"]<]video[>[", true},
      {"]<]start of image[>[", true}, {"]<]end of image[>[", true}, {"]<]start of video[>[", true},
      {"]<]end of video[>[", true}, {"]<]vision pad[>[", true}, {"]~!b[", true}, {"<think>", false},
      {"</think>", false}, {"<minimax:tool_call>", false}, {"</minimax:tool_call>", false},
      {"<mm:think>", false}, {"</mm:think>", false}, {"]<]minimax[>[", false}};
  for (size_t i = 0; i < added.size(); ++i) {
    auto id = t.token_to_id(added[i].first);
    ASSERT_TRUE(id.has_value()) << added[i].first;
    EXPECT_EQ(*id, int32_t(i)) << added[i].first;
    EXPECT_EQ(t.is_special(int32_t(i)), added[i].second) << added[i].first;
  }

  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"ROMEO:\nWhat light through yonder window breaks?\n",
       {1751, 46, 219, 593, 1102, 1130, 311, 2585, 2569, 1794, 103, 51, 219}},
      {"\u201cMy dear Albert,\u201d said the count, \u201cMerc\u00e9d\u00e8s!\u201d",
       {310, 801, 895, 772, 386, 405, 284, 521, 32, 389, 3767, 608}},
      {"]~!b[]~b]user\nhi[e~[\n]~b]ai\n<mm:think>x</mm:think>y",
       {13, 1, 449, 292, 219, 92, 93, 2, 219, 1, 85, 93, 219, 18, 108, 19, 109}},
      {"]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"f\">]<]minimax[>[</invoke>",
       {20, 48, 104, 1754, 83, 87, 443, 50, 219, 20, 48, 280, 1910, 384, 876, 49, 22, 90, 22, 50, 20, 48, 35, 280,
        1910, 384, 50}},
      {"numbers 12345, \u00e9moji \U0001F600 and \u4e2d\u6587\t\n  end",
       {98, 3204, 486, 1642, 38, 39, 40, 41, 32, 241, 558, 5436, 94, 93, 241, 193, 274, 267, 243, 315, 241, 181, 137,
        276, 183, 265, 250, 218, 219, 241, 988}},
  };
  for (const auto& [text, want] : cases) {
    EXPECT_EQ(t.encode(text), want) << text;
    EXPECT_EQ(t.decode(want), text);
  }
  // Reasoning/tool markers survive skip_special; control tokens do not.
  EXPECT_EQ(t.decode({13, 1, 18, 108, 19, 2}, true), "<mm:think>x</mm:think>");
}

INSTANTIATE_TEST_SUITE_P(Models, SmallModelTokenizer, ::testing::Values("m3-small", "m3-small-mxfp8"));

}  // namespace
}  // namespace m3
