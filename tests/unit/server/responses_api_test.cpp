// The Responses API: input items → chat messages (the prompt equals the chat request's),
// field errors by their Responses names, the typed event stream and the response object
// from scripted tokens, and the response store.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "chat/chat_template.h"
#include "server/generation.h"
#include "server/responses_api.h"
#include "tokenizer/list_tokenizer.h"

namespace m3::server {
namespace {

constexpr int32_t kEos = 2;
const std::string kNs = "]<]minimax[>[";

// Specials first (id 2 = "[e~[", the EOS), then every byte, then the tool-call tags.
const ListTokenizer& tokenizer() {
  static const ListTokenizer tok = [] {
    std::vector<std::string> items = {"]!p~[", "]~!b[", "[e~[", "<mm:think>", "</mm:think>", "]<]minimax[>["};
    for (int b = 0; b < 256; ++b) items.push_back(std::string(1, char(b)));
    for (const char* s : {"<tool_call>", "</tool_call>", "<invoke name="}) items.push_back(s);
    return ListTokenizer(std::move(items), 6);
  }();
  return tok;
}

std::function<std::string(const char*)> counter_ids() {
  auto n = std::make_shared<int>(0);
  return [n](const char* prefix) { return std::string(prefix) + "id" + std::to_string((*n)++); };
}

ResponsesRequest parse_ok(const std::string& body, const StoredResponse* previous = nullptr) {
  ResponsesRequest out;
  auto err = parse_responses_request(OrderedJson::parse(body), previous, counter_ids(), out);
  EXPECT_FALSE(err) << body << " -> " << (err ? err->message : "");
  return out;
}

ApiError parse_error(const std::string& body) {
  ResponsesRequest out;
  auto err = parse_responses_request(OrderedJson::parse(body), nullptr, counter_ids(), out);
  EXPECT_TRUE(err) << body;
  return err.value_or(ApiError{});
}

std::string render(const ChatRequest& chat) {
  ChatRenderOptions opts;
  opts.thinking_mode = chat.thinking_mode;
  auto prompt = render_chat(chat.messages, chat.tools, opts);
  EXPECT_TRUE(prompt.is_ok()) << (prompt.is_ok() ? "" : prompt.error());
  return prompt.is_ok() ? *prompt : std::string();
}

const char* kWeatherTool =
    R"({"type":"function","name":"get_weather","description":"Weather for a city",
        "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}})";

TEST(ResponsesRequest, TheConversationRendersAsTheSameChatRequest) {
  const std::string body = std::string(R"({"model":"tiny","instructions":"Be brief.","tools":[)") + kWeatherTool + R"(],
    "input":[{"role":"user","content":"Weather in Paris?"},
             {"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"Call the tool."}]},
             {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Checking."}]},
             {"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
             {"type":"function_call_output","call_id":"call_1","output":"18C, sunny"},
             {"type":"message","role":"user","content":[{"type":"input_text","text":"And "},{"type":"input_text","text":"Rome?"}]}],
    "max_output_tokens":50,"temperature":0.5,"reasoning":{"effort":"high"}})";
  ResponsesRequest r = parse_ok(body);
  const OrderedJson chat_body = OrderedJson::parse(R"({"model":"tiny","max_tokens":50,"temperature":0.5,
    "chat_template_kwargs":{"thinking_mode":"enabled"},
    "tools":[{"type":"function","function":{"name":"get_weather","description":"Weather for a city",
       "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],
    "messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Weather in Paris?"},
       {"role":"assistant","content":"Checking.","reasoning_content":"Call the tool.","tool_calls":[{"id":"call_1","type":"function",
        "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
       {"role":"tool","tool_call_id":"call_1","content":"18C, sunny"},{"role":"user","content":"And Rome?"}]})");
  ChatRequest chat;
  ASSERT_FALSE(parse_chat_request(chat_body, chat));
  EXPECT_EQ(render(r.chat), render(chat));
  EXPECT_EQ(r.chat.messages, chat.messages);
  EXPECT_EQ(r.chat.common.max_tokens, 50);
  EXPECT_FLOAT_EQ(r.chat.common.sampling.temperature, 0.5f);
  EXPECT_EQ(r.chat.thinking_mode, ThinkingMode::kEnabled);
  // The store keeps the conversation without the instructions; the items get ids.
  EXPECT_EQ(r.conversation.size(), 4u);
  EXPECT_EQ(r.conversation[0]["role"], "user");
  ASSERT_EQ(r.input_items.size(), 6u);
  std::set<std::string> ids;
  for (const auto& item : r.input_items) ids.insert(item["id"].get<std::string>());
  EXPECT_EQ(ids.size(), 6u);
  EXPECT_EQ(r.input_items[0]["type"], "message");
  EXPECT_EQ(r.input_items[0]["content"][0]["type"], "input_text");
  // The response object repeats the request's own forms.
  EXPECT_EQ(r.echo["instructions"], "Be brief.");
  EXPECT_EQ(r.echo["tools"][0]["name"], "get_weather");
  EXPECT_EQ(r.echo["max_output_tokens"], 50);
  EXPECT_EQ(r.echo["reasoning"]["effort"], "high");
  EXPECT_TRUE(r.store);
  EXPECT_FALSE(r.stream);
}

TEST(ResponsesRequest, FieldsMapToTheChatRequest) {
  ResponsesRequest r = parse_ok(R"({"input":"Hi","reasoning":{"effort":"minimal"},"store":false,"stream":true,
    "text":{"format":{"type":"json_schema","name":"city","schema":{"type":"object","properties":{"name":{"type":"string"}}}}},
    "top_logprobs":3,"include":["message.output_text.logprobs"],"top_k":5,"metadata":{"k":"v"}})");
  EXPECT_EQ(r.chat.messages, OrderedJson::parse(R"([{"role":"user","content":"Hi"}])"));
  EXPECT_EQ(r.chat.thinking_mode, ThinkingMode::kDisabled);
  EXPECT_FALSE(r.store);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.chat.common.json_object);
  ASSERT_TRUE(r.chat.common.json_schema);
  EXPECT_TRUE(r.output_logprobs);
  EXPECT_EQ(r.chat.common.logprobs, 3);
  EXPECT_EQ(r.chat.common.sampling.top_k, 5);  // vLLM's sampling fields pass through
  EXPECT_EQ(r.echo["metadata"]["k"], "v");
  EXPECT_EQ(r.echo["text"]["format"]["type"], "json_schema");

  // tool_choice by name becomes a call pattern, as in chat.
  ResponsesRequest named = parse_ok(std::string(R"({"input":"x","tools":[)") + kWeatherTool +
                                    R"(],"tool_choice":{"type":"function","name":"get_weather"}})");
  EXPECT_EQ(named.chat.tool_choice, ToolChoice::kNamed);
  EXPECT_TRUE(named.chat.common.pattern);
  EXPECT_EQ(named.echo["tool_choice"]["name"], "get_weather");
  // An explicit thinking_mode wins over reasoning.effort.
  ResponsesRequest kw = parse_ok(
      R"({"input":"x","reasoning":{"effort":"high"},"chat_template_kwargs":{"thinking_mode":"adaptive"}})");
  EXPECT_EQ(kw.chat.thinking_mode, ThinkingMode::kAdaptive);
}

TEST(ResponsesRequest, ErrorsNameTheResponsesField) {
  const std::map<std::string, std::string> cases = {
      {R"({"model":"tiny"})", "input"},
      {R"({"input":[]})", "input"},
      {R"({"input":7})", "input"},
      {R"({"input":[{"role":"user","content":[{"type":"input_image","image_url":"http://x"}]}]})",
       "input[0].content[0].type"},
      {R"({"input":[{"role":"robot","content":"x"}]})", "input[0].role"},
      {R"({"input":[{"type":"item_reference","id":"msg_1"}]})", "input[0].type"},
      {R"({"input":[{"type":"function_call","name":"f","arguments":"{}"}]})", "input[0].call_id"},
      {R"({"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
                    {"type":"function_call_output","call_id":"c"}]})", "input[1].output"},
      {R"({"input":[{"content":"no role or type"}]})", "input[0].type"},
      {R"({"input":[{"role":"user","content":"x","id":5}]})", "input[0].id"},
      {R"({"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"not json"}]})", "input[0].arguments"},
      {R"({"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"[1]"}]})", "input[0].arguments"},
      {R"({"input":[{"type":"function_call_output","call_id":"nobody","output":"y"}]})", "input[0].call_id"},
      {R"({"input":"x","tools":[{"type":"web_search"}]})", "tools[0].type"},
      {R"({"input":"x","tools":[{"type":"function"}]})", "tools[0].name"},
      {R"({"input":"x","tool_choice":"required"})", "tool_choice"},
      {R"({"input":"x","tool_choice":{"type":"file_search"}})", "tool_choice.type"},
      {R"({"input":"x","max_output_tokens":"many"})", "max_output_tokens"},
      {R"({"input":"x","max_output_tokens":0})", "max_output_tokens"},
      {R"({"input":"x","temperature":-1})", "temperature"},
      {R"({"input":"x","text":{"format":{"type":"yaml"}}})", "text.format.type"},
      {R"({"input":"x","text":{"format":{"type":"json_schema","name":"n"}}})", "text.format.schema"},
      {R"({"input":"x","reasoning":{"effort":"maximal"}})", "reasoning.effort"},
      {R"({"input":"x","background":true})", "background"},
      {R"({"input":"x","truncation":"auto"})", "truncation"},
      {R"({"input":"x","prompt":{"id":"pmpt_1"}})", "prompt"},
      {R"({"input":"x","instructions":5})", "instructions"},
      {R"({"input":"x","metadata":{"k":1}})", "metadata.k"},
      {R"({"input":"x","include":[3]})", "include[0]"},
      {R"({"input":"x","stream":"yes"})", "stream"},
      {R"({"input":"x","top_logprobs":50})", "top_logprobs"},
  };
  for (const auto& [body, param] : cases) {
    ApiError err = parse_error(body);
    EXPECT_EQ(err.http_status, 400) << body;
    EXPECT_EQ(err.param, param) << body << ": " << err.message;
    EXPECT_EQ(err.message.find("max_tokens"), std::string::npos) << err.message;  // chat names stay hidden
    EXPECT_EQ(err.message.find("response_format"), std::string::npos) << err.message;
  }
}

