#include "bench/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "tokenizer/tokenizer.h"

namespace m3::bench {

using nlohmann::json;

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * frac;
}

Distribution summarize_distribution(const std::vector<double>& values) {
  Distribution d;
  d.count = values.size();
  if (values.empty()) return d;
  double sum = 0;
  for (double v : values) sum += v;
  d.mean = sum / static_cast<double>(values.size());
  double sq = 0;
  for (double v : values) sq += (v - d.mean) * (v - d.mean);
  d.std = std::sqrt(sq / static_cast<double>(values.size()));  // population std, as numpy
  d.median = percentile(values, 50);
  d.p90 = percentile(values, 90);
  d.p99 = percentile(values, 99);
  d.min = *std::min_element(values.begin(), values.end());
  d.max = *std::max_element(values.begin(), values.end());
  return d;
}

json distribution_to_json(const Distribution& d) {
  return {{"count", d.count}, {"mean", d.mean},     {"std", d.std}, {"median", d.median},
          {"p90", d.p90},     {"p99", d.p99},       {"min", d.min}, {"max", d.max}};
}

TokenCountSources resolve_output_tokens(std::vector<RequestOutcome>& outcomes,
                                        const Tokenizer* tokenizer) {
  TokenCountSources sources;
  for (RequestOutcome& o : outcomes) {
    if (!o.success) continue;
    if (o.usage.completion_tokens >= 0) {
      o.output_tokens = o.usage.completion_tokens;
      ++sources.from_usage;
    } else if (tokenizer != nullptr) {
      o.output_tokens = static_cast<int64_t>(tokenizer->encode(o.text, false).size());
      ++sources.from_tokenizer;
    } else {
      o.output_tokens = o.num_text_chunks;
      ++sources.from_chunks;
    }
  }
  return sources;
}

BenchSummary summarize(const std::vector<RequestOutcome>& outcomes, double duration_s,
                       int num_gpus) {
  BenchSummary s;
  s.num_requests = static_cast<int64_t>(outcomes.size());
  s.duration_s = duration_s;
  s.num_gpus = std::max(1, num_gpus);
  std::vector<double> ttft, tpot, itl, e2el;
  for (const RequestOutcome& o : outcomes) {
    if (!o.success) {
      ++s.failed;
      ++s.failure_reasons[o.error.empty() ? "unknown" : o.error];
      continue;
    }
    ++s.completed;
    const int64_t input = o.prompt_len > 0 ? o.prompt_len : std::max<int64_t>(0, o.usage.prompt_tokens);
    const int64_t output = std::max<int64_t>(0, o.output_tokens);
    s.total_input_tokens += input;
    s.total_output_tokens += output;
    ttft.push_back(o.ttft_s * 1e3);
    e2el.push_back(o.latency_s * 1e3);
    if (output > 1) tpot.push_back((o.latency_s - o.ttft_s) * 1e3 / static_cast<double>(output - 1));
    for (double gap : o.itl_s) itl.push_back(gap * 1e3);
    if (o.usage.cached_tokens >= 0) {
      ++s.requests_with_cached_tokens;
      s.usage_cached_tokens += o.usage.cached_tokens;
      s.usage_prompt_tokens += std::max<int64_t>(0, o.usage.prompt_tokens);
    }
  }
  if (duration_s > 0) {
    s.request_throughput = static_cast<double>(s.completed) / duration_s;
    s.output_throughput = static_cast<double>(s.total_output_tokens) / duration_s;
    s.total_token_throughput =
        static_cast<double>(s.total_input_tokens + s.total_output_tokens) / duration_s;
  }
  s.ttft_ms = summarize_distribution(ttft);
  s.tpot_ms = summarize_distribution(tpot);
  s.itl_ms = summarize_distribution(itl);
  s.e2el_ms = summarize_distribution(e2el);
  s.interactivity_tok_s = s.tpot_ms.median > 0 ? 1000.0 / s.tpot_ms.median : 0.0;
  return s;
}

json summary_to_json(const BenchSummary& s) {
  const double gpus = static_cast<double>(s.num_gpus);
  json j = {
      {"num_requests", s.num_requests},
      {"completed", s.completed},
      {"failed", s.failed},
      {"failure_reasons", s.failure_reasons},
      {"duration_s", s.duration_s},
      {"total_input_tokens", s.total_input_tokens},
      {"total_output_tokens", s.total_output_tokens},
      {"request_throughput", s.request_throughput},
      {"output_throughput", s.output_throughput},
      {"total_token_throughput", s.total_token_throughput},
      {"num_gpus", s.num_gpus},
      {"per_gpu",
       {{"request_throughput", s.request_throughput / gpus},
        {"output_throughput", s.output_throughput / gpus},
        {"total_token_throughput", s.total_token_throughput / gpus}}},
      {"interactivity_tok_s", s.interactivity_tok_s},
      {"ttft_ms", distribution_to_json(s.ttft_ms)},
      {"tpot_ms", distribution_to_json(s.tpot_ms)},
      {"itl_ms", distribution_to_json(s.itl_ms)},
      {"e2el_ms", distribution_to_json(s.e2el_ms)},
      {"output_token_source",
       {{"usage", s.output_token_sources.from_usage},
        {"tokenizer", s.output_token_sources.from_tokenizer},
        {"chunks", s.output_token_sources.from_chunks}}},
  };
  if (s.requests_with_cached_tokens > 0) {
    j["server_cached_tokens"] = {
        {"requests_reporting", s.requests_with_cached_tokens},
        {"prompt_tokens", s.usage_prompt_tokens},
        {"cached_tokens", s.usage_cached_tokens},
        {"hit_rate", s.usage_prompt_tokens > 0 ? static_cast<double>(s.usage_cached_tokens) /
                                                     static_cast<double>(s.usage_prompt_tokens)
                                               : 0.0}};
  }
  return j;
}

