#pragma once
// A tokenizer over an explicit list of byte strings: id i is items[i], the first `specials` ids
// are special, and encode() is a greedy longest match (every single byte should be an item). For
// synthetic vocabularies: structured output's tests and its benchmark at M3's vocabulary size.
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace m3 {

class ListTokenizer : public Tokenizer {
 public:
  ListTokenizer(std::vector<std::string> items, int32_t specials);

  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const override;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const override;
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(int32_t id) const override;
  int32_t vocab_size() const override { return int32_t(items_.size()); }
  bool is_special(int32_t id) const override { return id >= 0 && id < specials_; }
  std::string_view token_bytes(int32_t id) const override;

 private:
  std::vector<std::string> items_;
  int32_t specials_;
  std::unordered_map<std::string, int32_t> index_;  // first id of each string
  size_t longest_ = 1;
};

}  // namespace m3
