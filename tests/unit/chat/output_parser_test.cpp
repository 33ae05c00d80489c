// Output parser tests: reasoning split, namespaced tool calls -> typed JSON arguments,
// streaming (char-by-char and random chunks) equal to one-shot, no namespace leaks.
#include <random>

#include <gtest/gtest.h>

#include "chat/chat_template.h"
#include "chat/output_parser.h"
#include "tokenizer/utf8.h"

namespace m3 {
namespace {

const std::string kNs(kNamespaceToken);

const OrderedJson& test_tools() {
  static const OrderedJson tools = OrderedJson::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                     "unit": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
      "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
        "score": {"type": "number"}, "safe": {"type": "boolean"},
        "after": {"type": ["string", "null"]}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ids": {"type": "array", "items": {"type": "integer"}},
        "filter": {"type": "object", "properties": {"site": {"type": "string"}, "year": {"type": "integer"},
          "range": {"type": "object", "properties": {"lo": {"type": "number"}, "hi": {"type": "number"}}}}},
        "rows": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "boolean"}}}},
        "anything": {}}}}}
  ])");
  return tools;
}

OutputParserOptions options(ThinkingMode mode) {
  OutputParserOptions o;
  o.thinking_mode = mode;
  o.tools = test_tools();
  o.call_id_prefix = "call_t";
  return o;
}

// Splits `text` into chunks of 1..max_chars code points (never inside a UTF-8 sequence).
std::vector<std::string> chunk(const std::string& text, int max_chars, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::string> chunks;
  size_t pos = 0;
  while (pos < text.size()) {
    const int chars = 1 + static_cast<int>(rng() % max_chars);
    size_t end = pos;
    for (int i = 0; i < chars && end < text.size(); ++i) {
      ++end;
      while (end < text.size() && (static_cast<uint8_t>(text[end]) & 0xC0) == 0x80) ++end;
    }
    chunks.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return chunks;
}

// Token-like pieces: the namespace string and each <...> tag whole, text in words and
// single spaces, the way a BPE with these specials would cut it.
std::vector<std::string> token_like(const std::string& text) {
  std::vector<std::string> pieces;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos + 1;
    if (text.compare(pos, kNs.size(), kNs) == 0) {
      end = pos + kNs.size();
    } else if (text[pos] == '<' && text.find('>', pos) != std::string::npos) {
      end = text.find('>', pos) + 1;
    } else if (text[pos] != ' ') {
      while (end < text.size() && text[end] != ' ' && text[end] != '<' && text[end] != ']') ++end;
    }
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return pieces;
}

ParsedOutput parse_chunked(const std::vector<std::string>& chunks, const OutputParserOptions& o) {
  OutputParser parser(o);
  ParsedOutput parsed;
  for (const auto& c : chunks) {
    const OutputDelta delta = parser.push(c);
    // Nothing visible may carry the namespace string or a piece of it.
    EXPECT_EQ(delta.content.find(kNs), std::string::npos) << "chunk '" << c << "'";
    EXPECT_EQ(delta.reasoning_content.find(kNs), std::string::npos);
    EXPECT_EQ(sanitize_utf8(delta.content), delta.content) << "split UTF-8 in content";
    parsed.append(delta);
  }
  parsed.append(parser.finish());
  return parsed;
}

void expect_same(const ParsedOutput& a, const ParsedOutput& b, const std::string& how) {
  EXPECT_EQ(a.reasoning_content, b.reasoning_content) << how;
  EXPECT_EQ(a.content, b.content) << how;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << how;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].id, b.tool_calls[i].id) << how;
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << how;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << how;
  }
}

