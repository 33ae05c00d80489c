// Chat template tests: byte parity with jinja2 rendering the real chat_template.jinja
// (goldens from make_chat_goldens.py at test time), validation errors, template check.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "chat/chat_template.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// First differing line, for readable failures.
std::string first_difference(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  const size_t from = i > 60 ? i - 60 : 0;
  return "at byte " + std::to_string(i) + "\n  got:  ..." + got.substr(from, 140) +
         "\n  want: ..." + want.substr(from, 140);
}

TEST(ChatTemplate, MatchesJinjaGoldens) {
  const char* env = std::getenv("M3_CHAT_GOLDENS");
  if (env == nullptr) GTEST_SKIP() << "M3_CHAT_GOLDENS not set (run through ctest)";
  const fs::path path(env);
  if (fs::exists(path.string() + ".SKIP")) {
    GTEST_SKIP() << "chat goldens were not generated: " << read_text(path.string() + ".SKIP");
  }
  if (!fs::exists(path)) GTEST_SKIP() << "no chat goldens at " << path;
  const OrderedJson goldens = OrderedJson::parse(read_text(path));
  ASSERT_GE(goldens.size(), 30u);
  for (const auto& golden : goldens) {
    SCOPED_TRACE(golden["name"].get<std::string>());
    ChatRenderOptions options;
    const auto& opts = golden["options"];
    options.add_generation_prompt = opts.value("add_generation_prompt", true);
    if (opts.contains("thinking_mode")) {
      auto mode = parse_thinking_mode(opts["thinking_mode"].get<std::string>());
      ASSERT_TRUE(mode.is_ok());
      options.thinking_mode = mode.value();
    }
    if (opts.contains("model_identity")) options.model_identity = opts["model_identity"];
    auto rendered = render_chat(golden["messages"], golden["tools"], options);
    if (golden.contains("error")) {
      EXPECT_FALSE(rendered.is_ok()) << "jinja raised: " << golden["error"];
      continue;
    }
    ASSERT_TRUE(rendered.is_ok()) << rendered.error();
    const std::string want = golden["expected"].get<std::string>();
    EXPECT_EQ(rendered.value(), want) << first_difference(rendered.value(), want);
  }
}

Result<std::string> render(const char* messages, const char* tools = "null") {
  return render_chat(OrderedJson::parse(messages), OrderedJson::parse(tools), ChatRenderOptions{});
}

void expect_error_naming(const Result<std::string>& result, const std::string& field) {
  ASSERT_FALSE(result.is_ok()) << "expected an error naming " << field;
  EXPECT_NE(result.error().find(field), std::string::npos) << result.error();
}

TEST(ChatTemplate, ValidationErrorsNameTheField) {
  expect_error_naming(render(R"([{"role": "user", "content": "a"}, {"role": "wizard"}])"),
                      "messages[1].role");
  expect_error_naming(render(R"([{"content": "a"}])"), "messages[0].role");
  expect_error_naming(render(R"({"role": "user"})"), "messages");
  expect_error_naming(render(R"([{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}])"),
                      "messages[1]");
  expect_error_naming(render(R"([{"role": "user", "content": "a"}])", R"([{"type": "function"}])"),
                      "tools[0].function");
  expect_error_naming(render(R"([{"role": "user", "content": "a"}])",
                             R"([{"type": "function", "function": {"name": "f"}}, {"function": {"name": 3}}])"),
                      "tools[1].function.name");
  expect_error_naming(render(R"([{"role": "user", "content": "a"}])",
                             R"([{"function": {"name": "f", "parameters": "object"}}])"),
                      "tools[0].function.parameters");
  expect_error_naming(render(R"([{"role": "user", "content": "a"}])", R"([{"type": "retrieval", "function": {"name": "f"}}])"),
                      "tools[0].type");
  expect_error_naming(
      render(R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}])"),
      "messages[0].tool_calls[0].function.arguments");
  expect_error_naming(
      render(R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])"),
      "messages[0].tool_calls[0].function.arguments");
  expect_error_naming(render(R"([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}])"),
                      "messages[0].tool_calls[0].function.name");
  expect_error_naming(render(R"([{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}])"),
                      "messages[0].content[0].text");
  EXPECT_TRUE(parse_thinking_mode("enabled").is_ok());
  expect_error_naming(Result<std::string>(parse_thinking_mode("on").status()), "thinking_mode");
}

