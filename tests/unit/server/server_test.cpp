// Server response assembly with scripted token streams (stop strings, EOS, UTF-8, streamed
// tool-call arguments, usage, logprobs), request validation, and Prometheus rendering.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "server/async_engine.h"
#include "server/generation.h"
#include "server/json_mode.h"
#include "server/pattern_mode.h"
#include "tokenizer/list_tokenizer.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "server/stats_logger.h"
#include "scripted_engine.h"

namespace m3::server {
namespace {

const std::vector<std::string> kSpecials = {"]!p~[", "]~!b[", "[e~[", "<mm:think>", "</mm:think>", "]<]minimax[>["};
const std::vector<std::string> kAdded = {"<tool_call>", "</tool_call>", "<invoke name=", "</invoke>"};
constexpr int32_t kEos = 2;

// GPT-2's byte → printable code point map, as UTF-8.
std::string byte_symbol(int b) {
  std::vector<int> bs;
  for (int c = '!'; c <= '~'; ++c) bs.push_back(c);
  for (int c = 0xA1; c <= 0xAC; ++c) bs.push_back(c);
  for (int c = 0xAE; c <= 0xFF; ++c) bs.push_back(c);
  int cp = -1, extra = 0;
  for (int x = 0; x < 256; ++x) {
    bool direct = std::find(bs.begin(), bs.end(), x) != bs.end();
    int mapped = direct ? x : 256 + extra++;
    if (x == b) cp = mapped;
  }
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  }
  return out;
}

// A byte-level BPE with no merges: one token per byte, plus the M3 specials.
const Tokenizer& test_tokenizer() {
  static std::unique_ptr<Tokenizer> tok = [] {
    OrderedJson vocab = OrderedJson::object(), added = OrderedJson::array();
    int32_t id = 0;
    for (const auto& s : kSpecials) {
      vocab[s] = id;
      added.push_back(OrderedJson{{"id", id++}, {"content", s}, {"special", true}, {"normalized", false}});
    }
    for (int b = 0; b < 256; ++b) vocab[byte_symbol(b)] = id++;
    for (const auto& s : kAdded) {
      vocab[s] = id;
      added.push_back(OrderedJson{{"id", id++}, {"content", s}, {"special", false}, {"normalized", false}});
    }
    OrderedJson root = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", OrderedJson::array()}}},
                        {"added_tokens", added},
                        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                        {"decoder", {{"type", "ByteLevel"}}}};
    const auto path = std::filesystem::temp_directory_path() / ("m3_server_test_tok_" + std::to_string(::getpid()) + ".json");
    std::ofstream(path) << root.dump();
    auto t = Tokenizer::from_tokenizer_json(path.string());
    std::filesystem::remove(path);
    if (!t) throw std::runtime_error(t.error());
    return std::move(*t);
  }();
  return *tok;
}

std::vector<TokenOutput> tokens_of(const std::string& text) {
  std::vector<TokenOutput> out;
  for (int32_t id : test_tokenizer().encode(text, true)) out.push_back(TokenOutput{id, -0.5f, {{id, -0.5f}, {3, -2.0f}}});
  return out;
}

RequestEvent event(RequestId id, std::vector<TokenOutput> tokens, FinishReason finish = FinishReason::kNone) {
  RequestEvent ev;
  ev.request_id = id;
  ev.new_tokens = std::move(tokens);
  ev.finished = finish != FinishReason::kNone;
  ev.finish_reason = finish;
  ev.num_prompt_tokens = 7;
  ev.num_cached_prompt_tokens = 4;
  return ev;
}

GenerationSpec spec_for(bool chat, int n = 1, ChoiceOptions opts = {}) {
  GenerationSpec spec;
  spec.chat = chat;
  spec.response_id = chat ? "chatcmpl-test" : "cmpl-test";
  spec.model = "tiny";
  opts.chat = chat;
  opts.stop_token_ids.insert(kEos);
  for (int i = 0; i < n; ++i) {
    spec.choices.push_back(opts);
    spec.choice_prompt.push_back(0);
  }
  spec.prompt_tokens = {7};
  return spec;
}

// Parses an SSE body into its JSON chunks (ignoring [DONE]).
std::vector<OrderedJson> chunks_of(const std::string& sse) {
  std::vector<OrderedJson> out;
  size_t pos = 0;
  while ((pos = sse.find("data: ", pos)) != std::string::npos) {
    size_t end = sse.find("\n\n", pos);
    std::string payload = sse.substr(pos + 6, end - pos - 6);
    if (payload != "[DONE]") out.push_back(OrderedJson::parse(payload));
    pos = end;
  }
  return out;
}

// Feeds tokens one event each; returns the SSE text.
std::string feed_one_by_one(Generation& gen, RequestId id, const std::vector<TokenOutput>& toks, FinishReason last,
                            std::vector<RequestId>& to_abort) {
  std::string sse = gen.stream_start();
  for (size_t i = 0; i < toks.size() && !gen.done(); ++i)
    sse += gen.on_events({event(id, {toks[i]}, i + 1 == toks.size() ? last : FinishReason::kNone)}, to_abort);
  if (gen.done()) sse += gen.stream_end();
  return sse;
}

TEST(ChoiceAssembler, StopStringSpanningTokensIsCutAndAborts) {
  ChoiceOptions opts;
  opts.stop = {"END"};
  Generation gen(test_tokenizer(), spec_for(false, 1, opts));
  gen.bind({9});
  std::vector<RequestId> to_abort;
  std::string sse = feed_one_by_one(gen, 9, tokens_of("Hello, wor\xc3\xa9ld ENDING more"), FinishReason::kMaxTokens,
                                    to_abort);
  ASSERT_TRUE(gen.done());
  EXPECT_EQ(to_abort, std::vector<RequestId>{9});
  std::string streamed;
  std::string finish;
  for (const auto& c : chunks_of(sse)) {
    streamed += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(streamed, "Hello, wor\xc3\xa9ld ");
  EXPECT_EQ(finish, "stop");
  EXPECT_EQ(gen.response()["choices"][0]["text"], "Hello, wor\xc3\xa9ld ");
  EXPECT_EQ(gen.response()["choices"][0]["finish_reason"], "stop");
  // The abort event that follows is ignored.
  EXPECT_TRUE(gen.on_events({event(9, {}, FinishReason::kAborted)}, to_abort).empty());
}

// Speculative decoding delivers several tokens per event: a stop string inside the event cuts
// the text there, and the tokens after it are neither counted nor given logprobs.
TEST(ChoiceAssembler, StopStringInsideAMultiTokenEventDropsTheTokensAfterIt) {
  ChoiceOptions opts;
  opts.stop = {"xy"};
  opts.logprobs = 0;
  Generation gen(test_tokenizer(), spec_for(false, 1, opts));
  gen.bind({4});
  std::vector<RequestId> to_abort;
  std::vector<TokenOutput> toks = tokens_of("abxycd");
  gen.on_events({event(4, toks, FinishReason::kNone)}, to_abort);
  ASSERT_TRUE(gen.done());
  EXPECT_EQ(to_abort, std::vector<RequestId>{4});
  const auto body = gen.response();
  EXPECT_EQ(body["choices"][0]["text"], "ab");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["usage"]["completion_tokens"], 4);  // a, b, x, y: not c, d
  EXPECT_EQ(body["choices"][0]["logprobs"]["tokens"].size(), 4u);
}

TEST(ChoiceAssembler, StopStringsCountOnlyPastTheFirstMinTokens) {
  // One token per character: "abxa" are the first four tokens, so with min_tokens 4 the "ab" at 0
  // does not count and the one at 3 (ending in the fifth token) does.
  for (int min_tokens : {0, 4, 8}) {
    ChoiceOptions opts;
    opts.stop = {"ab"};
    opts.min_tokens = min_tokens;
    Generation gen(test_tokenizer(), spec_for(false, 1, opts));
    gen.bind({3});
    std::vector<RequestId> to_abort;
    feed_one_by_one(gen, 3, tokens_of("abxabyab"), FinishReason::kMaxTokens, to_abort);
    const auto body = gen.response();
    const char* want = min_tokens == 0 ? "" : min_tokens == 4 ? "abx" : "abxabyab";
    EXPECT_EQ(body["choices"][0]["text"], want) << "min_tokens " << min_tokens;
    EXPECT_EQ(body["choices"][0]["finish_reason"], min_tokens == 8 ? "length" : "stop");
  }
}

