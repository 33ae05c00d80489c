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
  // tokenizer.json when the directory has one, else vocab.json + merges.txt (with added
  // tokens from added_tokens.json and tokenizer_config.json's added_tokens_decoder).
  static Result<std::unique_ptr<Tokenizer>> from_dir(const std::string& model_dir);
  static Result<std::unique_ptr<Tokenizer>> from_tokenizer_json(const std::string& path);
  static Result<std::unique_ptr<Tokenizer>> from_vocab_merges(const std::string& model_dir);
  virtual ~Tokenizer() = default;

  // Special tokens in the text are matched as whole tokens when allow_special is true
  // (non-special added tokens always are). Invalid UTF-8 in `text` is first replaced by
  // U+FFFD. No BOS/EOS is added (the chat template writes them).
  virtual std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const = 0;
  // Full decode; invalid UTF-8 sequences are replaced by U+FFFD as HF does.
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::string id_to_token(int32_t id) const = 0;  // "" for an unknown id
  virtual int32_t vocab_size() const = 0;  // including added tokens (max id + 1)
  virtual bool is_special(int32_t id) const = 0;
  // The raw bytes `id` decodes to (may be a partial UTF-8 sequence); empty for an unknown
  // id. decode() is the lossy UTF-8 reading of the concatenated token_bytes.
  virtual std::string_view token_bytes(int32_t id) const = 0;
};

// Incremental detokeniser for one stream: push ids, get the newly completed text; never
// emits a partial UTF-8 sequence (bytes are held back until the sequence completes).
// The concatenation of every push() and the final flush() equals decode(all ids).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  std::string push(int32_t id);
  std::string push(const std::vector<int32_t>& ids);
  std::string flush();  // whatever is held back, with U+FFFD for an incomplete tail

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::string pending_bytes_;  // an incomplete UTF-8 sequence (at most 3 bytes)
};

}  // namespace m3