// One-shot parse, checked against char-by-char and several random chunkings.
ParsedOutput parse_all_ways(const std::string& text, const OutputParserOptions& o) {
  const ParsedOutput once = OutputParser::parse(text, o);
  expect_same(once, parse_chunked(chunk(text, 1, 0), o), "char by char");
  expect_same(once, parse_chunked(token_like(text), o), "token by token");
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    expect_same(once, parse_chunked(chunk(text, 9, seed), o), "chunked seed " + std::to_string(seed));
  }
  for (const auto& call : once.tool_calls) {
    const auto parsed = OrderedJson::parse(call.arguments, nullptr, false);
    EXPECT_FALSE(parsed.is_discarded()) << "arguments are not JSON: " << call.arguments;
    EXPECT_TRUE(parsed.is_object()) << call.arguments;
  }
  return once;
}

TEST(ReasoningParser, ModesDecideWhereOutputStarts) {
  auto enabled = parse_all_ways("step 1\nstep 2</mm:think>The answer.", options(ThinkingMode::kEnabled));
  EXPECT_EQ(enabled.reasoning_content, "step 1\nstep 2");
  EXPECT_EQ(enabled.content, "The answer.");

  auto unfinished = parse_all_ways("still thinking <mm:thi", options(ThinkingMode::kEnabled));
  EXPECT_EQ(unfinished.reasoning_content, "still thinking <mm:thi");
  EXPECT_EQ(unfinished.content, "");

  auto adaptive_think = parse_all_ways("\n<mm:think>hmm</mm:think>Yes.", options(ThinkingMode::kAdaptive));
  EXPECT_EQ(adaptive_think.reasoning_content, "hmm");
  EXPECT_EQ(adaptive_think.content, "Yes.");

  auto adaptive_plain = parse_all_ways("Just text <b>", options(ThinkingMode::kAdaptive));
  EXPECT_EQ(adaptive_plain.reasoning_content, "");
  EXPECT_EQ(adaptive_plain.content, "Just text <b>");

  auto stray = parse_all_ways("</mm:think>Direct answer.", options(ThinkingMode::kDisabled));
  EXPECT_EQ(stray.reasoning_content, "");
  EXPECT_EQ(stray.content, "Direct answer.");

  auto repeated_open = parse_all_ways("<mm:think>r</mm:think>c", options(ThinkingMode::kEnabled));
  EXPECT_EQ(repeated_open.reasoning_content, "r");
  EXPECT_EQ(repeated_open.content, "c");

  auto long_blanks = parse_all_ways(std::string(300, '\n') + "<mm:think>x</mm:think>y",
                                   options(ThinkingMode::kAdaptive));
  EXPECT_EQ(long_blanks.reasoning_content, "");  // too far from the start to be the opener
  EXPECT_EQ(long_blanks.content, std::string(300, '\n') + "<mm:think>x</mm:think>y");

  OutputParserOptions raw = options(ThinkingMode::kEnabled);
  raw.parse_reasoning = false;
  EXPECT_EQ(OutputParser::parse("a</mm:think>b", raw).content, "a</mm:think>b");
}