TEST(ChoiceAssembler, IncludeStopStrKeepsTheMatchedString) {
  for (bool include : {false, true}) {
    ChoiceOptions opts;
    opts.stop = {"xyz", "END"};
    opts.include_stop_str = include;
    Generation gen(test_tokenizer(), spec_for(false, 1, opts));
    gen.bind({4});
    std::vector<RequestId> to_abort;
    feed_one_by_one(gen, 4, tokens_of("one END two xyz"), FinishReason::kMaxTokens, to_abort);
    EXPECT_EQ(gen.response()["choices"][0]["text"], include ? "one END" : "one ");
    EXPECT_EQ(gen.response()["choices"][0]["finish_reason"], "stop");
  }
}

// Echo and prompt logprobs: the prompt's entries come over two events (a non-final prefill chunk,
// then the last one with the first token); the stream sends the prompt chunk once, before the
// first token's, and the whole body holds the same.
TEST(Generation, EchoAndPromptLogprobsInBothForms) {
  const std::vector<int32_t> ids = test_tokenizer().encode("abc", true);
  ASSERT_EQ(ids.size(), 3u);
  auto lp = [&](int32_t pos, float v) {
    return PromptLogprob{pos, ids[size_t(pos)], v, 2, {{ids[0], -0.1f}, {ids[size_t(pos)], v}}};
  };
  for (bool stream : {false, true}) {
    ChoiceOptions opts;
    opts.echo = true;
    opts.logprobs = 1;
    opts.prompt_logprobs = 2;
    opts.prompt_ids = ids;
    opts.prompt_text = "abc";
    Generation gen(test_tokenizer(), spec_for(false, 1, opts));
    gen.bind({5});
    std::vector<RequestId> to_abort;
    RequestEvent first = event(5, {});
    first.prompt_logprobs = {lp(1, -1.5f)};
    RequestEvent second = event(5, tokens_of("X"));
    second.prompt_logprobs = {lp(2, -2.5f)};
    std::string sse = gen.stream_start();
    sse += gen.on_events({first}, to_abort);
    EXPECT_TRUE(sse.empty()) << "nothing before the prompt is whole";
    sse += gen.on_events({second}, to_abort);
    sse += gen.on_events({event(5, tokens_of("Y"), FinishReason::kMaxTokens)}, to_abort);
    ASSERT_TRUE(gen.done());
    if (stream) {
      const auto chunks = chunks_of(sse);
      ASSERT_GE(chunks.size(), 3u);
      const auto& c0 = chunks[0]["choices"][0];
      EXPECT_EQ(c0["text"], "abc");
      EXPECT_EQ(c0["logprobs"]["token_logprobs"], OrderedJson::parse("[null, -1.5, -2.5]"));
      EXPECT_EQ(c0["logprobs"]["text_offset"], OrderedJson::parse("[0, 1, 2]"));
      EXPECT_TRUE(c0["prompt_logprobs"][0].is_null());
      EXPECT_EQ(c0["prompt_logprobs"][2][std::to_string(ids[2])]["logprob"], -2.5);
      EXPECT_EQ(c0["prompt_logprobs"][2][std::to_string(ids[2])]["rank"], 2);
      EXPECT_EQ(c0["prompt_logprobs"][2][std::to_string(ids[0])]["rank"], 1);
      EXPECT_EQ(chunks[1]["choices"][0]["text"], "X");
      EXPECT_EQ(chunks[1]["choices"][0]["logprobs"]["text_offset"], OrderedJson::parse("[3]"));
      size_t prompt_chunks = 0;
      for (const auto& c : chunks) prompt_chunks += c["choices"][0].contains("prompt_logprobs");
      EXPECT_EQ(prompt_chunks, 1u);
    } else {
      const auto body = gen.response();
      const auto& c = body["choices"][0];
      EXPECT_EQ(c["text"], "abcXY");
      EXPECT_EQ(c["logprobs"]["tokens"], OrderedJson::parse(R"(["a", "b", "c", "X", "Y"])"));
      EXPECT_EQ(c["logprobs"]["token_logprobs"], OrderedJson::parse("[null, -1.5, -2.5, -0.5, -0.5]"));
      EXPECT_TRUE(c["logprobs"]["top_logprobs"][0].is_null());
      EXPECT_EQ(c["logprobs"]["text_offset"], OrderedJson::parse("[0, 1, 2, 3, 4]"));
      EXPECT_EQ(c["prompt_logprobs"].size(), 3u);
      EXPECT_EQ(body["usage"]["completion_tokens"], 2);
    }
  }
}

// JSON mode on the byte-level test tokenizer: the "model" always prefers byte 0x01 (never valid
// JSON), then EOS, then the next byte of a scripted document; the constraint must leave exactly
// the script's byte each step, and only EOS once the object has closed.
TEST(JsonObjectConstraint, LeavesOnlyValidJsonThenTheEnd) {
  const Tokenizer& tok = test_tokenizer();
  const auto table = std::make_shared<const TokenBytes>(tok);
  const int32_t think_begin = *tok.token_to_id("<mm:think>");
  ASSERT_EQ(table->think_begin, think_begin);
  const std::string doc = "{\"a\": [1, 2.5e3, true, null], \"b\": {\"c\": \"x\\\"y\"}}";
  JsonObjectConstraint c(table, {kEos}, JsonObjectConstraint::Start::kMayReason);
  const int64_t vocab = tok.vocab_size();
  auto byte_id = [&](char ch) { return tok.encode(std::string(1, ch), false).at(0); };
  std::vector<int32_t> out;
  for (size_t i = 0; i <= doc.size(); ++i) {
    std::vector<float> logits(size_t(vocab), 0.0f);
    logits[size_t(byte_id('\x01'))] = 10.0f;
    logits[kEos] = 7.0f;
    logits[size_t(think_begin)] = 4.0f;
    if (i < doc.size()) logits[size_t(byte_id(doc[i]))] = 5.0f;
    c.apply(out, logits.data(), vocab);
    const int32_t pick = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (i < doc.size()) {
      ASSERT_EQ(pick, byte_id(doc[i])) << "step " << i << " of " << doc;
      EXPECT_TRUE(std::isinf(logits[kEos])) << "EOS before the object closed";
    } else {
      EXPECT_EQ(pick, kEos);
      EXPECT_EQ(std::count_if(logits.begin(), logits.end(), [](float v) { return !std::isinf(v); }), 1);
    }
    out.push_back(pick);
  }
}

TEST(JsonObjectConstraint, ReasoningComesFirstUnconstrained) {
  const Tokenizer& tok = test_tokenizer();
  const auto table = std::make_shared<const TokenBytes>(tok);
  const int32_t think_begin = *tok.token_to_id("<mm:think>"), think_end = *tok.token_to_id("</mm:think>");
  const int32_t junk = tok.encode("\x01", false).at(0), brace = tok.encode("{", false).at(0);
  const int64_t vocab = tok.vocab_size();
  auto allowed = [&](JsonObjectConstraint& c, const std::vector<int32_t>& out, int32_t id) {
    std::vector<float> logits(size_t(vocab), 0.0f);
    c.apply(out, logits.data(), vocab);
    return !std::isinf(logits[size_t(id)]);
  };
  // Thinking enabled: the output starts inside reasoning; JSON is enforced after its end.
  using Start = JsonObjectConstraint::Start;
  JsonObjectConstraint in(table, {kEos}, Start::kReasoning);
  EXPECT_TRUE(allowed(in, {}, junk));
  EXPECT_TRUE(allowed(in, {junk, junk}, kEos));
  EXPECT_FALSE(allowed(in, {junk, junk, think_end}, junk));
  EXPECT_TRUE(allowed(in, {junk, junk, think_end}, brace));
  // Otherwise the model may open a reasoning block as its first token, or start the object.
  JsonObjectConstraint before(table, {kEos}, Start::kMayReason);
  EXPECT_TRUE(allowed(before, {}, think_begin));
  EXPECT_TRUE(allowed(before, {}, brace));
  EXPECT_FALSE(allowed(before, {}, kEos));
  EXPECT_TRUE(allowed(before, {think_begin}, junk));
  JsonObjectConstraint started(table, {kEos}, Start::kMayReason);
  EXPECT_FALSE(allowed(started, {brace}, think_begin));  // not once the object has begun
  JsonObjectConstraint plain(table, {kEos}, Start::kAtOnce);  // completions: no reasoning block
  EXPECT_FALSE(allowed(plain, {}, think_begin));
  EXPECT_TRUE(allowed(plain, {}, brace));
}

