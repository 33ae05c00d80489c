#include "server/structured_output.h"

#include <algorithm>
#include <limits>

#include "chat/chat_template.h"
#include "chat/json_prefix.h"

namespace m3::server {

void TokenTrie::build(const std::vector<std::pair<std::string_view, int32_t>>& tokens) {
  // A sorted list of the byte strings is the trie's depth-first order already: each distinct
  // prefix becomes a node where it first appears.
  std::vector<std::pair<std::string_view, int32_t>> sorted;
  for (const auto& t : tokens)
    if (!t.first.empty() && t.first.size() < 65535) sorted.push_back(t);
  std::sort(sorted.begin(), sorted.end());
  nodes.assign(1, Node{});
  ids.clear();
  max_depth = 0;
  std::vector<int32_t> path{0};  // path[d]: the node at depth d on the current branch
  std::string_view prev;
  for (const auto& [text, id] : sorted) {
    size_t common = 0;
    while (common < prev.size() && common < text.size() && prev[common] == text[common]) ++common;
    // Close the branch below the shared prefix, then open the new bytes.
    for (size_t d = path.size() - 1; d > common; --d) nodes[size_t(path[d])].subtree_end = int32_t(nodes.size());
    path.resize(common + 1);
    for (size_t d = common; d < text.size(); ++d) {
      Node n;
      n.byte = uint8_t(text[d]);
      n.depth = uint16_t(d + 1);
      n.ids_begin = n.ids_end = int32_t(ids.size());
      path.push_back(int32_t(nodes.size()));
      nodes.push_back(n);
    }
    max_depth = std::max(max_depth, int(text.size()));
    // Ids whose bytes end here are added while this node is the branch's last (sorted input:
    // duplicates of one string come together), so each node's ids stay contiguous.
    Node& end = nodes[size_t(path.back())];
    if (end.ids_end != int32_t(ids.size())) end.ids_begin = int32_t(ids.size());
    ids.push_back(id);
    end.ids_end = int32_t(ids.size());
    prev = text;
  }
  for (size_t d = path.size(); d-- > 1;) nodes[size_t(path[d])].subtree_end = int32_t(nodes.size());
  nodes[0].subtree_end = int32_t(nodes.size());
}

TokenBytes::TokenBytes(const Tokenizer& tok) {
  const int32_t n = tok.vocab_size();
  bytes.resize(size_t(n));
  special.resize(size_t(n));
  std::vector<std::pair<std::string_view, int32_t>> every, plains, others;
  for (int32_t id = 0; id < n; ++id) {
    bytes[size_t(id)] = std::string(tok.token_bytes(id));
    special[size_t(id)] = tok.is_special(id) ? 1 : 0;
  }
  for (int32_t id = 0; id < n; ++id) {
    const std::string& b = bytes[size_t(id)];
    if (special[size_t(id)] || b.empty()) continue;
    every.emplace_back(b, id);
    if (std::all_of(b.begin(), b.end(), [](char c) { return JsonPrefix::plain_string_byte(uint8_t(c)); }))
      plain_string_ids.push_back(id), plains.emplace_back(b, id);
    else
      others.emplace_back(b, id);
  }
  all.build(every);
  plain.build(plains);
  not_plain.build(others);
  if (auto b = tok.token_to_id(kThinkBegin)) think_begin = *b;
  if (auto e = tok.token_to_id(kThinkEnd)) think_end = *e;
}

ByteConstraint::ByteConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids, Start start)
    : table_(std::move(table)), end_ids_(std::move(end_ids)), phase_(Phase::kBody) {
  const bool tags = table_->think_begin >= 0 && table_->think_end >= 0;  // single tokens, or no reasoning
  if (tags && start == Start::kReasoning) phase_ = Phase::kReasoning;
  if (tags && start == Start::kMayReason) phase_ = Phase::kBefore;
}

void ByteConstraint::advance(int32_t id) {
  const TokenBytes& t = *table_;
  switch (phase_) {
    case Phase::kReasoning:
      if (id == t.think_end) phase_ = Phase::kBody;
      return;
    case Phase::kBefore:
      if (id == t.think_begin && t.think_end >= 0) {
        phase_ = Phase::kReasoning;
        return;
      }
      phase_ = Phase::kBody;
      [[fallthrough]];
    case Phase::kBody:
      if (id < 0 || size_t(id) >= t.bytes.size() || t.special[size_t(id)] || !feed(t.bytes[size_t(id)])) {
        broken_ = broken_ || std::find(end_ids_.begin(), end_ids_.end(), id) == end_ids_.end();
      }
      return;
  }
}

void ByteConstraint::apply(const std::vector<int32_t>& output_ids, float* logits, int64_t vocab) {
  for (; consumed_ < output_ids.size() && !broken_; ++consumed_) advance(output_ids[consumed_]);
  if (broken_ || phase_ == Phase::kReasoning) return;
  std::vector<char> allowed(size_t(vocab), 0);
  if (can_continue()) allow(allowed);
  const TokenBytes& t = *table_;
  if (phase_ == Phase::kBefore && t.think_begin >= 0 && t.think_begin < vocab) allowed[size_t(t.think_begin)] = 1;
  bool any = std::find(allowed.begin(), allowed.end(), char(1)) != allowed.end();
  // The end ids once the text is whole; and if no token can continue (a vocabulary without the
  // bytes the text needs): end rather than emit garbage.
  if (accepting() || !any) {
    for (int32_t id : end_ids_)
      if (id >= 0 && id < vocab) allowed[size_t(id)] = 1;
  }
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i)
    if (!allowed[size_t(i)]) logits[i] = kOff;
}

}  // namespace m3::server
