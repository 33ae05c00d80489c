#pragma once
// UTF-8 helpers shared by the tokenizer and the chat layer, and the GPT-2 byte <-> unicode
// mapping that byte-level BPE vocabularies are written in.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace m3 {

// Length of the well-formed UTF-8 sequence at the start of `text` (1..4), 0 when the
// first byte does not start one, or -k when the input ends after k bytes of a sequence
// that is still valid so far (more bytes would be needed to decide).
int utf8_sequence_length(std::string_view text);

// Appends `text` to `out` with every ill-formed subsequence replaced by U+FFFD, using the
// "maximal subpart" rule that Python's bytes.decode(errors="replace") and Rust's
// String::from_utf8_lossy both follow. When `final` is false a trailing incomplete (but so
// far valid) sequence is not consumed. Returns the number of bytes consumed.
size_t append_utf8_lossy(std::string_view text, bool final, std::string& out);

// Whole-string convenience form of append_utf8_lossy(final = true).
std::string sanitize_utf8(std::string_view text);

// Appends the UTF-8 encoding of `code_point` to `out`.
void append_utf8(uint32_t code_point, std::string& out);

// Decodes the code point at text[pos] (text must be valid UTF-8); advances pos.
uint32_t next_code_point(std::string_view text, size_t& pos);

// GPT-2's reversible byte -> printable-character table.
class ByteLevelAlphabet {
 public:
  ByteLevelAlphabet();
  // The UTF-8 text of the character that stands for `byte`.
  const std::string& char_for_byte(uint8_t byte) const { return byte_chars_[byte]; }
  // Byte-level text of raw bytes.
  std::string encode(std::string_view bytes) const;
  // Maps every character of `token` back to its byte; false (out untouched) when some
  // character is not in the alphabet.
  bool decode(std::string_view token, std::string& out) const;

 private:
  std::array<std::string, 256> byte_chars_;
  std::array<int16_t, 512> byte_for_code_point_;  // -1 where not in the alphabet
};

}  // namespace m3
