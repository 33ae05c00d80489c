// chat/json_schema.h: what compiles and what is refused by name; a Pydantic-style schema's
// documents accepted whole and complete, and bad ones refused at the byte where they go wrong;
// and no dead end: from every state a random walk reaches, some byte continues or the document
// is complete, and every completed document satisfies the schema.
#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "chat/json_schema.h"

namespace m3 {
namespace {

using Json = nlohmann::ordered_json;

const char* const kSchema = R"({
  "$defs": {
    "Color": {"enum": ["red", "green"], "type": "string", "title": "Color"},
    "Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "number"}},
              "required": ["x", "y"], "additionalProperties": false}
  },
  "type": "object", "title": "Shape",
  "properties": {
    "name": {"type": "string"},
    "color": {"$ref": "#/$defs/Color"},
    "points": {"type": "array", "items": {"$ref": "#/$defs/Point"}},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
    "ok": {"type": "boolean"},
    "tag": {"const": 7}
  },
  "required": ["name", "color", "points"],
  "additionalProperties": false
})";

std::shared_ptr<const JsonSchema> schema() {
  static auto s = *JsonSchema::compile(Json::parse(kSchema));
  return s;
}

// Accepted bytes, and whether the document completed.
std::pair<size_t, bool> run(const std::string& doc) {
  SchemaPrefix p(schema().get());
  for (size_t i = 0; i < doc.size(); ++i)
    if (!p.feed(uint8_t(doc[i]))) return {i, false};
  return {doc.size(), p.complete()};
}

TEST(JsonSchema, RefusesWhatItDoesNotEnforceByName) {
  struct Case {
    const char* schema;
    const char* says;
  };
  const Case cases[] = {
      {R"({"type": "object", "properties": {"a": {"type": "string", "minimum": 1}}})", "properties.a: 'minimum'"},
      {R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a|b$"}}})", "top-level '|'"},
      {R"j({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}})j",
       "properties.a.pattern: look-around"},
      {R"({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}})", "minLength: must be"},
      {R"({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}})",
       "minLength is above maxLength"},
      {R"({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/A"}}}}})",
       "recursive"},
      {R"({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}})", "different JSON types"},
      {R"({"type": "object", "required": ["a"]})", "'a' is not in properties"},
      {R"({"type": "array"})", "root must admit an object"},
      {R"({"type": "object", "properties": {"a": {"enum": [{"x": 1}]}}})", "enum / const values"},
      {R"({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}})", "is not defined"},
      {R"({"type": "object", "properties": {"a": {"type": "strin"}}})", "not a JSON type"},
      {R"({"type": "object", "properties": {"a": {"type": "string", "enum": [1, 2]}}})", "no enum / const value has"},
      {R"({"type": "object", "oneOf": []})", "'oneOf' is not supported"},
  };
  for (const auto& c : cases) {
    auto r = JsonSchema::compile(Json::parse(c.schema));
    ASSERT_FALSE(r.is_ok()) << c.schema;
    EXPECT_NE(r.error().find(c.says), std::string::npos) << r.error();
  }
  EXPECT_TRUE(JsonSchema::compile(Json::parse(kSchema)).is_ok());
  EXPECT_TRUE(JsonSchema::compile(Json::parse(R"({})")).is_ok());  // any object
}