namespace {

void line(std::ostringstream& os, const char* label, double value, int precision = 2) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), "%-40s %12.*f\n", label, precision, value);
  os << buf;
}

void dist_lines(std::ostringstream& os, const char* name, const Distribution& d) {
  char label[64];
  for (auto [stat, value] : {std::pair<const char*, double>{"Mean", d.mean}, {"Median", d.median},
                             {"P90", d.p90}, {"P99", d.p99}}) {
    std::snprintf(label, sizeof(label), "%s %s (ms):", stat, name);
    line(os, label, value);
  }
}

}  // namespace

std::string format_summary(const BenchSummary& s, const std::string& title) {
  std::ostringstream os;
  const std::string rule(53, '=');
  os << rule << "\n" << title << "\n" << rule << "\n";
  line(os, "Successful requests:", static_cast<double>(s.completed), 0);
  line(os, "Failed requests:", static_cast<double>(s.failed), 0);
  for (const auto& [reason, count] : s.failure_reasons) {
    os << "  " << count << " x " << reason << "\n";
  }
  line(os, "Benchmark duration (s):", s.duration_s);
  line(os, "Total input tokens:", static_cast<double>(s.total_input_tokens), 0);
  line(os, "Total generated tokens:", static_cast<double>(s.total_output_tokens), 0);
  line(os, "Request throughput (req/s):", s.request_throughput);
  line(os, "Output token throughput (tok/s):", s.output_throughput);
  line(os, "Total token throughput (tok/s):", s.total_token_throughput);
  if (s.num_gpus > 1) {
    line(os, "GPUs:", s.num_gpus, 0);
    line(os, "Output throughput per GPU (tok/s):", s.output_throughput / s.num_gpus);
    line(os, "Total throughput per GPU (tok/s):", s.total_token_throughput / s.num_gpus);
  }
  line(os, "Interactivity (tok/s/user):", s.interactivity_tok_s);
  os << "---------------Time to First Token----------------\n";
  dist_lines(os, "TTFT", s.ttft_ms);
  os << "-----Time per Output Token (excl. 1st token)------\n";
  dist_lines(os, "TPOT", s.tpot_ms);
  os << "---------------Inter-token Latency----------------\n";
  dist_lines(os, "ITL", s.itl_ms);
  os << "----------------End-to-end Latency----------------\n";
  dist_lines(os, "E2EL", s.e2el_ms);
  if (s.requests_with_cached_tokens > 0 && s.usage_prompt_tokens > 0) {
    line(os, "Server prefix cache hit rate (usage):",
         static_cast<double>(s.usage_cached_tokens) / static_cast<double>(s.usage_prompt_tokens), 4);
  }
  os << rule << "\n";
  return os.str();
}

json outcomes_to_json(const std::vector<RequestOutcome>& outcomes) {
  json arr = json::array();
  for (const RequestOutcome& o : outcomes) {
    json j = {{"success", o.success},        {"start_s", o.start_s},
              {"ttft_s", o.ttft_s},          {"latency_s", o.latency_s},
              {"prompt_len", o.prompt_len},  {"output_tokens", o.output_tokens},
              {"itl_s", o.itl_s},            {"finish_reason", o.finish_reason}};
    if (!o.success) {
      j["error"] = o.error;
      j["error_detail"] = o.error_detail;
    }
    if (o.usage.prompt_tokens >= 0) j["usage_prompt_tokens"] = o.usage.prompt_tokens;
    if (o.usage.cached_tokens >= 0) j["usage_cached_tokens"] = o.usage.cached_tokens;
    arr.push_back(std::move(j));
  }
  return arr;
}

std::map<std::string, double> parse_prometheus_text(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string row;
  while (std::getline(in, row)) {
    if (row.empty() || row[0] == '#') continue;
    size_t name_end = row.find_first_of("{ \t");
    if (name_end == std::string::npos) continue;
    const std::string name = row.substr(0, name_end);
    size_t value_begin = name_end;
    if (row[name_end] == '{') {
      // Label values may contain '}' inside quotes; scan respecting quotes and escapes.
      bool quoted = false;
      size_t i = name_end + 1;
      for (; i < row.size(); ++i) {
        if (quoted && row[i] == '\\') { ++i; continue; }
        if (row[i] == '"') quoted = !quoted;
        else if (!quoted && row[i] == '}') break;
      }
      if (i >= row.size()) continue;
      value_begin = i + 1;
    }
    const size_t num_begin = row.find_first_not_of(" \t", value_begin);
    if (num_begin == std::string::npos) continue;
    const size_t num_end = row.find_first_of(" \t", num_begin);
    const std::string token = row.substr(num_begin, num_end - num_begin);
    char* end = nullptr;
    const double value = std::strtod(token.c_str(), &end);
    if (end == token.c_str()) continue;
    out[name] += value;
  }
  return out;
}

const double* find_metric(const std::map<std::string, double>& metrics,
                          const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    auto it = metrics.find(n);
    if (it != metrics.end()) return &it->second;
  }
  return nullptr;
}

}  // namespace m3::bench
