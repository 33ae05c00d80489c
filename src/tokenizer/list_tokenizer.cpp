#include "tokenizer/list_tokenizer.h"

#include <algorithm>

namespace m3 {

ListTokenizer::ListTokenizer(std::vector<std::string> items, int32_t specials)
    : items_(std::move(items)), specials_(specials) {
  for (size_t i = 0; i < items_.size(); ++i) {
    index_.emplace(items_[i], int32_t(i));
    longest_ = std::max(longest_, items_[i].size());
  }
}

std::vector<int32_t> ListTokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<int32_t> out;
  for (size_t at = 0; at < text.size();) {
    size_t len = std::min(longest_, text.size() - at);
    for (; len > 0; --len) {
      auto it = index_.find(std::string(text.substr(at, len)));
      if (it != index_.end() && (allow_special || !is_special(it->second))) {
        out.push_back(it->second);
        break;
      }
    }
    at += std::max<size_t>(len, 1);  // a byte no item holds is skipped
  }
  return out;
}

std::string ListTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids)
    if (!(skip_special && is_special(id))) out += token_bytes(id);
  return out;
}

std::optional<int32_t> ListTokenizer::token_to_id(std::string_view token) const {
  auto it = index_.find(std::string(token));
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

std::string ListTokenizer::id_to_token(int32_t id) const { return std::string(token_bytes(id)); }

std::string_view ListTokenizer::token_bytes(int32_t id) const {
  return id >= 0 && size_t(id) < items_.size() ? std::string_view(items_[size_t(id)]) : std::string_view();
}

}  // namespace m3
