#include "chat/json_schema.h"

#include <map>
#include <set>

namespace m3 {
namespace {

using Json = nlohmann::ordered_json;
using Mode = JsonPrefix::Mode;

// RFC 3339 full-date and full-time.
constexpr const char* kDate = R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))";
constexpr const char* kTime = R"(([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+\-]([01]\d|2[0-3]):[0-5]\d))";

const std::set<std::string> kAnnotations = {"title", "description", "default", "examples", "$schema", "$id",
                                            "$comment", "readOnly", "writeOnly", "deprecated"};

// The kind of a value from its first byte.
uint8_t kind_of_first(uint8_t c) {
  switch (c) {
    case '{': return JsonSchema::kObject;
    case '[': return JsonSchema::kArray;
    case '"': return JsonSchema::kString;
    case 't': case 'f': return JsonSchema::kBoolean;
    case 'n': return JsonSchema::kNull;
    default: return (c == '-' || (c >= '0' && c <= '9')) ? uint8_t(JsonSchema::kNumber | JsonSchema::kInteger) : 0;
  }
}

uint8_t kind_of_value(const Json& v) {
  if (v.is_string()) return JsonSchema::kString;
  if (v.is_boolean()) return JsonSchema::kBoolean;
  if (v.is_null()) return JsonSchema::kNull;
  if (v.is_number_integer() || v.is_number_unsigned()) return JsonSchema::kInteger | JsonSchema::kNumber;
  if (v.is_number()) return JsonSchema::kNumber;
  return 0;
}

class Compiler {
 public:
  explicit Compiler(const Json& root) : root_(root) {}

