#pragma once
// Small string helpers for the streaming parsers (internal to the chat layer).
#include <string>
#include <string_view>

namespace m3::text_scan {

inline bool starts_with(std::string_view text, std::string_view prefix) {
  return text.size() >= prefix.size() && text.compare(0, prefix.size(), prefix) == 0;
}

// True when `text` is a proper prefix of `marker` (could still become it).
inline bool is_partial_of(std::string_view text, std::string_view marker) {
  return text.size() < marker.size() && marker.compare(0, text.size(), text) == 0;
}

// Length of the longest suffix of `text` that is a proper prefix of `marker`: the bytes
// to hold back because the next chunk may complete the marker.
inline size_t partial_suffix(std::string_view text, std::string_view marker) {
  const size_t longest = std::min(text.size(), marker.size() - 1);
  for (size_t length = longest; length > 0; --length) {
    if (text.compare(text.size() - length, length, marker, 0, length) == 0) return length;
  }
  return 0;
}

inline bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

}  // namespace m3::text_scan
