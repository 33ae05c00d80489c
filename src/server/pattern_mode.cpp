#include "server/pattern_mode.h"

#include <utility>

namespace m3::server {

PatternConstraint::PatternConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids,
                                     Start start, std::shared_ptr<const RegexNfa> pattern)
    : ByteConstraint(std::move(table), std::move(end_ids), start), dfa_(std::move(pattern)), state_(dfa_.start()) {}

bool PatternConstraint::feed(std::string_view bytes) {
  for (char c : bytes) {
    const int32_t next = dfa_.next(state_, uint8_t(c));
    if (next < 0) return false;
    state_ = next;
  }
  return true;
}

void PatternConstraint::allow(std::vector<char>& allowed) {
  state_ = dfa_.rebase(state_);  // bounds the cache; never during a walk (its ids stay valid)
  auto feed = [this](int32_t& s, uint8_t b) {
    s = dfa_.next(s, b);
    return s >= 0;
  };
  table().all.walk(state_, feed, allowed);
}

}  // namespace m3::server
