#pragma once
// GSM8K correctness gate: k-shot prompts (few-shot pool from train.jsonl, fixed seed),
// greedy decoding, answers extracted the way lm-evaluation-harness does ("strict":
// the first "#### <number>"; "flexible": the last number in the text), exact match after
// removing ',', '$', a trailing '.' and everything up to "#### ", case-insensitively.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/openai_stream.h"
#include "core/status.h"

namespace m3::bench {

struct Gsm8kExample {
  std::string question;
  std::string answer;  // worked solution ending in "#### <number>"
};

Result<std::vector<Gsm8kExample>> load_gsm8k_jsonl(const std::string& path);
// k distinct examples drawn with a fixed seed; the same shots serve every question.
std::vector<Gsm8kExample> pick_fewshot(const std::vector<Gsm8kExample>& pool, size_t k, uint64_t seed);

// "Question: q\nAnswer: a\n\n" per shot, then "Question: q\nAnswer:".
std::string build_gsm8k_prompt(const std::vector<Gsm8kExample>& shots, const std::string& question);
// The same as alternating user / assistant turns (few-shot as multi-turn).
std::vector<ChatMessage> build_gsm8k_messages(const std::vector<Gsm8kExample>& shots,
                                              const std::string& question);

std::optional<std::string> extract_strict_answer(const std::string& text);
std::optional<std::string> extract_flexible_answer(const std::string& text);
std::string normalize_gsm8k_answer(const std::string& text);
// Whether an extracted answer (nullopt: none found) matches the reference solution.
bool gsm8k_match(const std::optional<std::string>& extracted, const std::string& reference_answer);

struct ProportionInterval {
  double low = 0;
  double high = 0;
};
// Wilson score interval for successes out of trials at normal quantile z (95%: 1.96).
ProportionInterval wilson_interval(int64_t successes, int64_t trials, double z = 1.959963984540054);

struct Gsm8kConfig {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "completions";
  std::string model;
  std::string data_dir;  // holds test.jsonl and train.jsonl
  size_t limit = 0;      // 0: the whole test set
  int concurrency = 16;
  size_t num_fewshot = 5;
  uint64_t seed = 1234;
  int64_t max_tokens = 256;
  double timeout_s = 600;
  bool progress = true;
};
// Runs the evaluation; the JSON holds the scores, intervals, config and every sample.
Result<nlohmann::json> run_gsm8k(const Gsm8kConfig& config);

}  // namespace m3::bench