TEST(ToolCallParser, TypedArgumentsFromSchema) {
  const std::string text =
      "<mm:think>Need data.</mm:think>Checking." + kNs + "<tool_call>\n" + kNs +
      "<invoke name=\"search\">" + kNs + "<query>m3 \"fast\" \\ serving\n" + kNs + "</query>" + kNs +
      "<limit> 10 " + kNs + "</limit>" + kNs + "<score>2.5e-3" + kNs + "</score>" + kNs +
      "<safe>false" + kNs + "</safe>" + kNs + "<after>null" + kNs + "</after>" + kNs + "<maybe>7" +
      kNs + "</maybe>" + kNs + "<tags>" + kNs + "<item>a" + kNs + "</item>" + kNs + "<item>中文 😀" +
      kNs + "</item>" + kNs + "</tags>" + kNs + "<ids>" + kNs + "<item>1" + kNs + "</item>" + kNs +
      "<item>-2" + kNs + "</item>" + kNs + "</ids>" + kNs + "<filter>" + kNs + "<site>x.org" + kNs +
      "</site>" + kNs + "<year>2026" + kNs + "</year>" + kNs + "<range>" + kNs + "<lo>1" + kNs +
      "</lo>" + kNs + "<hi>2.5" + kNs + "</hi>" + kNs + "</range>" + kNs + "</filter>" + kNs +
      "<rows>" + kNs + "<item>" + kNs + "<k>x" + kNs + "</k>" + kNs + "<v>true" + kNs + "</v>" + kNs +
      "</item>" + kNs + "</rows>" + kNs + "<anything>" + kNs + "<item>u" + kNs + "</item>" + kNs +
      "</anything>" + kNs + "</invoke>\n" + kNs + "<invoke name=\"get_weather\">" + kNs +
      "<city>Paris" + kNs + "</city>" + kNs + "<days>3" + kNs + "</days>" + kNs + "</invoke>\n" + kNs +
      "</tool_call>";
  auto parsed = parse_all_ways(text, options(ThinkingMode::kAdaptive));
  EXPECT_EQ(parsed.reasoning_content, "Need data.");
  EXPECT_EQ(parsed.content, "Checking.");
  ASSERT_EQ(parsed.tool_calls.size(), 2u);
  EXPECT_EQ(parsed.tool_calls[0].id, "call_t0");
  EXPECT_EQ(parsed.tool_calls[0].name, "search");
  EXPECT_EQ(OrderedJson::parse(parsed.tool_calls[0].arguments), OrderedJson::parse(R"({
      "query": "m3 \"fast\" \\ serving\n", "limit": 10, "score": 0.0025, "safe": false,
      "after": null, "maybe": 7, "tags": ["a", "中文 😀"], "ids": [1, -2],
      "filter": {"site": "x.org", "year": 2026, "range": {"lo": 1.0, "hi": 2.5}},
      "rows": [{"k": "x", "v": true}], "anything": ["u"]})"));
  EXPECT_EQ(parsed.tool_calls[1].id, "call_t1");
  EXPECT_EQ(parsed.tool_calls[1].arguments, R"({"city":"Paris","days":3})");
}

TEST(ToolCallParser, ArgumentsStreamIncrementally) {
  OutputParser parser(options(ThinkingMode::kDisabled));
  ParsedOutput so_far;
  so_far.append(parser.push("</mm:think>" + kNs + "<tool_call>\n" + kNs + "<invoke name=\"get_weather\">"));
  ASSERT_EQ(so_far.tool_calls.size(), 1u);  // id and name arrive before any argument
  EXPECT_EQ(so_far.tool_calls[0].name, "get_weather");
  EXPECT_EQ(so_far.tool_calls[0].arguments, "");
  so_far.append(parser.push(kNs + "<city>San Fran"));
  EXPECT_EQ(so_far.tool_calls[0].arguments, R"({"city":"San Fran)");
  so_far.append(parser.push("cisco" + kNs + "</city>" + kNs + "<days>1"));
  EXPECT_EQ(so_far.tool_calls[0].arguments, R"({"city":"San Francisco","days":)");
  const OutputDelta tail = parser.push("4" + kNs + "</days>" + kNs + "</invoke>\n" + kNs + "</tool_call>");
  ASSERT_FALSE(tail.tool_calls.empty());
  EXPECT_TRUE(tail.tool_calls[0].id.empty());  // later deltas carry only fragments
  so_far.append(tail);
  so_far.append(parser.finish());
  EXPECT_EQ(so_far.tool_calls[0].arguments, R"({"city":"San Francisco","days":14})");
  EXPECT_EQ(so_far.content, "");
}

TEST(ToolCallParser, ToolCallOpenedInsideUnfinishedReasoning) {
  const std::string text = "I should look it up " + kNs + "<tool_call>\n" + kNs +
                           "<invoke name=\"get_weather\">" + kNs + "<city>Oslo" + kNs + "</city>" +
                           kNs + "</invoke>\n" + kNs + "</tool_call>";
  auto parsed = parse_all_ways(text, options(ThinkingMode::kEnabled));
  EXPECT_EQ(parsed.reasoning_content, "I should look it up ");
  EXPECT_EQ(parsed.content, "");
  ASSERT_EQ(parsed.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.tool_calls[0].arguments, R"({"city":"Oslo"})");
}

