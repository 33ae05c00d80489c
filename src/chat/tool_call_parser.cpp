// ToolCallParser: namespaced XML tool calls -> OpenAI tool_calls with JSON arguments typed
// by the tool's JSON schema, streamed as argument fragments.
//
// Grammar (NS = "]<]minimax[>["):
//   NS<tool_call> ( NS<invoke name="f"> member* NS</invoke> )* NS</tool_call>
//   member = NS<key> value NS</key>;  arrays hold NS<item> value NS</item>;
//   objects nest members; scalars are plain text.
#include <cmath>
#include <cstdlib>

#include "chat/output_parser.h"
#include "chat/text_scan.h"

namespace m3 {
namespace {

using namespace text_scan;  // NOLINT: small local helpers

using Json = OrderedJson;

constexpr std::string_view kToolCallOpen = "<tool_call>";
constexpr size_t kMaxTagBytes = 4096;  // a tag longer than this is junk, not a tag

struct TypeSet {
  bool string = false, integer = false, number = false, boolean = false, null = false,
       object = false, array = false;
  bool any() const { return string || integer || number || boolean || null || object || array; }
  bool scalar() const { return string || integer || number || boolean; }
};

void add_type(std::string_view name, TypeSet& types) {
  if (name == "string") types.string = true;
  if (name == "integer") types.integer = true;
  if (name == "number") types.number = true;
  if (name == "boolean") types.boolean = true;
  if (name == "null") types.null = true;
  if (name == "object") types.object = true;
  if (name == "array") types.array = true;
}

TypeSet schema_types(const Json* schema) {
  TypeSet types;
  if (schema == nullptr || !schema->is_object()) return types;
  if (auto it = schema->find("type"); it != schema->end()) {
    if (it->is_string()) add_type(it->get_ref<const std::string&>(), types);
    if (it->is_array()) {
      for (const Json& name : *it) {
        if (name.is_string()) add_type(name.get_ref<const std::string&>(), types);
      }
    }
  }
  for (const char* key : {"anyOf", "oneOf", "allOf"}) {
    if (auto it = schema->find(key); it != schema->end() && it->is_array()) {
      for (const Json& branch : *it) {
        const TypeSet sub = schema_types(&branch);
        types.string |= sub.string, types.integer |= sub.integer, types.number |= sub.number;
        types.boolean |= sub.boolean, types.null |= sub.null, types.object |= sub.object;
        types.array |= sub.array;
      }
    }
  }
  if (!types.any()) {
    if (schema->contains("properties")) types.object = true;
    if (schema->contains("items")) types.array = true;
    const Json* values = schema->contains("enum") ? &(*schema)["enum"] : nullptr;
    if (values != nullptr && values->is_array()) {
      for (const Json& value : *values) {
        if (value.is_string()) types.string = true;
        if (value.is_number_integer() || value.is_number_unsigned()) types.integer = true;
        if (value.is_number_float()) types.number = true;
        if (value.is_boolean()) types.boolean = true;
        if (value.is_null()) types.null = true;
      }
    }
  }
  return types;
}

// A sub-schema found directly or in an anyOf/oneOf/allOf branch.
const Json* sub_schema(const Json* schema, const std::string& key, const std::string& name) {
  if (schema == nullptr || !schema->is_object()) return nullptr;
  if (auto it = schema->find(key); it != schema->end() && it->is_object()) {
    if (name.empty()) return &*it;
    if (auto prop = it->find(name); prop != it->end()) return &*prop;
  }
  for (const char* combinator : {"anyOf", "oneOf", "allOf"}) {
    if (auto it = schema->find(combinator); it != schema->end() && it->is_array()) {
      for (const Json& branch : *it) {
        if (const Json* found = sub_schema(&branch, key, name)) return found;
      }
    }
  }
  if (!name.empty()) {
    auto extra = schema->find("additionalProperties");
    if (extra != schema->end() && extra->is_object()) return &*extra;
  }
  return nullptr;
}

// JSON string escaping that passes bytes >= 0x80 through unchanged, so a UTF-8 sequence
// split across fragments still concatenates correctly.
std::string escape_json(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string quote_json(std::string_view text) {
  std::string out(1, '"');
  out += escape_json(text);
  out += '"';
  return out;
}

std::string trim(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end && is_space(text[begin])) ++begin;
  while (end > begin && is_space(text[end - 1])) --end;
  return std::string(text.substr(begin, end - begin));
}

// JSON text of a scalar element, typed by its schema; falls back to any JSON literal,
// then to a string.
std::string convert_scalar(const std::string& text, const Json* schema) {
  const TypeSet types = schema_types(schema);
  const std::string value = trim(text);
  if (types.null && (value == "null" || value == "None")) return "null";
  if (types.integer || types.number) {
    const Json parsed = Json::parse(value, nullptr, false);
    if (!parsed.is_discarded() && parsed.is_number()) {
      if (types.integer && parsed.is_number_float()) {
        const double v = parsed.get<double>();
        if (std::trunc(v) == v && std::fabs(v) < 9.007199254740992e15) {
          return std::to_string(static_cast<int64_t>(v));
        }
      }
      if (types.number || !parsed.is_number_float()) return parsed.dump();
    } else if (types.number && !value.empty()) {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);  // "1." / ".5" / "+2"
      if (end == value.c_str() + value.size() && std::isfinite(v)) return Json(v).dump();
    }
  }
  if (types.boolean) {
    if (value == "true" || value == "True") return "true";
    if (value == "false" || value == "False") return "false";
  }
  if (types.string) return quote_json(text);
  if (!types.any()) return quote_json(text);
  const Json parsed = Json::parse(value, nullptr, false);
  if (!parsed.is_discarded()) return parsed.dump();
  return quote_json(text);
}

std::string parse_invoke_name(std::string_view tag) {
  const size_t eq = tag.find("name=");
  if (eq == std::string_view::npos) return {};
  std::string_view rest = tag.substr(eq + 5);
  if (!rest.empty() && (rest[0] == '"' || rest[0] == '\'')) {
    const size_t close = rest.find(rest[0], 1);
    return std::string(rest.substr(1, close == std::string_view::npos ? rest.size() - 1 : close - 1));
  }
  size_t end = 0;
  while (end < rest.size() && !is_space(rest[end]) && rest[end] != '/') ++end;
  return std::string(rest.substr(0, end));
}

}  // namespace

