#pragma once
// Pre-tokenisation steps HF writes for byte-level BPE: Split(regex or literal) and
// ByteLevel(add_prefix_space, use_regex), applied in order to each non-added-token segment.
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace m3 {

// GPT-2's word-splitting pattern, used by ByteLevel(use_regex = true).
inline constexpr const char kGpt2SplitPattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// A compiled PCRE2 pattern (UTF + UCP), or a literal string.
class SplitRegex {
 public:
  static Result<std::unique_ptr<SplitRegex>> compile(const std::string& pattern, bool literal);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;
  // Byte offsets [begin, end) of every match, left to right (text must be valid UTF-8).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  SplitRegex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
};

struct PreTokenizeStep {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kByteLevel;
  std::shared_ptr<SplitRegex> regex;  // kSplit, or kByteLevel with use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
};

class PreTokenizer {
 public:
  // From tokenizer.json's "pre_tokenizer" (null, ByteLevel, Split, or a Sequence of them).
  static Result<PreTokenizer> from_json(const nlohmann::json& config);
  // The GPT-2 default (ByteLevel, no prefix space, GPT-2 regex).
  static Result<PreTokenizer> gpt2();
  // Splits one text segment into words (raw bytes, before the byte-level mapping),
  // appended to `words`; they view `segment` or strings kept in `arena` (prefix spaces).
  void split(std::string_view segment, std::vector<std::string_view>& words,
             std::deque<std::string>& arena) const;

 private:
  std::vector<PreTokenizeStep> steps_;
};

}  // namespace m3
