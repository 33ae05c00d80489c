// The `bench` / `eval` subcommands, parsed by CLI11 as m3serve's main() does, against the
// stdlib-Python fake server.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "bench/cli.h"
#include "bench/datasets.h"
#include "bench/trace_replay.h"
#include "fake_server.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

// Runs `m3serve ARGS...` through CLI11; returns the exit code main() would.
int run_cli(std::vector<std::string> args) {
  CLI::App app{"m3serve"};
  app.require_subcommand(1);
  register_bench_commands(app);
  register_eval_commands(app);
  args.insert(args.begin(), "m3serve");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

class BenchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = ::testing::TempDir() + "/bench_cli_gsm8k";
    server_ = m3::bench::testing::FakeOpenAiServer::start(m3::bench::testing::write_mini_gsm8k(data_dir_));
    if (!server_) GTEST_SKIP() << "python3 or the fake server script is unavailable";
  }
  std::string data_dir_;
  std::unique_ptr<m3::bench::testing::FakeOpenAiServer> server_;
};

TEST_F(BenchCli, EvalGsm8kWritesResultFile) {
  const std::string out = ::testing::TempDir() + "/bench_cli_eval";
  ASSERT_EQ(run_cli({"eval", "gsm8k", "--base-url", server_->base_url(), "--model", "exact", "--data-dir",
                     data_dir_, "--limit", "3", "--concurrency", "2", "--no-progress", "--result-dir", out,
                     "--result-file", "g.json"}),
            0);
  const auto r = read_json(out + "/g.json");
  EXPECT_EQ(r["num_questions"], 3);
  EXPECT_EQ(r["strict_match"]["correct"], 3);
  EXPECT_EQ(r["config"]["num_fewshot"], 5);
}

TEST_F(BenchCli, ReplayWithoutTokenizerSendsIdsAndModelComesFromTheServer) {
  const std::string out = ::testing::TempDir() + "/bench_cli_replay";
  const std::string trace = m3::bench::testing::write_mini_trace(::testing::TempDir() + "/cli_trace.json");
  ASSERT_EQ(run_cli({"bench", "replay", "--base-url", server_->base_url(), "--trace", trace, "--token-id-min",
                     "1000", "--token-id-max", "2000", "--fixed-concurrency", "--max-concurrency", "1",
                     "--no-progress", "--result-dir", out}),
            0);
  const auto r = read_json(out + "/bench-replay.json");
  EXPECT_EQ(r["config"]["model"], "fake-model");
  EXPECT_EQ(r["prompt_format"], "token_ids");
  EXPECT_EQ(r["summary"]["completed"], 4);
}

TEST_F(BenchCli, ErrorsExitNonZero) {
  // bench serve's datasets need a tokenizer.
  EXPECT_EQ(run_cli({"bench", "serve", "--base-url", server_->base_url(), "--model", "m", "--no-progress"}), 1);
  EXPECT_NE(run_cli({"bench", "serve", "--no-such-flag"}), 0);
  EXPECT_NE(run_cli({"bench", "replay"}), 0);  // --trace is required
  EXPECT_EQ(run_cli({"bench", "serve", "--request-rate", "fast", "--model", "m"}), 1);
}

// A real byte-level BPE (trained here with HF `tokenizers`) through Tokenizer::from_dir:
// random prompts re-tokenise to their target lengths and synthesised trace prompts survive
// the text round trip token for token.
class RealTokenizer : public BenchCli {
 protected:
  void SetUp() override {
    BenchCli::SetUp();
    if (IsSkipped()) return;
    const char* src = std::getenv("M3_SOURCE_DIR");
    const char* shared = std::getenv("M3_SHARED_DIR");
    // Per process: two test runs (e.g. two clones under CI) must not rewrite each other's tokenizer.
    dir_ = ::testing::TempDir() + "/bench_bpe_" + std::to_string(getpid());
    const std::string corpus = std::string(shared ? shared : "../shared") + "/data/corpus/tinyshakespeare.txt";
    if (!std::ifstream(corpus)) GTEST_SKIP() << "corpus " << corpus << " is absent (../shared/data not beside the checkout)";
    const std::string cmd = "python3 '" + std::string(src ? src : ".") + "/tests/e2e/bench/make_bpe_tokenizer.py' '" +
                            dir_ + "' '" + corpus + "' > /dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "python3 with the tokenizers package is unavailable";
    auto tok = m3::Tokenizer::from_dir(dir_);
    ASSERT_TRUE(tok) << tok.error();
    tokenizer_ = std::move(tok.value());
  }
  std::string dir_;
  std::unique_ptr<m3::Tokenizer> tokenizer_;
};

TEST_F(RealTokenizer, RandomPromptsHaveTheirTargetLengths) {
  m3::bench::RandomDatasetConfig c;
  c.input_len = 300;
  c.output_len = 4;
  c.range_ratio = 0.2;
  c.num_prompts = 30;
  c.seed = 9;
  auto prompts = m3::bench::make_random_dataset(*tokenizer_, c);
  ASSERT_TRUE(prompts) << prompts.error();
  const auto targets = m3::bench::sample_lengths(30, 300, 0.2, 1, 9);
  int exact = 0;
  for (size_t i = 0; i < prompts->size(); ++i) {
    const auto len = static_cast<int64_t>(tokenizer_->encode((*prompts)[i].text).size());
    EXPECT_EQ(len, (*prompts)[i].prompt_len);
    EXPECT_LE(std::llabs(len - targets[i]), 1) << i;
    exact += len == targets[i];
  }
  EXPECT_GE(exact, 28);
}

TEST_F(RealTokenizer, TracePromptsSurviveTheTextRoundTrip) {
  const auto pool = m3::bench::word_token_pool(*tokenizer_);
  ASSERT_GE(pool.size(), 100u);
  const m3::bench::PromptSynthesizer synth(pool, 1);
  auto trace = m3::bench::load_trace(m3::bench::testing::write_mini_trace(::testing::TempDir() + "/rt_trace.json"));
  ASSERT_TRUE(trace) << trace.error();
  for (size_t i = 0; i < trace->requests.size(); ++i) {
    const auto ids = synth.synthesize(trace->requests[i], i);
    EXPECT_EQ(tokenizer_->encode(tokenizer_->decode(ids)), ids) << i;
  }
}

TEST_F(RealTokenizer, BenchServeCommandRuns) {
  const std::string out = ::testing::TempDir() + "/bench_cli_serve";
  ASSERT_EQ(run_cli({"bench", "serve", "--base-url", server_->base_url(), "--tokenizer", dir_,
                     "--random-input-len", "100", "--random-output-len", "5", "--num-prompts", "4",
                     "--max-concurrency", "2", "--no-progress", "--result-dir", out, "--result-file", "s.json"}),
            0);
  const auto r = read_json(out + "/s.json");
  EXPECT_EQ(r["summary"]["completed"], 4);
  EXPECT_EQ(r["summary"]["total_input_tokens"], 400);
  EXPECT_EQ(r["config"]["model"], "fake-model");
}

}  // namespace
