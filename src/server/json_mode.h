#pragma once
// response_format json_object / json_schema: the output is one JSON object (satisfying the
// schema). A LogitsConstraint that masks, at every step, each token whose bytes would leave the
// prefix the output has built (chat/json_schema.h); once the object closes only the end ids may
// come. An M3 reasoning
// block (<mm:think> ... </mm:think>, single tokens) may come first, unconstrained: the JSON starts
// after it, as vLLM applies structured output after the reasoning parser's end.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/json_schema.h"
#include "exec/sampler.h"
#include "tokenizer/tokenizer.h"

namespace m3::server {

// The byte strings of a set of tokens as a trie: a mask walks it depth-first from the current
// JSON state, so a shared prefix (" th" of " the", " that", ...) is tried once and a refused byte
// drops its whole subtree.
struct TokenTrie {
  struct Node {
    int32_t first_child = -1, next_sibling = -1;
    int32_t ids_begin = 0, ids_end = 0;  // the tokens whose bytes end here: ids[ids_begin, ids_end)
    uint8_t byte = 0;
  };
  TokenTrie() { nodes.emplace_back(); }
  std::vector<Node> nodes;  // [0]: the root (no byte)
  std::vector<int32_t> ids;
  void build(const std::vector<std::pair<std::string_view, int32_t>>& tokens);
};

// Each id's bytes, once per tokenizer; special tokens never count as JSON text. The non-special
// tokens split in two: plain string content (bytes >= 0x20 other than '"' and '\'), which a
// string accepts without a change of state, and the rest.
struct TokenBytes {
  explicit TokenBytes(const Tokenizer& tok);
  std::vector<std::string> bytes;
  std::vector<char> special;
  int32_t think_begin = -1, think_end = -1;  // -1: the tokenizer has no such single token
  std::vector<int32_t> plain_string_ids;
  TokenTrie all, not_plain;
};

class JsonObjectConstraint final : public LogitsConstraint {
 public:
  // How the output may begin: with the object (completions: think tags would be plain text),
  // with an optional reasoning block (chat), or inside one (chat, thinking mode enabled).
  enum class Start { kObject, kMayReason, kReasoning };
  // end_ids: what ends the request (EOS, stop_token_ids); schema: what the object must satisfy
  // (JsonSchema::any_object() for json_object).
  JsonObjectConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids, Start start,
                       std::shared_ptr<const JsonSchema> schema = JsonSchema::any_object());
  void apply(const std::vector<int32_t>& output_ids, float* logits, int64_t vocab) override;

 private:
  enum class Phase { kBefore, kReasoning, kJson };  // kBefore: the first token may open reasoning
  void advance(int32_t id);
  // Marks in `allowed` every token of `trie` whose bytes the current state accepts.
  void walk(const TokenTrie& trie, std::vector<char>& allowed) const;

  std::shared_ptr<const TokenBytes> table_;
  std::vector<int32_t> end_ids_;
  Phase phase_;
  std::shared_ptr<const JsonSchema> schema_;
  SchemaPrefix json_;
  size_t consumed_ = 0;
  bool broken_ = false;  // an output token the mask did not allow (never expected): stop masking
};

}  // namespace m3::server
