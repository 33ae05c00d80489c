#include "chat/chat_template.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace m3 {
namespace {

constexpr std::string_view kDefaultSystemPrompt =
    "Your model version is MiniMax-M3, developed by MiniMax. Knowledge cutoff: January 2026. "
    "Founded in early 2022, MiniMax is a global AI foundation model company committed to "
    "advancing the frontiers of AI towards AGI.";
constexpr std::string_view kDefaultDeveloperPrompt = "You are a helpful assistant.";
constexpr std::string_view kThinkingInstructions =
    "\n\n<thinking_instructions>\nYou have a thinking capability that allows you to reason step "
    "by step before responding. When thinking is enabled, wrap your reasoning in "
    "<mm:think></mm:think> tags before your response. When thinking is disabled, begin your "
    "response directly after the </mm:think> prefix. When thinking is adaptive, decide on your "
    "own whether to think for the current turn.\n";
constexpr std::string_view kModeEnabled =
    "Current thinking mode: enabled. You MUST think step by step before every response, "
    "including after receiving function/tool results.\n";
constexpr std::string_view kModeDisabled =
    "Current thinking mode: disabled. Do not output any thinking process.\n";
constexpr std::string_view kModeAdaptive =
    "Current thinking mode: adaptive. You are encouraged to think for complex decision-making, "
    "multi-step reasoning, or when analyzing function/tool results.\n";
constexpr std::string_view kToolsPreamble =
    "\n\n# Tools\nYou may call one or more tools to assist with the user query.\nHere are the "
    "tools available in JSONSchema format:\n\n<tools>\n";

using Json = OrderedJson;

// Jinja truthiness of a JSON value (Python's bool()).
bool truthy(const Json* value) {
  if (value == nullptr || value->is_null()) return false;
  if (value->is_boolean()) return value->get<bool>();
  if (value->is_number_integer()) return value->get<int64_t>() != 0;
  if (value->is_number_unsigned()) return value->get<uint64_t>() != 0;
  if (value->is_number_float()) return value->get<double>() != 0.0;
  if (value->is_string()) return !value->get_ref<const std::string&>().empty();
  return !value->empty();
}

const Json* field(const Json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

bool is_string_value(const Json* value, std::string_view expected) {
  return value != nullptr && value->is_string() && value->get_ref<const std::string&>() == expected;
}

// What `{{ value }}` prints for a scalar (Python's str()); containers are refused since
// the template would print a Python repr that no sane client sends.
Status append_python_str(const Json* value, const std::string& where, std::string& out) {
  if (value == nullptr) return Status::ok();  // undefined prints nothing
  if (value->is_string()) {
    out += value->get_ref<const std::string&>();
  } else if (value->is_null()) {
    out += "None";
  } else if (value->is_boolean()) {
    out += value->get<bool>() ? "True" : "False";
  } else if (value->is_number()) {
    out += value->dump();  // shortest round-trip, the same digits as Python's repr
  } else {
    return Status::error(where + ": expected a string, got " + std::string(value->type_name()));
  }
  return Status::ok();
}

// The template's visible_text macro.
Status append_visible_text(const Json* content, const std::string& where, std::string& out) {
  if (content == nullptr || content->is_null()) return Status::ok();
  if (content->is_string()) {
    out += content->get_ref<const std::string&>();
    return Status::ok();
  }
  if (content->is_array()) {
    for (size_t i = 0; i < content->size(); ++i) {
      const Json& item = (*content)[i];
      const std::string item_where = where + "[" + std::to_string(i) + "]";
      if (item.is_object()) {
        const Json* type = field(item, "type");
        if (is_string_value(type, "text")) {
          M3_RETURN_IF_ERROR(append_python_str(field(item, "text"), item_where + ".text", out));
        } else if (is_string_value(type, "image")) {
          out += kImageToken;
        } else if (is_string_value(type, "video")) {
          out += kVideoToken;
        }
      } else if (item.is_string()) {
        out += item.get_ref<const std::string&>();
      }
    }
    return Status::ok();
  }
  return append_python_str(content, where, out);
}

// Python's str.strip('\n').
std::string strip_newlines(std::string_view text) {
  size_t begin = 0;
  size_t end = text.size();
  while (begin < end && text[begin] == '\n') ++begin;
  while (end > begin && text[end - 1] == '\n') --end;
  return std::string(text.substr(begin, end - begin));
}

// The template's to_xml macro (nested tool-call arguments).
Status append_xml(const Json& value, const std::string& where, std::string& out) {
  if (value.is_object()) {
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (it.value().is_null()) continue;
      out += kNamespaceToken;
      out += "<" + it.key() + ">";
      M3_RETURN_IF_ERROR(append_xml(it.value(), where + "." + it.key(), out));
      out += kNamespaceToken;
      out += "</" + it.key() + ">";
    }
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i) {
      out += kNamespaceToken;
      out += "<item>";
      M3_RETURN_IF_ERROR(append_xml(value[i], where + "[" + std::to_string(i) + "]", out));
      out += kNamespaceToken;
      out += "</item>";
    }
  } else if (value.is_boolean()) {
    out += value.get<bool>() ? "true" : "false";
  } else if (!value.is_null()) {
    M3_RETURN_IF_ERROR(append_python_str(&value, where, out));
  }
  return Status::ok();
}