TEST(ResponsesRequest, PreviousResponseContinuesItsConversation) {
  StoredResponse previous;
  previous.messages = OrderedJson::parse(R"([{"role":"user","content":"Weather in Paris?"}])");
  const OrderedJson output = OrderedJson::parse(R"([
    {"id":"rs_1","type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"Use the tool."}]},
    {"id":"msg_1","type":"message","role":"assistant","status":"completed",
     "content":[{"type":"output_text","text":"Checking.","annotations":[]}]},
    {"id":"fc_1","type":"function_call","call_id":"call_9","name":"get_weather","arguments":"{\"city\":\"Paris\"}"}])");
  for (auto& m : output_as_messages(output)) previous.messages.push_back(m);
  ASSERT_EQ(previous.messages.size(), 2u);
  EXPECT_EQ(previous.messages[1], OrderedJson::parse(R"({"role":"assistant","content":"Checking.",
      "reasoning_content":"Use the tool.","tool_calls":[{"id":"call_9","type":"function",
      "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]})"));
  EXPECT_TRUE(output_as_messages(OrderedJson::array()).empty());

  ResponsesRequest r = parse_ok(std::string(R"({"instructions":"New rules.","previous_response_id":"resp_1","tools":[)") +
                                    kWeatherTool + R"(],"input":[{"type":"function_call_output","call_id":"call_9","output":"18C"}]})",
                                &previous);
  ASSERT_EQ(r.chat.messages.size(), 4u);
  EXPECT_EQ(r.chat.messages[0], OrderedJson::parse(R"({"role":"system","content":"New rules."})"));
  EXPECT_EQ(r.chat.messages[2]["tool_calls"][0]["id"], "call_9");
  EXPECT_EQ(r.chat.messages[3], OrderedJson::parse(R"({"role":"tool","tool_call_id":"call_9","content":"18C"})"));
  EXPECT_EQ(r.conversation.size(), 3u);  // stored without the instructions
  EXPECT_EQ(r.echo["previous_response_id"], "resp_1");
  EXPECT_FALSE(render(r.chat).empty());
}

TEST(ResponseStore, KeepsTheMostRecentlyUsed) {
  ResponseStore store(2);
  auto entry = [](int k) {
    StoredResponse e;
    e.response = OrderedJson{{"k", k}};
    return e;
  };
  store.put("a", entry(1));
  store.put("b", entry(2));
  ASSERT_TRUE(store.get("a"));  // a is now the most recent
  store.put("c", entry(3));     // evicts b
  EXPECT_FALSE(store.get("b"));
  EXPECT_EQ(store.get("a")->response["k"], 1);
  EXPECT_EQ(store.get("c")->response["k"], 3);
  store.put("c", entry(4));  // replaces
  EXPECT_EQ(store.size(), 2u);
  EXPECT_EQ(store.get("c")->response["k"], 4);
  EXPECT_TRUE(store.erase("a"));
  EXPECT_FALSE(store.erase("a"));
  EXPECT_EQ(store.size(), 1u);
  ResponseStore none(0);
  none.put("a", entry(1));
  EXPECT_FALSE(none.get("a"));

  // Bounded by bytes too: big conversations push the oldest out; one larger than the store is not kept.
  auto big = [](char c) {
    StoredResponse e;
    e.messages = OrderedJson::array({OrderedJson{{"role", "user"}, {"content", std::string(400, c)}}});
    return e;
  };
  ResponseStore small(100, 1000);
  small.put("x", big('x'));
  small.put("y", big('y'));
  EXPECT_EQ(small.size(), 2u);
  small.put("z", big('z'));  // three would pass 1000 bytes: x goes
  EXPECT_FALSE(small.get("x"));
  EXPECT_TRUE(small.get("y") && small.get("z"));
  EXPECT_LE(small.bytes(), 1000u);
  StoredResponse huge;
  huge.messages = std::string(2000, 'h');
  small.put("h", huge);
  EXPECT_FALSE(small.get("h"));
  EXPECT_EQ(small.size(), 2u);
  EXPECT_TRUE(small.erase("y"));
  EXPECT_LT(small.bytes(), 500u);
}

TEST(ResponseStore, InputItemPages) {
  OrderedJson items = OrderedJson::array();
  for (int k = 0; k < 5; ++k) {
    std::string id = "i";
    id += std::to_string(k);  // (gcc 12 -Wrestrict misfires on "i" + std::to_string(k))
    items.push_back(OrderedJson{{"id", id}});
  }
  auto ids = [](const OrderedJson& page) {
    std::string out;
    for (const auto& item : page["data"]) out += item["id"].get<std::string>();
    return out;
  };
  OrderedJson page;
  ASSERT_FALSE(input_items_page(items, {}, page));
  EXPECT_EQ(ids(page), "i4i3i2i1i0");  // newest first by default
  EXPECT_EQ(page["first_id"], "i4");
  EXPECT_EQ(page["last_id"], "i0");
  EXPECT_EQ(page["has_more"], false);
  ASSERT_FALSE(input_items_page(items, {"asc", "2", ""}, page));
  EXPECT_EQ(ids(page), "i0i1");
  EXPECT_EQ(page["has_more"], true);
  ASSERT_FALSE(input_items_page(items, {"asc", "2", "i1"}, page));
  EXPECT_EQ(ids(page), "i2i3");
  ASSERT_FALSE(input_items_page(items, {"asc", "2", "i3"}, page));
  EXPECT_EQ(ids(page), "i4");
  EXPECT_EQ(page["has_more"], false);
  ASSERT_FALSE(input_items_page(items, {"desc", "100", "i0"}, page));
  EXPECT_EQ(ids(page), "");
  EXPECT_TRUE(page["first_id"].is_null());
  EXPECT_EQ(input_items_page(items, {"up", "2", ""}, page)->param, "order");
  EXPECT_EQ(input_items_page(items, {"asc", "0", ""}, page)->param, "limit");
  EXPECT_EQ(input_items_page(items, {"asc", "2x", ""}, page)->param, "limit");
  EXPECT_EQ(input_items_page(items, {"asc", "101", ""}, page)->param, "limit");
  EXPECT_EQ(input_items_page(items, {"asc", "2", "nope"}, page)->param, "after");
}

// --- the output side, through Generation with scripted tokens ---

std::vector<TokenOutput> tokens_of(const std::string& text) {
  std::vector<TokenOutput> out;
  for (int32_t id : tokenizer().encode(text, true)) out.push_back(TokenOutput{id, -0.25f, {{id, -0.25f}, {7, -3.0f}}});
  return out;
}

struct Event {
  std::string type;
  OrderedJson data;
};

std::vector<Event> events_of(const std::string& sse) {
  std::vector<Event> out;
  size_t pos = 0;
  while ((pos = sse.find("event: ", pos)) != std::string::npos) {
    const size_t nl = sse.find('\n', pos);
    const size_t data = sse.find("data: ", nl);
    const size_t end = sse.find("\n\n", data);
    out.push_back(Event{sse.substr(pos + 7, nl - pos - 7), OrderedJson::parse(sse.substr(data + 6, end - data - 6))});
    pos = end;
  }
  return out;
}

GenerationSpec responses_spec(bool logprobs, const OrderedJson& tools) {
  GenerationSpec spec;
  spec.chat = true;
  spec.model = "tiny";
  ChoiceOptions opts;
  opts.chat = true;
  opts.stop_token_ids.insert(kEos);
  opts.parser.tools = tools;
  opts.parser.call_id_prefix = "call_t";
  opts.logprobs = logprobs ? 1 : -1;
  spec.choices = {opts};
  spec.choice_prompt = {0};
  spec.prompt_tokens = {9};
  ResponsesShape shape;
  shape.id = "resp_test";
  shape.created_at = 1700000000;
  shape.model = "tiny";
  shape.echo = OrderedJson{{"store", true}, {"tools", OrderedJson::array()}};
  shape.item_seed = "s";
  shape.logprobs = logprobs;
  spec.responses = shape;
  return spec;
}

// Runs `text` (then EOS unless `finish` says otherwise) one token per event; returns the SSE.
std::string run(Generation& gen, const std::string& text, FinishReason finish = FinishReason::kStopToken) {
  gen.bind({1});
  std::vector<RequestId> to_abort;
  auto toks = tokens_of(text);
  if (finish == FinishReason::kStopToken) toks.push_back(TokenOutput{kEos, 0.0f, {}});
  std::string sse = gen.stream_start();
  for (size_t i = 0; i < toks.size(); ++i) {
    RequestEvent ev;
    ev.request_id = 1;
    ev.new_tokens = {toks[i]};
    ev.finished = i + 1 == toks.size();
    ev.finish_reason = ev.finished ? finish : FinishReason::kNone;
    ev.num_prompt_tokens = 9;
    ev.num_cached_prompt_tokens = 3;
    sse += gen.on_events({ev}, to_abort);
  }
  EXPECT_TRUE(gen.done());
  return sse + gen.stream_end();
}

TEST(ResponsesOutput, StreamedItemsFoldIntoTheResponse) {
  const OrderedJson tools = OrderedJson::parse(
      R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"days":{"type":"integer"}}}}}])");
  Generation gen(tokenizer(), responses_spec(false, tools));
  const std::string text = "<mm:think>Need data.</mm:think>Checking." + kNs + "<tool_call>\n" + kNs +
                           "<invoke name=\"get_weather\">" + kNs + "<days>14" + kNs + "</days>" + kNs + "</invoke>\n" +
                           kNs + "</tool_call>";
  const std::string sse = run(gen, text);
  EXPECT_EQ(sse.find("[DONE]"), std::string::npos);
  EXPECT_EQ(sse.find(kNs), std::string::npos);
  const auto events = events_of(sse);
  ASSERT_GE(events.size(), 10u);
  EXPECT_EQ(events.front().type, "response.created");
  EXPECT_EQ(events.front().data["response"]["status"], "in_progress");
  EXPECT_EQ(events[1].type, "response.in_progress");
  EXPECT_EQ(events.back().type, "response.completed");

  // Sequence numbers count up from 0; every item is added, then done, one at a time; the deltas
  // of each item add up to its final text.
  std::map<size_t, std::string> streamed;
  std::vector<std::string> added, done;
  int open = -1;
  for (size_t k = 0; k < events.size(); ++k) {
    const Event& e = events[k];
    EXPECT_EQ(e.data["type"], e.type);
    EXPECT_EQ(e.data["sequence_number"], k);
    if (e.type == "response.output_item.added") {
      EXPECT_EQ(open, -1) << "an item opened before the last one closed";
      open = e.data["output_index"];
      added.push_back(e.data["item"]["type"]);
      EXPECT_EQ(e.data["item"]["status"], "in_progress");
    } else if (e.type == "response.output_item.done") {
      EXPECT_EQ(open, e.data["output_index"].get<int>());
      open = -1;
      done.push_back(e.data["item"]["type"]);
      EXPECT_EQ(e.data["item"]["status"], "completed");
    } else if (e.type.size() > 6 && e.type.compare(e.type.size() - 6, 6, ".delta") == 0) {
      EXPECT_EQ(open, e.data["output_index"].get<int>()) << e.type;
      streamed[e.data["output_index"]] += e.data["delta"].get<std::string>();
    }
  }
  EXPECT_EQ(added, (std::vector<std::string>{"reasoning", "message", "function_call"}));
  EXPECT_EQ(done, added);

  const OrderedJson r = gen.response();
  EXPECT_EQ(events.back().data["response"], r);
  EXPECT_EQ(r["id"], "resp_test");
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["status"], "completed");
  EXPECT_TRUE(r["incomplete_details"].is_null());
  EXPECT_EQ(r["store"], true);  // the request's fields are repeated
  const OrderedJson& out = r["output"];
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0]["content"][0], OrderedJson::parse(R"({"type":"reasoning_text","text":"Need data."})"));
  EXPECT_EQ(out[1]["role"], "assistant");
  EXPECT_EQ(out[1]["content"][0]["type"], "output_text");
  EXPECT_EQ(out[1]["content"][0]["text"], "Checking.");
  EXPECT_EQ(out[2]["name"], "get_weather");
  EXPECT_EQ(out[2]["call_id"], "call_t0");
  EXPECT_EQ(OrderedJson::parse(out[2]["arguments"].get<std::string>()), OrderedJson::parse(R"({"days":14})"));
  EXPECT_EQ(streamed[0], "Need data.");
  EXPECT_EQ(streamed[1], "Checking.");
  EXPECT_EQ(streamed[2], out[2]["arguments"]);
  std::set<std::string> ids;
  for (const auto& item : out) ids.insert(item["id"].get<std::string>());
  EXPECT_EQ(ids.size(), 3u);
  // Usage: 9 prompt tokens (3 cached), every generated token, the reasoning's share.
  const OrderedJson& u = r["usage"];
  EXPECT_EQ(u["input_tokens"], 9);
  EXPECT_EQ(u["input_tokens_details"]["cached_tokens"], 3);
  EXPECT_EQ(u["output_tokens"], int64_t(tokens_of(text).size() + 1));
  EXPECT_EQ(u["output_tokens_details"]["reasoning_tokens"], int64_t(std::string("Need data.").size()));
  EXPECT_EQ(u["total_tokens"], u["input_tokens"].get<int64_t>() + u["output_tokens"].get<int64_t>());
  // The conversation continues with one assistant turn holding all three.
  const OrderedJson next = output_as_messages(out);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0]["reasoning_content"], "Need data.");
  EXPECT_EQ(next[0]["tool_calls"][0]["id"], "call_t0");
}

