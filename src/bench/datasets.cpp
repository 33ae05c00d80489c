#include "bench/datasets.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace m3::bench {

std::vector<int32_t> word_token_pool(const Tokenizer& tokenizer, size_t max_tokens) {
  std::vector<int32_t> pool;
  const int32_t vocab = tokenizer.vocab_size();
  for (int32_t id = 0; id < vocab && pool.size() < max_tokens; ++id) {
    if (tokenizer.is_special(id)) continue;
    const std::string text = tokenizer.decode({id});
    if (text.size() < 3 || text[0] != ' ') continue;
    if (!std::all_of(text.begin() + 1, text.end(), [](char c) { return c >= 'a' && c <= 'z'; })) {
      continue;
    }
    const std::vector<int32_t> back = tokenizer.encode(text, false);
    if (back.size() == 1 && back[0] == id) pool.push_back(id);
  }
  return pool;
}

std::vector<int32_t> non_special_ids(const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  const int32_t vocab = tokenizer.vocab_size();
  ids.reserve(static_cast<size_t>(std::max(0, vocab)));
  for (int32_t id = 0; id < vocab; ++id) {
    if (!tokenizer.is_special(id)) ids.push_back(id);
  }
  return ids;
}

TextForLength text_with_token_length(const Tokenizer& tokenizer, std::vector<int32_t> ids,
                                     int64_t target_len, const std::vector<int32_t>& pool,
                                     const std::vector<int32_t>& stable_pool, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, pool.empty() ? 0 : pool.size() - 1);
  std::uniform_int_distribution<size_t> pick_stable(0, stable_pool.empty() ? 0 : stable_pool.size() - 1);
  constexpr size_t kStableTail = 8;
  const auto target = static_cast<size_t>(std::max<int64_t>(0, target_len));
  TextForLength best;
  size_t best_gap = SIZE_MAX;
  constexpr int kAttempts = 16;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    std::string text = tokenizer.decode(ids);
    std::vector<int32_t> encoded = tokenizer.encode(text);
    const size_t gap = encoded.size() > target ? encoded.size() - target : target - encoded.size();
    if (gap < best_gap) {
      best_gap = gap;
      best = {text, encoded};
    }
    if (gap == 0) break;
    // Work on the re-encoded ids: they are what the server will see for this text.
    ids = std::move(encoded);
    const bool stable = attempt >= 2 && !stable_pool.empty();
    if (stable) {
      const size_t tail = std::min(target, kStableTail << std::min(attempt - 2, 10));
      ids.resize(std::min(ids.size(), target - tail));
      while (ids.size() < target) ids.push_back(stable_pool[pick_stable(rng)]);
    } else if (ids.size() > target) {
      ids.resize(target);
    } else {
      while (ids.size() < target && !pool.empty()) ids.push_back(pool[pick(rng)]);
    }
  }
  return best;
}

std::vector<int64_t> sample_lengths(size_t count, int64_t len, double range_ratio,
                                    int64_t min_len, uint64_t seed) {
  const double r = std::clamp(range_ratio, 0.0, 1.0);
  const auto lo = std::max<int64_t>(min_len, static_cast<int64_t>(std::floor(static_cast<double>(len) * (1.0 - r))));
  const auto hi = std::max<int64_t>(lo, static_cast<int64_t>(std::ceil(static_cast<double>(len) * (1.0 + r))));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  std::vector<int64_t> out(count);
  for (auto& v : out) v = lo == hi ? lo : dist(rng);
  return out;
}

Result<std::vector<BenchPrompt>> make_random_dataset(const Tokenizer& tokenizer,
                                                     const RandomDatasetConfig& config) {
  if (config.input_len <= 0) return Status::error("--random-input-len must be positive");
  if (config.output_len <= 0) return Status::error("--random-output-len must be positive");
  if (config.range_ratio < 0 || config.range_ratio >= 1) {
    return Status::error("--random-range-ratio must be in [0, 1)");
  }
  const std::vector<int32_t> pool = non_special_ids(tokenizer);
  if (pool.empty()) return Status::error("tokenizer has no non-special tokens");
  const std::vector<int32_t> stable_pool = word_token_pool(tokenizer, 4096);
  const std::vector<int64_t> input_lens =
      sample_lengths(config.num_prompts, config.input_len, config.range_ratio, 1, config.seed);
  const std::vector<int64_t> output_lens =
      sample_lengths(config.num_prompts, config.output_len, config.range_ratio, 1, config.seed + 1);
  std::mt19937_64 rng(config.seed + 2);
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  std::vector<int32_t> prefix(static_cast<size_t>(std::max<int64_t>(0, config.prefix_len)));
  for (auto& id : prefix) id = pool[pick(rng)];

  std::vector<BenchPrompt> prompts;
  prompts.reserve(config.num_prompts);
  for (size_t i = 0; i < config.num_prompts; ++i) {
    std::vector<int32_t> ids = prefix;
    for (int64_t k = 0; k < input_lens[i]; ++k) ids.push_back(pool[pick(rng)]);
    const int64_t target = static_cast<int64_t>(prefix.size()) + input_lens[i];
    TextForLength t = text_with_token_length(tokenizer, std::move(ids), target, pool, stable_pool, rng());
    BenchPrompt p;
    p.prompt_len = static_cast<int64_t>(t.ids.size());
    p.text = std::move(t.text);
    p.ids = std::move(t.ids);
    p.output_len = output_lens[i];
    prompts.push_back(std::move(p));
  }
  return prompts;
}