Status validate_tools(const Json& tools) {
  if (tools.is_null()) return Status::ok();
  if (!tools.is_array()) return Status::error("tools: expected an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = "tools[" + std::to_string(i) + "]";
    const Json& tool = tools[i];
    if (!tool.is_object()) return Status::error(where + ": expected an object");
    const Json* type = field(tool, "type");
    if (type != nullptr && !is_string_value(type, "function")) {
      return Status::error(where + ".type: only \"function\" tools are supported");
    }
    const Json* function = field(tool, "function");
    if (function == nullptr || !function->is_object()) {
      return Status::error(where + ".function: missing or not an object");
    }
    const Json* name = field(*function, "name");
    if (name == nullptr || !name->is_string() || name->get_ref<const std::string&>().empty()) {
      return Status::error(where + ".function.name: missing or not a non-empty string");
    }
    const Json* parameters = field(*function, "parameters");
    if (parameters != nullptr && !parameters->is_null() && !parameters->is_object()) {
      return Status::error(where + ".function.parameters: expected a JSON Schema object");
    }
    if (parameters != nullptr && parameters->is_object()) {
      const Json* properties = field(*parameters, "properties");
      if (properties != nullptr && !properties->is_object()) {
        return Status::error(where + ".function.parameters.properties: expected an object");
      }
    }
  }
  return Status::ok();
}

// Appends one assistant tool call; sets `name` to the name the template remembers.
Status append_tool_call(const Json& call, const std::string& where, std::string& out,
                        std::string& name) {
  if (!call.is_object()) return Status::error(where + ": expected an object");
  const Json* function = field(call, "function");
  const bool wrapped = truthy(function);
  const Json& body = wrapped ? *function : call;
  const std::string body_where = wrapped ? where + ".function" : where;
  if (!body.is_object()) return Status::error(body_where + ": expected an object");
  const Json* name_value = field(body, "name");
  if (name_value == nullptr || !name_value->is_string()) {
    return Status::error(body_where + ".name: missing or not a string");
  }
  name = name_value->get<std::string>();
  const Json* arguments = field(body, "arguments");
  Json parsed;
  if (arguments != nullptr && arguments->is_string()) {
    // Clients send arguments as a JSON string; the template iterates a mapping.
    parsed = Json::parse(arguments->get_ref<const std::string&>(), nullptr, false);
    if (parsed.is_discarded()) {
      return Status::error(body_where + ".arguments: not valid JSON");
    }
    arguments = &parsed;
  }
  if (arguments == nullptr || !arguments->is_object()) {
    return Status::error(body_where + ".arguments: expected a JSON object");
  }
  out += kNamespaceToken;
  out += "<invoke name=\"" + name + "\">";
  for (auto it = arguments->begin(); it != arguments->end(); ++it) {
    if (it.value().is_null()) continue;
    out += kNamespaceToken;
    out += "<" + it.key() + ">";
    M3_RETURN_IF_ERROR(append_xml(it.value(), body_where + ".arguments." + it.key(), out));
    out += kNamespaceToken;
    out += "</" + it.key() + ">";
  }
  out += kNamespaceToken;
  out += "</invoke>\n";
  return Status::ok();
}

