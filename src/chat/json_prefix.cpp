#include "chat/json_prefix.h"

namespace m3 {
namespace {

bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

void JsonPrefix::value_done() { mode_ = stack_.empty() ? Mode::kDone : Mode::kAfterValue; }

bool JsonPrefix::close(uint8_t c) {
  if (stack_.empty() || !((c == '}' && stack_.back() == '{') || (c == ']' && stack_.back() == '['))) return false;
  stack_.pop_back();
  value_done();
  return true;
}

bool JsonPrefix::start_value(uint8_t c) {
  switch (c) {
    case '{':
    case '[':
      if (int(stack_.size()) >= kMaxDepth) return false;
      stack_.push_back(char(c));
      mode_ = c == '{' ? Mode::kObjectFirst : Mode::kArrayFirst;
      return true;
    case '"':
      mode_ = Mode::kString;
      key_ = false;
      return true;
    case '-': mode_ = Mode::kNumMinus; return true;
    case '0': mode_ = Mode::kNumZero; return true;
    case 't': literal_ = "rue"; mode_ = Mode::kLiteral; return true;
    case 'f': literal_ = "alse"; mode_ = Mode::kLiteral; return true;
    case 'n': literal_ = "ull"; mode_ = Mode::kLiteral; return true;
    default:
      if (c >= '1' && c <= '9') {
        mode_ = Mode::kNumInt;
        return true;
      }
      return false;
  }
}

bool JsonPrefix::feed(uint8_t c) {
  // A number ends at the first byte that cannot continue it, which is then read as structure.
  auto end_number = [&]() {
    value_done();
    return feed(c);
  };
  switch (mode_) {
    case Mode::kString:
      if (c == '"') {
        if (key_) mode_ = Mode::kColon;
        else value_done();
        ws_run_ = nl_run_ = 0;
        return true;
      }
      if (c == '\\') mode_ = Mode::kEscape;
      return c >= 0x20;
    case Mode::kEscape:
      switch (c) {
        case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
          mode_ = Mode::kString;
          return true;
        case 'u':
          mode_ = Mode::kUnicode;
          hex_left_ = 4;
          return true;
        default:
          return false;
      }
    case Mode::kUnicode:
      if (!is_hex(c)) return false;
      if (--hex_left_ == 0) mode_ = Mode::kString;
      return true;
    case Mode::kLiteral:
      if (c != uint8_t(*literal_)) return false;
      if (*++literal_ == '\0') value_done();
      return true;
    case Mode::kNumMinus:
      if (!is_digit(c)) return false;
      mode_ = c == '0' ? Mode::kNumZero : Mode::kNumInt;
      return true;
    case Mode::kNumZero:  // a number's terminal states: more digits, '.', an exponent or its end
    case Mode::kNumInt:
    case Mode::kNumFrac:
    case Mode::kNumExpDigits:
      if (is_digit(c) && mode_ != Mode::kNumZero) return true;
      if (c == '.' && (mode_ == Mode::kNumZero || mode_ == Mode::kNumInt)) {
        mode_ = Mode::kNumDot;
        return true;
      }
      if ((c == 'e' || c == 'E') && mode_ != Mode::kNumExpDigits) {
        mode_ = Mode::kNumExp;
        return true;
      }
      return end_number();
    case Mode::kNumDot:  // a digit must come
    case Mode::kNumExpSign:
      if (!is_digit(c)) return false;
      mode_ = mode_ == Mode::kNumDot ? Mode::kNumFrac : Mode::kNumExpDigits;
      return true;
    case Mode::kNumExp:
      if (c == '+' || c == '-') mode_ = Mode::kNumExpSign;
      else if (is_digit(c)) mode_ = Mode::kNumExpDigits;
      else return false;
      return true;
    case Mode::kDone:
      return false;
    default:
      break;
  }
  if (is_ws(c)) {
    if (c == '\n' || c == '\r') ++nl_run_;
    return ++ws_run_ <= kMaxWhitespaceRun && nl_run_ <= kMaxNewlineRun;
  }
  ws_run_ = nl_run_ = 0;
  switch (mode_) {
    case Mode::kStart:
      return (!object_only_ || c == '{') && start_value(c);
    case Mode::kValue:
      return start_value(c);
    case Mode::kArrayFirst:
      return c == ']' ? close(c) : start_value(c);
    case Mode::kObjectFirst:
      if (c == '}') return close(c);
      [[fallthrough]];
    case Mode::kKey:
      if (c != '"') return false;
      mode_ = Mode::kString;
      key_ = true;
      return true;
    case Mode::kColon:
      if (c != ':') return false;
      mode_ = Mode::kValue;
      return true;
    case Mode::kAfterValue:
      if (c == ',') {
        mode_ = stack_.back() == '{' ? Mode::kKey : Mode::kValue;
        return true;
      }
      return close(c);
    default:
      return false;
  }
}

}  // namespace m3
