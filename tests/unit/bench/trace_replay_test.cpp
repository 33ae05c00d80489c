#include "bench/trace_replay.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "bench/datasets.h"
#include "fake_tokenizer.h"

namespace m3::bench {
namespace {

std::string traces_dir() {
  const char* shared = std::getenv("M3_SHARED_DIR");
  const std::string dir = std::string(shared ? shared : "../shared") + "/data/traces";
  return std::filesystem::is_directory(dir) ? dir : "";
}

#define REQUIRE_TRACES(dir)                                                     \
  const std::string dir = traces_dir();                                        \
  if (dir.empty()) {                                                            \
    GTEST_SKIP() << "shared data absent: $M3_SHARED_DIR/data/traces";          \
  }                                                                            \
  static_assert(true, "")

TEST(TraceFiles, AgenticWithSubagents) {
  REQUIRE_TRACES(dir);
  auto trace = load_trace(dir + "/agentic-coding/trace_0277.json");
  ASSERT_TRUE(trace) << trace.error();
  EXPECT_EQ(trace->format, TraceFormat::kAgentic);
  EXPECT_EQ(trace->block_size, 64);
  ASSERT_EQ(trace->requests.size(), 53u);  // 9 main-session requests + 44 in 4 sub-agents
  EXPECT_EQ(trace->requests[0].input_len, 19560);
  EXPECT_EQ(trace->requests[0].output_len, 1017);
  // The first sub-agent starts at t=79.224 and its first request at its own t=0.
  const auto sub = std::find_if(trace->requests.begin(), trace->requests.end(),
                                [](const TraceRequest& r) { return !r.agent.empty(); });
  ASSERT_NE(sub, trace->requests.end());
  EXPECT_EQ(sub->agent, "agent_001");
  EXPECT_DOUBLE_EQ(sub->arrival_s, 79.224);
  EXPECT_EQ(sub->input_len, 11651);
  EXPECT_DOUBLE_EQ(sub->api_time_s, 2.16);
  size_t subagent_requests = 0;
  for (size_t i = 0; i < trace->requests.size(); ++i) {
    const TraceRequest& r = trace->requests[i];
    subagent_requests += r.agent.empty() ? 0 : 1;
    EXPECT_EQ(static_cast<int64_t>(r.hash_ids.size()), r.input_len / 64);  // full blocks only
    if (i > 0) {
      EXPECT_GE(r.arrival_s, trace->requests[i - 1].arrival_s);
    }
  }
  EXPECT_EQ(subagent_requests, 44u);
  const PrefixHitStats hits = theoretical_prefix_hits(trace->requests, 128);
  EXPECT_EQ(hits.input_tokens, 2576410);  // the file's combined_tokens.input
  EXPECT_EQ(hits.hit_tokens, 2248896);
  EXPECT_EQ(hits.hit_tokens_server_blocks, 2247040);
}

TEST(TraceFiles, EveryAgenticFileParsesAndMatchesItsTotals) {
  REQUIRE_TRACES(dir);
  auto files = list_trace_files(dir + "/agentic-coding");
  ASSERT_TRUE(files) << files.error();
  ASSERT_GE(files->size(), 11u);
  for (const std::string& f : *files) {
    std::ifstream in(f);
    const auto j = nlohmann::json::parse(in);
    auto trace = load_agentic_trace(f);
    ASSERT_TRUE(trace) << trace.error();
    int64_t input = 0, output = 0;
    for (const auto& r : trace->requests) {
      input += r.input_len;
      output += r.output_len;
    }
    EXPECT_EQ(input, j["totals"]["combined_tokens"]["input"].get<int64_t>()) << f;
    EXPECT_EQ(output, j["totals"]["combined_tokens"]["output"].get<int64_t>()) << f;
  }
}

TEST(TraceFiles, Mooncake) {
  REQUIRE_TRACES(dir);
  auto trace = load_trace(dir + "/mooncake/conversation_trace.jsonl");
  ASSERT_TRUE(trace) << trace.error();
  EXPECT_EQ(trace->format, TraceFormat::kMooncake);
  ASSERT_EQ(trace->requests.size(), 12031u);
  const TraceRequest& first = trace->requests.front();
  EXPECT_EQ(first.input_len, 6758);
  EXPECT_EQ(first.output_len, 500);
  EXPECT_EQ(first.block_size, 512);
  EXPECT_EQ(first.hash_ids.size(), 14u);  // ceil(6758 / 512): the last block is partial
  EXPECT_DOUBLE_EQ(trace->requests.back().arrival_s, 3536.999);
  const PrefixHitStats hits = theoretical_prefix_hits(trace->requests, 0);
  EXPECT_EQ(hits.input_tokens, 144793823);
  EXPECT_EQ(hits.hit_tokens, 54063104);
}

TEST(Synthesis, EqualHashIdsGiveEqualBlocksOnRealTraces) {
  REQUIRE_TRACES(dir);
  testing::FakeTokenizer tok;
  const PromptSynthesizer synth(word_token_pool(tok), 7);
  for (const std::string name : {"/agentic-coding/trace_0504.json", "/mooncake/synthetic_trace.jsonl"}) {
    auto trace = load_trace(dir + name);
    ASSERT_TRUE(trace) << trace.error();
    const size_t count = std::min<size_t>(trace->requests.size(), 40);
    std::map<int64_t, std::vector<int32_t>> block_of;  // hash id -> its full block
    for (size_t i = 0; i < count; ++i) {
      const TraceRequest& r = trace->requests[i];
      const std::vector<int32_t> ids = synth.synthesize(r, i);
      ASSERT_EQ(static_cast<int64_t>(ids.size()), r.input_len) << name << " request " << i;
      for (size_t b = 0; b < r.hash_ids.size(); ++b) {
        const size_t begin = b * static_cast<size_t>(r.block_size);
        const size_t end = std::min(ids.size(), begin + static_cast<size_t>(r.block_size));
        if (begin >= end) break;
        const std::vector<int32_t> block(ids.begin() + begin, ids.begin() + end);
        auto [it, inserted] = block_of.emplace(r.hash_ids[b], block);
        if (inserted && block.size() < static_cast<size_t>(r.block_size)) block_of.erase(it);  // keep full ones
        if (!inserted) {
          // A partial last block is a prefix of the full block with the same id.
          ASSERT_TRUE(std::equal(block.begin(), block.end(), it->second.begin())) << name << " id " << r.hash_ids[b];
        }
      }
    }
    EXPECT_FALSE(block_of.empty());
  }
}

TEST(Synthesis, BlocksDifferAcrossIdsAndScopesAndTailsAreUnique) {
  testing::FakeTokenizer tok;
  const PromptSynthesizer synth(word_token_pool(tok), 1);
  EXPECT_EQ(synth.block_tokens(0, 5, 64), synth.block_tokens(0, 5, 64));
  EXPECT_NE(synth.block_tokens(0, 5, 64), synth.block_tokens(0, 6, 64));
  EXPECT_NE(synth.block_tokens(0, 5, 64), synth.block_tokens(1, 5, 64));
  const auto prefix = synth.block_tokens(0, 5, 10);
  const auto full = synth.block_tokens(0, 5, 64);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), full.begin()));
  EXPECT_NE(PromptSynthesizer(word_token_pool(tok), 2).block_tokens(0, 5, 64), full);

  TraceRequest r;
  r.block_size = 64;
  r.hash_ids = {1, 2};
  r.input_len = 64 * 2 + 30;
  const auto a = synth.synthesize(r, 0);
  const auto b = synth.synthesize(r, 1);
  ASSERT_EQ(a.size(), 158u);
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 128, b.begin()));
  EXPECT_FALSE(std::equal(a.begin() + 128, a.end(), b.begin() + 128));
}

