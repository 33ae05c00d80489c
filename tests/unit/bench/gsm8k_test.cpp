#include "bench/gsm8k.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <set>

namespace m3::bench {
namespace {

TEST(Gsm8kExtract, Strict) {
  EXPECT_EQ(extract_strict_answer("So she sold 72 clips.\n#### 72"), "72");
  EXPECT_EQ(extract_strict_answer("#### -5 apples"), "-5");
  EXPECT_EQ(extract_strict_answer("total #### 1,234.\nQuestion:"), "1,234.");
  EXPECT_EQ(extract_strict_answer("#### none here #### 7"), "7");
  EXPECT_EQ(extract_strict_answer("The answer is 72."), std::nullopt);
  EXPECT_EQ(extract_strict_answer("####72"), std::nullopt);  // the marker needs its space
}

TEST(Gsm8kExtract, FlexibleTakesTheLastNumber) {
  EXPECT_EQ(extract_flexible_answer("3 apples and 4 pears make 7."), "7.");
  EXPECT_EQ(extract_flexible_answer("It costs $1,234.50 in total"), "$1,234.50");
  EXPECT_EQ(extract_flexible_answer("from -3 to -12"), "-12");
  EXPECT_EQ(extract_flexible_answer("#### 72"), "72");
  EXPECT_EQ(extract_flexible_answer("no digits at all"), std::nullopt);
  EXPECT_EQ(extract_flexible_answer("x = 5"), "5");
  EXPECT_EQ(extract_flexible_answer("5 then a-b"), "5");
}

TEST(Gsm8kExtract, NormalizeAndMatch) {
  EXPECT_EQ(normalize_gsm8k_answer("$1,234."), "1234");
  EXPECT_EQ(normalize_gsm8k_answer("Step one.\n#### 1,000"), "1000");
  const std::string reference = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72";
  EXPECT_TRUE(gsm8k_match(extract_strict_answer("blah\n#### 72"), reference));
  EXPECT_TRUE(gsm8k_match(extract_flexible_answer("The answer is $72."), reference));
  EXPECT_FALSE(gsm8k_match(extract_flexible_answer("The answer is 720."), reference));
  EXPECT_FALSE(gsm8k_match(extract_strict_answer("The answer is 72."), reference));
  EXPECT_FALSE(gsm8k_match(std::nullopt, reference));
}

TEST(Wilson, KnownIntervals) {
  ProportionInterval ci = wilson_interval(50, 100);
  EXPECT_NEAR(ci.low, 0.4038315303659956, 1e-12);
  EXPECT_NEAR(ci.high, 0.5961684696340044, 1e-12);
  ci = wilson_interval(81, 100);
  EXPECT_NEAR(ci.low, 0.7222115462093562, 1e-12);
  EXPECT_NEAR(ci.high, 0.8748524849023126, 1e-12);
  ci = wilson_interval(0, 10);
  EXPECT_DOUBLE_EQ(ci.low, 0.0);
  EXPECT_NEAR(ci.high, 0.2775327998628892, 1e-12);
  ci = wilson_interval(10, 10);
  EXPECT_NEAR(ci.low, 0.7224672001371107, 1e-12);
  EXPECT_NEAR(ci.high, 1.0, 1e-12);
  ci = wilson_interval(0, 0);
  EXPECT_EQ(ci.low, 0.0);
  EXPECT_EQ(ci.high, 1.0);
}

TEST(Gsm8kPrompt, FewShotFormat) {
  const std::vector<Gsm8kExample> shots = {{"1+1?", "2\n#### 2"}, {"2+2?", "4\n#### 4"}};
  EXPECT_EQ(build_gsm8k_prompt(shots, "3+3?"),
            "Question: 1+1?\nAnswer: 2\n#### 2\n\nQuestion: 2+2?\nAnswer: 4\n#### 4\n\nQuestion: 3+3?\nAnswer:");
  const auto msgs = build_gsm8k_messages(shots, "3+3?");
  ASSERT_EQ(msgs.size(), 5u);
  EXPECT_EQ(msgs[1].role, "assistant");
  EXPECT_EQ(msgs[1].content, "2\n#### 2");
  EXPECT_EQ(msgs[4].content, "Question: 3+3?\nAnswer:");
}

TEST(Gsm8kPrompt, FewShotIsDeterministicAndDistinct) {
  std::vector<Gsm8kExample> pool;
  for (int i = 0; i < 100; ++i) {
    // append(), not "literal" + string: GCC 12 warns falsely (-Wrestrict) on the latter.
    pool.push_back({std::string("q").append(std::to_string(i)), std::string("#### ").append(std::to_string(i))});
  }
  const auto a = pick_fewshot(pool, 5, 1234);
  const auto b = pick_fewshot(pool, 5, 1234);
  const auto c = pick_fewshot(pool, 5, 99);
  ASSERT_EQ(a.size(), 5u);
  std::set<std::string> distinct;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].question, b[i].question);
    distinct.insert(a[i].question);
  }
  EXPECT_EQ(distinct.size(), 5u);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) differs |= a[i].question != c[i].question;
  EXPECT_TRUE(differs);
  EXPECT_EQ(pick_fewshot(pool, 500, 1).size(), 100u);
}

TEST(Gsm8kData, RealFilesLoadAndEveryReferenceHasAStrictAnswer) {
  const char* shared = std::getenv("M3_SHARED_DIR");
  const std::string dir = std::string(shared ? shared : "../shared") + "/data/gsm8k";
  if (!std::filesystem::exists(dir + "/test.jsonl")) GTEST_SKIP() << "shared data absent: " << dir;
  auto test = load_gsm8k_jsonl(dir + "/test.jsonl");
  ASSERT_TRUE(test) << test.error();
  EXPECT_EQ(test->size(), 1319u);
  auto train = load_gsm8k_jsonl(dir + "/train.jsonl");
  ASSERT_TRUE(train) << train.error();
  EXPECT_EQ(train->size(), 7473u);
  for (const auto& ex : *test) {
    // A model that reproduces the reference solution scores on both extractors.
    ASSERT_TRUE(gsm8k_match(extract_strict_answer(ex.answer), ex.answer)) << ex.answer;
    ASSERT_TRUE(gsm8k_match(extract_flexible_answer(ex.answer), ex.answer)) << ex.answer;
  }
}

}  // namespace
}  // namespace m3::bench
