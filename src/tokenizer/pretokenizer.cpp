#include "tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace m3 {
namespace {

using Span = std::pair<std::pair<size_t, size_t>, bool>;  // (offsets, is_match)

// Cuts `text` into matched and unmatched spans, then groups them like HF's
// SplitDelimiterBehavior does; appends the non-empty pieces (views of `text`).
void split_with(std::string_view text, const PreTokenizeStep& step, SplitBehavior behavior,
                bool invert, std::vector<std::string_view>& pieces) {
  std::vector<Span> spans;
  size_t prev = 0;
  for (auto [begin, end] : step.regex->find_all(text)) {
    if (begin != prev) spans.push_back({{prev, begin}, false});
    spans.push_back({{begin, end}, true});
    prev = end;
  }
  if (prev != text.size()) spans.push_back({{prev, text.size()}, false});
  if (invert) {
    for (auto& span : spans) span.second = !span.second;
  }

  std::vector<Span> grouped;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      grouped = std::move(spans);
      break;
    case SplitBehavior::kRemoved:
      for (const auto& span : spans) {
        if (!span.second) grouped.push_back(span);
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const auto& span : spans) {
        if (span.second && !previous_match && !grouped.empty()) {
          grouped.back().first.second = span.first.second;
        } else {
          grouped.push_back(span);
        }
        previous_match = span.second;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->second && !previous_match && !grouped.empty()) {
          grouped.back().first.first = it->first.first;
        } else {
          grouped.push_back(*it);
        }
        previous_match = it->second;
      }
      std::reverse(grouped.begin(), grouped.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const auto& span : spans) {
        if (span.second && previous_match && !grouped.empty()) {
          grouped.back().first.second = span.first.second;
        } else {
          grouped.push_back(span);
        }
        previous_match = span.second;
      }
      break;
    }
  }
  for (const auto& span : grouped) {
    if (span.first.second > span.first.first) {
      pieces.push_back(text.substr(span.first.first, span.first.second - span.first.first));
    }
  }
}

Result<SplitBehavior> parse_behavior(const nlohmann::json& value) {
  const std::string name = value.is_string() ? value.get<std::string>() : "Isolated";
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return Status::error("pre_tokenizer.behavior: unsupported value '" + name + "'");
}

Result<PreTokenizeStep> byte_level_step(bool add_prefix_space, bool use_regex) {
  PreTokenizeStep step;
  step.kind = PreTokenizeStep::Kind::kByteLevel;
  step.add_prefix_space = add_prefix_space;
  if (use_regex) {
    auto regex = SplitRegex::compile(kGpt2SplitPattern, false);
    if (!regex) return regex.status();
    step.regex = std::move(regex.value());
  }
  return step;
}

Status append_steps(const nlohmann::json& config, std::vector<PreTokenizeStep>& steps) {
  if (config.is_null()) return Status::ok();
  if (!config.is_object() || !config.contains("type")) {
    return Status::error("pre_tokenizer: expected an object with a 'type'");
  }
  const std::string type = config["type"].get<std::string>();
  if (type == "Sequence") {
    for (const auto& sub : config.value("pretokenizers", nlohmann::json::array())) {
      M3_RETURN_IF_ERROR(append_steps(sub, steps));
    }
    return Status::ok();
  }
  if (type == "ByteLevel") {
    auto step = byte_level_step(config.value("add_prefix_space", false),
                                config.value("use_regex", true));
    if (!step) return step.status();
    steps.push_back(std::move(step.value()));
    return Status::ok();
  }
  if (type == "Split") {
    const auto& pattern = config.value("pattern", nlohmann::json::object());
    std::string text;
    bool literal = false;
    if (pattern.contains("Regex")) {
      text = pattern["Regex"].get<std::string>();
    } else if (pattern.contains("String")) {
      text = pattern["String"].get<std::string>();
      literal = true;
    } else {
      return Status::error("pre_tokenizer.Split.pattern: expected 'Regex' or 'String'");
    }
    auto regex = SplitRegex::compile(text, literal);
    if (!regex) return regex.status();
    auto behavior = parse_behavior(config.value("behavior", nlohmann::json()));
    if (!behavior) return behavior.status();
    PreTokenizeStep step;
    step.kind = PreTokenizeStep::Kind::kSplit;
    step.regex = std::move(regex.value());
    step.behavior = behavior.value();
    step.invert = config.value("invert", false);
    steps.push_back(std::move(step));
    return Status::ok();
  }
  return Status::error("pre_tokenizer: unsupported type '" + type + "'");
}

}  // namespace