// A vocabulary of every printable byte, a few specials and many random multi-byte tokens over
// JSON's characters: the trie walk must allow exactly the tokens a per-token trial allows.
ListTokenizer random_vocab(uint32_t seed) {
  std::vector<std::string> items = {"<s>", "</s>", "<mm:think>", "</mm:think>"};
  for (int b = 0x09; b < 0x7f; ++b) items.push_back(std::string(1, char(b)));
  const std::string alphabet = "{}[]:,\"\\ \n\t0123456789-+.eEtrufalsn abcxyz/";
  std::mt19937 rng(seed);
  for (int i = 0; i < 3000; ++i) {
    std::string t;
    const int len = 2 + int(rng() % 6);
    for (int k = 0; k < len; ++k) t += alphabet[rng() % alphabet.size()];
    items.push_back(t);
  }
  return ListTokenizer(std::move(items), 4);
}

TEST(JsonObjectConstraint, TrieWalkEqualsTryingEveryToken) {
  const ListTokenizer vocab = random_vocab(9);
  const auto table = std::make_shared<const TokenBytes>(vocab);
  const int64_t n = vocab.vocab_size();
  // Any object (free keys and strings take the plain-token shortcut), then a schema whose
  // strings are checked (the cursor walk over plain tokens).
  const auto checked = *JsonSchema::compile(OrderedJson::parse(R"({"type": "object", "properties": {
      "key": {"type": "string", "pattern": "^[a-z ]*x[a-z]*$"}, "day": {"type": "string", "format": "date"},
      "s": {"type": "string", "maxLength": 4}}, "additionalProperties": false})"));
  const std::pair<std::shared_ptr<const JsonSchema>, std::string> cases[] = {
      {JsonSchema::any_object(), "{\"key\": [1, -2.5e+3, true, \"str \\\"q\\\" \\u00e9\"], \"o\": {\"n\": null}, \"z\": 0}"},
      {checked, "{\"key\": \"ab x\\u0063\", \"day\": \"2026-12-05\", \"s\": \"a\\tbc\"}"}};
  for (const auto& [schema, doc] : cases) {
    size_t in_string = 0;
    for (size_t len = 0; len < doc.size(); ++len) {
      JsonObjectConstraint c(table, {1}, JsonObjectConstraint::Start::kAtOnce, schema);
      const std::vector<int32_t> out = vocab.encode(doc.substr(0, len), false);
      std::vector<float> logits(size_t(n), 0.0f);
      c.apply(out, logits.data(), n);
      SchemaPrefix state(schema.get());
      ASSERT_TRUE(state.feed(std::string_view(doc).substr(0, len))) << doc.substr(0, len);
      in_string += state.in_plain_string() || state.in_checked_plain_string();
      for (int32_t id = 0; id < n; ++id) {
        SchemaPrefix trial = state;
        const bool want = !vocab.is_special(id) && trial.feed(vocab.token_bytes(id));
        ASSERT_EQ(!std::isinf(logits[size_t(id)]), want) << "prefix '" << doc.substr(0, len) << "' token '"
                                                         << vocab.token_bytes(id) << "'";
      }
    }
    EXPECT_GT(in_string, 5u) << doc;  // the string shortcuts were exercised
  }
}

// The pattern mask allows exactly the tokens after which the regex can still match, and the end
// ids exactly where the text so far matches.
TEST(PatternConstraint, MaskEqualsTryingEveryToken) {
  const ListTokenizer vocab = random_vocab(11);
  const auto table = std::make_shared<const TokenBytes>(vocab);
  const int64_t n = vocab.vocab_size();
  const std::string pattern = R"re(\{"(a|bc)": (-?\d+|true|"[^"]*")\}\n?)re";
  const auto nfa = *RegexNfa::compile(pattern);
  const std::string doc = "{\"bc\": \"x y\"}\n";
  ASSERT_TRUE(regex_full_match(nfa, doc));
  for (size_t len = 0; len <= doc.size(); ++len) {
    PatternConstraint c(table, {1}, ByteConstraint::Start::kAtOnce, nfa);
    std::vector<float> logits(size_t(n), 0.0f);
    c.apply(vocab.encode(doc.substr(0, len), false), logits.data(), n);
    for (int32_t id = 0; id < n; ++id) {
      bool want = false;
      if (id == 1) {
        want = regex_full_match(nfa, doc.substr(0, len));
      } else if (!vocab.is_special(id)) {
        LazyDfa dfa(nfa);
        int32_t st = dfa.start();
        for (char ch : doc.substr(0, len) + std::string(vocab.token_bytes(id))) {
          st = dfa.next(st, uint8_t(ch));
          if (st < 0) break;
        }
        want = st >= 0;
      }
      ASSERT_EQ(!std::isinf(logits[size_t(id)]), want)
          << "prefix '" << doc.substr(0, len) << "' token '" << vocab.token_bytes(id) << "'";
    }
  }
}

// A "model" that prefers garbage, then EOS, then the script: a choice constraint leaves the script
// (one of the options) and then only EOS; a reasoning block may come first in chat.
TEST(PatternConstraint, ChoiceFollowsTheOptions) {
  const Tokenizer& tok = test_tokenizer();
  const auto table = std::make_shared<const TokenBytes>(tok);
  const int64_t vocab = tok.vocab_size();
  const auto options = RegexNfa::choice({"yes", "no", "yesterday"});
  auto byte_id = [&](char ch) { return tok.encode(std::string(1, ch), false).at(0); };
  for (const std::string want : {"yes", "yesterday", "no"}) {
    PatternConstraint c(table, {kEos}, ByteConstraint::Start::kMayReason, options);
    std::vector<int32_t> out;
    for (size_t i = 0; i <= want.size(); ++i) {
      std::vector<float> logits(size_t(vocab), 0.0f);
      logits[size_t(byte_id('\x01'))] = 10.0f;
      logits[kEos] = 7.0f;
      if (i < want.size()) logits[size_t(byte_id(want[i]))] = 5.0f;
      c.apply(out, logits.data(), vocab);
      const int32_t pick = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      const std::string so_far = want.substr(0, i);
      const bool whole = so_far == "yes" || so_far == "no" || so_far == "yesterday";
      EXPECT_EQ(!std::isinf(logits[kEos]), whole) << want << " step " << i;
      if (!whole) {
        ASSERT_EQ(pick, byte_id(want[i])) << want << " step " << i;
      } else if (i == want.size()) {
        EXPECT_EQ(pick, kEos);
      }
      out.push_back(i < want.size() ? byte_id(want[i]) : kEos);
    }
  }
  // Inside a reasoning block nothing is masked; after it the options are.
  const int32_t think_begin = *tok.token_to_id("<mm:think>"), think_end = *tok.token_to_id("</mm:think>");
  PatternConstraint r(table, {kEos}, ByteConstraint::Start::kMayReason, options);
  std::vector<float> logits(size_t(vocab), 0.0f);
  r.apply({think_begin, byte_id('q')}, logits.data(), vocab);
  EXPECT_TRUE(std::none_of(logits.begin(), logits.end(), [](float v) { return std::isinf(v); }));
  std::fill(logits.begin(), logits.end(), 0.0f);
  r.apply({think_begin, byte_id('q'), think_end}, logits.data(), vocab);
  EXPECT_FALSE(std::isinf(logits[size_t(byte_id('y'))]));
  EXPECT_TRUE(std::isinf(logits[size_t(byte_id('q'))]));
  EXPECT_TRUE(std::isinf(logits[kEos]));
}

