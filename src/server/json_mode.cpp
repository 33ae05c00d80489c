#include "server/json_mode.h"

#include <algorithm>
#include <limits>

#include "chat/chat_template.h"

namespace m3::server {

TokenBytes::TokenBytes(const Tokenizer& tok) {
  const int32_t n = tok.vocab_size();
  bytes.resize(size_t(n));
  special.resize(size_t(n));
  for (int32_t id = 0; id < n; ++id) {
    bytes[size_t(id)] = std::string(tok.token_bytes(id));
    special[size_t(id)] = tok.is_special(id) ? 1 : 0;
  }
  if (auto b = tok.token_to_id(kThinkBegin)) think_begin = *b;
  if (auto e = tok.token_to_id(kThinkEnd)) think_end = *e;
}

JsonObjectConstraint::JsonObjectConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids,
                                           Start start)
    : table_(std::move(table)), end_ids_(std::move(end_ids)), phase_(Phase::kJson) {
  const bool tags = table_->think_begin >= 0 && table_->think_end >= 0;  // single tokens, or no reasoning
  if (tags && start == Start::kReasoning) phase_ = Phase::kReasoning;
  if (tags && start == Start::kMayReason) phase_ = Phase::kBefore;
}

void JsonObjectConstraint::advance(int32_t id) {
  const TokenBytes& t = *table_;
  switch (phase_) {
    case Phase::kReasoning:
      if (id == t.think_end) phase_ = Phase::kJson;
      return;
    case Phase::kBefore:
      if (id == t.think_begin && t.think_end >= 0) {
        phase_ = Phase::kReasoning;
        return;
      }
      phase_ = Phase::kJson;
      [[fallthrough]];
    case Phase::kJson:
      if (id < 0 || size_t(id) >= t.bytes.size() || t.special[size_t(id)] || !json_.feed(t.bytes[size_t(id)])) {
        broken_ = broken_ || std::find(end_ids_.begin(), end_ids_.end(), id) == end_ids_.end();
      }
      return;
  }
}

void JsonObjectConstraint::apply(const std::vector<int32_t>& output_ids, float* logits, int64_t vocab) {
  for (; consumed_ < output_ids.size(); ++consumed_) advance(output_ids[consumed_]);
  if (broken_ || phase_ == Phase::kReasoning) return;
  const TokenBytes& t = *table_;
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  if (json_.complete()) {
    std::vector<char> end(size_t(vocab), 0);
    for (int32_t id : end_ids_)
      if (id >= 0 && id < vocab) end[size_t(id)] = 1;
    for (int64_t i = 0; i < vocab; ++i)
      if (!end[size_t(i)]) logits[i] = kOff;
    return;
  }
  bool any = false;
  for (int64_t i = 0; i < vocab; ++i) {
    bool ok = false;
    if (size_t(i) < t.bytes.size() && !t.special[size_t(i)] && !t.bytes[size_t(i)].empty()) {
      JsonPrefix trial = json_;
      ok = trial.feed(t.bytes[size_t(i)]);
    }
    if (phase_ == Phase::kBefore && i == t.think_begin && t.think_end >= 0) ok = true;
    if (ok) any = true;
    else logits[i] = kOff;
  }
  // No token can continue (a vocabulary without the bytes JSON needs): end rather than emit garbage.
  if (!any) {
    for (int32_t id : end_ids_)
      if (id >= 0 && id < vocab) logits[id] = 0.0f;
  }
}

}  // namespace m3::server