// pattern (a search unless anchored), format and lengths apply to the decoded text of a string:
// escapes count as the character they stand for, a surrogate pair as one code point.
TEST(JsonSchema, StringRulesFollowTheDecodedText) {
  const auto schema = *JsonSchema::compile(Json::parse(R"({"type": "object", "properties": {
      "code": {"type": "string", "pattern": "^[A-Z]{2}\\d{3}$"},
      "has": {"type": "string", "pattern": "ab"},
      "day": {"type": "string", "format": "date"},
      "at": {"type": ["string", "null"], "format": "date-time"},
      "mail": {"anyOf": [{"type": "string", "format": "email"}, {"type": "null"}]},
      "id": {"type": "string", "format": "uuid"},
      "short": {"type": "string", "minLength": 2, "maxLength": 3},
      "free": {"type": "string", "format": "not-a-known-format"}}})"));
  auto whole = [&](const std::string& doc) {
    SchemaPrefix p(schema.get());
    return p.feed(std::string_view(doc)) && p.complete();
  };
  auto prefix = [&](const std::string& doc) {
    SchemaPrefix p(schema.get());
    return p.feed(std::string_view(doc));
  };
  for (const char* ok : {R"({"code": "AB123"})", R"({"code": "A\u0042123"})", R"({"has": "xxabyy"})", R"({"has": "ab"})",
                         R"({"day": "2026-12-05"})", R"({"at": "2026-12-05T10:45:00.5+01:00"})", R"({"at": null})",
                         R"({"mail": "edmond.dantes@chateau-if.fr"})", R"({"mail": null})",
                         R"({"id": "123e4567-e89b-12d3-a456-426614174000"})", R"({"short": "ab"})",
                         R"({"short": "\u00e9t\u00e9"})", R"({"short": "\ud83d\ude00x"})", R"({"short": "\n\t"})",
                         R"({"free": "anything"})"})
    EXPECT_TRUE(whole(ok)) << ok;
  for (const char* bad : {R"({"code": "AB1234"})", R"({"code": "ab123"})", R"({"has": "a b"})", R"({"day": "2026-13-05"})",
                          R"({"at": "2026-12-05"})", R"({"mail": "no-at-sign"})", R"({"id": "123e4567"})",
                          R"({"short": "a"})", R"({"short": "abcd"})", R"({"short": "\ude00x"})"})
    EXPECT_FALSE(whole(bad)) << bad;
  // Refused at the byte where no valid text can follow, not only at the end.
  EXPECT_FALSE(prefix(R"({"code": "A1)"));
  EXPECT_FALSE(prefix(R"({"code": "AB1234)"));
  EXPECT_FALSE(prefix(R"({"short": "abcd)"));
  EXPECT_FALSE(prefix(R"({"day": "2026-1x)"));
  EXPECT_TRUE(prefix(R"({"day": "2026-1)"));
  EXPECT_FALSE(prefix(R"({"short": "a")"));  // too short to close
  SchemaPrefix in(schema.get());
  ASSERT_TRUE(in.feed(std::string_view(R"({"code": "A)")));
  EXPECT_FALSE(in.in_plain_string());  // a checked string takes no shortcut in the mask
  SchemaPrefix free(schema.get());
  ASSERT_TRUE(free.feed(std::string_view(R"({"free": "a)")));
  EXPECT_TRUE(free.in_plain_string());
}

// A random byte walk through the schema's documents: each step takes one byte the recogniser
// accepts (ASCII and no padding when there is a choice, structure half of the time so walks
// end); fails on a dead end. Returns the document, complete or not after max_steps.
std::string random_document(const JsonSchema& schema, std::mt19937& rng, int max_steps, bool* complete) {
  SchemaPrefix p(&schema);
  std::string doc;
  for (int step = 0; step < max_steps && !p.complete(); ++step) {
    std::vector<uint8_t> ok;
    for (int b = 0; b < 256; ++b) {
      SchemaPrefix t = p;
      if (t.feed(uint8_t(b))) ok.push_back(uint8_t(b));
    }
    EXPECT_FALSE(ok.empty()) << "dead end after: " << doc;
    if (ok.empty()) break;
    std::vector<uint8_t> pick;
    for (uint8_t b : ok)
      if (b != ' ' && b != '\n' && b != '\t' && b != '\r' && b < 0x80) pick.push_back(b);
    if (pick.empty()) pick = ok;
    std::vector<uint8_t> structure;  // brackets, commas, quotes: documents that end
    for (uint8_t x : pick)
      if (x == '{' || x == '}' || x == '[' || x == ']' || x == ',' || x == '"' || x == ':') structure.push_back(x);
    uint8_t b = !structure.empty() && rng() % 2 ? structure[rng() % structure.size()] : pick[rng() % pick.size()];
    if (std::find(ok.begin(), ok.end(), '"') != ok.end() && rng() % 3 == 0) b = '"';
    EXPECT_TRUE(p.feed(b));
    doc += char(b);
  }
  *complete = p.complete();
  return doc;
}

// Random byte walks through string rules never meet a dead end and always end valid.
TEST(JsonSchema, StringRulesLeaveNoDeadEnds) {
  const auto schema = *JsonSchema::compile(Json::parse(R"({"type": "object", "properties": {
      "code": {"type": "string", "pattern": "^[A-C]{2}\\d{1,3}$"}, "day": {"type": "string", "format": "date"},
      "short": {"type": "string", "minLength": 2, "maxLength": 3}}, "required": ["code", "day", "short"],
      "additionalProperties": false})"));
  const std::regex code("[A-C]{2}[0-9]{1,3}"), day("[0-9]{4}-[0-9]{2}-[0-9]{2}");
  std::mt19937 rng(3);
  int completed = 0;
  for (int walk = 0; walk < 200; ++walk) {
    bool complete = false;
    const std::string doc = random_document(*schema, rng, 400, &complete);
    ASSERT_FALSE(HasFailure()) << doc;
    if (!complete) continue;
    ++completed;
    const Json d = Json::parse(doc);
    EXPECT_TRUE(std::regex_match(d["code"].get<std::string>(), code)) << doc;
    EXPECT_TRUE(std::regex_match(d["day"].get<std::string>(), day)) << doc;
    EXPECT_GE(d["short"].get<std::string>().size(), 2u) << doc;
  }
  EXPECT_GT(completed, 50);
}

TEST(JsonSchema, AcceptsValidDocumentsInAnyPropertyOrder) {
  for (const char* doc : {
           R"({"name": "a", "color": "red", "points": [{"x": 1, "y": 2.5}, {"y": -3e2, "x": 0}], "note": null, "ok": true, "tag": 7})",
           R"({"points": [], "color": "green", "name": ""})",
           "{\n  \"name\": \"\\\"q\\\"\",\n  \"color\": \"red\",\n  \"points\": [ ],\n  \"note\": \"n\"\n}",
       }) {
    ASSERT_TRUE(nlohmann::json::accept(doc)) << doc;
    EXPECT_EQ(run(doc), std::make_pair(std::string(doc).size(), true)) << doc;
  }
}

TEST(JsonSchema, RefusesTheByteWhereADocumentLeavesTheSchema) {
  struct Case {
    std::string doc;
    std::string bad;  // the accepted prefix; the next byte is refused
  };
  const std::vector<Case> cases = {
      {R"({"name": 1)", R"({"name": )"},
      {R"({"colour")", R"({"colo)"},
      {R"({"name": "a"})", R"({"name": "a")"},  // '}' before color and points
      {R"({"color": "blue")", R"({"color": ")"},
      {R"({"color": "re")", R"({"color": "re)"},
      {R"({"points": [{"x": 1.5)", R"({"points": [{"x": 1)"},
      {R"({"points": [{"x": 1, "y": 2, "z")", R"({"points": [{"x": 1, "y": 2)"},  // no key may follow
      {R"({"points": [{"x": 1}])", R"({"points": [{"x": 1)"},  // y is required
      {R"({"name":"a","color":"red","points":[],"note":null,"ok":true,"tag":7,)", R"({"name":"a","color":"red","points":[],"note":null,"ok":true,"tag":7)"},
      {R"({"note": 5)", R"({"note": )"},
      {R"({"name":"a","name")", R"({"name":"a","n)"},  // a key given once
      {R"({"tag": 70)", R"({"tag": 7)"},
      {R"({"ok": nul)", R"({"ok": )"},
      {R"({"points": {)", R"({"points": )"},
  };
  for (const auto& c : cases) {
    ASSERT_EQ(c.doc.compare(0, c.bad.size(), c.bad), 0) << c.doc;
    EXPECT_EQ(run(c.doc).first, c.bad.size()) << c.doc;
  }
}

// The walk's documents, checked against the schema by hand.
bool satisfies(const Json& d) {
  if (!d.is_object()) return false;
  const std::set<std::string> known = {"name", "color", "points", "note", "ok", "tag"};
  for (auto it = d.begin(); it != d.end(); ++it)
    if (!known.count(it.key())) return false;
  if (!d.contains("name") || !d.contains("color") || !d.contains("points")) return false;
  if (!d["name"].is_string()) return false;
  if (d["color"] != "red" && d["color"] != "green") return false;
  if (!d["points"].is_array()) return false;
  for (const auto& p : d["points"]) {
    if (!p.is_object() || p.size() != 2 || !p.contains("x") || !p.contains("y")) return false;
    if (!p["x"].is_number_integer() || !p["y"].is_number()) return false;
  }
  if (d.contains("note") && !d["note"].is_string() && !d["note"].is_null()) return false;
  if (d.contains("ok") && !d["ok"].is_boolean()) return false;
  if (d.contains("tag") && d["tag"] != 7) return false;
  return true;
}

TEST(JsonSchema, RandomWalksNeverDeadEndAndCompleteValid) {
  std::mt19937 rng(17);
  int completed = 0;
  for (int walk = 0; walk < 400; ++walk) {
    bool complete = false;
    const std::string doc = random_document(*schema(), rng, 600, &complete);
    ASSERT_FALSE(HasFailure()) << doc;
    if (!complete) continue;
    ++completed;
    Json d;
    try {
      d = Json::parse(doc);
    } catch (const nlohmann::json::out_of_range&) {  // a number past double's range: valid JSON all the same
      continue;
    } catch (const std::exception& e) {
      FAIL() << e.what() << ": " << doc;
    }
    EXPECT_TRUE(satisfies(d)) << doc;
  }
  EXPECT_GT(completed, 50);
}

}  // namespace
}  // namespace m3