TEST(ChoiceAssembler, HeldBackPrefixOfStopStringIsReleasedAtTheEnd) {
  ChoiceOptions opts;
  opts.stop = {"STOP"};
  Generation gen(test_tokenizer(), spec_for(false, 1, opts));
  gen.bind({1});
  std::vector<RequestId> to_abort;
  std::string sse = feed_one_by_one(gen, 1, tokens_of("abc ST"), FinishReason::kMaxTokens, to_abort);
  EXPECT_TRUE(to_abort.empty());
  EXPECT_EQ(gen.response()["choices"][0]["text"], "abc ST");
  EXPECT_EQ(gen.response()["choices"][0]["finish_reason"], "length");
}

TEST(ChoiceAssembler, EosIsNotDecodedButCounted) {
  Generation gen(test_tokenizer(), spec_for(false));
  gen.bind({1});
  std::vector<RequestId> to_abort;
  auto toks = tokens_of("hi");
  toks.push_back(TokenOutput{kEos, -0.1f, {}});
  feed_one_by_one(gen, 1, toks, FinishReason::kStopToken, to_abort);
  const auto body = gen.response();
  EXPECT_EQ(body["choices"][0]["text"], "hi");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["usage"]["completion_tokens"], 3);
  EXPECT_EQ(body["usage"]["prompt_tokens"], 7);
  EXPECT_EQ(body["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
}

TEST(ChoiceAssembler, SplitUtf8NeverReachesTheWire) {
  ChoiceOptions opts;
  opts.stop = {"zzzz"};  // forces hold-back at arbitrary byte positions
  Generation gen(test_tokenizer(), spec_for(false, 1, opts));
  gen.bind({1});
  std::vector<RequestId> to_abort;
  const std::string text = "a\xe4\xb8\xad\xf0\x9f\x98\x80" "b\xc3\xa9";
  std::string sse = feed_one_by_one(gen, 1, tokens_of(text), FinishReason::kMaxTokens, to_abort);
  std::string streamed;
  for (const auto& c : chunks_of(sse)) streamed += c["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(sse.find("\xef\xbf\xbd"), std::string::npos);  // no U+FFFD from a split sequence
}

TEST(ChatGeneration, ReasoningContentAndStreamedToolCallArguments) {
  const std::string ns = "]<]minimax[>[";
  const std::string text = "<mm:think>Need the weather.</mm:think>Let me check." + ns + "<tool_call>\n" + ns +
                           "<invoke name=\"get_weather\">" + ns + "<city>San Francisco" + ns + "</city>" + ns +
                           "<days>14" + ns + "</days>" + ns + "</invoke>\n" + ns + "</tool_call>";
  ChoiceOptions opts;
  opts.parser.tools = OrderedJson::parse(R"([{"type":"function","function":{"name":"get_weather","parameters":
      {"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}}}}}])");
  opts.parser.call_id_prefix = "call_x";
  Generation gen(test_tokenizer(), spec_for(true, 1, opts));
  gen.bind({5});
  std::vector<RequestId> to_abort;
  auto toks = tokens_of(text);
  toks.push_back(TokenOutput{kEos, 0.0f, {}});
  std::string sse = feed_one_by_one(gen, 5, toks, FinishReason::kStopToken, to_abort);
  auto chunks = chunks_of(sse);
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string reasoning, content, args, name, id, finish;
  int argument_chunks = 0;
  for (const auto& c : chunks) {
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    const auto& d = c["choices"][0]["delta"];
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (d.contains("tool_calls")) {
      for (const auto& call : d["tool_calls"]) {
        EXPECT_EQ(call["index"], 0);
        if (call.contains("id")) {
          EXPECT_TRUE(id.empty());  // id and name come once
          id = call["id"];
          name = call["function"]["name"];
          EXPECT_EQ(call["type"], "function");
        }
        if (!call["function"]["arguments"].get<std::string>().empty()) ++argument_chunks;
        args += call["function"]["arguments"].get<std::string>();
      }
    }
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(reasoning, "Need the weather.");
  EXPECT_EQ(content, "Let me check.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(id, "call_x0");
  EXPECT_EQ(OrderedJson::parse(args), OrderedJson::parse(R"({"city":"San Francisco","days":14})"));
  EXPECT_GT(argument_chunks, 3);  // arguments arrive incrementally, not in one piece
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_EQ(sse.find(ns), std::string::npos);  // the namespace token never leaks
  const auto body = gen.response();
  const auto& msg = body["choices"][0]["message"];
  EXPECT_EQ(msg["reasoning_content"], "Need the weather.");
  EXPECT_EQ(msg["content"], "Let me check.");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(OrderedJson::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>())["days"], 14);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
}

TEST(ChatGeneration, ToolChoiceNoneDropsCalls) {
  const std::string ns = "]<]minimax[>[";
  ChoiceOptions opts;
  opts.drop_tool_calls = true;
  Generation gen(test_tokenizer(), spec_for(true, 1, opts));
  gen.bind({5});
  std::vector<RequestId> to_abort;
  feed_one_by_one(gen, 5, tokens_of("ok" + ns + "<tool_call>\n" + ns + "<invoke name=\"f\">" + ns + "</invoke>\n" + ns +
                                    "</tool_call>"),
                  FinishReason::kStopToken, to_abort);
  const OrderedJson body = gen.response();
  const auto& msg = body["choices"][0]["message"];
  EXPECT_EQ(msg["content"], "ok");
  EXPECT_FALSE(msg.contains("tool_calls"));
  EXPECT_EQ(gen.response()["choices"][0]["finish_reason"], "stop");
}

TEST(ChatGeneration, NoParallelToolCallsEndsAtTheSecondCall) {
  const std::string ns = "]<]minimax[>[";
  auto invoke = [&](const std::string& name, int x) {
    return ns + "<invoke name=\"" + name + "\">" + ns + "<x>" + std::to_string(x) + ns + "</x>" + ns + "</invoke>\n";
  };
  const std::string text = ns + "<tool_call>\n" + invoke("f", 1) + invoke("g", 2) + ns + "</tool_call>";
  for (bool parallel : {true, false}) {
    ChoiceOptions opts;
    opts.parallel_tool_calls = parallel;
    Generation gen(test_tokenizer(), spec_for(true, 1, opts));
    gen.bind({5});
    std::vector<RequestId> to_abort;
    auto toks = tokens_of(text);
    toks.push_back(TokenOutput{kEos, 0.0f, {}});
    const auto chunks = chunks_of(feed_one_by_one(gen, 5, toks, FinishReason::kStopToken, to_abort));
    const OrderedJson body = gen.response();
    const auto& calls = body["choices"][0]["message"]["tool_calls"];
    ASSERT_EQ(calls.size(), parallel ? 2u : 1u);
    EXPECT_EQ(calls[0]["function"]["name"], "f");
    EXPECT_EQ(OrderedJson::parse(calls[0]["function"]["arguments"].get<std::string>())["x"], "1");
    EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
    // Without parallel calls the request is aborted as soon as the second call shows.
    EXPECT_EQ(to_abort, parallel ? std::vector<RequestId>{} : std::vector<RequestId>{5});
    for (const auto& c : chunks) {
      if (!c["choices"][0]["delta"].contains("tool_calls") || parallel) continue;
      for (const auto& call : c["choices"][0]["delta"]["tool_calls"]) {
        EXPECT_EQ(call["index"], 0);
      }
    }
  }
}

TEST(Generation, ReturnTokenIdsInBothForms) {
  for (bool chat : {false, true}) {
    ChoiceOptions opts;
    opts.return_token_ids = true;
    opts.prompt_ids = {9, 8, 7};
    Generation gen(test_tokenizer(), spec_for(chat, 1, opts));
    gen.bind({3});
    std::vector<RequestId> to_abort;
    auto toks = tokens_of("Hi there");
    toks.push_back(TokenOutput{kEos, 0.0f, {}});
    std::vector<int32_t> sampled;
    for (const auto& t : toks) sampled.push_back(t.token);
    const auto chunks = chunks_of(feed_one_by_one(gen, 3, toks, FinishReason::kStopToken, to_abort));
    std::vector<int32_t> streamed;
    int prompt_ids_seen = 0;
    for (const auto& c : chunks) {
      const auto& choice = c["choices"][0];
      if (chat ? c.contains("prompt_token_ids") : choice.contains("prompt_token_ids")) {
        ++prompt_ids_seen;
        EXPECT_EQ((chat ? c["prompt_token_ids"] : choice["prompt_token_ids"]), OrderedJson({9, 8, 7}));
      }
      if (choice.contains("token_ids"))
        for (const auto& id : choice["token_ids"]) streamed.push_back(id.get<int32_t>());
    }
    EXPECT_EQ(prompt_ids_seen, 1) << "chat " << chat;  // once, with the first chunk
    EXPECT_EQ(streamed, sampled) << "chat " << chat;  // EOS included: what the model sampled
    const OrderedJson body = gen.response();
    EXPECT_EQ(body["choices"][0]["token_ids"].get<std::vector<int32_t>>(), sampled);
    EXPECT_EQ((chat ? body["prompt_token_ids"] : body["choices"][0]["prompt_token_ids"]), OrderedJson({9, 8, 7}));
  }
  // Off by default: no such fields.
  Generation plain(test_tokenizer(), spec_for(false));
  plain.bind({4});
  std::vector<RequestId> to_abort;
  feed_one_by_one(plain, 4, tokens_of("x"), FinishReason::kMaxTokens, to_abort);
  EXPECT_FALSE(plain.response()["choices"][0].contains("token_ids"));
}

TEST(ChatGeneration, ThinkingEnabledStartsInReasoning) {
  ChoiceOptions opts;
  opts.parser.thinking_mode = ThinkingMode::kEnabled;
  Generation gen(test_tokenizer(), spec_for(true, 1, opts));
  gen.bind({1});
  std::vector<RequestId> to_abort;
  feed_one_by_one(gen, 1, tokens_of("plan</mm:think>answer"), FinishReason::kMaxTokens, to_abort);
  const OrderedJson body = gen.response();
  const auto& msg = body["choices"][0]["message"];
  EXPECT_EQ(msg["reasoning_content"], "plan");
  EXPECT_EQ(msg["content"], "answer");
}

TEST(Generation, SeveralChoicesInterleavedWithUsageAndLogprobs) {
  ChoiceOptions opts;
  opts.logprobs = 1;
  auto spec = spec_for(true, 2, opts);
  spec.include_usage = true;
  Generation gen(test_tokenizer(), spec);
  gen.bind({10, 11});
  std::vector<RequestId> to_abort;
  std::string sse = gen.stream_start();
  sse += gen.on_events({event(11, tokens_of("xy")), event(10, tokens_of("a"))}, to_abort);
  EXPECT_FALSE(gen.done());
  EXPECT_EQ(gen.unfinished_ids(), (std::vector<RequestId>{10, 11}));
  sse += gen.on_events({event(10, tokens_of("b"), FinishReason::kMaxTokens)}, to_abort);
  EXPECT_EQ(gen.unfinished_ids(), std::vector<RequestId>{11});
  sse += gen.on_events({event(11, {}, FinishReason::kAborted)}, to_abort);
  ASSERT_TRUE(gen.done());
  sse += gen.stream_end();
  EXPECT_NE(sse.find("data: [DONE]\n\n"), std::string::npos);
  auto chunks = chunks_of(sse);
  const auto& last = chunks.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"]["completion_tokens"], 4);
  EXPECT_EQ(last["usage"]["prompt_tokens"], 7);  // one prompt, counted once
  const auto body = gen.response();
  EXPECT_EQ(body["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(body["choices"][1]["message"]["content"], "xy");
  EXPECT_EQ(body["choices"][1]["finish_reason"], "abort");
  const auto& lp = body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[0]["token"], "a");
  EXPECT_EQ(lp[0]["bytes"], OrderedJson::array({97}));
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 1u);  // trimmed to top_logprobs = 1
  EXPECT_FLOAT_EQ(lp[0]["logprob"].get<float>(), -0.5f);
}

TEST(Generation, CompletionLogprobsShape) {
  ChoiceOptions opts;
  opts.logprobs = 2;
  Generation gen(test_tokenizer(), spec_for(false, 1, opts));
  gen.bind({1});
  std::vector<RequestId> to_abort;
  feed_one_by_one(gen, 1, tokens_of("abc"), FinishReason::kMaxTokens, to_abort);
  const OrderedJson body = gen.response();
  const auto& lp = body["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], OrderedJson::array({"a", "b", "c"}));
  EXPECT_EQ(lp["text_offset"], OrderedJson::array({0, 1, 2}));
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
}

TEST(Generation, RandomChunkingGivesTheSameResult) {
  const std::string ns = "]<]minimax[>[";
  const std::string text = std::string("<mm:think>r\xc3\xa9" "flexion</mm:think>R\xc3\xa9ponse ") + ns + "<tool_call>\n" + ns +
                           "<invoke name=\"f\">" + ns + "<q>x y" + ns + "</q>" + ns + "</invoke>\n" + ns + "</tool_call>";
  auto all = tokens_of(text);
  std::mt19937 rng(5);
  OrderedJson reference;
  for (int trial = 0; trial < 20; ++trial) {
    ChoiceOptions opts;
    opts.stop = {"never-matches"};
    opts.parser.call_id_prefix = std::string(1, 'c');
    Generation gen(test_tokenizer(), spec_for(true, 1, opts));
    gen.bind({1});
    std::vector<RequestId> to_abort;
    size_t i = 0;
    while (i < all.size()) {
      size_t take = std::min(all.size() - i, size_t(1 + rng() % 5));
      std::vector<TokenOutput> part(all.begin() + long(i), all.begin() + long(i + take));
      i += take;
      gen.on_events({event(1, part, i == all.size() ? FinishReason::kStopToken : FinishReason::kNone)}, to_abort);
    }
    ASSERT_TRUE(gen.done());
    OrderedJson msg = gen.response()["choices"][0]["message"];
    if (trial == 0) reference = msg;
    EXPECT_EQ(msg, reference);
  }
  EXPECT_EQ(reference["reasoning_content"], "r\xc3\xa9" "flexion");
  EXPECT_EQ(reference["tool_calls"][0]["function"]["arguments"], R"({"q":"x y"})");
}

// ---- request validation -------------------------------------------------------------------

ApiError chat_error(const std::string& body_text) {
  ChatRequest req;
  auto err = parse_chat_request(OrderedJson::parse(body_text), req);
  return err ? *err : ApiError{0, "", "", "", ""};
}

TEST(Protocol, ErrorsNameTheField) {
  struct Case {
    const char* body;
    const char* param;
  };
  const Case cases[] = {
      {R"({"messages":[{"role":"user","content":"x"}],"n":0})", "n"},
      {R"({"messages":[{"role":"user","content":"x"}],"n":"2"})", "n"},
      {R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})", "max_tokens"},
      {R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0})", "max_completion_tokens"},
      {R"({"messages":[{"role":"user","content":"x"}],"temperature":-1})", "temperature"},
      {R"({"messages":[{"role":"user","content":"x"}],"temperature":true})", "temperature"},
      {R"({"messages":[{"role":"user","content":"x"}],"top_p":0})", "top_p"},
      {R"({"messages":[{"role":"user","content":"x"}],"top_k":-2})", "top_k"},
      {R"({"messages":[{"role":"user","content":"x"}],"min_p":2})", "min_p"},
      {R"({"messages":[{"role":"user","content":"x"}],"presence_penalty":3})", "presence_penalty"},
      {R"({"messages":[{"role":"user","content":"x"}],"repetition_penalty":0})", "repetition_penalty"},
      {R"({"messages":[{"role":"user","content":"x"}],"seed":"s"})", "seed"},
      {R"({"messages":[{"role":"user","content":"x"}],"stop":5})", "stop"},
      {R"({"messages":[{"role":"user","content":"x"}],"stop_token_ids":[-1]})", "stop_token_ids"},
      {R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", "top_logprobs"},
      {R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})", "top_logprobs"},
      {R"({"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}})", "stream_options"},
      {R"({"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":1}})",
       "stream_options.include_usage"},
      {R"({"messages":[]})", "messages"},
      {R"({"messages":[{"role":"bot","content":"x"}]})", "messages[0].role"},
      {R"({"messages":[{"content":"x"}]})", "messages[0].role"},
      {R"({"messages":[{"role":"user","content":5}]})", "messages[0].content"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":{}})", "tools"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":""}}]})",
       "tools[0].function.name"},
      {R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required"})", "tool_choice"},
      {R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"sometimes"})", "tool_choice"},
      {R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"thinking_mode":"maybe"}})",
       "chat_template_kwargs.thinking_mode"},
      {R"({"model":3,"messages":[{"role":"user","content":"x"}]})", "model"},
      {R"({"messages":[{"role":"user","content":"x"}],"min_tokens":-1})", "min_tokens"},
      {R"({"messages":[{"role":"user","content":"x"}],"allowed_token_ids":[]})", "allowed_token_ids"},
      {R"({"messages":[{"role":"user","content":"x"}],"allowed_token_ids":[1,-1]})", "allowed_token_ids"},
      {R"({"messages":[{"role":"user","content":"x"}],"include_stop_str_in_output":1})", "include_stop_str_in_output"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_json":"{bad"})", "guided_json"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_json":{"type":"string","pattern":"a"}})", "guided_json"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_regex":"(a"})", "guided_regex"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_regex":5})", "guided_regex"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_choice":[]})", "guided_choice"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_choice":["a",1]})", "guided_choice[1]"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_grammar":"root ::= x"})", "guided_grammar"},
      {R"({"messages":[{"role":"user","content":"x"}],"guided_regex":"a","guided_choice":["a"]})", "guided_choice"},
      {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"},"guided_regex":"a"})",
       "guided_regex"},
      {R"({"messages":[{"role":"user","content":"x"}],"structured_outputs":{"grammar":"x"}})", "structured_outputs"},
      {R"j({"messages":[{"role":"user","content":"x"}],"structured_outputs":{"regex":"(?=a)"}})j",
       "structured_outputs.regex"},
      {R"({"messages":[{"role":"user","content":"x"}],"structured_outputs":{"disable_any_whitespace":true}})",
       "structured_outputs"},
      {R"({"messages":[{"role":"user","content":"x"}],"structured_outputs":[]})", "structured_outputs"},
      {R"({"messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":0})", "truncate_prompt_tokens"},
      {R"({"messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":-2})", "truncate_prompt_tokens"},
      {R"({"messages":[{"role":"user","content":"x"}],"bad_words":"x"})", "bad_words"},
      {R"({"messages":[{"role":"user","content":"x"}],"bad_words":["  "]})", "bad_words"},
      {R"({"messages":[{"role":"user","content":"x"}],"use_beam_search":true})", "use_beam_search"},
      {R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":21})", "prompt_logprobs"},
      {R"({"messages":[{"role":"user","content":"x"}],"min_tokens":"2"})", "min_tokens"},
      {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":[5]})", "logit_bias"},
      {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"5":100.5}})", "logit_bias"},
      {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"-5":1}})", "logit_bias"},
      {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"five":1}})", "logit_bias"},
      {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"99999999999":1}})", "logit_bias"},
      {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"5":"1"}})", "logit_bias[\"5\"]"},
      {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}})", "response_format"},
      {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":1}})", "response_format.type"},
      {R"({"messages":[{"role":"user","content":"x"}],"response_format":"json"})", "response_format"},
      {R"([])", ""},
  };
  for (const auto& c : cases) {
    ApiError err = chat_error(c.body);
    EXPECT_EQ(err.http_status, 400) << c.body;
    EXPECT_EQ(err.param, c.param) << c.body << " -> " << err.message;
    EXPECT_EQ(err.type, "invalid_request_error");
    if (*c.param) {
      EXPECT_NE(err.message.find(c.param), std::string::npos) << err.message;
    }
    const auto j = err.to_json();
    EXPECT_TRUE(j["error"].contains("code"));
  }
}

