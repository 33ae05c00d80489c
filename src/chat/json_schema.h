#pragma once
// JSON Schema for structured output (response_format json_schema), compiled to a tree the
// byte-level recogniser SchemaPrefix follows: value types (type, type arrays, anyOf of distinct
// types: Optional[X]), objects (properties, required, additionalProperties), arrays (items),
// enum / const of scalars, and $ref into $defs / definitions. Annotations (title, description,
// default, examples, ...) are ignored; any other keyword is refused by name, so a schema is never
// enforced partially. The recogniser refuses a byte exactly when no valid document can follow,
// so a masked decoder cannot reach a dead end: no key that matches no property, no '}' before
// the required keys, no ',' when no further key may come.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/byte_regex.h"
#include "chat/json_prefix.h"
#include "core/status.h"

namespace m3 {

class JsonSchema {
 public:
  // Value kinds a node admits (bits).
  static constexpr uint8_t kObject = 1, kArray = 2, kString = 4, kNumber = 8, kInteger = 16, kBoolean = 32,
                           kNull = 64, kAnyKind = 127;
  static constexpr int kMaxProperties = 64;

  struct Node {
    uint8_t kinds = kAnyKind;
    bool unconstrained = true;  // {} / true: any value, and anything inside it
    // Objects.
    std::vector<std::string> names;  // each as it appears between the quotes (JSON-escaped)
    std::vector<int32_t> props;      // node of each name
    uint64_t required = 0;           // bit i: names[i]
    bool additional = true;          // other keys allowed ...
    int32_t additional_node = -1;    // ... with this node's values (-1: any)
    // Arrays.
    int32_t items = -1;              // -1: any
    // enum / const: a value of a kind in choice_kinds must be one of these texts exactly.
    std::vector<std::string> choices;
    uint8_t choice_kinds = 0;
    // Strings: pattern / format (indices into rules, each a full match of the decoded text) and
    // minLength / maxLength in code points (-1: no maximum).
    std::vector<int32_t> string_rules;
    int32_t min_length = 0, max_length = -1;
    bool string_checked() const { return !string_rules.empty() || min_length > 0 || max_length >= 0; }
  };
  static constexpr int kMaxStringRules = 2;  // per node: pattern and format

  // An error names the keyword and where it is ("properties.a.pattern: ... not supported").
  static Result<std::shared_ptr<const JsonSchema>> compile(const nlohmann::ordered_json& schema);
  // {"type": "object"}: json_object mode.
  static std::shared_ptr<const JsonSchema> any_object();

  const Node& node(int32_t i) const { return nodes_[size_t(i)]; }
  std::vector<Node> nodes_;  // [0]: the root
  std::vector<std::shared_ptr<const RegexNfa>> rules_;  // string patterns and formats
};

// JsonPrefix plus the schema: feed() refuses a byte that breaks either.
class SchemaPrefix {
 public:
  // `schema` must outlive the recogniser and its copies (copies are how a mask tries a token).
  explicit SchemaPrefix(const JsonSchema* schema);
  // Copies only the open frames: a mask copies the state once per trie node it tries.
  SchemaPrefix(const SchemaPrefix& o) : schema_(o.schema_) { *this = o; }
  SchemaPrefix& operator=(const SchemaPrefix& o) {
    schema_ = o.schema_;
    syntax_ = o.syntax_;
    std::copy(o.frames_, o.frames_ + o.depth_, frames_);
    depth_ = o.depth_;
    expect_ = o.expect_;
    int_only_ = o.int_only_;
    capturing_ = o.capturing_;
    capture_node_ = o.capture_node_;
    capture_ = o.capture_;
    key_ = o.key_;
    dfas_ = o.dfas_;
    str_node_ = o.str_node_;
    str_len_ = o.str_len_;
    std::copy(o.str_state_, o.str_state_ + JsonSchema::kMaxStringRules, str_state_);
    esc_cp_ = o.esc_cp_;
    esc_digits_ = o.esc_digits_;
    pending_high_ = o.pending_high_;
    return *this;
  }
  // Inside a checked string (pattern / format / lengths), where plain bytes only step the
  // rules: a small cursor a mask can advance over plain string tokens without copying the
  // whole recogniser.
  struct StringCursor {
    int32_t state[JsonSchema::kMaxStringRules];
    int32_t len;
  };
  bool in_checked_plain_string() const {
    return str_node_ >= 0 && syntax_.mode() == JsonPrefix::Mode::kString && pending_high_ == 0;
  }
  StringCursor string_cursor() const {
    StringCursor c{};
    std::copy(str_state_, str_state_ + JsonSchema::kMaxStringRules, c.state);
    c.len = str_len_;
    return c;
  }
  // Steps the cursor over a plain string byte (>= 0x20, not '"' or '\\'); false: refused.
  bool step(StringCursor& c, uint8_t b) const;