TEST(Synthesis, WordTokenPromptsKeepTheirLengthAsText) {
  testing::FakeTokenizer tok;
  const std::vector<int32_t> pool = word_token_pool(tok);
  ASSERT_EQ(pool.size(), static_cast<size_t>(testing::FakeTokenizer::kNumWords));
  const PromptSynthesizer synth(pool, 3);
  TraceRequest r;
  r.block_size = 16;
  r.hash_ids = {9, 8, 7};
  r.input_len = 41;
  const auto ids = synth.synthesize(r, 4);
  EXPECT_EQ(tok.encode(tok.decode(ids)), ids);
}

TEST(PrefixHits, InfiniteCacheChainsOnFullBlocks) {
  auto req = [](std::vector<int64_t> ids, int64_t input_len, uint32_t scope = 0) {
    TraceRequest r;
    r.block_size = 10;
    r.hash_ids = std::move(ids);
    r.input_len = input_len;
    r.scope = scope;
    return r;
  };
  const std::vector<TraceRequest> reqs = {
      req({1, 2, 3}, 25),     // blocks 1,2 full (3 partial, not cached): 0 hits
      req({1, 2, 3}, 30),     // 1,2 hit; 3 now cached
      req({1, 4, 3}, 30),     // 1 hits; 4 misses, so 3 (a different chain) misses too
      req({1, 2, 3, 5}, 35),  // 1,2,3 hit
      req({1, 2}, 20, 1),     // another file's ids: no hits
  };
  const PrefixHitStats s = theoretical_prefix_hits(reqs, 0);
  EXPECT_EQ(s.input_tokens, 140);
  EXPECT_EQ(s.hit_tokens, 0 + 20 + 10 + 30 + 0);
  EXPECT_DOUBLE_EQ(s.hit_rate(), 60.0 / 140.0);
  const PrefixHitStats s16 = theoretical_prefix_hits(reqs, 16);
  EXPECT_EQ(s16.hit_tokens_server_blocks, 16 + 0 + 16);
}