TEST(Protocol, StructuredOutputForms) {
  auto chat = [](const char* extra) {
    ChatRequest req;
    const std::string body = std::string(R"({"messages":[{"role":"user","content":"x"}],)") + extra + "}";
    auto err = parse_chat_request(OrderedJson::parse(body), req);
    EXPECT_FALSE(err) << body << ": " << (err ? err->message : "");
    return req.common;
  };
  CommonRequest c = chat(R"("guided_choice":["yes","no"],"guided_decoding_backend":"xgrammar")");
  ASSERT_TRUE(c.pattern);
  EXPECT_TRUE(regex_full_match(c.pattern, "no"));
  EXPECT_FALSE(regex_full_match(c.pattern, "n"));
  EXPECT_TRUE(c.ignored_fields.empty());
  c = chat(R"("guided_regex":"\\d{2}")");
  ASSERT_TRUE(c.pattern);
  EXPECT_TRUE(regex_full_match(c.pattern, "42"));
  c = chat(R"("structured_outputs":{"regex":"[ab]+","disable_fallback":true})");
  ASSERT_TRUE(c.pattern);
  EXPECT_TRUE(regex_full_match(c.pattern, "abba"));
  c = chat(R"("structured_outputs":{"choice":["x"]})");
  ASSERT_TRUE(c.pattern);
  EXPECT_FALSE(c.json_object);
  for (const char* json : {R"("guided_json":{"type":"object","required":["a"],"properties":{"a":{"type":"integer"}}})",
                           R"("guided_json":"{\"type\":\"object\",\"required\":[\"a\"],\"properties\":{\"a\":{\"type\":\"integer\"}}}")",
                           R"("structured_outputs":{"json":{"type":"object","required":["a"],"properties":{"a":{"type":"integer"}}}})"}) {
    c = chat(json);
    EXPECT_TRUE(c.json_object) << json;
    ASSERT_TRUE(c.json_schema) << json;
    SchemaPrefix p(c.json_schema.get());
    EXPECT_FALSE(p.feed(std::string_view(R"({"a": "s")"))) << json;  // a string where an integer must be
    SchemaPrefix q(c.json_schema.get());
    EXPECT_TRUE(q.feed(std::string_view(R"({"a": 1})")) && q.complete()) << json;
  }
  c = chat(R"("structured_outputs":{"json_object":true})");
  EXPECT_TRUE(c.json_object);
  EXPECT_FALSE(c.json_schema);
  c = chat(R"("truncate_prompt_tokens":-1,"bad_words":["foo"," bar"],"use_beam_search":false)");
  EXPECT_EQ(c.truncate_prompt_tokens, -1);
  EXPECT_EQ(c.bad_words, (std::vector<std::string>{"foo", " bar"}));
}