TEST(ChatTemplate, GenerationPromptFollowsThinkingMode) {
  const auto messages = OrderedJson::parse(R"([{"role": "user", "content": "hi"}])");
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  ChatRenderOptions options;
  EXPECT_TRUE(ends_with(render_chat(messages, nullptr, options).value(), "[e~[\n]~b]ai\n"));
  options.thinking_mode = ThinkingMode::kEnabled;
  EXPECT_TRUE(ends_with(render_chat(messages, nullptr, options).value(), "]~b]ai\n<mm:think>"));
  options.thinking_mode = ThinkingMode::kDisabled;
  EXPECT_TRUE(ends_with(render_chat(messages, nullptr, options).value(), "]~b]ai\n</mm:think>"));
  options.add_generation_prompt = false;
  EXPECT_TRUE(ends_with(render_chat(messages, nullptr, options).value(), "hi[e~[\n"));
}

TEST(ChatTemplate, ContinueFinalMessageLeavesTheLastTurnOpen) {
  ChatRenderOptions options;
  options.add_generation_prompt = false;
  const auto messages = OrderedJson::parse(
      R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the answer is"}])");
  const std::string closed = render_chat(messages, nullptr, options).value();
  options.continue_final_message = true;
  const std::string open = render_chat(messages, nullptr, options).value();
  EXPECT_EQ(open + "[e~[\n", closed);  // the same prompt, the message's end left off
  EXPECT_EQ(open.substr(open.size() - 37), "]~b]ai\n</mm:think>Sure, the answer is");
  const auto reasoned = OrderedJson::parse(
      R"([{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "Think.", "content": ""}])");
  const std::string after_reasoning = render_chat(reasoned, nullptr, options).value();
  EXPECT_EQ(after_reasoning.substr(after_reasoning.size() - 34), "]~b]ai\n<mm:think>Think.</mm:think>");
  // Only an assistant message without tool calls can be continued, and not with a new turn too.
  EXPECT_FALSE(render_chat(OrderedJson::parse(R"([{"role": "user", "content": "hi"}])"), nullptr, options).is_ok());
  const auto call = OrderedJson::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}])");
  EXPECT_FALSE(render_chat(call, nullptr, options).is_ok());
  options.add_generation_prompt = true;
  EXPECT_FALSE(render_chat(messages, nullptr, options).is_ok());
}

TEST(ChatTemplate, PythonJsonDumpsKeepsOrderAndSeparators) {
  const auto value = OrderedJson::parse(
      R"({"z": 1, "a": [1.5, true, null, "x\"y\n\u00e9\u0001"], "m": {}, "e": [], "f": 1e-05, "g": 100.0})");
  EXPECT_EQ(python_json_dumps(value),
            "{\"z\": 1, \"a\": [1.5, true, null, \"x\\\"y\\n\xC3\xA9\\u0001\"], \"m\": {}, \"e\": [], "
            "\"f\": 1e-05, \"g\": 100.0}");
}

TEST(ChatTemplate, CheckModelTemplate) {
  const fs::path dir = fs::temp_directory_path() / "m3_chat_template_check";
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_FALSE(check_chat_template(dir.string()).found);

  const std::string reference = "{{ messages }}\n";
  std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": "{{ messages }}"})";
  auto from_config = check_chat_template(dir.string(), reference);
  EXPECT_TRUE(from_config.found);
  EXPECT_TRUE(from_config.matches) << from_config.message;
  EXPECT_NE(from_config.source.find("tokenizer_config.json"), std::string::npos);

  std::ofstream(dir / "chat_template.jinja") << "{{ other }}";
  auto from_jinja = check_chat_template(dir.string(), reference);
  EXPECT_TRUE(from_jinja.found);
  EXPECT_FALSE(from_jinja.matches);
  EXPECT_NE(from_jinja.message.find("differs"), std::string::npos) << from_jinja.message;
  fs::remove_all(dir);

  const char* shared = std::getenv("M3_SHARED_DIR");
  const fs::path real = shared ? fs::path(shared) / "data" / "minimax-m3" : fs::path();
  if (!shared || !fs::exists(real / "chat_template.jinja")) {
    GTEST_SKIP() << "reference template not found under M3_SHARED_DIR/data/minimax-m3";
  }
  EXPECT_EQ(chat_template_fingerprint(read_text(real / "chat_template.jinja")),
            kReferenceTemplateFingerprint);
  auto check = check_chat_template(real.string());
  EXPECT_TRUE(check.matches) << check.message;
}

}  // namespace
}  // namespace m3
