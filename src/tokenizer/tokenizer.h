#pragma once
// Byte-level BPE tokenizer loaded from a model directory (tokenizer.json, or vocab.json +
// merges.txt), with added/special tokens and UTF-8-safe streaming detokenisation.
// Interface fixed up front so the server and the bench clients can code against it.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace m3 {

class Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> from_dir(const std::string& model_dir);
  virtual ~Tokenizer() = default;

  // Special tokens in the text are matched as whole tokens when allow_special is true.
  virtual std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const = 0;
  // Full decode; invalid UTF-8 sequences are replaced by U+FFFD as HF does.
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::string id_to_token(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;  // including added tokens
  virtual bool is_special(int32_t id) const = 0;
};

// Incremental detokeniser for one stream: push ids, get the newly completed text; never
// emits a partial UTF-8 sequence (bytes are held back until the sequence completes).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  std::string push(int32_t id);
  std::string flush();  // whatever is held back, with U+FFFD for an incomplete tail

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t emitted_bytes_ = 0;
};

}  // namespace m3
