// Token-by-token path of the server: ids -> StreamDecoder -> OutputParser, using the small
// BPE (with M3's specials) that the tokenizer goldens fixture trains.
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>

#include "chat/output_parser.h"
#include "tokenizer/tokenizer.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

TEST(StreamIntegration, TokenByTokenEqualsOneShot) {
  const char* env = std::getenv("M3_TOKENIZER_GOLDENS");
  if (env == nullptr || !fs::exists(fs::path(env) / "json_bytelevel" / "tokenizer.json")) {
    GTEST_SKIP() << "tokenizer goldens not generated (fixture unit_tokenizer_goldens_setup)";
  }
  auto tok = Tokenizer::from_dir((fs::path(env) / "json_bytelevel").string());
  ASSERT_TRUE(tok.is_ok()) << tok.error();
  const std::string ns(kNamespaceToken);
  const std::string text =
      "<mm:think>The user wants weather in 東京 😀; call the tool.</mm:think>Sure — checking." + ns +
      "<tool_call>\n" + ns + "<invoke name=\"get_weather\">" + ns + "<city>東京 😀" + ns + "</city>" +
      ns + "<days>2" + ns + "</days>" + ns + "</invoke>\n" + ns + "</tool_call>";
  OutputParserOptions options;
  options.thinking_mode = ThinkingMode::kAdaptive;
  options.call_id_prefix = "call_";
  options.tools = OrderedJson::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])");

  const std::vector<int32_t> ids = (*tok)->encode(text);
  ASSERT_TRUE((*tok)->token_to_id(kNamespaceToken).has_value());
  StreamDecoder decoder(**tok);
  OutputParser parser(options);
  ParsedOutput streamed;
  for (int32_t id : ids) {
    const OutputDelta delta = parser.push(decoder.push(id));
    EXPECT_EQ(delta.content.find(ns), std::string::npos);
    streamed.append(delta);
  }
  streamed.append(parser.push(decoder.flush()));
  streamed.append(parser.finish());

  const ParsedOutput once = OutputParser::parse(text, options);
  EXPECT_EQ(streamed.reasoning_content, "The user wants weather in 東京 😀; call the tool.");
  EXPECT_EQ(streamed.content, "Sure — checking.");
  EXPECT_EQ(streamed.reasoning_content, once.reasoning_content);
  EXPECT_EQ(streamed.content, once.content);
  ASSERT_EQ(streamed.tool_calls.size(), 1u);
  ASSERT_EQ(once.tool_calls.size(), 1u);
  EXPECT_EQ(streamed.tool_calls[0].arguments, R"({"city":"東京 😀","days":2})");
  EXPECT_EQ(streamed.tool_calls[0].arguments, once.tool_calls[0].arguments);
  EXPECT_EQ(streamed.tool_calls[0].id, "call_0");
}

}  // namespace
}  // namespace m3