ToolCallParser::ToolCallParser(const OrderedJson& tools, std::string call_id_prefix)
    : tools_(tools), call_id_prefix_(std::move(call_id_prefix)) {}

OutputDelta ToolCallParser::push(std::string_view text) {
  buffer_ += text;
  OutputDelta out;
  drain(out, false);
  return out;
}

OutputDelta ToolCallParser::finish() {
  OutputDelta out;
  drain(out, true);
  while (!frames_.empty()) close_frame(out);  // an unfinished call still ends as valid JSON
  buffer_.clear();
  mode_ = Mode::kText;
  return out;
}

void ToolCallParser::drain(OutputDelta& out, bool final) {
  while (true) {
    bool progressed = false;
    switch (mode_) {
      case Mode::kText: progressed = step_text(out, final); break;
      case Mode::kBlock: progressed = step_block(out, final); break;
      case Mode::kInvoke: progressed = step_frame(out, final); break;
    }
    if (!progressed) return;
  }
}

bool ToolCallParser::step_text(OutputDelta& out, bool final) {
  if (buffer_.empty()) return false;
  const size_t ns = buffer_.find(kNamespaceToken);
  if (ns == std::string::npos) {
    const size_t hold = final ? 0 : partial_suffix(buffer_, kNamespaceToken);
    out.content.append(buffer_, 0, buffer_.size() - hold);
    buffer_.erase(0, buffer_.size() - hold);
    return false;
  }
  out.content.append(buffer_, 0, ns);
  buffer_.erase(0, ns);
  const std::string_view after = std::string_view(buffer_).substr(kNamespaceToken.size());
  if (starts_with(after, kToolCallOpen)) {
    buffer_.erase(0, kNamespaceToken.size() + kToolCallOpen.size());
    mode_ = Mode::kBlock;
    return true;
  }
  if (!final && is_partial_of(after, kToolCallOpen)) return false;
  buffer_.erase(0, kNamespaceToken.size());  // a stray namespace string never shows
  return true;
}

