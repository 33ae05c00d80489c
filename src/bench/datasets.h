#pragma once
// Prompt sets for `bench serve`: random token ids (decoded, re-encoded and adjusted until the
// text re-tokenises to the target length, so the server sees the intended lengths),
// ShareGPT-format conversations, and sonnet-style prompts sharing a fixed prefix.
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace m3 {
class Tokenizer;
}

namespace m3::bench {

struct BenchPrompt {
  std::string text;
  std::vector<int32_t> ids;  // the text's tokenisation (random dataset), else empty
  int64_t prompt_len = 0;    // tokens of text under the tokenizer
  int64_t output_len = 0;    // max_tokens to request
};

// Token ids that decode to " " followed by 2+ ASCII lowercase letters and encode back to
// themselves. A byte-level BPE pre-tokeniser splits text at those spaces, so any sequence of
// them re-tokenises to exactly the same ids: synthetic prompts keep their length as text.
std::vector<int32_t> word_token_pool(const Tokenizer& tokenizer, size_t max_tokens = 16384);

// Non-special token ids of the vocabulary.
std::vector<int32_t> non_special_ids(const Tokenizer& tokenizer);

struct TextForLength {
  std::string text;
  std::vector<int32_t> ids;  // encode(text)
};
// Decodes ids and re-encodes, truncating or extending with random ids from pool, until the
// text's tokenisation has target_len tokens (or attempts run out: then the closest found).
// After two attempts a growing tail (8, 16, 32.. tokens) is replaced by tokens from stable_pool
// (word tokens, see word_token_pool), which stops merges across the cut from oscillating.
TextForLength text_with_token_length(const Tokenizer& tokenizer, std::vector<int32_t> ids,
                                     int64_t target_len, const std::vector<int32_t>& pool,
                                     const std::vector<int32_t>& stable_pool, uint64_t seed);

struct RandomDatasetConfig {
  int64_t input_len = 1024;
  int64_t output_len = 128;
  double range_ratio = 0.0;  // lengths uniform in [len*(1-r), len*(1+r)]
  int64_t prefix_len = 0;    // random tokens shared by every prompt, on top of input_len
  size_t num_prompts = 1000;
  uint64_t seed = 0;
};
Result<std::vector<BenchPrompt>> make_random_dataset(const Tokenizer& tokenizer,
                                                     const RandomDatasetConfig& config);

struct ShareGptConfig {
  std::string path;
  size_t num_prompts = 1000;
  int64_t output_len = 0;  // 0: the length of the recorded reply
  uint64_t seed = 0;
};
// JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]};
// the first turn is the prompt. Pairs with < 4 tokens on either side, a prompt over 1024 or
// a total over 2048 tokens are skipped (the usual ShareGPT filter).
Result<std::vector<BenchPrompt>> load_sharegpt_dataset(const Tokenizer& tokenizer,
                                                       const ShareGptConfig& config);

struct SonnetConfig {
  std::string path;  // a text file of short lines (a poem, a play)
  int64_t input_len = 550;
  int64_t output_len = 150;
  int64_t prefix_len = 200;  // leading lines shared by all prompts
  size_t num_prompts = 1000;
  uint64_t seed = 0;
};
Result<std::vector<BenchPrompt>> make_sonnet_dataset(const Tokenizer& tokenizer,
                                                     const SonnetConfig& config);

// Uniform integer lengths in [floor(len*(1-r)), ceil(len*(1+r))], at least min_len.
std::vector<int64_t> sample_lengths(size_t count, int64_t len, double range_ratio,
                                    int64_t min_len, uint64_t seed);

}  // namespace m3::bench
