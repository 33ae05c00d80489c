// Prompt-lookup drafts: the longest suffix match wins, the most recent among equals, bounded by
// the draft length and what the request may still produce.
#include <gtest/gtest.h>

#include "exec/ngram_proposer.h"

namespace m3 {
namespace {

NgramConfig cfg(int32_t k, int32_t lo, int32_t hi) {
  NgramConfig c;
  c.num_speculative_tokens = k;
  c.prompt_lookup_min = lo;
  c.prompt_lookup_max = hi;
  return c;
}

TEST(NgramProposer, ContinuesTheMostRecentLongestMatch) {
  //                    0  1  2  3  4  5  6  7  8  9 10 11 12
  std::vector<int32_t> p{5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 0, 2, 2};
  // Output ends with 6 7: matches at 1..2 (then 8 9 1) and 6..7 (then 3 4 0); the latest wins.
  std::vector<int32_t> out{1, 6, 7};
  EXPECT_EQ(propose_ngram(p, out, cfg(3, 1, 4), 10), (std::vector<int32_t>{3, 4, 0}));
  // The output "8 9 1 6 7" is p[3..7]: that length-5 match is taken.
  std::vector<int32_t> out2{8, 9, 1, 6, 7};
  EXPECT_EQ(propose_ngram(p, out2, cfg(2, 1, 5), 10), (std::vector<int32_t>{3, 4}));
  std::vector<int32_t> q{1, 2, 3, 9, 2, 3, 8, 0, 0};
  // Suffix "1 2 3": the length-3 match at 0..2 beats the more recent length-2 match "2 3" at 4..5.
  EXPECT_EQ(propose_ngram(q, std::vector<int32_t>{1, 2, 3}, cfg(2, 1, 3), 10), (std::vector<int32_t>{9, 2}));
  // With prompt_lookup_max 2 both are length 2: the most recent (4..5) wins.
  EXPECT_EQ(propose_ngram(q, std::vector<int32_t>{1, 2, 3}, cfg(2, 1, 2), 10), (std::vector<int32_t>{8, 0}));
}

TEST(NgramProposer, RespectsBoundsAndFindsNothingWithoutAMatch) {
  std::vector<int32_t> p{1, 2, 3, 4, 5, 6};
  std::vector<int32_t> none{7, 8};
  EXPECT_TRUE(propose_ngram(p, none, cfg(4, 1, 3), 10).empty());
  std::vector<int32_t> one{1};  // "1" matches at 0 (length 1)
  EXPECT_EQ(propose_ngram(p, one, cfg(3, 1, 3), 10), (std::vector<int32_t>{2, 3, 4}));
  EXPECT_TRUE(propose_ngram(p, one, cfg(3, 2, 3), 10).empty());  // length 1 < prompt_lookup_min
  EXPECT_EQ(propose_ngram(p, one, cfg(3, 1, 3), 2), (std::vector<int32_t>{2, 3}));  // room for 2
  EXPECT_TRUE(propose_ngram(p, one, cfg(3, 1, 3), 0).empty());
  EXPECT_TRUE(propose_ngram(p, one, cfg(0, 1, 3), 10).empty());  // speculation off
  // The draft stops at the end of the sequence: "4 5 6 | 4 5" -> after the match "4 5" comes 6, 4, 5.
  std::vector<int32_t> tail{4, 5};
  EXPECT_EQ(propose_ngram(p, tail, cfg(8, 1, 4), 10), (std::vector<int32_t>{6, 4, 5}));
  // A run of one token proposes more of it.
  std::vector<int32_t> run{9, 9, 9, 9};
  EXPECT_EQ(propose_ngram(std::vector<int32_t>{3}, run, cfg(3, 2, 3), 10), (std::vector<int32_t>{9}));
  // Empty output: the prompt alone is searched.
  EXPECT_EQ(propose_ngram(std::vector<int32_t>{7, 1, 7}, std::vector<int32_t>{}, cfg(2, 1, 2), 10),
            (std::vector<int32_t>{1, 7}));
}

TEST(NgramProposer, ConfigValidation) {
  EXPECT_TRUE(cfg(4, 2, 4).validate().is_ok());
  EXPECT_FALSE(cfg(-1, 2, 4).validate().is_ok());
  EXPECT_FALSE(cfg(33, 2, 4).validate().is_ok());
  EXPECT_FALSE(cfg(4, 0, 4).validate().is_ok());
  const Status st = cfg(4, 5, 3).validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("prompt_lookup_max"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace m3