TEST(ToolCallParser, NamespaceNeverLeaks) {
  auto stray = parse_all_ways("a " + kNs + "b ]<]mini c " + kNs, options(ThinkingMode::kAdaptive));
  EXPECT_EQ(stray.content, "a b ]<]mini c ");  // a broken prefix is ordinary text
  auto in_reasoning = parse_all_ways("x" + kNs + "y</mm:think>z", options(ThinkingMode::kEnabled));
  EXPECT_EQ(in_reasoning.reasoning_content, "xy");
  EXPECT_EQ(in_reasoning.content, "z");

  OutputParser parser(options(ThinkingMode::kAdaptive));
  EXPECT_EQ(parser.push("Hello ]<]mini").content, "Hello ");  // held back at the chunk end
  const OutputDelta next = parser.push("max[>[<tool_call>\n");
  EXPECT_EQ(next.content, "");
  EXPECT_TRUE(parser.push(kNs + "<invoke name=\"get_weather\">").content.empty());
  ParsedOutput rest;
  rest.append(parser.push(kNs + "</invoke>" + kNs + "</tool_call>"));
  rest.append(parser.finish());
  ASSERT_EQ(rest.tool_calls.size(), 1u);
  EXPECT_EQ(rest.tool_calls[0].arguments, "{}");
  EXPECT_EQ(rest.content, "");
}

TEST(ToolCallParser, UnknownToolsRawJsonAndTruncation) {
  const std::string unknown = kNs + "<tool_call>" + kNs + "<invoke name=\"mystery\">" + kNs + "<n>5" + kNs +
                              "</n>" + kNs + "<list>" + kNs + "<item>1" + kNs + "</item>" + kNs +
                              "</list>" + kNs + "<obj> " + kNs + "<a>x" + kNs + "</a>" + kNs + "</obj>" +
                              kNs + "<empty>" + kNs + "</empty>" + kNs + "</invoke>" + kNs + "</tool_call>after";
  auto parsed = parse_all_ways(unknown, options(ThinkingMode::kAdaptive));
  ASSERT_EQ(parsed.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.tool_calls[0].name, "mystery");
  EXPECT_EQ(parsed.tool_calls[0].arguments, R"({"n":"5","list":["1"],"obj":{"a":"x"},"empty":""})");
  EXPECT_EQ(parsed.content, "after");

  const std::string raw_json = kNs + "<tool_call>" + kNs + "<invoke name=\"search\">" + kNs +
                               "<tags>[\"a\", \"b\"]" + kNs + "</tags>" + kNs + "<filter>{\"year\": 1}" +
                               kNs + "</filter>" + kNs + "</invoke>" + kNs + "</tool_call>";
  auto raw = parse_all_ways(raw_json, options(ThinkingMode::kAdaptive));
  ASSERT_EQ(raw.tool_calls.size(), 1u);
  EXPECT_EQ(raw.tool_calls[0].arguments, R"({"tags":["a","b"],"filter":{"year":1}})");

  const std::string truncated = kNs + "<tool_call>" + kNs + "<invoke name=\"search\">" + kNs +
                                "<filter>" + kNs + "<site>half a str";
  auto cut = parse_all_ways(truncated, options(ThinkingMode::kAdaptive));
  ASSERT_EQ(cut.tool_calls.size(), 1u);
  EXPECT_EQ(cut.tool_calls[0].arguments, R"({"filter":{"site":"half a str"}})");
}

