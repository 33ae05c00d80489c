#pragma once
// Structured output: constraints on the bytes of a request's output, enforced by masking at every
// step each token whose bytes the constraint's recogniser would refuse (json_mode.h: one JSON
// object, optionally of a schema; pattern_mode.h: a regular expression or one of fixed strings).
// An M3 reasoning block (<mm:think> ... </mm:think>, single tokens) may come first,
// unconstrained: the constrained text starts after it, as vLLM applies structured output after
// the reasoning parser's end.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "exec/sampler.h"
#include "tokenizer/tokenizer.h"

namespace m3::server {

// The byte strings of a set of tokens as a trie, stored in depth-first order: a node's subtree
// is the range [node, subtree_end), so a mask scans it front to back, keeps one state per depth,
// and skips a refused byte's whole subtree with one jump (" th" of " the", " that", ... is tried
// once).
struct TokenTrie {
  struct Node {
    int32_t subtree_end = 0;
    int32_t ids_begin = 0, ids_end = 0;  // the tokens whose bytes end here: ids[ids_begin, ids_end)
    uint16_t depth = 0;                  // bytes from the root (the root: 0)
    uint8_t byte = 0;
  };
  std::vector<Node> nodes;  // [0]: the root (no byte)
  std::vector<int32_t> ids;
  int max_depth = 0;
  void build(const std::vector<std::pair<std::string_view, int32_t>>& tokens);

  // Marks in `allowed` every token whose bytes `feed(state, byte)` accepts one by one from
  // `start` (State is copied once per node tried).
  template <class State, class Feed>
  void walk(const State& start, Feed&& feed, std::vector<char>& allowed) const {
    std::vector<State> at(size_t(max_depth) + 1, start);  // at[d]: the state after the node at depth d
    const auto n = int32_t(nodes.size());
    for (int32_t i = 1; i < n;) {
      const Node& nd = nodes[size_t(i)];
      State& s = at[nd.depth];
      s = at[nd.depth - 1u];
      if (!feed(s, nd.byte)) {
        i = nd.subtree_end;
        continue;
      }
      for (int32_t k = nd.ids_begin; k < nd.ids_end; ++k)
        if (size_t(ids[size_t(k)]) < allowed.size()) allowed[size_t(ids[size_t(k)])] = 1;
      ++i;
    }
  }
};

// Each id's bytes, once per tokenizer; special tokens never count as output text. The non-special
// tokens split in two: plain JSON string content (bytes >= 0x20 other than '"' and '\'), which a
// JSON string accepts without a change of state, and the rest.
struct TokenBytes {
  explicit TokenBytes(const Tokenizer& tok);
  std::vector<std::string> bytes;
  std::vector<char> special;
  int32_t think_begin = -1, think_end = -1;  // -1: the tokenizer has no such single token
  std::vector<int32_t> plain_string_ids;
  TokenTrie all, plain, not_plain;  // plain: the plain string tokens
};

// The request-side half every structured output shares: the reasoning block's phases, the end ids
// once the text is complete, and what to do if no token fits.
class ByteConstraint : public LogitsConstraint {
 public:
  // How the output may begin: with the constrained text (completions: think tags would be plain
  // text), with an optional reasoning block (chat), or inside one (chat, thinking mode enabled).
  enum class Start { kAtOnce, kMayReason, kReasoning };
  // end_ids: what ends the request (EOS, stop_token_ids).
  ByteConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids, Start start);
  void apply(const std::vector<int32_t>& output_ids, float* logits, int64_t vocab) final;

 protected:
  virtual bool feed(std::string_view bytes) = 0;  // false: refused (the state is then unspecified)
  virtual bool accepting() const = 0;             // the text so far is whole: the end ids may come
  virtual bool can_continue() = 0;                // some byte may still come
  // Marks in `allowed` ([vocab]) every non-special token whose bytes the state accepts.
  virtual void allow(std::vector<char>& allowed) = 0;
  const TokenBytes& table() const { return *table_; }

 private:
  enum class Phase { kBefore, kReasoning, kBody };  // kBefore: the first token may open reasoning
  void advance(int32_t id);

  std::shared_ptr<const TokenBytes> table_;
  std::vector<int32_t> end_ids_;
  Phase phase_;
  size_t consumed_ = 0;
  bool broken_ = false;  // an output token the mask did not allow (never expected): stop masking
};

}  // namespace m3::server
