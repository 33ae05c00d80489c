// ReasoningParser, the combined OutputParser, and ParsedOutput.
#include "chat/output_parser.h"

#include <algorithm>
#include <random>

#include "chat/text_scan.h"

namespace m3 {
namespace {

using namespace text_scan;  // NOLINT: small local helpers

constexpr std::string_view kToolCallOpen = "<tool_call>";
constexpr size_t kMaxLeadingBlanks = 256;

std::string random_call_prefix() {
  std::random_device device;
  std::uniform_int_distribution<uint32_t> dist;
  char hex[16];
  std::snprintf(hex, sizeof(hex), "%08x", dist(device));
  return std::string("call_") + hex + "_";
}

void merge_into(OutputDelta& into, OutputDelta&& from) {
  into.reasoning_content += from.reasoning_content;
  into.content += from.content;
  for (auto& call : from.tool_calls) into.tool_calls.push_back(std::move(call));
}

}  // namespace

ReasoningParser::ReasoningParser(ThinkingMode mode)
    : default_state_(mode == ThinkingMode::kEnabled ? State::kReasoning : State::kContent) {}

ReasoningParser::Split ReasoningParser::push(std::string_view text) {
  buffer_ += text;
  Split out;
  drain(out, false);
  return out;
}

ReasoningParser::Split ReasoningParser::finish() {
  Split out;
  drain(out, true);
  return out;
}

void ReasoningParser::drain(Split& out, bool final) {
  while (true) {
    if (state_ == State::kContent) {
      out.content += buffer_;
      buffer_.clear();
      return;
    }
    if (state_ == State::kStart) {
      // The response may open with <mm:think> (thinking), or with a stray </mm:think>
      // (dropped), after optional whitespace; anything else decides the default.
      size_t ws = 0;
      while (ws < buffer_.size() && is_space(buffer_[ws])) ++ws;
      // Blanks before the tag are bounded, so a run of newlines decides (the same way for
      // any chunking) instead of being rescanned on every push.
      if (ws <= kMaxLeadingBlanks) {
        const std::string_view rest = std::string_view(buffer_).substr(ws);
        if (starts_with(rest, kThinkBegin)) {
          buffer_.erase(0, ws + kThinkBegin.size());
          state_ = State::kReasoning;
          continue;
        }
        if (starts_with(rest, kThinkEnd)) {
          buffer_.erase(0, ws + kThinkEnd.size());
          state_ = State::kContent;
          continue;
        }
        if (!final && (rest.empty() || is_partial_of(rest, kThinkBegin) || is_partial_of(rest, kThinkEnd))) {
          return;
        }
      }
      state_ = default_state_;
      continue;
    }
    // Inside reasoning: it ends at </mm:think>, or where a tool call opens.
    const size_t end = buffer_.find(kThinkEnd);
    const size_t ns = buffer_.find(kNamespaceToken);
    if (end != std::string::npos && (ns == std::string::npos || end < ns)) {
      out.reasoning.append(buffer_, 0, end);
      buffer_.erase(0, end + kThinkEnd.size());
      state_ = State::kContent;
      continue;
    }
    if (ns != std::string::npos) {
      out.reasoning.append(buffer_, 0, ns);
      buffer_.erase(0, ns);
      const std::string_view after = std::string_view(buffer_).substr(kNamespaceToken.size());
      if (starts_with(after, kToolCallOpen)) {
        state_ = State::kContent;  // the tool parser takes it from the namespace string
        continue;
      }
      if (!final && is_partial_of(after, kToolCallOpen)) return;
      buffer_.erase(0, kNamespaceToken.size());  // a stray namespace string is dropped
      continue;
    }
    const size_t hold = final ? 0
                              : std::max(partial_suffix(buffer_, kThinkEnd),
                                         partial_suffix(buffer_, kNamespaceToken));
    out.reasoning.append(buffer_, 0, buffer_.size() - hold);
    buffer_.erase(0, buffer_.size() - hold);
    return;
  }
}

void ParsedOutput::append(const OutputDelta& delta) {
  reasoning_content += delta.reasoning_content;
  content += delta.content;
  for (const ToolCallDelta& call : delta.tool_calls) {
    if (call.index < 0) continue;
    if (static_cast<size_t>(call.index) >= tool_calls.size()) tool_calls.resize(call.index + 1);
    ToolCall& target = tool_calls[call.index];
    if (!call.id.empty()) target.id = call.id;
    if (!call.name.empty()) target.name = call.name;
    target.arguments += call.arguments;
  }
}

OutputParser::OutputParser(OutputParserOptions options) : options_(std::move(options)) {
  if (options_.parse_reasoning) reasoning_.emplace(options_.thinking_mode);
  if (options_.parse_tool_calls) {
    tools_.emplace(options_.tools, options_.call_id_prefix.empty() ? random_call_prefix()
                                                                   : options_.call_id_prefix);
  }
}

OutputDelta OutputParser::route(ReasoningParser::Split split, bool final) {
  OutputDelta out;
  out.reasoning_content = std::move(split.reasoning);
  if (tools_) {
    merge_into(out, tools_->push(split.content));
    if (final) merge_into(out, tools_->finish());
  } else {
    out.content = std::move(split.content);
  }
  return out;
}

OutputDelta OutputParser::push(std::string_view text) {
  ReasoningParser::Split split;
  if (reasoning_) {
    split = reasoning_->push(text);
  } else {
    split.content = std::string(text);
  }
  return route(std::move(split), false);
}

OutputDelta OutputParser::finish() {
  ReasoningParser::Split split;
  if (reasoning_) split = reasoning_->finish();
  return route(std::move(split), true);
}

ParsedOutput OutputParser::parse(std::string_view text, const OutputParserOptions& options) {
  OutputParser parser(options);
  ParsedOutput parsed;
  parsed.append(parser.push(text));
  parsed.append(parser.finish());
  return parsed;
}

}  // namespace m3