// tool_choice required / named: the call syntax the chat template writes, as a pattern.
TEST(Protocol, ToolChoiceRequiredBecomesACallPattern) {
  const std::string tools = R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
      "properties":{"city":{"type":"string"},"days":{"type":"integer"},"unit":{"enum":["C","F"]},
      "opts":{"type":"object","properties":{"wind":{"type":"boolean"}}}},"required":["city"]}}},
      {"type":"function","function":{"name":"ping"}}])";
  auto parse = [&](const std::string& choice) {
    ChatRequest req;
    auto err = parse_chat_request(OrderedJson::parse(R"({"messages":[{"role":"user","content":"x"}],"tools":)" + tools +
                                                     R"(,"tool_choice":)" + choice + "}"),
                                  req);
    EXPECT_FALSE(err) << (err ? err->message : "");
    return req.common.pattern;
  };
  const std::string ns(kNamespaceToken);
  auto call = [&](const std::string& name, const std::string& members) {
    return ns + "<invoke name=\"" + name + "\">" + members + ns + "</invoke>\n";
  };
  auto member = [&](const std::string& key, const std::string& value) { return ns + "<" + key + ">" + value + ns + "</" + key + ">"; };
  auto block = [&](const std::string& calls) { return ns + "<tool_call>\n" + calls + ns + "</tool_call>"; };
  const auto required = parse(R"("required")");
  ASSERT_TRUE(required);
  const std::string weather =
      call("get_weather", member("city", "Paris, \"old\" town") + member("days", "3") + member("unit", "F") +
                              member("opts", ns + "<wind>true" + ns + "</wind>"));
  EXPECT_TRUE(regex_full_match(required, block(weather)));
  EXPECT_TRUE(regex_full_match(required, block(weather + call("ping", member("any", "thing")))));
  EXPECT_FALSE(regex_full_match(required, block("")));                                            // no call
  EXPECT_FALSE(regex_full_match(required, "Sure! " + block(weather)));                             // text first
  EXPECT_FALSE(regex_full_match(required, block(call("get_weather", member("days", "three")))));  // not an integer
  EXPECT_FALSE(regex_full_match(required, block(call("get_weather", member("unit", "K")))));      // not in the enum
  EXPECT_FALSE(regex_full_match(required, block(call("get_weather", member("town", "x")))));      // no such parameter
  EXPECT_FALSE(regex_full_match(required, block(call("get_time", ""))));                          // no such tool
  EXPECT_FALSE(regex_full_match(required, block(call("get_weather", member("city", "a]<b")))));  // "]<" in a value
  const auto named = parse(R"({"type":"function","function":{"name":"ping"}})");
  ASSERT_TRUE(named);
  EXPECT_TRUE(regex_full_match(named, block(call("ping", ""))));
  EXPECT_FALSE(regex_full_match(named, block(weather)));
  EXPECT_FALSE(parse(R"("auto")"));
  ChatRequest both;
  auto err = parse_chat_request(OrderedJson::parse(R"({"messages":[{"role":"user","content":"x"}],"tools":)" + tools +
                                                   R"(,"tool_choice":"required","guided_regex":"a"})"),
                                both);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->param, "tool_choice");
}

