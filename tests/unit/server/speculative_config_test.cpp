// --speculative-config: vLLM's JSON for the ngram and eagle3 methods; everything else refused with the reason.
#include <gtest/gtest.h>

#include "server/speculative_config.h"

namespace m3::server {
namespace {

TEST(SpeculativeConfig, NgramWithDefaultsAndBounds) {
  EngineConfig c;
  EXPECT_FALSE(parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 5})", c));
  EXPECT_EQ(c.speculative_method, "ngram");
  EXPECT_EQ(c.ngram.num_speculative_tokens, 5);
  EXPECT_EQ(c.ngram.prompt_lookup_min, 2);
  EXPECT_EQ(c.ngram.prompt_lookup_max, 4);
  // One bound given: the other follows where the default would contradict it.
  EXPECT_FALSE(parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6})", c));
  EXPECT_EQ(c.ngram.prompt_lookup_min, 6);
  EXPECT_EQ(c.ngram.prompt_lookup_max, 6);
  EXPECT_FALSE(parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1})", c));
  EXPECT_EQ(c.ngram.prompt_lookup_min, 1);
  EXPECT_EQ(c.ngram.prompt_lookup_max, 1);
  EXPECT_EQ(c.ngram.disable_by_batch_size, 0);
  EXPECT_FALSE(parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8})", c));
  EXPECT_EQ(c.ngram.disable_by_batch_size, 8);
}

TEST(SpeculativeConfig, Eagle3WithItsDraftDirectory) {
  EngineConfig c;
  EXPECT_FALSE(parse_speculative_config(
      R"({"method": "eagle3", "model": "/models/M3-EAGLE3", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 4,
          "disable_by_batch_size": 16})",
      c));
  EXPECT_EQ(c.speculative_method, "eagle3");
  EXPECT_EQ(c.speculative_model, "/models/M3-EAGLE3");
  EXPECT_EQ(c.ngram.num_speculative_tokens, 3);
  EXPECT_EQ(c.ngram.disable_by_batch_size, 16);
}

TEST(SpeculativeConfig, ErrorsNameTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"{nope", "not JSON"},
      {"[1]", "JSON object"},
      {R"({"num_speculative_tokens": 3})", "method is required"},
      {R"({"model": "org/draft", "num_speculative_tokens": 3})", "'draft_model' is not supported"},
      {R"({"method": "eagle", "model": "d", "num_speculative_tokens": 3})", "'eagle' is not supported"},
      {R"({"method": "eagle3", "num_speculative_tokens": 3})", "eagle3 needs \"model\""},
      {R"({"method": "eagle3", "model": "", "num_speculative_tokens": 3})", "model must be a directory path"},
      {R"({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "prompt_lookup_min": 2})", "unknown key"},
      {R"({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 0})",
       "draft_tensor_parallel_size must be an integer >= 1"},
      {R"({"method": "ngram"})", "num_speculative_tokens is required"},
      {R"({"method": "ngram", "num_speculative_tokens": 0})", "num_speculative_tokens must be >= 1"},
      {R"({"method": "ngram", "num_speculative_tokens": 64})", "num_speculative_tokens must be in [0, 32]"},
      {R"({"method": "ngram", "num_speculative_tokens": 2.5})", "must be an integer"},
      {R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2})",
       "prompt_lookup_max (2) must be >= prompt_lookup_min (5)"},
      {R"({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})", "unknown key"},
  };
  for (const auto& [text, needle] : cases) {
    EngineConfig c;
    auto err = parse_speculative_config(text, c);
    ASSERT_TRUE(err) << text;
    EXPECT_NE(err->find(needle), std::string::npos) << text << " -> " << *err;
    EXPECT_EQ(err->rfind("--speculative-config: ", 0), 0u) << *err;
    EXPECT_TRUE(c.speculative_method.empty());
  }
}

}  // namespace
}  // namespace m3::server