Status append_assistant(const Json& message, const std::string& where, std::string& out,
                        std::optional<std::string>& last_tool_call) {
  out += kRoleStart;
  out += "ai\n";
  std::string content;
  M3_RETURN_IF_ERROR(append_visible_text(field(message, "content"), where + ".content", content));
  std::string reasoning;
  const Json* reasoning_value = field(message, "reasoning_content");
  if (reasoning_value != nullptr && reasoning_value->is_string()) {
    reasoning = reasoning_value->get<std::string>();
  } else if (content.find(kThinkEnd) != std::string::npos) {
    // Reasoning inlined in content: text before the first end tag, after its last begin
    // tag; the answer is what follows the last end tag.
    std::string before = strip_newlines(std::string_view(content).substr(0, content.find(kThinkEnd)));
    const size_t begin = before.rfind(kThinkBegin);
    if (begin != std::string::npos) before = before.substr(begin + kThinkBegin.size());
    reasoning = strip_newlines(before);
    content = strip_newlines(
        std::string_view(content).substr(content.rfind(kThinkEnd) + kThinkEnd.size()));
  }
  if (!reasoning.empty()) {
    out += kThinkBegin;
    out += reasoning;
  }
  out += kThinkEnd;
  out += content;

  const Json* tool_calls = field(message, "tool_calls");
  if (truthy(tool_calls)) {
    if (!tool_calls->is_array()) return Status::error(where + ".tool_calls: expected an array");
    out += kNamespaceToken;
    out += "<tool_call>\n";
    std::string name;
    for (size_t i = 0; i < tool_calls->size(); ++i) {
      M3_RETURN_IF_ERROR(append_tool_call((*tool_calls)[i],
                                          where + ".tool_calls[" + std::to_string(i) + "]", out, name));
    }
    out += kNamespaceToken;
    out += "</tool_call>";
    last_tool_call = name;
  } else {
    last_tool_call.reset();
  }
  out += kEndOfMessage;
  out += "\n";
  return Status::ok();
}

Status append_tool_content(const Json* content, const std::string& where, std::string& out) {
  if (content != nullptr && content->is_string()) {
    out += content->get_ref<const std::string&>();
    return Status::ok();
  }
  if (content == nullptr || !content->is_array()) {
    return Status::error(where + ": expected a string or an array of content parts");
  }
  for (size_t i = 0; i < content->size(); ++i) {
    const Json& part = (*content)[i];
    const std::string part_where = where + "[" + std::to_string(i) + "]";
    if (part.is_object()) {
      const Json* type = field(part, "type");
      if (is_string_value(type, "image")) {
        out += kImageToken;
      } else if (is_string_value(type, "video")) {
        out += kVideoToken;
      } else if (const Json* output = field(part, "output")) {
        M3_RETURN_IF_ERROR(append_python_str(output, part_where + ".output", out));
      } else if (is_string_value(type, "text") && field(part, "text") != nullptr) {
        M3_RETURN_IF_ERROR(append_python_str(field(part, "text"), part_where + ".text", out));
      } else {
        return Status::error(part_where + ": unsupported content part");
      }
    } else {
      M3_RETURN_IF_ERROR(append_python_str(&part, part_where, out));
    }
  }
  return Status::ok();
}

const std::string& role_of(const Json& message) {
  return message.at("role").get_ref<const std::string&>();
}

}  // namespace

Result<ThinkingMode> parse_thinking_mode(std::string_view text) {
  if (text == "enabled") return ThinkingMode::kEnabled;
  if (text == "disabled") return ThinkingMode::kDisabled;
  if (text == "adaptive") return ThinkingMode::kAdaptive;
  return Status::error("thinking_mode: expected \"enabled\", \"disabled\" or \"adaptive\", got \"" +
                       std::string(text) + "\"");
}

const char* thinking_mode_name(ThinkingMode mode) {
  switch (mode) {
    case ThinkingMode::kEnabled: return "enabled";
    case ThinkingMode::kDisabled: return "disabled";
    case ThinkingMode::kAdaptive: return "adaptive";
  }
  return "adaptive";
}

