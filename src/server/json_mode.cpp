#include "server/json_mode.h"

#include <utility>

namespace m3::server {

JsonObjectConstraint::JsonObjectConstraint(std::shared_ptr<const TokenBytes> table, std::vector<int32_t> end_ids,
                                           Start start, std::shared_ptr<const JsonSchema> schema)
    : ByteConstraint(std::move(table), std::move(end_ids), start), schema_(std::move(schema)), json_(schema_.get()) {}

void JsonObjectConstraint::allow(std::vector<char>& allowed) {
  json_.compact();  // the string rules' DFA caches stay bounded (never during the walk below)
  const TokenBytes& t = table();
  auto feed = [](SchemaPrefix& s, uint8_t b) { return s.feed(b); };
  // Inside a string value every plain content token is accepted without a trial.
  if (json_.in_plain_string()) {
    for (int32_t id : t.plain_string_ids)
      if (size_t(id) < allowed.size()) allowed[size_t(id)] = 1;
    t.not_plain.walk(json_, feed, allowed);
  } else if (json_.in_checked_plain_string()) {
    // Plain tokens only step the string's rules: walk them with the small cursor.
    auto step = [this](SchemaPrefix::StringCursor& c, uint8_t b) { return json_.step(c, b); };
    t.plain.walk(json_.string_cursor(), step, allowed);
    t.not_plain.walk(json_, feed, allowed);
  } else {
    t.all.walk(json_, feed, allowed);
  }
}

}  // namespace m3::server