TEST(ResponsesOutput, MaxOutputTokensLeavesItIncomplete) {
  Generation gen(tokenizer(), responses_spec(false, OrderedJson()));
  const auto events = events_of(run(gen, "Partial answ", FinishReason::kMaxTokens));
  EXPECT_EQ(events.back().type, "response.incomplete");
  const OrderedJson r = gen.response();
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
  ASSERT_EQ(r["output"].size(), 1u);
  EXPECT_EQ(r["output"][0]["status"], "incomplete");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Partial answ");
}

TEST(ResponsesOutput, NothingSaidIsAnEmptyMessageAndAbortFails) {
  Generation empty(tokenizer(), responses_spec(false, OrderedJson()));
  run(empty, "");
  const OrderedJson r = empty.response();
  ASSERT_EQ(r["output"].size(), 1u);
  EXPECT_EQ(r["output"][0]["type"], "message");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "");
  EXPECT_EQ(r["status"], "completed");

  Generation aborted(tokenizer(), responses_spec(false, OrderedJson()));
  const auto events = events_of(run(aborted, "Cut", FinishReason::kAborted));
  EXPECT_EQ(events.back().type, "response.failed");
  EXPECT_EQ(aborted.response()["status"], "failed");
  EXPECT_FALSE(aborted.response()["error"].is_null());
}

TEST(ResponsesOutput, LogprobsCoverTheVisibleTextOnly) {
  Generation gen(tokenizer(), responses_spec(true, OrderedJson()));
  const std::string sse = run(gen, "<mm:think>Hmm.</mm:think>Yes!");
  const OrderedJson r = gen.response();
  const OrderedJson& part = r["output"][1]["content"][0];
  EXPECT_EQ(part["text"], "Yes!");
  ASSERT_EQ(part["logprobs"].size(), 4u);  // one per byte token of "Yes!", none of the reasoning
  std::string tokens;
  for (const auto& lp : part["logprobs"]) {
    tokens += lp["token"].get<std::string>();
    EXPECT_FLOAT_EQ(lp["logprob"].get<float>(), -0.25f);
    EXPECT_EQ(lp["top_logprobs"].size(), 1u);
  }
  EXPECT_EQ(tokens, "Yes!");
  size_t streamed = 0;
  for (const auto& e : events_of(sse))
    if (e.type == "response.output_text.delta") streamed += e.data["logprobs"].size();
  EXPECT_EQ(streamed, 4u);
}

}  // namespace
}  // namespace m3::server