std::string python_json_dumps(const OrderedJson& value) {
  if (value.is_object()) {
    if (value.empty()) return "{}";
    std::string out = "{";
    bool first = true;
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace);
      out += ": ";
      out += python_json_dumps(it.value());
    }
    return out + "}";
  }
  if (value.is_array()) {
    if (value.empty()) return "[]";
    std::string out = "[";
    for (size_t i = 0; i < value.size(); ++i) {
      if (i > 0) out += ", ";
      out += python_json_dumps(value[i]);
    }
    return out + "]";
  }
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Result<std::string> render_chat(const OrderedJson& messages, const OrderedJson& tools,
                                const ChatRenderOptions& options) {
  if (!messages.is_array()) return Status::error("messages: expected an array");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const Json& message = messages[i];
    if (!message.is_object()) return Status::error(where + ": expected an object");
    const Json* role = field(message, "role");
    if (role == nullptr || !role->is_string()) {
      return Status::error(where + ".role: missing or not a string");
    }
    const std::string& name = role->get_ref<const std::string&>();
    if (name != "system" && name != "developer" && name != "root" && name != "user" &&
        name != "assistant" && name != "tool") {
      return Status::error(where + ".role: unknown role \"" + name + "\"");
    }
  }
  M3_RETURN_IF_ERROR(validate_tools(tools));

  // root -> the system prompt; a following (or leading) system/developer -> developer prompt.
  size_t first = 0;
  const Json* system_message = nullptr;
  const Json* developer_message = nullptr;
  auto is_developer = [](const Json& m) {
    return role_of(m) == "system" || role_of(m) == "developer";
  };
  if (!messages.empty() && role_of(messages[0]) == "root") {
    system_message = &messages[0];
    first = 1;
    if (messages.size() > 1 && is_developer(messages[1])) {
      developer_message = &messages[1];
      first = 2;
    }
  } else if (!messages.empty() && is_developer(messages[0])) {
    developer_message = &messages[0];
    first = 1;
  }

  std::string out;
  out += kBeginOfDocument;
  out += kRoleStart;
  out += "system\n";
  if (system_message != nullptr && truthy(field(*system_message, "content"))) {
    M3_RETURN_IF_ERROR(append_visible_text(field(*system_message, "content"),
                                           "messages[0].content", out));
  } else {
    out += kDefaultSystemPrompt;
  }
  out += kThinkingInstructions;
  const ThinkingMode mode = options.thinking_mode.value_or(ThinkingMode::kAdaptive);
  out += mode == ThinkingMode::kEnabled ? kModeEnabled
         : mode == ThinkingMode::kDisabled ? kModeDisabled
                                           : kModeAdaptive;
  out += "</thinking_instructions>";
  out += kEndOfMessage;
  out += "\n";

  out += kRoleStart;
  out += "developer\n";
  if (developer_message != nullptr && truthy(field(*developer_message, "content"))) {
    M3_RETURN_IF_ERROR(append_visible_text(field(*developer_message, "content"),
                                           "messages[" + std::to_string(first - 1) + "].content",
                                           out));
  } else {
    out += options.model_identity ? std::string_view(*options.model_identity)
                                  : kDefaultDeveloperPrompt;
  }
  if (truthy(&tools)) {
    out += kToolsPreamble;
    for (const Json& tool : tools) {
      out += "<tool>" + python_json_dumps(tool.at("function")) + "</tool>\n";
    }
    const std::string ns(kNamespaceToken);
    out += "</tools>\n\nTo call tools, wrap all invocations in a single " + ns + "<tool_call>" +
           ns + "</tool_call> block. Parameter values containing nested objects or arrays are "
           "recursively expanded into XML elements. Example:\n\n" + ns + "<tool_call>\n" +
           ns + "<invoke name=\"tool-name-1\">" + ns + "<param-1>value-1" + ns + "</param-1>" +
           ns + "<param-2>" + ns + "<item>" + ns + "<key-a>val-a" + ns + "</key-a>" + ns +
           "<key-b>val-b" + ns + "</key-b>" + ns + "</item>" + ns + "</param-2>" + ns +
           "</invoke>\n" + ns + "<invoke name=\"tool-name-2\">" + ns + "<param-1>value-1" + ns +
           "</param-1>" + ns + "</invoke>\n" + ns + "</tool_call>";
  }
  out += kEndOfMessage;
  out += "\n";

  std::optional<std::string> last_tool_call;
  for (size_t i = first; i < messages.size(); ++i) {
    const Json& message = messages[i];
    const std::string& role = role_of(message);
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (role == "assistant") {
      M3_RETURN_IF_ERROR(append_assistant(message, where, out, last_tool_call));
    } else if (role == "tool") {
      if (!last_tool_call) {
        return Status::error(where + ": tool message without a preceding assistant tool call");
      }
      if (i == first || role_of(messages[i - 1]) != "tool") {
        out += kRoleStart;
        out += "tool";
      }
      out += "\n<response>";
      M3_RETURN_IF_ERROR(append_tool_content(field(message, "content"), where + ".content", out));
      out += "</response>";
      if (i + 1 == messages.size() || role_of(messages[i + 1]) != "tool") {
        out += kEndOfMessage;
        out += "\n";
      }
    } else if (role == "user") {
      out += kRoleStart;
      out += "user\n";
      M3_RETURN_IF_ERROR(append_visible_text(field(message, "content"), where + ".content", out));
      out += kEndOfMessage;
      out += "\n";
    }
    // Later root/system/developer messages are not rendered by the template.
  }

  if (options.continue_final_message) {
    if (options.add_generation_prompt)
      return Status::error("continue_final_message: add_generation_prompt must be false");
    const std::string closing = std::string(kEndOfMessage) + "\n";
    if (messages.size() <= first || role_of(messages.back()) != "assistant" || truthy(field(messages.back(), "tool_calls")) ||
        out.size() < closing.size() || out.compare(out.size() - closing.size(), closing.size(), closing) != 0)
      return Status::error("messages[" + std::to_string(messages.size() - 1) +
                           "]: continue_final_message needs the last message to be an assistant message without tool calls");
    out.resize(out.size() - closing.size());
  }
  if (options.add_generation_prompt) {
    out += kRoleStart;
    out += "ai\n";
    if (options.thinking_mode == ThinkingMode::kDisabled) out += kThinkEnd;
    if (options.thinking_mode == ThinkingMode::kEnabled) out += kThinkBegin;
  }
  return out;
}

