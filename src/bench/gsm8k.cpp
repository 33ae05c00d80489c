#include "bench/gsm8k.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <random>

#include "bench/http_client.h"
#include "bench/load_runner.h"
#include "bench/progress.h"

namespace m3::bench {

using nlohmann::json;

Result<std::vector<Gsm8kExample>> load_gsm8k_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::error("cannot open " + path);
  std::vector<Gsm8kExample> out;
  std::string row;
  for (size_t line_no = 1; std::getline(in, row); ++line_no) {
    if (row.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(row, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("question") || !j.contains("answer") ||
        !j["question"].is_string() || !j["answer"].is_string()) {
      return Status::error(path + ":" + std::to_string(line_no) + ": expected {question, answer}");
    }
    out.push_back({j["question"].get<std::string>(), j["answer"].get<std::string>()});
  }
  if (out.empty()) return Status::error(path + ": no examples");
  return out;
}

std::vector<Gsm8kExample> pick_fewshot(const std::vector<Gsm8kExample>& pool, size_t k, uint64_t seed) {
  std::vector<size_t> order(pool.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed);
  // Partial Fisher-Yates: only the first k positions are needed.
  const size_t count = std::min(k, pool.size());
  for (size_t i = 0; i < count; ++i) {
    std::uniform_int_distribution<size_t> pick(i, order.size() - 1);
    std::swap(order[i], order[pick(rng)]);
  }
  std::vector<Gsm8kExample> shots;
  for (size_t i = 0; i < count; ++i) shots.push_back(pool[order[i]]);
  return shots;
}

std::string build_gsm8k_prompt(const std::vector<Gsm8kExample>& shots, const std::string& question) {
  std::string out;
  for (const Gsm8kExample& s : shots) out += "Question: " + s.question + "\nAnswer: " + s.answer + "\n\n";
  out += "Question: " + question + "\nAnswer:";
  return out;
}

std::vector<ChatMessage> build_gsm8k_messages(const std::vector<Gsm8kExample>& shots,
                                              const std::string& question) {
  std::vector<ChatMessage> out;
  for (const Gsm8kExample& s : shots) {
    out.push_back({"user", "Question: " + s.question + "\nAnswer:"});
    out.push_back({"assistant", s.answer});
  }
  out.push_back({"user", "Question: " + question + "\nAnswer:"});
  return out;
}

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool in_flex_class(char c) { return is_digit(c) || c == '$' || c == '.' || c == ','; }

// Length of a match of -?[0-9.,]+ at pos (0 if none).
size_t strict_number_at(const std::string& s, size_t pos) {
  size_t i = pos;
  if (i < s.size() && s[i] == '-') ++i;
  const size_t digits_begin = i;
  while (i < s.size() && (is_digit(s[i]) || s[i] == '.' || s[i] == ',')) ++i;
  return i > digits_begin ? i - pos : 0;
}

}  // namespace

std::optional<std::string> extract_strict_answer(const std::string& text) {
  const std::string marker = "#### ";
  for (size_t pos = text.find(marker); pos != std::string::npos; pos = text.find(marker, pos + 1)) {
    const size_t begin = pos + marker.size();
    const size_t len = strict_number_at(text, begin);
    if (len > 0) return text.substr(begin, len);
  }
  return std::nullopt;
}

std::optional<std::string> extract_flexible_answer(const std::string& text) {
  // Leftmost-first matches of (-?[$0-9.,]{2,})|(-?[0-9]+), keeping the last.
  std::optional<std::string> last;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i;
    if (text[j] == '-') ++j;
    size_t run = 0;
    while (j + run < text.size() && in_flex_class(text[j + run])) ++run;
    if (run >= 2) {
      last = text.substr(i, j + run - i);
      i = j + run;
      continue;
    }
    size_t digits = 0;
    while (j + digits < text.size() && is_digit(text[j + digits])) ++digits;
    if (digits >= 1) {
      last = text.substr(i, j + digits - i);
      i = j + digits;
      continue;
    }
    ++i;
  }
  return last;
}

std::string normalize_gsm8k_answer(const std::string& text) {
  std::string s = text;
  const std::string marker = "#### ";
  if (const size_t pos = s.rfind(marker); pos != std::string::npos) s = s.substr(pos + marker.size());
  s.erase(std::remove_if(s.begin(), s.end(), [](char c) { return c == ',' || c == '$'; }), s.end());
  if (!s.empty() && s.back() == '.') s.pop_back();
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool gsm8k_match(const std::optional<std::string>& extracted, const std::string& reference_answer) {
  if (!extracted) return false;
  return normalize_gsm8k_answer(*extracted) == normalize_gsm8k_answer(reference_answer);
}

ProportionInterval wilson_interval(int64_t successes, int64_t trials, double z) {
  if (trials <= 0) return {0.0, 1.0};
  const double n = static_cast<double>(trials);
  const double p = static_cast<double>(successes) / n;
  const double z2 = z * z;
  const double denom = 1.0 + z2 / n;
  const double center = (p + z2 / (2.0 * n)) / denom;
  const double half = z / denom * std::sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n));
  return {std::max(0.0, center - half), std::min(1.0, center + half)};
}