  Result<int32_t> compile(const Json& s, const std::string& at) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) return fail(at, "the schema false admits nothing");
      return add(JsonSchema::Node{});
    }
    if (!s.is_object()) return fail(at, "a schema must be an object or a boolean");
    if (auto r = s.find("$ref"); r != s.end()) return ref(*r, s, at);
    JsonSchema::Node n;
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string& k = it.key();
      static const std::set<std::string> known = {"type",  "properties", "required",    "additionalProperties",
                                                  "items", "enum",       "const",       "anyOf",
                                                  "$defs", "definitions", "pattern",    "format",
                                                  "minLength", "maxLength"};
      if (!known.count(k) && !kAnnotations.count(k)) return fail(at, "'" + k + "' is not supported");
    }
    if (auto a = s.find("anyOf"); a != s.end()) return any_of(*a, s, at);
    if (auto t = s.find("type"); t != s.end()) {
      auto kinds = type_kinds(*t, at);
      if (!kinds.is_ok()) return kinds.status();
      n.kinds = *kinds;
      n.unconstrained = false;
    }
    const bool has_choices = s.contains("enum") || s.contains("const");
    if (has_choices) {
      std::vector<Json> values;
      if (auto e = s.find("enum"); e != s.end()) {
        if (!e->is_array() || e->empty()) return fail(at + ".enum", "must be a non-empty array");
        for (const auto& v : *e) values.push_back(v);
      }
      if (auto c = s.find("const"); c != s.end()) values.push_back(*c);
      uint8_t kinds = 0;
      for (const auto& v : values) {
        const uint8_t k = kind_of_value(v);
        if (!k) return fail(at, "enum / const values must be strings, numbers, booleans or null");
        if (!(k & n.kinds)) continue;  // a value the type excludes can never be written
        n.choices.push_back(v.dump());
        kinds |= k;
      }
      if (n.choices.empty()) return fail(at, "no enum / const value has the schema's type");
      n.kinds &= kinds;
      n.choice_kinds = n.kinds;
      n.unconstrained = false;
    }
    if (auto p = s.find("properties"); p != s.end()) {
      if (!p->is_object()) return fail(at + ".properties", "must be an object");
      if (p->size() > size_t(JsonSchema::kMaxProperties))
        return fail(at + ".properties", "more than " + std::to_string(JsonSchema::kMaxProperties) + " properties");
      n.unconstrained = false;
      for (auto it = p->begin(); it != p->end(); ++it) {
        auto child = compile(it.value(), at + ".properties." + it.key());
        if (!child.is_ok()) return child.status();
        const std::string quoted = Json(it.key()).dump();
        n.names.push_back(quoted.substr(1, quoted.size() - 2));
        n.props.push_back(*child);
      }
    }
    if (auto r = s.find("required"); r != s.end()) {
      if (!r->is_array()) return fail(at + ".required", "must be an array of names");
      n.unconstrained = false;
      for (const auto& name : *r) {
        if (!name.is_string()) return fail(at + ".required", "must be an array of names");
        const std::string quoted = Json(name.get<std::string>()).dump();
        const std::string raw = quoted.substr(1, quoted.size() - 2);
        size_t i = 0;
        while (i < n.names.size() && n.names[i] != raw) ++i;
        if (i == n.names.size())
          return fail(at + ".required", "'" + name.get<std::string>() + "' is not in properties");
        n.required |= uint64_t(1) << i;
      }
    }
    if (auto a = s.find("additionalProperties"); a != s.end()) {
      n.unconstrained = false;
      if (a->is_boolean()) {
        n.additional = a->get<bool>();
      } else {
        auto child = compile(*a, at + ".additionalProperties");
        if (!child.is_ok()) return child.status();
        n.additional_node = *child;
      }
    }
    if (auto i = s.find("items"); i != s.end()) {
      auto child = compile(*i, at + ".items");
      if (!child.is_ok()) return child.status();
      n.items = *child;
      n.unconstrained = false;
    }
    if (auto st = strings(s, n, at); !st.is_ok()) return st;
    if (!n.names.empty() || !n.additional || n.additional_node >= 0) {
      if (!s.contains("type")) n.kinds = JsonSchema::kObject;  // object keywords imply an object
    } else if (n.items >= 0 && !s.contains("type")) {
      n.kinds = JsonSchema::kArray;
    }
    if (!n.kinds) return fail(at, "admits no value");
    return add(std::move(n));
  }

  std::vector<JsonSchema::Node> nodes;
  std::vector<std::shared_ptr<const RegexNfa>> rules;
  std::string error;

 private:
  Result<int32_t> fail(const std::string& at, const std::string& what) {
    return Status::error((at.empty() ? std::string("schema") : at) + ": " + what);
  }
  int32_t add(JsonSchema::Node n) {
    nodes.push_back(std::move(n));
    return int32_t(nodes.size()) - 1;
  }

  // pattern (ECMA-262 semantics: a search unless anchored), format, minLength, maxLength: rules
  // on the decoded text of string values.
  Status strings(const Json& s, JsonSchema::Node& n, const std::string& at) {
    for (const char* key : {"minLength", "maxLength"}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
        return Status::error(at + "." + key + ": must be a non-negative integer");
      const int64_t v = it->get<int64_t>();
      const auto clamped = int32_t(std::min<int64_t>(v, INT32_MAX));
      (std::string(key) == "minLength" ? n.min_length : n.max_length) = clamped;
      n.unconstrained = false;
    }
    if (n.max_length >= 0 && n.min_length > n.max_length)
      return Status::error(at + ": minLength is above maxLength");
    if (auto p = s.find("pattern"); p != s.end()) {
      if (!p->is_string()) return Status::error(at + ".pattern: must be a string");
      auto text = search_pattern(p->get<std::string>());
      if (!text.is_ok()) return Status::error(at + ".pattern: " + text.error());
      auto nfa = RegexNfa::compile(*text);
      if (!nfa.is_ok()) return Status::error(at + ".pattern: " + nfa.error());
      n.string_rules.push_back(int32_t(rules.size()));
      rules.push_back(*nfa);
      n.unconstrained = false;
    }
    if (auto f = s.find("format"); f != s.end()) {
      if (!f->is_string()) return Status::error(at + ".format: must be a string");
      // The formats that have a regular syntax; others stay annotations, as JSON Schema's
      // default (format-annotation) vocabulary has it.
      static const std::map<std::string, std::string> formats = {
          {"date", kDate},
          {"time", kTime},
          {"date-time", std::string(kDate) + "[Tt ]" + kTime},
          {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
          {"email", R"([A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]+)*@[A-Za-z0-9](-*[A-Za-z0-9])*(\.[A-Za-z0-9](-*[A-Za-z0-9])*)+)"},
          {"ipv4", R"(((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))"},
          {"uri", R"([A-Za-z][A-Za-z0-9+.\-]*:[^\s"<>\^`{|}]+)"},
      };
      if (auto it = formats.find(f->get<std::string>()); it != formats.end()) {
        n.string_rules.push_back(int32_t(rules.size()));
        rules.push_back(*RegexNfa::compile(it->second));
        n.unconstrained = false;
      }
    }
    return Status::ok();
  }

  // A JSON Schema pattern matches anywhere unless anchored: wrap it for a full match.
  static Result<std::string> search_pattern(const std::string& p) {
    const bool head = !p.empty() && p[0] == '^';
    size_t slashes = 0;
    while (p.size() >= 2 + slashes && p[p.size() - 2 - slashes] == '\\') ++slashes;
    const bool tail = p.size() > size_t(head) && p.back() == '$' && slashes % 2 == 0;
    const std::string core = p.substr(head ? 1 : 0, p.size() - (head ? 1 : 0) - (tail ? 1 : 0));
    if (head || tail) {  // ^a|b$ anchors each branch apart: refuse rather than misread it
      int depth = 0;
      bool in_class = false;
      for (size_t i = 0; i < core.size(); ++i) {
        const char c = core[i];
        if (c == '\\') ++i;
        else if (in_class) in_class = c != ']';
        else if (c == '[') in_class = true;
        else if (c == '(') ++depth;
        else if (c == ')') --depth;
        else if (c == '|' && depth == 0)
          return Status::error("anchors with a top-level '|' are not supported (group the alternatives)");
      }
    }
    return std::string(head ? "" : "[\\s\\S]*") + "(?:" + core + ")" + (tail ? "" : "[\\s\\S]*");
  }

  Result<uint8_t> type_kinds(const Json& t, const std::string& at) {
    static const std::map<std::string, uint8_t> names = {
        {"object", JsonSchema::kObject},   {"array", JsonSchema::kArray},
        {"string", JsonSchema::kString},   {"number", JsonSchema::kNumber | JsonSchema::kInteger},
        {"integer", JsonSchema::kInteger}, {"boolean", JsonSchema::kBoolean},
        {"null", JsonSchema::kNull}};
    std::vector<Json> list;
    if (t.is_array()) list.assign(t.begin(), t.end());
    else list.push_back(t);
    uint8_t kinds = 0;
    for (const auto& v : list) {
      auto it = v.is_string() ? names.find(v.get<std::string>()) : names.end();
      if (it == names.end()) return Status::error(at + ".type: '" + v.dump() + "' is not a JSON type");
      kinds |= it->second;
    }
    return kinds;
  }

  // anyOf whose alternatives take different JSON types (Optional[X]): one node, each value's
  // first byte picks its alternative.
  Result<int32_t> any_of(const Json& list, const Json& s, const std::string& at) {
    if (!list.is_array() || list.empty()) return fail(at + ".anyOf", "must be a non-empty array");
    for (auto it = s.begin(); it != s.end(); ++it)
      if (it.key() != "anyOf" && !kAnnotations.count(it.key()) && it.key() != "$defs" && it.key() != "definitions")
        return fail(at, "'" + it.key() + "' beside anyOf is not supported");
    JsonSchema::Node merged;
    merged.kinds = 0;
    merged.unconstrained = false;
    for (size_t i = 0; i < list.size(); ++i) {
      auto alt = compile(list[i], at + ".anyOf[" + std::to_string(i) + "]");
      if (!alt.is_ok()) return alt.status();
      const JsonSchema::Node a = nodes[size_t(*alt)];
      if (a.unconstrained) return fail(at + ".anyOf", "an alternative that admits anything is not supported");
      // Numbers: integer and number read alike from the first byte; so do the rest per kind.
      const uint8_t first_kinds = uint8_t(a.kinds & JsonSchema::kInteger ? a.kinds | JsonSchema::kNumber : a.kinds);
      const uint8_t taken = uint8_t(merged.kinds & JsonSchema::kInteger ? merged.kinds | JsonSchema::kNumber : merged.kinds);
      if (first_kinds & taken) return fail(at + ".anyOf", "alternatives must take different JSON types");
      merged.kinds |= a.kinds;
      if (a.kinds & JsonSchema::kObject) {
        merged.names = a.names;
        merged.props = a.props;
        merged.required = a.required;
        merged.additional = a.additional;
        merged.additional_node = a.additional_node;
      }
      if (a.kinds & JsonSchema::kArray) merged.items = a.items;
      if (a.kinds & JsonSchema::kString) {
        merged.string_rules = a.string_rules;
        merged.min_length = a.min_length;
        merged.max_length = a.max_length;
      }
      merged.choices.insert(merged.choices.end(), a.choices.begin(), a.choices.end());
      merged.choice_kinds |= a.choice_kinds;
    }
    return add(std::move(merged));
  }

  Result<int32_t> ref(const Json& r, const Json& s, const std::string& at) {
    for (auto it = s.begin(); it != s.end(); ++it)
      if (it.key() != "$ref" && !kAnnotations.count(it.key()) && it.key() != "$defs" && it.key() != "definitions")
        return fail(at, "'" + it.key() + "' beside $ref is not supported");
    if (!r.is_string()) return fail(at + ".$ref", "must be a string");
    const std::string target = r.get<std::string>();
    std::string section, name;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      if (target.rfind(prefix, 0) == 0) {
        section = std::string(prefix).substr(2, std::string(prefix).size() - 3);
        name = target.substr(std::string(prefix).size());
      }
    }
    if (name.empty() || name.find('/') != std::string::npos)
      return fail(at + ".$ref", "only #/$defs/<name> and #/definitions/<name> are supported");
    auto defs = root_.find(section);
    if (defs == root_.end() || !defs->is_object() || !defs->contains(name))
      return fail(at + ".$ref", "'" + target + "' is not defined");
    if (resolving_.count(target)) return fail(at + ".$ref", "recursive references are not supported");
    if (auto done = resolved_.find(target); done != resolved_.end()) return done->second;
    resolving_.insert(target);
    auto node = compile((*defs)[name], target.substr(2));
    resolving_.erase(target);
    if (node.is_ok()) resolved_[target] = *node;
    return node;
  }

  const Json& root_;
  std::set<std::string> resolving_;
  std::map<std::string, int32_t> resolved_;
};

}  // namespace

Result<std::shared_ptr<const JsonSchema>> JsonSchema::compile(const nlohmann::ordered_json& schema) {
  Compiler c(schema);
  auto root = c.compile(schema, "");
  if (!root.is_ok()) return root.status();
  auto out = std::make_shared<JsonSchema>();
  out->nodes_ = std::move(c.nodes);
  out->rules_ = std::move(c.rules);
  // The root goes first: the recogniser starts at node 0.
  std::swap(out->nodes_[0], out->nodes_[size_t(*root)]);
  for (auto& n : out->nodes_) {
    auto fix = [&](int32_t& i) {
      if (i == 0) i = *root;
      else if (i == *root) i = 0;
    };
    for (auto& p : n.props) fix(p);
    if (n.additional_node >= 0) fix(n.additional_node);
    if (n.items >= 0) fix(n.items);
  }
  JsonSchema::Node& r = out->nodes_[0];
  if (!(r.kinds & kObject)) return Status::error("schema: the root must admit an object");
  r.kinds = kObject;  // a document is an object (OpenAI's rule; the recogniser needs its end)
  r.unconstrained = false;
  return std::shared_ptr<const JsonSchema>(std::move(out));
}

std::shared_ptr<const JsonSchema> JsonSchema::any_object() {
  auto s = std::make_shared<JsonSchema>();
  Node root;
  root.kinds = kObject;
  root.unconstrained = false;
  s->nodes_.push_back(root);
  return s;
}

// ---- the recogniser --------------------------------------------------------------------------

SchemaPrefix::SchemaPrefix(const JsonSchema* schema) : schema_(schema) {
  if (schema_->rules_.empty()) return;
  dfas_ = std::make_shared<std::vector<LazyDfa>>();
  for (const auto& r : schema_->rules_) dfas_->emplace_back(r);
}

void SchemaPrefix::compact() {
  if (!dfas_) return;
  const JsonSchema::Node* n = str_node_ >= 0 ? &schema_->node(str_node_) : nullptr;
  for (size_t r = 0; r < dfas_->size(); ++r) {
    LazyDfa& d = (*dfas_)[r];
    int32_t keep = d.start();
    int slot = -1;
    if (n)
      for (size_t k = 0; k < n->string_rules.size(); ++k)
        if (n->string_rules[k] == int32_t(r)) slot = int(k), keep = str_state_[k];
    const int32_t moved = d.rebase(keep);
    if (slot >= 0) str_state_[slot] = moved;
  }
}

bool SchemaPrefix::emit_byte(uint8_t b) {
  if ((b & 0xC0) != 0x80) {  // a code point begins
    ++str_len_;
    const int32_t most = schema_->node(str_node_).max_length;
    if (most >= 0 && str_len_ > most) return false;
  }
  const auto& rules = schema_->node(str_node_).string_rules;
  for (size_t k = 0; k < rules.size(); ++k) {
    str_state_[k] = (*dfas_)[size_t(rules[k])].next(str_state_[k], b);
    if (str_state_[k] < 0) return false;
  }
  return true;
}

bool SchemaPrefix::step(StringCursor& c, uint8_t b) const {
  const JsonSchema::Node& n = schema_->node(str_node_);
  if ((b & 0xC0) != 0x80 && n.max_length >= 0 && ++c.len > n.max_length) return false;
  for (size_t k = 0; k < n.string_rules.size(); ++k) {
    c.state[k] = (*dfas_)[size_t(n.string_rules[k])].next(c.state[k], b);
    if (c.state[k] < 0) return false;
  }
  return true;
}

bool SchemaPrefix::emit_code_point(uint32_t cp) {
  uint8_t b[4];
  int n = 0;
  if (cp < 0x80) b[n++] = uint8_t(cp);
  else if (cp < 0x800) b[n++] = uint8_t(0xC0 | (cp >> 6)), b[n++] = uint8_t(0x80 | (cp & 0x3F));
  else if (cp < 0x10000)
    b[n++] = uint8_t(0xE0 | (cp >> 12)), b[n++] = uint8_t(0x80 | ((cp >> 6) & 0x3F)), b[n++] = uint8_t(0x80 | (cp & 0x3F));
  else
    b[n++] = uint8_t(0xF0 | (cp >> 18)), b[n++] = uint8_t(0x80 | ((cp >> 12) & 0x3F)),
    b[n++] = uint8_t(0x80 | ((cp >> 6) & 0x3F)), b[n++] = uint8_t(0x80 | (cp & 0x3F));
  for (int k = 0; k < n; ++k)
    if (!emit_byte(b[k])) return false;
  return true;
}

bool SchemaPrefix::string_end() {
  const JsonSchema::Node& n = schema_->node(str_node_);
  if (pending_high_ != 0 || str_len_ < n.min_length) return false;
  for (size_t k = 0; k < n.string_rules.size(); ++k)
    if (!(*dfas_)[size_t(n.string_rules[k])].accepting(str_state_[k])) return false;
  str_node_ = -1;
  return true;
}

bool SchemaPrefix::code_points_viable(uint32_t lo, uint32_t hi) const {
  if (lo > hi) return false;
  const JsonSchema::Node& n = schema_->node(str_node_);
  if (n.max_length >= 0 && str_len_ + 1 > n.max_length) return false;
  // Each rule alone (with pattern and format both, a code point each accepts need not be one).
  for (size_t k = 0; k < n.string_rules.size(); ++k)
    if (!(*dfas_)[size_t(n.string_rules[k])].reaches_any(str_state_[k], lo, hi)) return false;
  return true;
}

bool SchemaPrefix::escape_viable(uint32_t lo, uint32_t hi) const {
  auto supplementary = [](uint32_t high) { return 0x10000 + ((high - 0xD800) << 10); };
  if (pending_high_ != 0) {
    const uint32_t a = std::max<uint32_t>(lo, 0xDC00), b = std::min<uint32_t>(hi, 0xDFFF);
    return a <= b && code_points_viable(supplementary(pending_high_) + a - 0xDC00,
                                        supplementary(pending_high_) + b - 0xDC00);
  }
  if (lo <= 0xD7FF && code_points_viable(lo, std::min<uint32_t>(hi, 0xD7FF))) return true;
  const uint32_t a = std::max<uint32_t>(lo, 0xD800), b = std::min<uint32_t>(hi, 0xDBFF);  // high halves
  if (a <= b && code_points_viable(supplementary(a), supplementary(b) + 0x3FF)) return true;
  return hi >= 0xE000 && code_points_viable(std::max<uint32_t>(lo, 0xE000), hi);
}

bool SchemaPrefix::string_byte(Mode before, uint8_t c) {
  if (before == Mode::kString) {
    if (c == '"') return string_end();
    if (c == '\\') return escape_viable(0, 0xFFFF);  // an escape begins: \uXXXX can write any character
    return pending_high_ == 0 && emit_byte(c);
  }
  if (before == Mode::kEscape) {
    if (c == 'u') {
      esc_cp_ = 0, esc_digits_ = 0;
      return true;  // as viable as the backslash was
    }
    if (pending_high_ != 0) return false;  // a high surrogate's low half must follow
    switch (c) {
      case 'b': return emit_byte(8);
      case 'f': return emit_byte(12);
      case 'n': return emit_byte(10);
      case 'r': return emit_byte(13);
      case 't': return emit_byte(9);
      default: return emit_byte(c);  // '"', '\\', '/' (the syntax refused anything else)
    }
  }
  // Mode::kUnicode: one of four hex digits (the syntax checked it is one).
  esc_cp_ = esc_cp_ * 16 + uint32_t(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
  const int left = 4 - ++esc_digits_;
  if (!escape_viable(esc_cp_ << (4 * left), ((esc_cp_ + 1) << (4 * left)) - 1)) return false;
  if (left > 0) return true;
  uint32_t cp = esc_cp_;
  if (pending_high_ != 0) {
    if (cp < 0xDC00 || cp > 0xDFFF) return false;
    cp = 0x10000 + ((pending_high_ - 0xD800) << 10) + (cp - 0xDC00);
    pending_high_ = 0;
    return emit_code_point(cp);
  }
  if (cp >= 0xD800 && cp <= 0xDBFF) {
    pending_high_ = cp;
    return true;
  }
  if (cp >= 0xDC00 && cp <= 0xDFFF) return false;  // a lone low surrogate is no character
  return emit_code_point(cp);
}

bool SchemaPrefix::key_may_begin(const Frame& f, std::string_view key) const {
  if (f.node < 0) return true;
  const JsonSchema::Node& n = schema_->node(f.node);
  if (n.additional) return true;
  for (size_t i = 0; i < n.names.size(); ++i)
    if (!(f.seen >> i & 1) && n.names[i].compare(0, key.size(), key) == 0) return true;
  return false;
}

bool SchemaPrefix::value_start(uint8_t c) {
  const uint8_t kind = kind_of_first(c);
  int_only_ = false;
  capturing_ = false;
  if (expect_ >= 0) {
    const JsonSchema::Node& n = schema_->node(expect_);
    if (!(n.kinds & kind)) return false;
    if (kind & JsonSchema::kNumber) int_only_ = !(n.kinds & JsonSchema::kNumber);
    if (n.choice_kinds & kind) {
      capturing_ = true;
      capture_node_ = expect_;
      capture_.assign(1, char(c));
      bool any = false;
      for (const auto& ch : n.choices) any = any || ch.compare(0, 1, capture_) == 0;
      if (!any) return false;
    }
  }
  if (c == '"' && expect_ >= 0 && !capturing_ && schema_->node(expect_).string_checked()) {
    str_node_ = expect_;
    str_len_ = 0;
    pending_high_ = 0;
    const JsonSchema::Node& n = schema_->node(expect_);
    for (size_t k = 0; k < n.string_rules.size(); ++k) str_state_[k] = (*dfas_)[size_t(n.string_rules[k])].start();
  }
  if (c == '{' || c == '[') {
    if (depth_ >= kMaxDepth) return false;
    Frame& f = frames_[depth_++];
    f = Frame{-1, -1, 0};
    f.node = expect_ >= 0 && !schema_->node(expect_).unconstrained ? expect_ : -1;
    if (c == '[') expect_ = f.node >= 0 ? schema_->node(f.node).items : -1;
  }
  return true;
}

bool SchemaPrefix::value_end() {
  if (!capturing_) return true;
  capturing_ = false;
  for (const auto& ch : schema_->node(capture_node_).choices)
    if (ch == capture_) return true;
  return false;
}

// A structural byte (outside strings, numbers and literals), with the syntax already past it.
bool SchemaPrefix::structural(Mode before, char container, uint8_t c) {
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r') return true;
  auto close = [&]() {
    const Frame& f = frames_[depth_ - 1];
    if (c == '}' && f.node >= 0 && (schema_->node(f.node).required & ~f.seen) != 0) return false;
    --depth_;
    return true;
  };
  switch (before) {
    case Mode::kStart:
    case Mode::kValue:
      return value_start(c);
    case Mode::kArrayFirst:
      return c == ']' ? close() : value_start(c);
    case Mode::kObjectFirst:
    case Mode::kKey:
      if (c == '}') return close();  // kObjectFirst only: the syntax refuses it after ','
      key_.clear();                  // '"': a key begins
      return key_may_begin(frames_[depth_ - 1], {});
    case Mode::kColon:  // ':'
      expect_ = frames_[depth_ - 1].pending;
      return true;
    case Mode::kAfterValue:
      if (c != ',') return close();
      if (container == '[') {
        const Frame& f = frames_[depth_ - 1];
        expect_ = f.node >= 0 ? schema_->node(f.node).items : -1;
        return true;
      }
      return key_may_begin(frames_[depth_ - 1], {});
    default:
      return true;
  }
}

bool SchemaPrefix::feed(uint8_t c) {
  const Mode before = syntax_.mode();
  const bool was_key = syntax_.in_key(), was_number = syntax_.in_number();
  const bool in_value_string = !was_key && (before == Mode::kString || before == Mode::kEscape || before == Mode::kUnicode);
  const char container = syntax_.container();
  if (!syntax_.feed(c)) return false;
  const Mode after = syntax_.mode();
  // Inside a key: its bytes so far must begin some property name (or any key may come).
  if (was_key) {
    Frame& f = frames_[depth_ - 1];
    if (after == Mode::kColon) {  // the closing quote
      f.pending = -1;
      if (f.node >= 0) {
        const JsonSchema::Node& n = schema_->node(f.node);
        size_t i = 0;
        while (i < n.names.size() && n.names[i] != key_) ++i;
        if (i < n.names.size()) {
          f.seen |= uint64_t(1) << i;
          f.pending = n.props[i];
        } else if (!n.additional) {
          return false;
        } else {
          f.pending = n.additional_node;
        }
      }
      return true;
    }
    key_ += char(c);
    return key_may_begin(f, key_);
  }
  // Inside a scalar: an enum value's bytes must begin one of its texts; an integer has no
  // fraction or exponent.
  if (in_value_string || before == Mode::kLiteral || (was_number && syntax_.in_number())) {
    if (was_number && int_only_ && (c == '.' || c == 'e' || c == 'E')) return false;
    if (in_value_string && str_node_ >= 0 && !string_byte(before, c)) return false;
    if (capturing_) {
      capture_ += char(c);
      bool any = false;
      for (const auto& ch : schema_->node(capture_node_).choices) any = any || ch.compare(0, capture_.size(), capture_) == 0;
      if (!any) return false;
    }
    if (after == Mode::kAfterValue || after == Mode::kDone) return value_end();  // a string or literal ended
    return true;
  }
  if (was_number) {  // the number ended at c, which the syntax read as structure
    if (!value_end()) return false;
    return structural(Mode::kAfterValue, container, c);
  }
  return structural(before, container, c);
}

}  // namespace m3
