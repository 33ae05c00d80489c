#include "bench/openai_stream.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "bench/http_client.h"

namespace m3::bench {
namespace {

std::vector<std::string> feed_in_pieces(const std::string& stream, size_t piece) {
  SseParser parser;
  std::vector<std::string> events;
  auto on_event = [&](std::string_view data) { events.emplace_back(data); };
  for (size_t i = 0; i < stream.size(); i += piece) parser.feed(std::string_view(stream).substr(i, piece), on_event);
  parser.finish(on_event);
  return events;
}

const std::string kStream =
    ": keep-alive\n\n"
    "data: {\"choices\":[{\"text\":\"Hel\"}]}\n\n"
    "data: {\"choices\":[{\"text\":\"lo\\n\"}]}\r\n\r\n"
    "event: message\nid: 3\ndata: {\"choices\":[{\"text\":\"!\",\"finish_reason\":\"length\"}]}\n\n"
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,"
    "\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n"
    "data: [DONE]\n\n";

TEST(SseParser, SameEventsForEveryChunking) {
  const std::vector<std::string> whole = feed_in_pieces(kStream, kStream.size());
  ASSERT_EQ(whole.size(), 5u);
  EXPECT_EQ(whole[0], "{\"choices\":[{\"text\":\"Hel\"}]}");
  EXPECT_EQ(whole[1], "{\"choices\":[{\"text\":\"lo\\n\"}]}");
  EXPECT_EQ(whole[4], "[DONE]");
  for (size_t piece = 1; piece <= 17; ++piece) EXPECT_EQ(feed_in_pieces(kStream, piece), whole) << piece;
}

TEST(SseParser, EveryTwoWaySplit) {
  const std::vector<std::string> whole = feed_in_pieces(kStream, kStream.size());
  for (size_t cut = 0; cut <= kStream.size(); ++cut) {
    SseParser parser;
    std::vector<std::string> events;
    auto on_event = [&](std::string_view data) { events.emplace_back(data); };
    parser.feed(std::string_view(kStream).substr(0, cut), on_event);
    parser.feed(std::string_view(kStream).substr(cut), on_event);
    parser.finish(on_event);
    ASSERT_EQ(events, whole) << "cut at " << cut;
  }
}

TEST(SseParser, MultiLineDataAndUnterminatedLastEvent) {
  const auto events = feed_in_pieces("data: a\ndata: b\n\ndata:c", 3);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], "a\nb");
  EXPECT_EQ(events[1], "c");
}

TEST(ResponseChunk, CompletionsTextFinishAndUsage) {
  auto c = parse_response_chunk("{\"choices\":[{\"text\":\"!\",\"finish_reason\":\"length\"}]}", ApiKind::kCompletions);
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->has_text);
  EXPECT_EQ(c->text, "!");
  EXPECT_EQ(c->finish_reason, "length");
  EXPECT_FALSE(c->has_usage);

  c = parse_response_chunk(
      "{\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,"
      "\"prompt_tokens_details\":{\"cached_tokens\":4}}}",
      ApiKind::kCompletions);
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->has_text);
  ASSERT_TRUE(c->has_usage);
  EXPECT_EQ(c->usage.prompt_tokens, 5);
  EXPECT_EQ(c->usage.completion_tokens, 3);
  EXPECT_EQ(c->usage.cached_tokens, 4);

  c = parse_response_chunk("{\"choices\":[{\"text\":\"\"}],\"usage\":null}", ApiKind::kCompletions);
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->has_text);
  EXPECT_FALSE(c->has_usage);
}

TEST(ResponseChunk, ChatDeltaReasoningAndWholeMessage) {
  auto c = parse_response_chunk("{\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}", ApiKind::kChat);
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->has_text);
  c = parse_response_chunk("{\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}", ApiKind::kChat);
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->has_text);
  EXPECT_EQ(c->text, "hm");
  c = parse_response_chunk("{\"choices\":[{\"message\":{\"content\":\"42\"},\"finish_reason\":\"stop\"}]}",
                           ApiKind::kChat);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->text, "42");
  EXPECT_EQ(c->finish_reason, "stop");
}

TEST(ResponseChunk, DoneErrorAndMalformed) {
  auto c = parse_response_chunk("[DONE]", ApiKind::kChat);
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->done);
  c = parse_response_chunk("{\"error\":{\"message\":\"context too long\",\"code\":400}}", ApiKind::kCompletions);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->error, "context too long");
  EXPECT_FALSE(parse_response_chunk("{\"choices\":[", ApiKind::kCompletions));
}

TEST(RequestBody, CompletionsChatAndTokenIds) {
  RequestSpec spec;
  spec.prompt = "hi";
  spec.max_tokens = 8;
  spec.ignore_eos = true;
  RequestOptions opt;
  opt.model = "m";
  auto j = nlohmann::json::parse(build_request_body(spec, opt));
  EXPECT_EQ(j["prompt"], "hi");
  EXPECT_EQ(j["max_tokens"], 8);
  EXPECT_EQ(j["ignore_eos"], true);
  EXPECT_EQ(j["temperature"], 0.0);
  EXPECT_EQ(j["stream"], true);
  EXPECT_EQ(j["stream_options"]["include_usage"], true);
  EXPECT_FALSE(j.contains("stop"));

  spec.prompt_ids = {5, 6, 7};
  j = nlohmann::json::parse(build_request_body(spec, opt));
  EXPECT_EQ(j["prompt"], nlohmann::json({5, 6, 7}));

  opt.api = ApiKind::kChat;
  opt.stream = false;
  spec.temperature = -1;
  spec.messages = {{"user", "q"}, {"assistant", "a"}, {"user", "q2"}};
  j = nlohmann::json::parse(build_request_body(spec, opt));
  EXPECT_FALSE(j.contains("prompt"));
  EXPECT_FALSE(j.contains("temperature"));
  EXPECT_FALSE(j.contains("stream_options"));
  ASSERT_EQ(j["messages"].size(), 3u);
  EXPECT_EQ(j["messages"][1]["role"], "assistant");
}

TEST(Endpoints, ApiKindAndPaths) {
  EXPECT_EQ(*parse_api_kind("completions"), ApiKind::kCompletions);
  EXPECT_EQ(*parse_api_kind("chat"), ApiKind::kChat);
  EXPECT_EQ(*parse_api_kind("/v1/chat/completions"), ApiKind::kChat);
  EXPECT_FALSE(parse_api_kind("embeddings"));
  EXPECT_EQ(endpoint_path("chat"), "/v1/chat/completions");
  EXPECT_EQ(endpoint_path("/x/completions"), "/x/completions");
}

TEST(BaseUrl, SplitsHostAndPrefix) {
  auto b = parse_base_url("http://10.0.0.1:8000");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->scheme_host_port, "http://10.0.0.1:8000");
  EXPECT_EQ(b->path_prefix, "");
  b = parse_base_url("https://host/api/v1/");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->scheme_host_port, "https://host");
  EXPECT_EQ(b->path_prefix, "/api/v1");
  EXPECT_EQ(join_url_path(b->path_prefix, "/v1/completions"), "/api/v1/completions");
  EXPECT_EQ(join_url_path("", "/v1/completions"), "/v1/completions");
  EXPECT_EQ(join_url_path("/api", "metrics"), "/api/metrics");
  EXPECT_FALSE(parse_base_url("localhost:8000"));
  EXPECT_FALSE(parse_base_url("ftp://x"));
  EXPECT_FALSE(parse_base_url("http://"));
}

}  // namespace
}  // namespace m3::bench
