#pragma once
// A byte-at-a-time recogniser of JSON prefixes (RFC 8259): feed() refuses the first byte after
// which no completion to a valid document exists, complete() says a whole value has been read.
// JSON-mode decoding (response_format json_object) keeps one per request and masks every token
// whose bytes it would refuse. The state is a few bytes plus the open containers, so copying it
// to try a token is cheap. Strings take any byte >= 0x20 but '"' and '\' (UTF-8 is not checked:
// a token may end inside a multi-byte sequence).
#include <cstdint>
#include <string>
#include <string_view>

namespace m3 {

class JsonPrefix {
 public:
  // object_only: the document must be an object (OpenAI's json_object mode).
  explicit JsonPrefix(bool object_only = true) : object_only_(object_only) {}

  bool feed(uint8_t c);
  bool feed(std::string_view bytes) {
    for (char c : bytes)
      if (!feed(uint8_t(c))) return false;
    return true;
  }
  // A whole top-level value has been read (nothing more may follow).
  bool complete() const { return mode_ == Mode::kDone; }
  // Inside a string, where every byte >= 0x20 but '"' and '\' is accepted and changes nothing.
  bool in_string() const { return mode_ == Mode::kString; }
  static bool plain_string_byte(uint8_t c) { return c >= 0x20 && c != '"' && c != '\\'; }

  static constexpr int kMaxDepth = 64;

  // Where the recogniser stands (json_schema.h follows the document's structure from it).
  enum class Mode : uint8_t {
    kStart,          // before the document
    kValue,          // a value must start (after ':' or ',' in an array)
    kArrayFirst,     // after '[': a value or ']'
    kObjectFirst,    // after '{': a key or '}'
    kKey,            // after ',' in an object: a key
    kColon,          // after a key
    kAfterValue,     // inside a container: ',' or its closing bracket
    kString,         // inside a string (in_key() says which kind)
    kEscape,         // after '\' in a string
    kUnicode,        // inside \uXXXX (hex_left_ digits to go)
    kNumMinus,       // after '-'
    kNumZero,        // a leading 0
    kNumInt,         // integer digits
    kNumDot,         // after '.'
    kNumFrac,        // fraction digits
    kNumExp,         // after 'e' / 'E'
    kNumExpSign,     // after the exponent's sign
    kNumExpDigits,   // exponent digits
    kLiteral,        // inside true / false / null (literal_ is what is left)
    kDone,
  };
  Mode mode() const { return mode_; }
  bool in_key() const { return key_ && (mode_ == Mode::kString || mode_ == Mode::kEscape || mode_ == Mode::kUnicode); }
  bool in_number() const { return mode_ >= Mode::kNumMinus && mode_ <= Mode::kNumExpDigits; }
  // The innermost open container: '{', '[' or 0 at the top level.
  char container() const { return stack_.empty() ? 0 : stack_.back(); }
  // Whitespace between tokens: at most this many bytes in a row, of which at most
  // kMaxNewlineRun line breaks (room for pretty-printing; a model cannot pad forever).
  static constexpr int kMaxWhitespaceRun = 16;
  static constexpr int kMaxNewlineRun = 2;

 private:
  bool start_value(uint8_t c);
  void value_done();
  bool close(uint8_t c);
  static bool is_ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

  bool object_only_;
  Mode mode_ = Mode::kStart;
  bool key_ = false;
  uint8_t hex_left_ = 0;
  uint8_t ws_run_ = 0, nl_run_ = 0;
  const char* literal_ = nullptr;
  std::string stack_;  // open containers: '{' or '['
};

}  // namespace m3