TEST(Protocol, ValidRequestsParse) {
  ChatRequest chat;
  auto err = parse_chat_request(OrderedJson::parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "n":2,"max_completion_tokens":7,"temperature":0.5,"top_p":0.9,"top_k":5,"min_p":0.1,"seed":3,
      "stop":["a",""],"stop_token_ids":[9],"logprobs":true,"top_logprobs":3,"presence_penalty":0.5,
      "frequency_penalty":-0.5,"repetition_penalty":1.1,"stream":true,"stream_options":{"include_usage":true},
      "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{}}}}],
      "tool_choice":{"type":"function","function":{"name":"f"}},"chat_template_kwargs":{"thinking_mode":"enabled"},
      "logit_bias":{"7":-100,"12":2.5},"min_tokens":3,"allowed_token_ids":[4,5],"include_stop_str_in_output":true,
      "user":"u","metadata":{"k":"v"},"no_such_field":1,"another":null})"),
                                chat);
  ASSERT_FALSE(err) << err->message;
  EXPECT_EQ(chat.common.n, 2);
  EXPECT_EQ(*chat.common.max_tokens, 7);
  EXPECT_EQ(chat.common.sampling.top_k, 5);
  EXPECT_EQ(chat.common.stop, std::vector<std::string>{"a"});
  EXPECT_EQ(chat.common.logprobs, 3);
  EXPECT_TRUE(chat.common.include_usage);
  EXPECT_EQ(chat.tool_choice, ToolChoice::kNamed);
  EXPECT_EQ(chat.thinking_mode, ThinkingMode::kEnabled);
  using Bias = std::vector<std::pair<int32_t, float>>;
  Bias bias = chat.common.sampling.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (Bias{{7, -100.0f}, {12, 2.5f}}));
  EXPECT_EQ(chat.common.sampling.min_tokens, 3);
  EXPECT_EQ(chat.common.sampling.allowed_token_ids, (std::vector<int32_t>{4, 5}));
  EXPECT_TRUE(chat.common.include_stop_str_in_output);
  EXPECT_TRUE(chat.common.pattern);  // the named tool's call
  EXPECT_EQ(chat.common.ignored_fields, (std::vector<std::string>{"no_such_field", "another"}));
  CompletionRequest comp;
  ASSERT_FALSE(parse_completion_request(OrderedJson::parse(R"({"prompt":[[1,2],"text"],"logprobs":2,"max_tokens":3})"),
                                        comp));
  ASSERT_EQ(comp.prompts.size(), 2u);
  EXPECT_EQ(std::get<std::vector<int32_t>>(comp.prompts[0]), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(comp.common.logprobs, 2);
  CompletionRequest bad;
  auto e = parse_completion_request(OrderedJson::parse(R"({"prompt":[1,-2]})"), bad);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "prompt");
}

// A step's stats: running / waiting requests, a quarter of 100 KV blocks used, prefix lookups.
EngineStepStats step_stats(int32_t running, int32_t waiting, int32_t queries, int32_t hits) {
  EngineStepStats st;
  st.scheduler.num_running = running;
  st.scheduler.num_waiting = waiting;
  st.scheduler.kv_blocks_used = 25;
  st.scheduler.kv_blocks_free = 75;
  st.scheduler.prefix_query_tokens = queries;
  st.scheduler.prefix_hit_tokens = hits;
  return st;
}

TEST(Metrics, RendersPrometheusText) {
  Metrics m("tiny");
  EngineStepStats st = step_stats(3, 2, 32, 16);
  st.scheduler.num_preemptions = 1;
  m.observe_step(st);
  m.observe_first_token(0.003);
  FinishedRequest f;
  f.reason = "length";
  f.e2e_s = 0.5;
  f.queue_s = 0.002;
  f.scheduled = true;
  f.prefill_s = 0.001;
  f.decode_s = 0.3;
  f.inference_s = 0.301;
  f.prompt_tokens = 10;
  f.generation_tokens = 4;
  f.max_tokens = 4;
  f.tpot_s = 0.1;
  m.observe_finished(f);
  FinishedRequest waiting;  // aborted before it was scheduled
  waiting.reason = "abort";
  waiting.e2e_s = waiting.queue_s = 0.2;
  waiting.prompt_tokens = 7;
  m.observe_finished(waiting);
  const std::string text = m.render();
  EXPECT_NE(text.find("vllm:num_requests_running{model_name=\"tiny\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:num_requests_waiting{model_name=\"tiny\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:kv_cache_usage_perc{model_name=\"tiny\"} 0.25\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:prefix_cache_hits_total{model_name=\"tiny\"} 16\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:num_preemptions_total{model_name=\"tiny\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.001\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.005\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:generation_tokens_total{model_name=\"tiny\"} 4\n"), std::string::npos);
  // Request-level histograms: both requests queued, only the scheduled one has the rest.
  EXPECT_NE(text.find("vllm:request_queue_time_seconds_count{model_name=\"tiny\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_queue_time_seconds_bucket{model_name=\"tiny\",le=\"0.005\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_prefill_time_seconds_count{model_name=\"tiny\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_decode_time_seconds_sum{model_name=\"tiny\"} 0.3\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_inference_time_seconds_count{model_name=\"tiny\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_prompt_tokens_bucket{model_name=\"tiny\",le=\"10\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_prompt_tokens_bucket{model_name=\"tiny\",le=\"5\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_generation_tokens_bucket{model_name=\"tiny\",le=\"1\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_params_max_tokens_count{model_name=\"tiny\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:iteration_tokens_total_count{model_name=\"tiny\"} 0\n"), std::string::npos);
  EXPECT_EQ(text.find("vllm:cache_config_info"), std::string::npos);  // not set yet
  ModelSummary summary;
  summary.block_size = 128;
  summary.num_kv_blocks = 100;
  summary.kv_cache_dtype = "bf16";
  summary.index_cache_dtype = "fp8";
  m.set_cache_info(summary);  // prefix caching on: the summary's default
  EXPECT_NE(m.render().find("vllm:cache_config_info{model_name=\"tiny\",block_size=\"128\",num_gpu_blocks=\"100\","
                            "cache_dtype=\"bf16\",index_cache_dtype=\"fp8\",enable_prefix_caching=\"True\"} 1\n"),
            std::string::npos);
  EXPECT_NE(m.render().find("m3:kv_cache_blocks_total{model_name=\"tiny\"} 100\n"), std::string::npos);
  m.observe_idle();
  EXPECT_NE(m.render().find("vllm:num_requests_running{model_name=\"tiny\"} 0\n"), std::string::npos);
}