Result<json> run_gsm8k(const Gsm8kConfig& config) {
  auto api = parse_api_kind(config.endpoint);
  if (!api) return api.status();
  auto base = parse_base_url(config.base_url);
  if (!base) return base.status();
  auto test = load_gsm8k_jsonl(config.data_dir + "/test.jsonl");
  if (!test) return test.status();
  auto train = load_gsm8k_jsonl(config.data_dir + "/train.jsonl");
  if (!train) return train.status();
  const std::vector<Gsm8kExample> shots = pick_fewshot(*train, config.num_fewshot, config.seed);
  std::vector<Gsm8kExample> questions = std::move(*test);
  if (config.limit > 0 && config.limit < questions.size()) questions.resize(config.limit);

  std::vector<RequestSpec> specs;
  for (const Gsm8kExample& q : questions) {
    RequestSpec spec;
    if (*api == ApiKind::kChat) {
      spec.messages = build_gsm8k_messages(shots, q.question);
    } else {
      spec.prompt = build_gsm8k_prompt(shots, q.question);
    }
    spec.max_tokens = config.max_tokens;
    spec.temperature = 0.0;
    spec.stop = {"Question:", "</s>", "<|im_end|>"};
    specs.push_back(std::move(spec));
  }
  LoadConfig load;
  load.scheme_host_port = base->scheme_host_port;
  load.path = join_url_path(base->path_prefix, endpoint_path(config.endpoint));
  load.options.api = *api;
  load.options.model = config.model;
  load.options.stream = false;
  load.timeout_s = config.timeout_s;
  load.max_concurrency = std::max(1, config.concurrency);
  ProgressBar progress("gsm8k", static_cast<int64_t>(specs.size()), config.progress);
  LoadResult result = run_load(load, specs, {}, &progress);

  int64_t strict_ok = 0, flexible_ok = 0, failed = 0;
  std::map<std::string, int64_t> failure_reasons;
  json samples = json::array();
  for (size_t i = 0; i < questions.size(); ++i) {
    const RequestOutcome& o = result.outcomes[i];
    const auto strict = o.success ? extract_strict_answer(o.text) : std::nullopt;
    const auto flexible = o.success ? extract_flexible_answer(o.text) : std::nullopt;
    const bool s_ok = gsm8k_match(strict, questions[i].answer);
    const bool f_ok = gsm8k_match(flexible, questions[i].answer);
    strict_ok += s_ok;
    flexible_ok += f_ok;
    if (!o.success) {
      ++failed;
      ++failure_reasons[o.error];
    }
    samples.push_back({{"index", i},
                       {"question", questions[i].question},
                       {"target", normalize_gsm8k_answer(questions[i].answer)},
                       {"response", o.text},
                       {"strict", strict.value_or("[invalid]")},
                       {"flexible", flexible.value_or("[invalid]")},
                       {"strict_correct", s_ok},
                       {"flexible_correct", f_ok},
                       {"error", o.success ? "" : o.error + " " + o.error_detail}});
  }
  const auto n = static_cast<int64_t>(questions.size());
  auto score = [n](int64_t correct) {
    const ProportionInterval ci = wilson_interval(correct, n);
    return json{{"correct", correct},
                {"accuracy", n > 0 ? static_cast<double>(correct) / static_cast<double>(n) : 0.0},
                {"ci95_low", ci.low},
                {"ci95_high", ci.high}};
  };
  json shot_questions = json::array();
  for (const Gsm8kExample& s : shots) shot_questions.push_back(s.question);
  return json{{"task", "gsm8k"},
              {"num_questions", n},
              {"strict_match", score(strict_ok)},
              {"flexible_extract", score(flexible_ok)},
              {"failed_requests", failed},
              {"failure_reasons", failure_reasons},
              {"duration_s", result.duration_s},
              {"config",
               {{"base_url", config.base_url},
                {"endpoint", config.endpoint},
                {"model", config.model},
                {"data_dir", config.data_dir},
                {"limit", config.limit},
                {"concurrency", config.concurrency},
                {"num_fewshot", config.num_fewshot},
                {"seed", config.seed},
                {"max_tokens", config.max_tokens}}},
              {"fewshot_questions", shot_questions},
              {"samples", samples}};
}

}  // namespace m3::bench
