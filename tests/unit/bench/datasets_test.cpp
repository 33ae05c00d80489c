#include "bench/datasets.h"

#include <gtest/gtest.h>

#include <fstream>

#include "fake_tokenizer.h"

namespace m3::bench {
namespace {

using testing::FakeTokenizer;

TEST(WordPool, OnlySelfEncodingSpaceWords) {
  FakeTokenizer tok;
  const auto pool = word_token_pool(tok);
  ASSERT_EQ(pool.size(), static_cast<size_t>(FakeTokenizer::kNumWords));
  for (int32_t id : pool) EXPECT_EQ(tok.encode(tok.decode({id})), std::vector<int32_t>{id});
  EXPECT_EQ(word_token_pool(tok, 10).size(), 10u);
  const auto ids = non_special_ids(tok);
  EXPECT_EQ(ids.size(), static_cast<size_t>(tok.vocab_size() - 1));
}

TEST(TextForLength, ReachesTheTargetAfterRetokenisation) {
  FakeTokenizer tok;
  const auto pool = non_special_ids(tok);
  // Bytes ' ', 'a', 'b' decode to " ab", which re-encodes as one word: length changes.
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) {
    ids.push_back(' ');
    ids.push_back('a');
    ids.push_back('b');
  }
  for (int64_t target : {1, 17, 64, 120, 300}) {
    const TextForLength t = text_with_token_length(tok, ids, target, pool, word_token_pool(tok), 5);
    EXPECT_EQ(static_cast<int64_t>(t.ids.size()), target);
    EXPECT_EQ(tok.encode(t.text), t.ids);
  }
}

TEST(SampleLengths, WithinRangeRatio) {
  const auto lens = sample_lengths(1000, 100, 0.25, 1, 3);
  int64_t lo = 1 << 30, hi = 0;
  for (int64_t v : lens) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  EXPECT_GE(lo, 75);
  EXPECT_LE(hi, 125);
  EXPECT_LT(lo, 80);   // the range is actually used
  EXPECT_GT(hi, 120);
  for (int64_t v : sample_lengths(10, 100, 0.0, 1, 3)) EXPECT_EQ(v, 100);
}

TEST(RandomDataset, ServerSeesTheIntendedLengths) {
  FakeTokenizer tok;
  RandomDatasetConfig c;
  c.input_len = 200;
  c.output_len = 32;
  c.range_ratio = 0.1;
  c.prefix_len = 16;
  c.num_prompts = 20;
  c.seed = 11;
  auto prompts = make_random_dataset(tok, c);
  ASSERT_TRUE(prompts) << prompts.error();
  ASSERT_EQ(prompts->size(), 20u);
  for (const BenchPrompt& p : *prompts) {
    EXPECT_EQ(static_cast<int64_t>(tok.encode(p.text).size()), p.prompt_len);
    EXPECT_GE(p.prompt_len, 16 + 180);
    EXPECT_LE(p.prompt_len, 16 + 220);
    EXPECT_GE(p.output_len, 28);
    EXPECT_LE(p.output_len, 36);
  }
  auto again = make_random_dataset(tok, c);
  ASSERT_TRUE(again);
  EXPECT_EQ((*again)[3].text, (*prompts)[3].text);
  c.input_len = 0;
  EXPECT_FALSE(make_random_dataset(tok, c));
}

TEST(SonnetDataset, SharedPrefixAndLengths) {
  FakeTokenizer tok;
  const std::string path = ::testing::TempDir() + "/poem.txt";
  {
    std::ofstream out(path);
    for (int i = 0; i < 50; ++i) out << "line number " << i << " of the poem\n\n";
  }
  SonnetConfig c;
  c.path = path;
  c.input_len = 300;
  c.prefix_len = 150;
  c.output_len = 20;
  c.num_prompts = 5;
  auto prompts = make_sonnet_dataset(tok, c);
  ASSERT_TRUE(prompts) << prompts.error();
  ASSERT_EQ(prompts->size(), 5u);
  const std::string& first = (*prompts)[0].text;
  const std::string head = first.substr(0, first.size() / 2 - 10);
  for (const BenchPrompt& p : *prompts) {
    EXPECT_EQ(p.text.rfind("Pick as many lines", 0), 0u);
    EXPECT_EQ(p.text.substr(0, head.size()), head) << "prompts share the prefix lines";
    EXPECT_NEAR(static_cast<double>(p.prompt_len), 300.0, 40.0);
    EXPECT_EQ(p.output_len, 20);
  }
  c.prefix_len = 400;
  EXPECT_FALSE(make_sonnet_dataset(tok, c));
}

TEST(ShareGptDataset, FiltersAndUsesReplyLength) {
  FakeTokenizer tok;
  const std::string path = ::testing::TempDir() + "/sharegpt.json";
  std::ofstream(path) << R"([
    {"conversations": [{"from": "human", "value": "hello there friend"}, {"from": "gpt", "value": "hi back to you"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long enough reply"}]},
    {"conversations": [{"from": "human", "value": "only one turn"}]},
    {"id": "no conversations"}
  ])";
  ShareGptConfig c;
  c.path = path;
  c.num_prompts = 10;
  auto prompts = load_sharegpt_dataset(tok, c);
  ASSERT_TRUE(prompts) << prompts.error();
  ASSERT_EQ(prompts->size(), 1u);  // "hi" is under 4 tokens
  EXPECT_EQ((*prompts)[0].text, "hello there friend");
  EXPECT_EQ((*prompts)[0].prompt_len, static_cast<int64_t>(tok.encode("hello there friend").size()));
  EXPECT_EQ((*prompts)[0].output_len, static_cast<int64_t>(tok.encode("hi back to you").size()));
  c.output_len = 50;
  prompts = load_sharegpt_dataset(tok, c);
  ASSERT_TRUE(prompts);
  EXPECT_EQ((*prompts)[0].output_len, 50);
  c.path = ::testing::TempDir() + "/missing.json";
  EXPECT_FALSE(load_sharegpt_dataset(tok, c));
}

}  // namespace
}  // namespace m3::bench
