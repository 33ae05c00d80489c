#pragma once
// response_format {"type": "json_object"}: the output is one JSON object. A LogitsConstraint
// that masks, at every step, each token whose bytes would leave the JSON prefix the output has
// built (chat/json_prefix.h); once the object closes only the end ids may come. An M3 reasoning
// block (<mm:think> ... </mm:think>, single tokens) may come first, unconstrained: the JSON starts
// after it, as vLLM applies structured output after the reasoning parser's end.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chat/json_prefix.h"
#include "exec/sampler.h"
#include "tokenizer/tokenizer.h"

namespace m3::server {

// Each id's bytes, once per tokenizer; special tokens never count as JSON text.
struct TokenBytes {
  explicit TokenBytes(const Tokenizer& tok);
  std::vector<std::string> bytes;
  std::vector<char> special;
  int32_t think_begin = -1, think_end = -1;  // -1: the tokenizer has no such single token
};

class JsonObjectConstraint final : public LogitsConstraint {
 public:
  // How the output may begin: with the object (completions: think tags would be plain text),
  // with an optional reasoning block (chat), or inside one (chat, thinking mode enabled).
  enum class Start { kObject, kMayReason, kReasoning };
  // end_ids: what ends the request (EOS, stop_token_ids).
  JsonObjectConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids, Start start);
  void apply(const std::vector<int32_t>& output_ids, float* logits, int64_t vocab) override;

 private:
  enum class Phase { kBefore, kReasoning, kJson };  // kBefore: the first token may open reasoning
  void advance(int32_t id);

  std::shared_ptr<const TokenBytes> table_;
  std::vector<int32_t> end_ids_;
  Phase phase_;
  JsonPrefix json_;
  size_t consumed_ = 0;
  bool broken_ = false;  // an output token the mask did not allow (never expected): stop masking
};

}  // namespace m3::server