bool ToolCallParser::step_block(OutputDelta& out, bool final) {
  // Between invokes only tags matter; other text (newlines) is dropped.
  const size_t ns = buffer_.find(kNamespaceToken);
  if (ns == std::string::npos) {
    const size_t hold = final ? 0 : partial_suffix(buffer_, kNamespaceToken);
    buffer_.erase(0, buffer_.size() - hold);
    return false;
  }
  buffer_.erase(0, ns);
  const std::string_view after = std::string_view(buffer_).substr(kNamespaceToken.size());
  if (after.empty()) return false;
  const size_t gt = after.find('>');
  if (after[0] != '<' || (gt == std::string_view::npos && (final || after.size() > kMaxTagBytes))) {
    buffer_.erase(0, kNamespaceToken.size());
    return true;
  }
  if (gt == std::string_view::npos) return false;
  const std::string tag(after.substr(1, gt - 1));
  buffer_.erase(0, kNamespaceToken.size() + gt + 1);
  if (tag == "/tool_call") {
    mode_ = Mode::kText;
  } else if (starts_with(tag, "invoke")) {
    const std::string name = parse_invoke_name(tag);
    const int index = num_calls_++;
    out.tool_calls.push_back({index, call_id_prefix_ + std::to_string(index), name, ""});
    frames_.push_back({Kind::kObject, "invoke", find_tool_parameters(name), false, false, {}});
    mode_ = Mode::kInvoke;
  }
  return true;
}

bool ToolCallParser::step_frame(OutputDelta& out, bool final) {
  Frame& frame = frames_.back();
  if (frame.kind == Kind::kString || frame.kind == Kind::kScalar) {
    // The value runs to its closing tag. A closing tag of an enclosing element (or of the
    // block) also ends it, for output that forgot one; other "</x>" text is literal.
    const std::string close_prefix = std::string(kNamespaceToken) + "</";
    auto consume = [&](size_t length) {
      if (frame.kind == Kind::kString) {
        emit_args(escape_json(std::string_view(buffer_).substr(0, length)), out);
      } else {
        frame.text.append(buffer_, 0, length);
      }
      buffer_.erase(0, length);
    };
    size_t search_from = 0;
    while (true) {
      const size_t at = buffer_.find(close_prefix, search_from);
      if (at == std::string::npos) {
        consume(buffer_.size() - (final ? 0 : partial_suffix(buffer_, close_prefix)));
        return false;
      }
      const size_t gt = buffer_.find('>', at + close_prefix.size());
      if (gt == std::string::npos) {
        if (!final && buffer_.size() - at <= kMaxTagBytes) {
          consume(at);
          return false;
        }
        search_from = at + 1;
        continue;
      }
      const std::string name = buffer_.substr(at + close_prefix.size(), gt - at - close_prefix.size());
      bool closes_outer = name == "tool_call";
      for (const Frame& outer : frames_) closes_outer = closes_outer || outer.tag == name;
      if (name == frame.tag || closes_outer) {
        consume(at);
        if (name == frame.tag) buffer_.erase(0, gt + 1 - at);
        close_frame(out);  // an outer tag stays in the buffer for the enclosing frame
        return true;
      }
      search_from = gt + 1;
    }
  }

  if (frame.kind == Kind::kUnknown) {
    // No usable schema: the first non-blank text decides between nested elements
    // (object, or array when it is <item>) and a plain string.
    size_t ws = 0;
    while (ws < buffer_.size() && is_space(buffer_[ws])) ++ws;
    frame.text.append(buffer_, 0, ws);
    buffer_.erase(0, ws);
    if (buffer_.empty()) return false;
    if (!starts_with(buffer_, kNamespaceToken)) {
      if (!final && is_partial_of(buffer_, kNamespaceToken)) return false;
      frame.kind = Kind::kString;
    } else {
      const std::string_view after = std::string_view(buffer_).substr(kNamespaceToken.size());
      const size_t gt = after.find('>');
      if (gt == std::string_view::npos && !final && after.size() <= kMaxTagBytes) return false;
      const std::string_view tag = gt == std::string_view::npos ? after : after.substr(0, gt + 1);
      if (tag == "<item>") {
        frame.kind = Kind::kArray;
      } else if (starts_with(tag, "<") && !starts_with(tag, "</")) {
        frame.kind = Kind::kObject;
      } else {
        frame.kind = Kind::kString;
      }
    }
    if (frame.kind == Kind::kString) {
      emit_args(std::string(1, '"') + escape_json(frame.text), out);
    }
    frame.text.clear();
    return true;
  }

  // Object or array: expecting child elements or the closing tag.
  const size_t ns = buffer_.find(kNamespaceToken);
  const size_t take = ns != std::string::npos
                          ? ns
                          : buffer_.size() - (final ? 0 : partial_suffix(buffer_, kNamespaceToken));
  if (!frame.opened) frame.text.append(buffer_, 0, take);  // raw text: JSON fallback
  buffer_.erase(0, take);
  if (ns == std::string::npos) return false;
  const std::string_view after = std::string_view(buffer_).substr(kNamespaceToken.size());
  if (after.empty() && !final) return false;
  const size_t gt = after.find('>');
  if (after.empty() || after[0] != '<' ||
      (gt == std::string_view::npos && (final || after.size() > kMaxTagBytes))) {
    buffer_.erase(0, kNamespaceToken.size());
    return true;
  }
  if (gt == std::string_view::npos) return false;
  const std::string tag(after.substr(1, gt - 1));
  buffer_.erase(0, kNamespaceToken.size() + gt + 1);
  if (starts_with(tag, "/")) {
    const std::string name = tag.substr(1);
    if (name == "tool_call") {  // block closed with calls still open
      while (!frames_.empty()) close_frame(out);
      mode_ = Mode::kText;
      return true;
    }
    // Close up to the matching element; an unmatched closing tag is ignored.
    for (size_t i = frames_.size(); i-- > 0;) {
      if (frames_[i].tag == name) {
        while (frames_.size() > i) close_frame(out);
        break;
      }
    }
    return true;
  }
  const bool is_object = frame.kind == Kind::kObject;
  if (!frame.opened) {
    frame.opened = true;
    frame.text.clear();
    emit_args(is_object ? "{" : "[", out);
  }
  std::string prefix = frame.has_member ? "," : "";
  frame.has_member = true;
  if (is_object) prefix += quote_json(tag) + ":";
  emit_args(prefix, out);
  const Json* schema = is_object ? sub_schema(frame.schema, "properties", tag)
                                 : sub_schema(frame.schema, "items", "");
  open_value(tag, schema, out);
  return true;
}

