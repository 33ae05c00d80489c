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
  if (dfa_.rebuilds() != masks_rebuilds_) masks_.clear(), masks_rebuilds_ = dfa_.rebuilds();
  if (auto it = masks_.find(state_); it != masks_.end()) {
    const std::vector<uint64_t>& bits = it->second;
    for (size_t w = 0; w < bits.size(); ++w)
      for (uint64_t m = bits[w]; m != 0; m &= m - 1) allowed[w * 64 + size_t(__builtin_ctzll(m))] = 1;
    return;
  }
  auto feed = [this](int32_t& s, uint8_t b) {
    s = dfa_.next(s, b);
    return s >= 0;
  };
  table().all.walk(state_, feed, allowed);
  if (masks_.size() >= kMaxCachedMasks) masks_.clear();
  std::vector<uint64_t>& bits = masks_[state_];
  bits.assign((allowed.size() + 63) / 64, 0);
  for (size_t i = 0; i < allowed.size(); ++i)
    if (allowed[i]) bits[i / 64] |= uint64_t(1) << (i % 64);
}

}  // namespace m3::server
