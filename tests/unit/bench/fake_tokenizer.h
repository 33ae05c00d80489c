#pragma once
// A tiny deterministic tokenizer for tests: ids 0..255 are single bytes, 256.. are the
// 676 words " aa".." zz" (matched greedily), and one special token "<|end|>".
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace m3::bench::testing {

class FakeTokenizer : public Tokenizer {
 public:
  static constexpr int32_t kWordBase = 256;
  static constexpr int32_t kNumWords = 26 * 26;
  static constexpr int32_t kSpecial = kWordBase + kNumWords;
  static constexpr std::string_view kSpecialText = "<|end|>";

  FakeTokenizer() {
    for (int32_t id = 0; id < vocab_size(); ++id) pieces_.push_back(id_to_token(id));
  }

  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const override {
    std::vector<int32_t> ids;
    size_t i = 0;
    while (i < text.size()) {
      if (allow_special && text.substr(i, kSpecialText.size()) == kSpecialText) {
        ids.push_back(kSpecial);
        i += kSpecialText.size();
      } else if (text[i] == ' ' && i + 2 < text.size() && is_lower(text[i + 1]) && is_lower(text[i + 2])) {
        ids.push_back(kWordBase + (text[i + 1] - 'a') * 26 + (text[i + 2] - 'a'));
        i += 3;
      } else {
        ids.push_back(static_cast<unsigned char>(text[i]));
        ++i;
      }
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id == kSpecial) {
        if (!skip_special) out += kSpecialText;
      } else {
        out += id_to_token(id);
      }
    }
    return out;
  }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    auto ids = encode(token);
    if (ids.size() == 1) return ids[0];
    return std::nullopt;
  }
  std::string id_to_token(int32_t id) const override {
    if (id < 0 || id > kSpecial) return "";
    if (id < kWordBase) return std::string(1, static_cast<char>(id));
    if (id < kSpecial) {
      const int32_t w = id - kWordBase;
      return std::string{' ', static_cast<char>('a' + w / 26), static_cast<char>('a' + w % 26)};
    }
    return std::string(kSpecialText);
  }
  int32_t vocab_size() const override { return kSpecial + 1; }
  // No `override`: the tokenizer interface gains token_bytes() in the tokenizer branch, and
  // this compiles against the header either way.
  std::string_view token_bytes(int32_t id) const {  // NOLINT(modernize-use-override)
    return id >= 0 && id < vocab_size() ? std::string_view(pieces_[static_cast<size_t>(id)]) : std::string_view();
  }
  bool is_special(int32_t id) const override { return id == kSpecial; }

 private:
  static bool is_lower(char c) { return c >= 'a' && c <= 'z'; }
  std::vector<std::string> pieces_;
};

}  // namespace m3::bench::testing
