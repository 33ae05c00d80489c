#pragma once
// tool_choice "required" or a named function: the output (after an optional reasoning block) must
// be one M3 tool-call block, as the chat template writes it:
//   NS<tool_call>\n ( NS<invoke name="f"> ( NS<param>value NS</param> )* NS</invoke>\n )+ NS</tool_call>
// (NS = "]<]minimax[>["), with f one of the request's tools (or the named one), parameters among
// the tool's schema properties, and scalar values of the schema's type: integers, numbers,
// true / false, enum strings; string and nested values are free text without "]<" (the namespace
// token's start, so a value never ends its own element early). Enforced as a regular expression
// (server/pattern_mode.h); the end ids come only after the block.
#include <optional>
#include <string>

#include "chat/chat_template.h"
#include "core/status.h"

namespace m3::server {

// The pattern (chat/byte_regex.h syntax) of a tool-call block for `tools` (the request's array),
// restricted to `only` when given. An error names the tool or parameter it cannot express.
Result<std::string> tool_call_pattern(const OrderedJson& tools, const std::optional<std::string>& only);

}  // namespace m3::server