TEST(Sessions, EachRequestFollowsItsSessionsPrevious) {
  auto req = [](double t, double api, uint32_t scope, std::string agent) {
    TraceRequest r;
    r.arrival_s = t;
    r.api_time_s = api;
    r.scope = scope;
    r.agent = std::move(agent);
    return r;
  };
  const std::vector<TraceRequest> reqs = {req(0, 2, 0, ""), req(1, 1, 1, ""), req(3, 5, 0, "a1"),
                                          req(5, 1, 0, ""), req(5.5, 1, 0, "a1"), req(6, 0, 1, "")};
  const auto links = session_links(reqs, 0.5);
  EXPECT_EQ(links[0].after, -1);
  EXPECT_EQ(links[1].after, -1);
  EXPECT_EQ(links[2].after, -1);  // a sub-agent is its own session
  EXPECT_EQ(links[3].after, 0);
  EXPECT_DOUBLE_EQ(links[3].gap_s, (5 - 0 - 2) * 0.5);
  EXPECT_EQ(links[4].after, 2);
  EXPECT_DOUBLE_EQ(links[4].gap_s, 0.0);  // 5.5 - 3 - 5 < 0
  EXPECT_EQ(links[5].after, 1);
  EXPECT_DOUBLE_EQ(links[5].gap_s, (6 - 1 - 1) * 0.5);
}

TEST(TraceFiles, MalformedInputIsAnError) {
  const std::string path = ::testing::TempDir() + "/bad_trace.jsonl";
  std::ofstream(path) << "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [\"x\"]}\n";
  auto t = load_trace(path);
  ASSERT_FALSE(t);
  EXPECT_NE(t.error().find("hash id"), std::string::npos);
  EXPECT_FALSE(load_trace(::testing::TempDir() + "/does_not_exist.json"));
}

}  // namespace
}  // namespace m3::bench