uint64_t chat_template_fingerprint(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r' ||
                           text.back() == '\t')) {
    text.remove_suffix(1);
  }
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

ChatTemplateCheck check_chat_template(const std::string& model_dir,
                                      const std::optional<std::string>& reference_template) {
  namespace fs = std::filesystem;
  ChatTemplateCheck check;
  std::string text;
  const fs::path jinja = fs::path(model_dir) / "chat_template.jinja";
  const fs::path config = fs::path(model_dir) / "tokenizer_config.json";
  if (fs::exists(jinja)) {
    std::ifstream in(jinja, std::ios::binary);
    std::ostringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
    check.found = true;
    check.source = jinja.string();
  } else if (fs::exists(config)) {
    std::ifstream in(config, std::ios::binary);
    Json parsed = Json::parse(in, nullptr, false);
    const Json* value = parsed.is_discarded() ? nullptr : field(parsed, "chat_template");
    if (value != nullptr && value->is_string()) {
      text = value->get<std::string>();
      check.found = true;
    } else if (value != nullptr && value->is_array()) {
      for (const Json& entry : *value) {
        if (is_string_value(field(entry, "name"), "default") && field(entry, "template") &&
            field(entry, "template")->is_string()) {
          text = field(entry, "template")->get<std::string>();
          check.found = true;
        }
      }
    }
    if (check.found) check.source = config.string() + " (chat_template)";
  }
  if (!check.found) {
    check.message = "no chat template in " + model_dir + "; the built-in M3 format is used";
    return check;
  }
  const uint64_t expected = reference_template ? chat_template_fingerprint(*reference_template)
                                               : kReferenceTemplateFingerprint;
  check.matches = chat_template_fingerprint(text) == expected;
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(chat_template_fingerprint(text)));
  check.message = check.matches
                      ? "chat template in " + check.source + " matches the built-in M3 format"
                      : "chat template in " + check.source + " (fingerprint " + hex +
                            ") differs from the M3 reference; the built-in M3 format is used";
  return check;
}

}  // namespace m3
