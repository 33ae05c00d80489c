#pragma once
// The MiniMax-M3 chat format rendered natively: byte-identical to the model's
// chat_template.jinja as HF transformers renders it (trim_blocks, lstrip_blocks, tojson with
// ensure_ascii=False and Python's ", " / ": " separators).
//
// JSON inputs are nlohmann::ordered_json: tool schemas are printed in their original key
// order, so request bodies must be parsed with ordered_json too.
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace m3 {

using OrderedJson = nlohmann::ordered_json;

// The template's `thinking_mode` variable.
enum class ThinkingMode { kAdaptive, kEnabled, kDisabled };

// "enabled" | "disabled" | "adaptive"; anything else is an error naming `thinking_mode`.
Result<ThinkingMode> parse_thinking_mode(std::string_view text);
const char* thinking_mode_name(ThinkingMode mode);

// The literal strings of the format (architecture doc 5.2 / 5.3).
inline constexpr std::string_view kNamespaceToken = "]<]minimax[>[";
inline constexpr std::string_view kBeginOfDocument = "]~!b[";
inline constexpr std::string_view kRoleStart = "]~b]";
inline constexpr std::string_view kEndOfMessage = "[e~[";
inline constexpr std::string_view kThinkBegin = "<mm:think>";
inline constexpr std::string_view kThinkEnd = "</mm:think>";
inline constexpr std::string_view kImageToken = "]<]image[>[";
inline constexpr std::string_view kVideoToken = "]<]video[>[";

struct ChatRenderOptions {
  bool add_generation_prompt = true;
  // nullopt = the variable is not defined (the template then behaves as adaptive).
  std::optional<ThinkingMode> thinking_mode;
  // The template's `model_identity` variable: the developer prompt when none is given.
  std::optional<std::string> model_identity;
  // vLLM's continue_final_message: the last message (an assistant one without tool calls) is
  // left open, so generation continues its text. Needs add_generation_prompt false.
  bool continue_final_message = false;
};

// Renders an OpenAI-style conversation. `messages` is an array of {role, content, ...}
// with roles root | system | developer | user | assistant | tool; `tools` is null or an
// array of {type: "function", function: {name, description?, parameters?, ...}}.
// Assistant tool_calls may carry arguments as a JSON object or as a JSON-object string.
// Errors (unknown role, bad tool schema, tool message with no preceding assistant tool
// call, malformed content or tool call) name the offending field, e.g.
// "messages[3].tool_calls[0].function.arguments: ...".
Result<std::string> render_chat(const OrderedJson& messages, const OrderedJson& tools,
                                const ChatRenderOptions& options);

// Python's json.dumps(value, ensure_ascii=False) (what the template's tojson prints).
std::string python_json_dumps(const OrderedJson& value);

// Whether a model directory's chat template is the one render_chat implements.
struct ChatTemplateCheck {
  bool found = false;    // a template was found in the model dir
  bool matches = false;  // identical to the reference (ignoring trailing whitespace)
  std::string source;    // file it was read from, e.g. ".../chat_template.jinja"
  std::string message;   // human-readable verdict
};

// Looks for chat_template.jinja, then tokenizer_config.json "chat_template" (a string,
// or a list of {name, template} where "default" is used). Compares against
// `reference_template` when given, else against the fingerprint of the reference
// template that render_chat was verified against.
ChatTemplateCheck check_chat_template(const std::string& model_dir,
                                      const std::optional<std::string>& reference_template = {});

// 64-bit FNV-1a of `text` with trailing whitespace removed (the template fingerprint).
uint64_t chat_template_fingerprint(std::string_view text);

// Fingerprint of the reference chat_template.jinja (the MiniMax-M3 template mirrored in
// ../shared/data/minimax-m3, 11756 bytes); a unit test recomputes it from that file.
inline constexpr uint64_t kReferenceTemplateFingerprint = 0xdf3dad21a55ed8afull;

}  // namespace m3
