#pragma once
// The byte-level BPE implementation behind Tokenizer (internal to the tokenizer layer).
#include <mutex>
#include <unordered_map>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace m3 {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// Everything a BpeTokenizer is built from, in the model's own spelling (byte-level text).
struct BpeSpec {
  std::vector<std::pair<std::string, int32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::vector<AddedToken> added_tokens;
  std::optional<std::string> unk_token;
  bool ignore_merges = false;
  PreTokenizer pre_tokenizer;
};

class BpeTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<BpeTokenizer>> build(BpeSpec spec);

  std::vector<int32_t> encode(std::string_view text, bool allow_special) const override;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(int32_t id) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_token_.size()); }
  bool is_special(int32_t id) const override;
  std::string_view token_bytes(int32_t id) const override;

 private:
  struct Segment {
    std::string_view text;
    int32_t added_id = -1;  // >= 0: this segment is that added token
  };
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };

  BpeTokenizer() = default;
  // Splits the text segments of `segments` around matches of the added tokens for which
  // `select` is true (leftmost, then longest).
  void split_added(std::vector<Segment>& segments, bool normalized_pass, bool allow_special) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;

  PreTokenizer pre_tokenizer_;
  ByteLevelAlphabet alphabet_;
  std::unordered_map<std::string, int32_t> token_to_id_;     // model vocab + added
  std::unordered_map<std::string, int32_t> bytes_to_id_;     // model vocab, by raw bytes
  std::unordered_map<uint64_t, Merge> merges_;               // (left id, right id) -> merge
  std::array<int32_t, 256> byte_id_{};                       // single-byte tokens, -1 if absent
  std::vector<std::string> id_to_token_;
  std::vector<std::string> id_bytes_;
  std::vector<uint8_t> special_;
  std::vector<AddedToken> added_;                            // longest first
  std::array<std::vector<int32_t>, 256> added_by_first_byte_;  // indices into added_
  int32_t unk_id_ = -1;
  bool ignore_merges_ = false;

  // Lookups by string_view without building a key string.
  struct WordHash {
    using is_transparent = void;
    size_t operator()(std::string_view word) const { return std::hash<std::string_view>{}(word); }
  };
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, WordHash, std::equal_to<>> cache_;
};

}  // namespace m3
