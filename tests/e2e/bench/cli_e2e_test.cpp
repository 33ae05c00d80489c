// The `bench` / `eval` subcommands, parsed by CLI11 as m3serve's main() does, against the
// stdlib-Python fake server.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "bench/cli.h"
#include "fake_server.h"

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

}  // namespace
