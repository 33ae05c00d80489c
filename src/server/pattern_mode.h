#pragma once
// vLLM's guided_regex / guided_choice (structured_outputs.regex / .choice): the output matches a
// regular expression as a whole, or is exactly one of a list of strings (chat/byte_regex.h). The
// end ids may come whenever the text so far matches; only they once nothing can follow.
#include <memory>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "chat/byte_regex.h"
#include "server/structured_output.h"

namespace m3::server {

class PatternConstraint final : public ByteConstraint {
 public:
  PatternConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids, Start start,
                    std::shared_ptr<const RegexNfa> pattern);

 private:
  bool feed(std::string_view bytes) override;
  bool accepting() const override { return dfa_.accepting(state_); }
  bool can_continue() override { return dfa_.can_continue(state_); }
  void allow(std::vector<char>& allowed) override;

  LazyDfa dfa_;
  int32_t state_;
  // Masks already walked, by DFA state (a loop such as [a-z]+ comes back to one state): bitsets
  // over the vocabulary, a few per request (dropped with the DFA's ids on a rebase).
  static constexpr size_t kMaxCachedMasks = 16;
  std::unordered_map<int32_t, std::vector<uint64_t>> masks_;
  uint32_t masks_rebuilds_ = 0;
};

}  // namespace m3::server