void ToolCallParser::open_value(const std::string& tag, const OrderedJson* schema, OutputDelta& out) {
  const TypeSet types = schema_types(schema);
  Kind kind = Kind::kScalar;
  if (!types.any() || ((types.object || types.array) && (types.scalar() || (types.object && types.array)))) {
    kind = Kind::kUnknown;
  } else if (types.object) {
    kind = Kind::kObject;
  } else if (types.array) {
    kind = Kind::kArray;
  } else if (types.string && !types.integer && !types.number && !types.boolean && !types.null) {
    kind = Kind::kString;
  }
  frames_.push_back({kind, tag, schema, false, false, {}});
  if (kind == Kind::kString) emit_args("\"", out);
}

void ToolCallParser::close_frame(OutputDelta& out) {
  Frame frame = std::move(frames_.back());
  frames_.pop_back();
  switch (frame.kind) {
    case Kind::kString:
      emit_args("\"", out);
      break;
    case Kind::kScalar:
      emit_args(convert_scalar(frame.text, frame.schema), out);
      break;
    case Kind::kUnknown:
      emit_args(quote_json(frame.text), out);
      break;
    case Kind::kObject:
    case Kind::kArray: {
      const bool is_object = frame.kind == Kind::kObject;
      if (frame.opened) {
        emit_args(is_object ? "}" : "]", out);
        break;
      }
      // No child elements: the model may have written the value as JSON text.
      const std::string raw = trim(frame.text);
      const Json parsed = raw.empty() ? Json() : Json::parse(raw, nullptr, false);
      if (raw.empty()) {
        emit_args(is_object ? "{}" : "[]", out);
      } else if (!parsed.is_discarded() && (frames_.empty() ? parsed.is_object() : true)) {
        emit_args(parsed.dump(-1, ' ', false, Json::error_handler_t::replace), out);
      } else {
        emit_args(frames_.empty() ? "{}" : quote_json(raw), out);
      }
      break;
    }
  }
  if (frames_.empty() && mode_ == Mode::kInvoke) mode_ = Mode::kBlock;
}

void ToolCallParser::emit_args(std::string_view fragment, OutputDelta& out) {
  if (fragment.empty() || num_calls_ == 0) return;
  const int index = num_calls_ - 1;
  if (!out.tool_calls.empty() && out.tool_calls.back().index == index &&
      out.tool_calls.back().id.empty()) {
    out.tool_calls.back().arguments += fragment;
  } else {
    out.tool_calls.push_back({index, "", "", std::string(fragment)});
  }
}

const OrderedJson* ToolCallParser::find_tool_parameters(const std::string& name) const {
  if (!tools_.is_array()) return nullptr;
  for (const Json& tool : tools_) {
    const Json* function = tool.is_object() && tool.contains("function") ? &tool["function"] : &tool;
    if (!function->is_object()) continue;
    auto found = function->find("name");
    if (found == function->end() || !found->is_string() || *found != name) continue;
    auto parameters = function->find("parameters");
    return parameters == function->end() ? nullptr : &*parameters;
  }
  return nullptr;
}

}  // namespace m3
