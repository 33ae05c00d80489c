#include "tokenizer/utf8.h"

namespace m3 {
namespace {

constexpr const char kReplacement[] = "\xEF\xBF\xBD";

// Allowed range of the second byte for a given lead byte (Unicode Table 3-7); later
// continuation bytes are always 0x80..0xBF.
bool second_byte_ok(uint8_t lead, uint8_t b) {
  if (lead == 0xE0) return b >= 0xA0 && b <= 0xBF;
  if (lead == 0xED) return b >= 0x80 && b <= 0x9F;
  if (lead == 0xF0) return b >= 0x90 && b <= 0xBF;
  if (lead == 0xF4) return b >= 0x80 && b <= 0x8F;
  return b >= 0x80 && b <= 0xBF;
}

int expected_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

}  // namespace

int utf8_sequence_length(std::string_view text) {
  if (text.empty()) return 0;
  const auto lead = static_cast<uint8_t>(text[0]);
  const int need = expected_length(lead);
  if (need <= 1) return need;
  for (int k = 1; k < need; ++k) {
    if (static_cast<size_t>(k) >= text.size()) return -k;
    const auto b = static_cast<uint8_t>(text[k]);
    const bool ok = k == 1 ? second_byte_ok(lead, b) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return 0;
  }
  return need;
}

size_t append_utf8_lossy(std::string_view text, bool final, std::string& out) {
  size_t pos = 0;
  while (pos < text.size()) {
    // Fast path for ASCII runs.
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      size_t end = pos + 1;
      while (end < text.size() && static_cast<uint8_t>(text[end]) < 0x80) ++end;
      out.append(text.data() + pos, end - pos);
      pos = end;
      continue;
    }
    const std::string_view rest = text.substr(pos);
    const int length = utf8_sequence_length(rest);
    if (length > 0) {
      out.append(rest.data(), length);
      pos += length;
      continue;
    }
    if (length < 0) {  // valid but truncated by the end of input
      if (!final) return pos;
      out += kReplacement;
      return text.size();
    }
    // Ill-formed: the maximal subpart is the lead byte plus the continuation bytes that
    // were still acceptable, and it becomes one U+FFFD.
    const auto lead = static_cast<uint8_t>(rest[0]);
    size_t subpart = 1;
    const int need = expected_length(lead);
    for (int k = 1; k < need && static_cast<size_t>(k) < rest.size(); ++k) {
      const auto b = static_cast<uint8_t>(rest[k]);
      const bool ok = k == 1 ? second_byte_ok(lead, b) : (b >= 0x80 && b <= 0xBF);
      if (!ok) break;
      subpart = k + 1;
    }
    out += kReplacement;
    pos += subpart;
  }
  return pos;
}

std::string sanitize_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  append_utf8_lossy(text, true, out);
  return out;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

uint32_t next_code_point(std::string_view text, size_t& pos) {
  const auto lead = static_cast<uint8_t>(text[pos]);
  int length = expected_length(lead);
  if (length == 0 || pos + length > text.size()) {  // not valid: consume one byte
    ++pos;
    return 0xFFFD;
  }
  uint32_t cp = length == 1 ? lead : (lead & (0x7F >> length));
  for (int k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[pos + k]) & 0x3F);
  pos += length;
  return cp;
}

ByteLevelAlphabet::ByteLevelAlphabet() {
  byte_for_code_point_.fill(-1);
  // Printable Latin-1 bytes stand for themselves; the rest are shifted to 256 + n in
  // byte order, which keeps every token printable and whitespace-free.
  int shifted = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256u + shifted++;
    append_utf8(cp, byte_chars_[b]);
    byte_for_code_point_[cp] = static_cast<int16_t>(b);
  }
}

std::string ByteLevelAlphabet::encode(std::string_view bytes) const {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += byte_chars_[static_cast<uint8_t>(c)];
  return out;
}

bool ByteLevelAlphabet::decode(std::string_view token, std::string& out) const {
  std::string bytes;
  bytes.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    if (utf8_sequence_length(token.substr(pos)) <= 0) return false;
    const uint32_t cp = next_code_point(token, pos);
    if (cp >= byte_for_code_point_.size() || byte_for_code_point_[cp] < 0) return false;
    bytes += static_cast<char>(byte_for_code_point_[cp]);
  }
  out += bytes;
  return true;
}

}  // namespace m3