TEST(StatsLogger, LogsAtTheIntervalWhileBusy) {
  using Clock = StatsLogger::Clock;
  const Clock::time_point t0{};
  StatsLogger log(10.0, t0);
  EngineStepStats st = step_stats(2, 1, 400, 100);
  st.scheduler.num_prefill_tokens = 500;
  log.add_generated(100);
  EXPECT_FALSE(log.observe_step(st, t0 + std::chrono::seconds(5)));  // not due yet
  st.scheduler.num_prefill_tokens = 500;
  const auto line = log.observe_step(st, t0 + std::chrono::seconds(10));
  ASSERT_TRUE(line);
  EXPECT_EQ(*line, "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 2 reqs, "
                   "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%");
  // Idle for an interval: nothing to say. Interval 0: never.
  EngineStepStats idle;
  EXPECT_FALSE(log.observe_step(idle, t0 + std::chrono::seconds(25)));
  StatsLogger off(0.0, t0);
  off.add_generated(5);
  EXPECT_FALSE(off.observe_step(st, t0 + std::chrono::seconds(100)));
}

TEST(StatsLogger, SpecDecodingLineOverTheSameInterval) {
  using Clock = StatsLogger::Clock;
  const Clock::time_point t0{};
  StatsLogger log(10.0, t0);
  EngineStepStats st = step_stats(2, 0, 400, 100);
  st.spec_num_drafts = 10;
  st.spec_num_draft_tokens = 40;
  st.spec_num_accepted_tokens = 15;
  st.spec_accepted_per_pos = {8, 4, 2, 1};
  log.add_generated(25);
  EXPECT_FALSE(log.observe_step(st, t0 + std::chrono::seconds(4)));
  EXPECT_FALSE(log.take_spec_line());  // only with a stats line
  EXPECT_TRUE(log.observe_step(st, t0 + std::chrono::seconds(10)));
  const auto spec = log.take_spec_line();
  ASSERT_TRUE(spec);
  EXPECT_EQ(*spec, "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, Drafted "
                   "throughput: 8.00 tokens/s, Accepted: 30 tokens, Drafted: 80 tokens, Per-position acceptance "
                   "rate: 0.800, 0.400, 0.200, 0.100, Avg Draft acceptance rate: 37.5%");
  EXPECT_FALSE(log.take_spec_line());  // once
  // An interval without drafts has no spec line.
  EngineStepStats plain = step_stats(1, 0, 400, 100);
  log.add_generated(3);
  EXPECT_TRUE(log.observe_step(plain, t0 + std::chrono::seconds(20)));
  EXPECT_FALSE(log.take_spec_line());
}

TEST(Metrics, SpecDecodeCountersOnlyWithSpeculation) {
  Metrics m("tiny");
  EngineStepStats st = step_stats(1, 0, 32, 16);
  st.spec_num_drafts = 2;
  st.spec_num_draft_tokens = 6;
  st.spec_num_accepted_tokens = 4;
  st.spec_accepted_per_pos = {2, 1, 1};
  m.observe_step(st);
  EXPECT_EQ(m.render().find("spec_decode"), std::string::npos);
  ModelSummary summary;
  summary.speculative_method = "ngram";
  summary.num_speculative_tokens = 4;
  m.set_cache_info(summary);
  m.observe_step(st);
  const std::string text = m.render();
  EXPECT_NE(text.find("vllm:spec_decode_num_drafts_total{model_name=\"tiny\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("vllm:spec_decode_num_draft_tokens_total{model_name=\"tiny\"} 12\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:spec_decode_num_accepted_tokens_total{model_name=\"tiny\"} 8\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny\",position=\"0\"} 4\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny\",position=\"3\"} 0\n"),
            std::string::npos);
}

// ---- AsyncEngine over the scripted engine ---------------------------------------------------

std::unique_ptr<Engine> scripted(size_t script_tokens) {
  ScriptedEngineConfig config;
  config.script.assign(script_tokens, 40);
  config.vocab_size = 300;
  config.max_model_len = 1 << 30;
  config.eos_token_id = kEos;
  return make_scripted_engine(std::move(config));
}

GenerationRequest gen_request(int max_tokens) {
  GenerationRequest r;
  r.prompt_token_ids = {5, 6};
  r.sampling.max_tokens = max_tokens;
  return r;
}

// Collects a channel's events until every id has finished.
std::map<RequestId, std::pair<int, FinishReason>> drain(RequestChannel& channel, size_t num_requests) {
  std::map<RequestId, std::pair<int, FinishReason>> out;
  size_t finished = 0;
  for (int spins = 0; finished < num_requests && spins < 2000; ++spins) {
    for (auto& ev : channel.wait(std::chrono::milliseconds(10))) {
      out[ev.request_id].first += int(ev.new_tokens.size());
      if (ev.finished) {
        out[ev.request_id].second = ev.finish_reason;
        ++finished;
      }
    }
  }
  return out;
}

TEST(AsyncEngine, RoutesEventsAndCountsInFlight) {
  Metrics metrics("m");
  AsyncEngine engine(scripted(5), metrics, AsyncEngineConfig{8});
  auto channel = std::make_shared<RequestChannel>();
  std::vector<GenerationRequest> reqs;
  reqs.push_back(gen_request(3));
  reqs.push_back(gen_request(100));
  SubmitOutcome out = engine.submit(std::move(reqs), channel);
  ASSERT_TRUE(out.ok()) << out.error;
  ASSERT_EQ(out.ids.size(), 2u);
  auto events = drain(*channel, 2);
  EXPECT_EQ(events[out.ids[0]], std::make_pair(3, FinishReason::kMaxTokens));
  EXPECT_EQ(events[out.ids[1]], std::make_pair(6, FinishReason::kStopToken));  // 5 script tokens + EOS
  EXPECT_EQ(engine.num_in_flight(), 0);
  EXPECT_NE(metrics.render().find("vllm:generation_tokens_total{model_name=\"m\"} 9\n"), std::string::npos);
}

TEST(AsyncEngine, RejectsAllOrNoneAndRefusesOverCapacity) {
  Metrics metrics("m");
  AsyncEngine engine(scripted(5), metrics, AsyncEngineConfig{2});
  auto channel = std::make_shared<RequestChannel>();
  std::vector<GenerationRequest> three(3, gen_request(1));
  SubmitOutcome over = engine.submit(three, channel);
  EXPECT_TRUE(over.overloaded);
  std::vector<GenerationRequest> bad = {gen_request(1), gen_request(1)};
  bad[1].prompt_token_ids = {999};  // outside the vocabulary
  SubmitOutcome rejected = engine.submit(bad, channel);
  EXPECT_FALSE(rejected.ok());
  EXPECT_FALSE(rejected.overloaded);
  EXPECT_NE(rejected.error.find("vocabulary"), std::string::npos);
  EXPECT_EQ(engine.num_in_flight(), 0);
  EXPECT_TRUE(channel->wait(std::chrono::milliseconds(50)).empty());  // the withdrawn one reports nothing
}

TEST(AsyncEngine, AbortEndsARequestEarly) {
  Metrics metrics("m");
  AsyncEngine engine(scripted(1 << 22), metrics, AsyncEngineConfig{4});
  auto channel = std::make_shared<RequestChannel>();
  SubmitOutcome out = engine.submit({gen_request(1 << 22)}, channel);
  ASSERT_TRUE(out.ok());
  ASSERT_FALSE(channel->wait(std::chrono::milliseconds(1000)).empty());
  engine.abort(out.ids[0]);
  auto events = drain(*channel, 1);
  EXPECT_EQ(events[out.ids[0]].second, FinishReason::kAborted);
  EXPECT_LT(events[out.ids[0]].first, 1 << 22);
  EXPECT_EQ(engine.num_in_flight(), 0);
  EXPECT_NE(metrics.render().find("finished_reason=\"abort\"} 1\n"), std::string::npos);
}

TEST(AsyncEngine, ShutdownFinishesInFlightRequests) {
  Metrics metrics("m");
  auto engine = std::make_unique<AsyncEngine>(scripted(50), metrics, AsyncEngineConfig{4});
  auto channel = std::make_shared<RequestChannel>();
  SubmitOutcome out = engine->submit({gen_request(40)}, channel);
  ASSERT_TRUE(out.ok());
  engine->shutdown();
  EXPECT_TRUE(engine->submit({gen_request(1)}, channel).overloaded);  // refused after shutdown
  auto events = drain(*channel, 1);
  EXPECT_EQ(events[out.ids[0]], std::make_pair(40, FinishReason::kMaxTokens));
}

}  // namespace
}  // namespace m3::server