Result<std::unique_ptr<SplitRegex>> SplitRegex::compile(const std::string& pattern, bool literal) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const uint32_t options = literal ? (PCRE2_LITERAL | PCRE2_UTF) : (PCRE2_UTF | PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return Status::error("pre_tokenizer regex '" + pattern + "' at offset " +
                         std::to_string(error_offset) + ": " +
                         reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // optional speed-up; falls back silently
  std::unique_ptr<SplitRegex> regex(new SplitRegex());
  regex->code_ = code;
  return regex;
}

SplitRegex::~SplitRegex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<std::pair<size_t, size_t>> SplitRegex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t offset = 0;
  while (offset <= text.size()) {
    // The subject was validated once; later calls skip the UTF check.
    const uint32_t options = offset == 0 ? 0 : PCRE2_NO_UTF_CHECK;
    int rc = pcre2_match(code, subject, text.size(), offset, options, data, nullptr);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
      // JIT stack or match limits on pathological input: retry with the interpreter so
      // the split never silently stops early.
      rc = pcre2_match(code, subject, text.size(), offset, options | PCRE2_NO_JIT, data, nullptr);
    }
    if (rc < 0) break;
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (end == begin) {  // empty match: step over one character
      if (begin >= text.size()) break;
      size_t next = begin + 1;
      while (next < text.size() && (static_cast<uint8_t>(text[next]) & 0xC0) == 0x80) ++next;
      offset = next;
      continue;
    }
    matches.emplace_back(begin, end);
    offset = end;
  }
  pcre2_match_data_free(data);
  return matches;
}

Result<PreTokenizer> PreTokenizer::from_json(const nlohmann::json& config) {
  PreTokenizer pre;
  M3_RETURN_IF_ERROR(append_steps(config, pre.steps_));
  bool has_byte_level = false;
  for (size_t i = 0; i < pre.steps_.size(); ++i) {
    if (pre.steps_[i].kind == PreTokenizeStep::Kind::kByteLevel) {
      has_byte_level = true;
    } else if (has_byte_level) {
      // Splitting after the byte mapping would split mapped text; never written by HF
      // for byte-level BPE, so refuse rather than guess.
      return Status::error("pre_tokenizer: Split after ByteLevel is not supported");
    }
  }
  if (!has_byte_level) return Status::error("pre_tokenizer: a ByteLevel step is required");
  return pre;
}

Result<PreTokenizer> PreTokenizer::gpt2() {
  PreTokenizer pre;
  auto step = byte_level_step(false, true);
  if (!step) return step.status();
  pre.steps_.push_back(std::move(step.value()));
  return pre;
}

void PreTokenizer::split(std::string_view segment, std::vector<std::string_view>& words,
                         std::deque<std::string>& arena) const {
  std::vector<std::string_view> pieces{segment};
  std::vector<std::string_view> next;
  for (const auto& step : steps_) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.kind == PreTokenizeStep::Kind::kByteLevel) {
        if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
          std::string& prefixed = arena.emplace_back(1, ' ');
          prefixed.append(piece);
          piece = prefixed;
        }
        if (!step.regex) {
          next.push_back(piece);
        } else {
          split_with(piece, step, SplitBehavior::kIsolated, false, next);
        }
      } else {
        split_with(piece, step, step.behavior, step.invert, next);
      }
    }
    pieces.swap(next);
  }
  words.insert(words.end(), pieces.begin(), pieces.end());
}

}  // namespace m3
