#pragma once
// vLLM's guided_regex / guided_choice (structured_outputs.regex / .choice): the output matches a
// regular expression as a whole, or is exactly one of a list of strings (chat/byte_regex.h). The
// end ids may come whenever the text so far matches; only they once nothing can follow.
#include <memory>
#include <string_view>
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
};

}  // namespace m3::server