  // Bounds the string rules' DFA caches (their state ids change): call between masks, never
  // while copies made for a mask are in use.
  void compact();

  bool feed(uint8_t c);
  bool feed(std::string_view bytes) {
    for (char c : bytes)
      if (!feed(uint8_t(c))) return false;
    return true;
  }
  bool complete() const { return syntax_.complete(); }
  // Inside a string that nothing constrains (a value with no enum, or a key where any key may
  // come): every plain string byte is accepted and changes nothing that matters.
  bool in_plain_string() const {
    if (!syntax_.in_string() || capturing_ || str_node_ >= 0) return false;
    if (!syntax_.in_key()) return true;
    const Frame& f = frames_[depth_ - 1];
    return f.node < 0 || schema_->node(f.node).additional;
  }

  static constexpr int kMaxDepth = 32;

 private:
  struct Frame {  // trivial, so that the frames past depth_ are never written when copying
    int32_t node;     // -1: unconstrained
    int32_t pending;  // an object's: the node of the value after the key just read
    uint64_t seen;    // an object's: the properties already given
  };
  bool value_start(uint8_t c);
  bool value_end();  // a scalar value is complete: its enum check
  // Some key beginning with `key` may still come in this object (an unseen property's name, or
  // any with additional properties).
  bool key_may_begin(const Frame& f, std::string_view key) const;
  // A byte outside strings, numbers and literals; before: the syntax's mode ahead of it,
  // container: the innermost container then.
  bool structural(JsonPrefix::Mode before, char container, uint8_t c);
  // A byte inside a checked string value (str_node_): decodes escapes, counts code points and
  // steps the rules' DFAs; the closing quote checks them.
  bool string_byte(JsonPrefix::Mode before, uint8_t c);
  bool emit_byte(uint8_t b);
  bool emit_code_point(uint32_t cp);
  bool string_end();
  // Some \uXXXX value in [lo, hi] (with a pending high surrogate: its low half) could come next:
  // refuses an escape's digit as soon as no completion of it fits the rules.
  bool escape_viable(uint32_t lo, uint32_t hi) const;
  bool code_points_viable(uint32_t lo, uint32_t hi) const;

  const JsonSchema* schema_;
  JsonPrefix syntax_{true};
  Frame frames_[kMaxDepth];
  int depth_ = 0;
  int32_t expect_ = 0;       // node of the next value (-1: any)
  bool int_only_ = false;    // the number being read must be an integer
  bool capturing_ = false;   // the value being read must be one of its node's choices
  int32_t capture_node_ = -1;
  std::string capture_;      // its bytes so far
  std::string key_;          // the key being read (raw bytes between the quotes)
  // A string value with pattern / format / length rules (-1: none being read).
  std::shared_ptr<std::vector<LazyDfa>> dfas_;  // one per schema rule, shared by copies
  int32_t str_node_ = -1;
  int32_t str_len_ = 0;                          // code points so far
  int32_t str_state_[JsonSchema::kMaxStringRules] = {};
  uint32_t esc_cp_ = 0;                          // \uXXXX being read
  uint8_t esc_digits_ = 0;
  uint32_t pending_high_ = 0;                    // a high surrogate waiting for its low half
};

}  // namespace m3