TEST(ToolCallParser, MissingClosingTagsAreRecovered) {
  const std::string missing_param_close = kNs + "<tool_call>" + kNs + "<invoke name=\"search\">" + kNs +
                                          "<query>a </b> b" + kNs + "<limit>4" + kNs + "</invoke>" + kNs +
                                          "<invoke name=\"get_weather\">" + kNs + "<city>Rome" + kNs +
                                          "</tool_call>tail";
  auto parsed = parse_all_ways(missing_param_close, options(ThinkingMode::kAdaptive));
  ASSERT_EQ(parsed.tool_calls.size(), 2u);
  // "<limit>" sits inside the unterminated string; "</invoke>" still ends the value.
  EXPECT_EQ(OrderedJson::parse(parsed.tool_calls[0].arguments),
            OrderedJson::parse(R"({"query": "a </b> b]<]minimax[>[<limit>4"})"));
  EXPECT_EQ(parsed.tool_calls[1].arguments, R"({"city":"Rome"})");
  EXPECT_EQ(parsed.content, "tail");
}

// Random fragment soup: never hangs or crashes, streaming equals one-shot, arguments are
// always valid JSON objects, and content never carries the namespace string.
TEST(OutputParser, RandomFragmentsKeepInvariants) {
  const std::vector<std::string> fragments = {
      kNs, kNs + "<tool_call>", kNs + "</tool_call>", kNs + "<invoke name=\"search\">",
      kNs + "<invoke name=\"nope\">", kNs + "</invoke>", kNs + "<query>", kNs + "</query>",
      kNs + "<tags>", kNs + "</tags>", kNs + "<item>", kNs + "</item>", kNs + "<filter>",
      kNs + "</filter>", kNs + "<limit>", kNs + "</limit>", "<mm:think>", "</mm:think>", "text",
      " ", "\n", "5", "true", "null", "<", ">", "]", "[", "]<]", "min", "\"", "\\", "é", "😀", "{\"a\": 1}"};
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int length = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < length; ++i) text += fragments[rng() % fragments.size()];
    const auto mode = static_cast<ThinkingMode>(rng() % 3);
    SCOPED_TRACE(text);
    parse_all_ways(text, options(mode));
  }
}

// The renderer's XML for a tool call parses back to the same arguments.
TEST(ToolCallParser, RoundTripsTheTemplateRendering) {
  const OrderedJson arguments = OrderedJson::parse(R"({
      "query": "a <b> & \"c\"\nline", "limit": 3, "score": 0.5, "safe": true, "after": null,
      "tags": ["x", "y z"], "ids": [5, 6], "filter": {"site": "s", "range": {"lo": 1.5, "hi": 2.0}},
      "rows": [{"k": "a", "v": false}, {"k": "b", "v": true}]})");
  OrderedJson messages = OrderedJson::array();
  messages.push_back({{"role", "user"}, {"content", "go"}});
  messages.push_back({{"role", "assistant"}, {"content", "On it."}, {"reasoning_content", "plan"},
                      {"tool_calls", {{{"type", "function"},
                                       {"function", {{"name", "search"}, {"arguments", arguments}}}}}}});
  ChatRenderOptions render_options;
  render_options.add_generation_prompt = false;
  auto rendered = render_chat(messages, test_tools(), render_options);
  ASSERT_TRUE(rendered.is_ok()) << rendered.error();
  const std::string& prompt = rendered.value();
  const size_t begin = prompt.rfind("]~b]ai\n") + 7;
  const std::string reply = prompt.substr(begin, prompt.rfind("[e~[") - begin);
  auto parsed = parse_all_ways(reply, options(ThinkingMode::kAdaptive));
  EXPECT_EQ(parsed.reasoning_content, "plan");
  EXPECT_EQ(parsed.content, "On it.");
  ASSERT_EQ(parsed.tool_calls.size(), 1u);
  OrderedJson expected = arguments;
  expected.erase("after");  // None values are omitted by the template
  EXPECT_EQ(OrderedJson::parse(parsed.tool_calls[0].arguments), expected);
}

}  // namespace
}  // namespace m3