namespace {

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Result<std::vector<BenchPrompt>> load_sharegpt_dataset(const Tokenizer& tokenizer,
                                                       const ShareGptConfig& config) {
  auto content = read_file(config.path);
  if (!content) return content.status();
  nlohmann::json data = nlohmann::json::parse(*content, nullptr, false);
  if (data.is_discarded() || !data.is_array()) {
    return Status::error(config.path + ": expected a JSON list of conversations");
  }
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& entry : data) {
    if (!entry.is_object()) continue;
    auto conv = entry.find("conversations");
    if (conv == entry.end() || !conv->is_array() || conv->size() < 2) continue;
    const auto& a = (*conv)[0];
    const auto& b = (*conv)[1];
    if (!a.is_object() || !b.is_object() || !a.contains("value") || !b.contains("value") ||
        !a["value"].is_string() || !b["value"].is_string()) {
      continue;
    }
    pairs.emplace_back(a["value"].get<std::string>(), b["value"].get<std::string>());
  }
  std::mt19937_64 rng(config.seed);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  std::vector<BenchPrompt> prompts;
  for (const auto& [prompt, reply] : pairs) {
    if (prompts.size() >= config.num_prompts) break;
    const auto prompt_len = static_cast<int64_t>(tokenizer.encode(prompt).size());
    const int64_t reply_len = config.output_len > 0
                                  ? config.output_len
                                  : static_cast<int64_t>(tokenizer.encode(reply).size());
    if (prompt_len < 4 || (config.output_len <= 0 && reply_len < 4)) continue;
    if (prompt_len > 1024 || prompt_len + reply_len > 2048) continue;
    prompts.push_back({prompt, {}, prompt_len, reply_len});
  }
  if (prompts.empty()) return Status::error(config.path + ": no usable conversations");
  return prompts;
}

Result<std::vector<BenchPrompt>> make_sonnet_dataset(const Tokenizer& tokenizer,
                                                     const SonnetConfig& config) {
  auto content = read_file(config.path);
  if (!content) return content.status();
  std::vector<std::string> lines;
  std::istringstream in(*content);
  for (std::string row; std::getline(in, row);) {
    if (row.find_first_not_of(" \t\r") == std::string::npos) continue;
    lines.push_back(row + "\n");
  }
  if (lines.empty()) return Status::error(config.path + ": no text lines");
  const std::string base = "Pick as many lines as you can from these poem lines:\n";
  const auto base_len = static_cast<int64_t>(tokenizer.encode(base).size());
  // Average line length over (at most) the first 1000 lines sets how many lines fill a prompt.
  int64_t sampled_tokens = 0;
  const size_t sampled = std::min<size_t>(lines.size(), 1000);
  for (size_t i = 0; i < sampled; ++i) sampled_tokens += static_cast<int64_t>(tokenizer.encode(lines[i]).size());
  const double avg_line = std::max(1.0, static_cast<double>(sampled_tokens) / static_cast<double>(sampled));
  if (config.input_len <= base_len) {
    return Status::error("--sonnet-input-len must exceed the instruction's " +
                         std::to_string(base_len) + " tokens");
  }
  if (config.prefix_len > config.input_len) {
    return Status::error("--sonnet-prefix-len must not exceed --sonnet-input-len");
  }
  const auto num_input_lines = static_cast<size_t>(std::max(1.0, std::round(static_cast<double>(config.input_len - base_len) / avg_line)));
  const auto num_prefix_lines = std::min(
      num_input_lines, static_cast<size_t>(std::max(0.0, std::round(static_cast<double>(config.prefix_len - base_len) / avg_line))));
  std::string prefix = base;
  for (size_t i = 0; i < num_prefix_lines; ++i) prefix += lines[i % lines.size()];
  std::mt19937_64 rng(config.seed);
  std::uniform_int_distribution<size_t> pick(0, lines.size() - 1);
  std::vector<BenchPrompt> prompts;
  for (size_t p = 0; p < config.num_prompts; ++p) {
    std::string text = prefix;
    for (size_t i = num_prefix_lines; i < num_input_lines; ++i) text += lines[pick(rng)];
    const auto prompt_len = static_cast<int64_t>(tokenizer.encode(text).size());
    prompts.push_back({std::move(text), {}, prompt_len, config.output_len});
  }
  return prompts;
}

}  // namespace m3::bench
