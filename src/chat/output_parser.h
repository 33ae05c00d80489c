#pragma once
// Streaming parsers for M3 output: reasoning (<mm:think>...</mm:think>) and namespaced XML
// tool calls, turned into OpenAI-style deltas. Push decoded text as it arrives (any
// chunking: per token, per character); each push returns only what is certain so far.
// Text that may be the start of a tag or of the namespace string is held back, so
// "]<]minimax[>[" never reaches content or reasoning.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "chat/chat_template.h"

namespace m3 {

struct ToolCallDelta {
  int index = 0;          // position of the call in this response (0, 1, ...)
  std::string id;         // set on the first delta of a call only
  std::string name;       // set on the first delta of a call only
  std::string arguments;  // next fragment of the JSON arguments text
};

struct OutputDelta {
  std::string reasoning_content;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning_content.empty() && content.empty() && tool_calls.empty(); }
};

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a complete JSON object
};

struct ParsedOutput {
  std::string reasoning_content;
  std::string content;
  std::vector<ToolCall> tool_calls;
  // Folds one delta in (concatenating fragments per call index).
  void append(const OutputDelta& delta);
};

struct OutputParserOptions {
  // What the prompt ended with: enabled -> output starts inside reasoning; disabled /
  // adaptive -> it starts as content unless the model opens <mm:think> first.
  ThinkingMode thinking_mode = ThinkingMode::kAdaptive;
  bool parse_reasoning = true;   // false: think tags are left in content
  bool parse_tool_calls = true;  // false: tool-call XML is left in content
  // The request's tools array ([{type, function: {name, parameters}}]); parameter schemas
  // type the arguments (integer, number, boolean, null, array, object; else string).
  OrderedJson tools;
  // Tool call ids are call_id_prefix + index; empty = "call_" + random hex + "_".
  std::string call_id_prefix;
};

// <mm:think> handling alone. Also ends reasoning at "]<]minimax[>[<tool_call>" (a tool
// call opened before </mm:think>), handing that text on as content.
class ReasoningParser {
 public:
  explicit ReasoningParser(ThinkingMode mode);
  struct Split {
    std::string reasoning;
    std::string content;
  };
  Split push(std::string_view text);
  Split finish();  // releases anything held back

 private:
  enum class State { kStart, kReasoning, kContent };
  void drain(Split& out, bool final);
  State state_ = State::kStart;
  State default_state_;  // where output goes when it opens with no think tag
  std::string buffer_;
};

// Tool-call XML alone: content in, visible content + tool-call deltas out.
class ToolCallParser {
 public:
  ToolCallParser(const OrderedJson& tools, std::string call_id_prefix);
  // Frames point into tools_, so copies are refused (moves keep the JSON nodes in place).
  ToolCallParser(const ToolCallParser&) = delete;
  ToolCallParser& operator=(const ToolCallParser&) = delete;
  ToolCallParser(ToolCallParser&&) = default;
  ToolCallParser& operator=(ToolCallParser&&) = default;
  OutputDelta push(std::string_view text);
  OutputDelta finish();  // closes an unfinished call so its arguments are valid JSON
  int num_calls() const { return num_calls_; }

 private:
  enum class Mode { kText, kBlock, kInvoke };
  enum class Kind { kObject, kArray, kString, kScalar, kUnknown };
  struct Frame {
    Kind kind;
    std::string tag;                 // element that closes this value
    const OrderedJson* schema = nullptr;
    bool opened = false;             // containers: "{" / "[" written
    bool has_member = false;         // containers: a member was written (comma needed)
    std::string text;                // scalars, undecided values, raw container text
  };
  void drain(OutputDelta& out, bool final);
  bool step_text(OutputDelta& out, bool final);
  bool step_block(OutputDelta& out, bool final);
  bool step_frame(OutputDelta& out, bool final);
  void open_value(const std::string& tag, const OrderedJson* schema, OutputDelta& out);
  void close_frame(OutputDelta& out);
  void emit_args(std::string_view fragment, OutputDelta& out);
  const OrderedJson* find_tool_parameters(const std::string& name) const;

  OrderedJson tools_;
  std::string call_id_prefix_;
  Mode mode_ = Mode::kText;
  std::string buffer_;
  std::vector<Frame> frames_;
  int num_calls_ = 0;
};

// Reasoning then tool calls, as the server needs them.
class OutputParser {
 public:
  explicit OutputParser(OutputParserOptions options);
  OutputDelta push(std::string_view text);
  OutputDelta finish();
  // One-shot form: push(text) + finish(), accumulated.
  static ParsedOutput parse(std::string_view text, const OutputParserOptions& options);

 private:
  OutputDelta route(ReasoningParser::Split split, bool final);
  OutputParserOptions options_;
  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
};

}  // namespace m3
