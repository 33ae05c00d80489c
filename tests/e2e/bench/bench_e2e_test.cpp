// End-to-end: the bench clients against a stdlib-Python OpenAI-compatible streaming server.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "bench/bench_serve.h"
#include "bench/gsm8k.h"
#include "bench/replay.h"
#include "fake_server.h"
#include "fake_tokenizer.h"

namespace m3::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class BenchE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_dir_ = new std::string(::testing::TempDir() + "/bench_e2e_gsm8k");
    server_ = testing::FakeOpenAiServer::start(testing::write_mini_gsm8k(*data_dir_)).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    delete data_dir_;
  }
  void SetUp() override {
    if (server_ == nullptr) GTEST_SKIP() << "python3 or the fake server script is unavailable";
  }
  static std::string result_dir(const std::string& name) { return ::testing::TempDir() + "/bench_e2e_" + name; }
  static json read_json(const std::string& path) {
    std::ifstream in(path);
    return json::parse(in);
  }

  static testing::FakeOpenAiServer* server_;
  static std::string* data_dir_;
  testing::FakeTokenizer tokenizer_;
};

testing::FakeOpenAiServer* BenchE2E::server_ = nullptr;
std::string* BenchE2E::data_dir_ = nullptr;

TEST_F(BenchE2E, ServeRandomCompletionsStreamsAndCountsUsage) {
  BenchServeConfig c;
  c.base_url = server_->base_url();
  c.model = "m";
  c.random_input_len = 64;
  c.random_output_len = 12;
  c.num_prompts = 12;
  c.max_concurrency = 4;
  c.num_warmups = 2;
  c.ignore_eos = true;
  c.num_gpus = 2;
  c.progress = false;
  c.save_detailed = true;
  c.result_dir = result_dir("serve");
  c.result_file = "serve.json";
  auto r = run_bench_serve(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  const json file = read_json(c.result_dir + "/serve.json");
  EXPECT_EQ(file, *r);
  const json& s = file["summary"];
  EXPECT_EQ(s["completed"], 12);
  EXPECT_EQ(s["failed"], 0);
  EXPECT_EQ(s["total_input_tokens"], 12 * 64);
  EXPECT_EQ(s["total_output_tokens"], 12 * 12);
  EXPECT_EQ(s["output_token_source"]["usage"], 12);
  EXPECT_EQ(s["itl_ms"]["count"], 12 * 11);  // one chunk per token
  EXPECT_GT(s["ttft_ms"]["median"].get<double>(), 0.0);
  EXPECT_GT(s["tpot_ms"]["median"].get<double>(), 1.0);  // the server sleeps 2 ms per token
  EXPECT_NEAR(s["per_gpu"]["output_throughput"].get<double>(), s["output_throughput"].get<double>() / 2, 1e-9);
  ASSERT_EQ(file["requests"].size(), 12u);
  EXPECT_EQ(file["requests"][0]["output_tokens"], 12);
}

TEST_F(BenchE2E, ServeChatWithoutUsageRetokenisesOutput) {
  BenchServeConfig c;
  c.base_url = server_->base_url() + "/v1";
  c.endpoint = "chat";
  c.model = "m";
  c.random_input_len = 32;
  c.random_output_len = 9;
  c.num_prompts = 6;
  c.request_rate = 200;
  c.include_usage = false;
  c.progress = false;
  c.result_dir = result_dir("chat");
  auto r = run_bench_serve(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ((*r)["summary"]["completed"], 6);
  EXPECT_EQ((*r)["summary"]["total_output_tokens"], 6 * 9);
  EXPECT_EQ((*r)["summary"]["output_token_source"]["tokenizer"], 6);
  EXPECT_TRUE(fs::exists(c.result_dir + "/bench-serve-random-cinf.json"));
}

TEST_F(BenchE2E, SweepWritesOneJsonPerPointAndAChart) {
  BenchServeConfig c;
  c.base_url = server_->base_url();
  c.model = "m";
  c.random_input_len = 16;
  c.random_output_len = 4;
  c.sweep_concurrency = {1, 3};
  c.sweep_prompts_per_concurrency = 2;
  c.progress = false;
  c.result_dir = result_dir("sweep");
  c.label = "mini";
  auto r = run_bench_serve(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ(read_json(c.result_dir + "/mini-c1.json")["summary"]["completed"], 2);
  EXPECT_EQ(read_json(c.result_dir + "/mini-c3.json")["summary"]["completed"], 6);
  const json sweep = read_json(c.result_dir + "/mini-sweep.json");
  ASSERT_EQ(sweep["points"].size(), 2u);
  EXPECT_EQ(sweep["points"][1]["max_concurrency"], 3);
  std::ifstream svg(c.result_dir + "/mini-sweep.svg");
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("TTFT vs concurrency"), std::string::npos);
}

TEST_F(BenchE2E, FailedRequestsAreCountedWithReasons) {
  BenchServeConfig c;
  c.base_url = server_->base_url();
  c.model = "fail";
  c.random_input_len = 8;
  c.random_output_len = 2;
  c.num_prompts = 5;
  c.progress = false;
  c.result_dir = result_dir("fail");
  auto r = run_bench_serve(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ((*r)["summary"]["failed"], 5);
  EXPECT_EQ((*r)["summary"]["failure_reasons"]["HTTP 500"], 5);

  c.base_url = "http://127.0.0.1:1";  // nothing listens there
  auto down = run_bench_serve(c, &tokenizer_);
  ASSERT_TRUE(down) << down.error();
  EXPECT_EQ((*down)["summary"]["failed"], 5);
  EXPECT_EQ((*down)["summary"]["failure_reasons"].begin().key().rfind("connection", 0), 0u);
}

TEST_F(BenchE2E, ReplaySendsTokenIdsAndServerHitsMatchTheory) {
  ReplayConfig c;
  c.base_url = server_->base_url();
  c.model = "m";
  c.traces = {testing::write_mini_trace(::testing::TempDir() + "/mini_trace.json")};
  c.fixed_concurrency = true;
  c.max_concurrency = 1;  // in order, so the server's cache sees what the theory assumes
  c.metrics_interval_s = 0.05;
  c.server_block_size = 16;
  c.progress = false;
  c.result_dir = result_dir("replay");
  auto r = run_replay(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  const json& p = (*r)["prefix_cache"];
  EXPECT_EQ((*r)["prompt_format"], "token_ids");
  EXPECT_EQ((*r)["summary"]["completed"], 4);
  EXPECT_EQ((*r)["summary"]["total_input_tokens"], 900);
  EXPECT_EQ((*r)["summary"]["total_output_tokens"], 11);
  EXPECT_EQ(p["theoretical_hit_tokens"], 384);
  EXPECT_DOUBLE_EQ(p["theoretical_hit_rate"].get<double>(), 384.0 / 900.0);
  EXPECT_DOUBLE_EQ(p["usage_hit_rate"].get<double>(), 384.0 / 900.0);
  EXPECT_DOUBLE_EQ(p["metrics_hit_rate"].get<double>(), 384.0 / 900.0);
  EXPECT_DOUBLE_EQ((*r)["kv_cache_usage"]["max"].get<double>(), 0.5);
  EXPECT_TRUE(fs::exists(c.result_dir + "/bench-replay.json"));
}

TEST_F(BenchE2E, ReplaySessionsWaitForTheirPreviousTurn) {
  ReplayConfig c;
  c.base_url = server_->base_url();
  c.model = "m";
  c.traces = {testing::write_mini_trace(::testing::TempDir() + "/mini_trace3.json")};
  c.sessions = true;
  c.time_scale = 1.0;
  c.progress = false;
  c.metrics_interval_s = 0;
  c.save_detailed = true;
  c.result_dir = result_dir("replay_sessions");
  auto r = run_replay(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  ASSERT_EQ((*r)["summary"]["completed"], 4);
  // Main session: requests 0, 1 and 3 (by arrival); each starts after the previous ends.
  const json& q = (*r)["requests"];
  auto end_s = [&](int i) { return q[i]["start_s"].get<double>() + q[i]["latency_s"].get<double>(); };
  EXPECT_GE(q[1]["start_s"].get<double>(), end_s(0) + 0.01 - 1e-3);  // recorded gap 0.01 s
  EXPECT_GE(q[3]["start_s"].get<double>(), end_s(1) + 0.04 - 1e-3);
  EXPECT_LT(q[2]["start_s"].get<double>(), end_s(1) + 0.04);  // the sub-agent does not wait
}

TEST_F(BenchE2E, ReplayFallsBackToTextWhenIdsAreRejected) {
  ReplayConfig c;
  c.base_url = server_->base_url();
  c.model = "noids";
  c.traces = {testing::write_mini_trace(::testing::TempDir() + "/mini_trace2.json")};
  c.time_scale = 0.5;
  c.progress = false;
  c.metrics_interval_s = 0;
  c.result_dir = result_dir("replay_text");
  auto r = run_replay(c, &tokenizer_);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ((*r)["prompt_format"], "text");
  EXPECT_EQ((*r)["summary"]["completed"], 4);
  EXPECT_EQ((*r)["text_prompt_length"]["mismatched_requests"], 0);
  // Without a tokenizer there is no text to send.
  EXPECT_FALSE(run_replay(c, nullptr));
}

TEST_F(BenchE2E, Gsm8kStrictAndFlexibleScores) {
  Gsm8kConfig c;
  c.base_url = server_->base_url();
  c.data_dir = *data_dir_;
  c.concurrency = 3;
  c.progress = false;
  c.model = "exact";
  auto r = run_gsm8k(c);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ((*r)["num_questions"], 5);
  EXPECT_EQ((*r)["strict_match"]["correct"], 5);
  EXPECT_EQ((*r)["flexible_extract"]["correct"], 5);
  EXPECT_NEAR((*r)["strict_match"]["ci95_low"].get<double>(), 0.5655, 1e-4);  // Wilson, 5/5

  c.model = "flex";
  c.endpoint = "chat";
  c.limit = 4;
  r = run_gsm8k(c);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ((*r)["num_questions"], 4);
  EXPECT_EQ((*r)["strict_match"]["correct"], 0);
  EXPECT_EQ((*r)["flexible_extract"]["correct"], 4);

  c.model = "zero";  // answers 0: right only for the last question, which --limit 4 drops
  c.endpoint = "completions";
  c.limit = 0;
  r = run_gsm8k(c);
  ASSERT_TRUE(r) << r.error();
  EXPECT_EQ((*r)["flexible_extract"]["correct"], 1);
  EXPECT_EQ((*r)["samples"][4]["flexible_correct"], true);
}

}  // namespace
}  // namespace m3::bench
