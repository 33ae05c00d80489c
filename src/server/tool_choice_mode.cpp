#include "server/tool_choice_mode.h"

#include <set>

namespace m3::server {
namespace {

std::string escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    const auto b = uint8_t(c);
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || b >= 0x80;
    if (!plain) out += '\\';
    out += c;
  }
  return out;
}

const std::string& ns() {
  static const std::string s = escape(kNamespaceToken);
  return s;
}

// Text without "]<": a run of ']' is followed by anything but '<' (or ends the text).
const char* const kTextPiece = R"([^\]]|\]+[^\]<])";
std::string free_text() { return std::string("(") + kTextPiece + R"()*\]*)"; }
// Nested elements (objects, arrays): text and namespaced tags.
std::string nested() {
  return std::string("(") + kTextPiece + R"(|\]*)" + ns() + R"(</?[A-Za-z0-9_.:\-]+>)*\]*)";
}

void collect_types(const OrderedJson& schema, std::set<std::string>& types, std::vector<std::string>& enums,
                   bool& free, int depth) {
  if (!schema.is_object() || depth > 8) {
    free = true;
    return;
  }
  bool typed = false;
  if (auto t = schema.find("type"); t != schema.end()) {
    if (t->is_string()) types.insert(t->get<std::string>()), typed = true;
    if (t->is_array())
      for (const auto& x : *t)
        if (x.is_string()) types.insert(x.get<std::string>()), typed = true;
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    if (auto a = schema.find(key); a != schema.end() && a->is_array()) {
      typed = true;
      for (const auto& branch : *a) collect_types(branch, types, enums, free, depth + 1);
    }
  }
  if (auto e = schema.find("enum"); e != schema.end() && e->is_array() && !e->empty()) {
    bool all_scalar = true;
    for (const auto& v : *e) all_scalar = all_scalar && (v.is_string() || v.is_number() || v.is_boolean());
    if (all_scalar) {
      // The template writes strings as they are, booleans and numbers as JSON.
      for (const auto& v : *e) enums.push_back(v.is_string() ? v.get<std::string>() : v.dump());
      return;
    }
  }
  if (!typed) {
    if (schema.contains("properties")) types.insert("object");
    else if (schema.contains("items")) types.insert("array");
    else free = true;
  }
}

std::string value_pattern(const OrderedJson* schema) {
  if (!schema) return free_text();
  std::set<std::string> types;
  std::vector<std::string> enums;
  bool free = false;
  collect_types(*schema, types, enums, free, 0);
  if (free || types.count("string")) return free_text();
  std::vector<std::string> alts;
  for (const auto& e : enums) alts.push_back(escape(e));
  if (types.count("integer") && !types.count("number")) alts.push_back(R"(-?\d+)");
  if (types.count("number")) alts.push_back(R"(-?\d+(\.\d+)?([eE][+\-]?\d+)?)");
  if (types.count("boolean")) alts.push_back("true|false");
  if (types.count("object") || types.count("array")) alts.push_back(nested());
  if (alts.empty()) return free_text();  // "null" only: the template omits it; nothing better to ask for
  std::string out = "(";
  for (size_t i = 0; i < alts.size(); ++i) out += (i ? "|" : "") + alts[i];
  return out + ")";
}

std::string invoke_pattern(const OrderedJson& function) {
  const std::string name = function["name"].get<std::string>();
  std::string members;
  const OrderedJson* params = nullptr;
  if (auto p = function.find("parameters"); p != function.end() && p->is_object()) params = &*p;
  const OrderedJson* props = nullptr;
  if (params)
    if (auto p = params->find("properties"); p != params->end() && p->is_object() && !p->empty()) props = &*p;
  if (props) {
    for (auto it = props->begin(); it != props->end(); ++it) {
      const std::string key = escape(it.key());
      members += (members.empty() ? "" : "|") + ns() + "<" + key + ">" + value_pattern(&it.value()) + ns() + "</" +
                 key + ">";
    }
  } else {
    members = ns() + R"(<[A-Za-z0-9_.:\-]+>)" + nested() + ns() + R"(</[A-Za-z0-9_.:\-]+>)";
  }
  return ns() + "<invoke name=\"" + escape(name) + "\">((" + members + ")\\n?)*" + ns() + "</invoke>\\n?";
}

}  // namespace

Result<std::string> tool_call_pattern(const OrderedJson& tools, const std::optional<std::string>& only) {
  if (!tools.is_array() || tools.empty()) return Status::error("tool_choice needs at least one tool");
  std::string invokes;
  for (const auto& tool : tools) {
    const OrderedJson& fn = tool["function"];
    if (only && fn["name"].get<std::string>() != *only) continue;
    if (!invokes.empty()) invokes += '|';
    invokes += '(';
    invokes += invoke_pattern(fn);
    invokes += ')';
  }
  if (invokes.empty()) return Status::error(std::string("no tool named '").append(only.value_or("")).append("'"));
  return ns() + "<tool_call>\\n?(" + invokes + ")+" + ns() + "</tool_call>";
}

}  // namespace m3::server
