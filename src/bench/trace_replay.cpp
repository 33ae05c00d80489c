#include "bench/trace_replay.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_set>

#include <nlohmann/json.hpp>

namespace m3::bench {

using nlohmann::json;

namespace {

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open trace " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<std::vector<int64_t>> hash_id_list(const json& j, const std::string& where) {
  if (!j.is_array()) return Status::error(where + ": hash_ids is not a list");
  std::vector<int64_t> ids;
  ids.reserve(j.size());
  for (const json& v : j) {
    if (!v.is_number_integer()) return Status::error(where + ": hash id is not an integer");
    ids.push_back(v.get<int64_t>());
  }
  return ids;
}

Result<int64_t> int_field(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return Status::error(where + ": missing number '" + key + "'");
  return static_cast<int64_t>(it->get<double>());
}

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void sort_by_arrival(std::vector<TraceRequest>& requests) {
  std::stable_sort(requests.begin(), requests.end(),
                   [](const TraceRequest& a, const TraceRequest& b) { return a.arrival_s < b.arrival_s; });
}

}  // namespace

Result<Trace> load_mooncake_trace(const std::string& path, int64_t block_size) {
  auto text = read_text(path);
  if (!text) return text.status();
  Trace trace;
  trace.path = path;
  trace.format = TraceFormat::kMooncake;
  trace.block_size = block_size;
  std::istringstream in(*text);
  std::string row;
  for (size_t line_no = 1; std::getline(in, row); ++line_no) {
    if (row.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    json j = json::parse(row, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return Status::error(where + ": not a JSON object");
    TraceRequest r;
    auto ts = int_field(j, "timestamp", where);
    auto in_len = int_field(j, "input_length", where);
    auto out_len = int_field(j, "output_length", where);
    if (!ts) return ts.status();
    if (!in_len) return in_len.status();
    if (!out_len) return out_len.status();
    auto ids = hash_id_list(j.value("hash_ids", json()), where);
    if (!ids) return ids.status();
    r.arrival_s = static_cast<double>(*ts) / 1000.0;
    r.input_len = *in_len;
    r.output_len = *out_len;
    r.block_size = block_size;
    r.hash_ids = std::move(*ids);
    trace.requests.push_back(std::move(r));
  }
  sort_by_arrival(trace.requests);
  return trace;
}

namespace {

Status add_agentic_requests(const json& list, double base_s, const std::string& agent,
                            int64_t block_size, const std::string& where, std::vector<TraceRequest>& out) {
  if (!list.is_array()) return Status::error(where + ": 'requests' is not a list");
  for (size_t i = 0; i < list.size(); ++i) {
    const json& r = list[i];
    const std::string at = where + " request " + std::to_string(i);
    if (!r.is_object()) return Status::error(at + ": not an object");
    const double t = r.value("t", 0.0);
    if (r.value("type", std::string()) == "subagent") {
      M3_RETURN_IF_ERROR(add_agentic_requests(r.value("requests", json::array()), base_s + t,
                                              r.value("agent_id", std::string("subagent")),
                                              block_size, at, out));
      continue;
    }
    auto in_len = int_field(r, "in", at);
    auto out_len = int_field(r, "out", at);
    if (!in_len) return in_len.status();
    if (!out_len) return out_len.status();
    auto ids = hash_id_list(r.value("hash_ids", json()), at);
    if (!ids) return ids.status();
    TraceRequest req;
    req.arrival_s = base_s + t;
    req.input_len = *in_len;
    req.output_len = *out_len;
    req.block_size = block_size;
    req.hash_ids = std::move(*ids);
    req.agent = agent;
    req.api_time_s = r.value("api_time", 0.0);
    out.push_back(std::move(req));
  }
  return Status::ok();
}

}  // namespace

Result<Trace> load_agentic_trace(const std::string& path) {
  auto text = read_text(path);
  if (!text) return text.status();
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::error(path + ": not a JSON object");
  Trace trace;
  trace.path = path;
  trace.format = TraceFormat::kAgentic;
  trace.block_size = j.value("block_size", int64_t{64});
  if (trace.block_size <= 0) return Status::error(path + ": block_size must be positive");
  M3_RETURN_IF_ERROR(add_agentic_requests(j.value("requests", json()), 0.0, "", trace.block_size,
                                          path, trace.requests));
  sort_by_arrival(trace.requests);
  return trace;
}

Result<Trace> load_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open trace " + path);
  std::string first_line;
  std::getline(in, first_line);
  // A Mooncake file is one object per line; an agentic file is one object with "requests".
  json j = json::parse(first_line, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("input_length")) return load_mooncake_trace(path);
  return load_agentic_trace(path);
}

Result<std::vector<std::string>> list_trace_files(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return std::vector<std::string>{path};
  if (!fs::is_directory(path, ec)) return Status::error("no trace file or directory at " + path);
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    const std::string ext = entry.path().extension().string();
    if (entry.is_regular_file() && (ext == ".json" || ext == ".jsonl")) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) return Status::error("no *.json / *.jsonl traces in " + path);
  return files;
}

std::vector<TraceRequest> merge_traces(const std::vector<Trace>& traces, double stagger_s) {
  std::vector<TraceRequest> all;
  for (size_t k = 0; k < traces.size(); ++k) {
    for (TraceRequest r : traces[k].requests) {
      r.scope = static_cast<uint32_t>(k);
      r.arrival_s += static_cast<double>(k) * stagger_s;
      all.push_back(std::move(r));
    }
  }
  sort_by_arrival(all);
  return all;
}

std::vector<SessionLink> session_links(const std::vector<TraceRequest>& requests, double time_scale) {
  std::vector<SessionLink> links(requests.size());
  std::map<std::pair<uint32_t, std::string>, size_t> last_of_session;
  for (size_t i = 0; i < requests.size(); ++i) {
    const TraceRequest& r = requests[i];
    auto key = std::make_pair(r.scope, r.agent);
    auto it = last_of_session.find(key);
    if (it != last_of_session.end()) {
      const TraceRequest& prev = requests[it->second];
      links[i].after = static_cast<int64_t>(it->second);
      links[i].gap_s = std::max(0.0, r.arrival_s - prev.arrival_s - prev.api_time_s) * time_scale;
      it->second = i;
    } else {
      last_of_session.emplace(std::move(key), i);
    }
  }
  return links;
}

PromptSynthesizer::PromptSynthesizer(std::vector<int32_t> pool, uint64_t seed)
    : pool_(std::move(pool)), seed_(seed) {}

void PromptSynthesizer::append_tokens(uint64_t key, int64_t num_tokens, std::vector<int32_t>& out) const {
  if (pool_.empty()) return;
  uint64_t state = mix64(seed_ ^ mix64(key));
  for (int64_t i = 0; i < num_tokens; ++i) {
    state = mix64(state);
    out.push_back(pool_[state % pool_.size()]);
  }
}

std::vector<int32_t> PromptSynthesizer::block_tokens(uint32_t scope, int64_t hash_id, int64_t num_tokens) const {
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(0, num_tokens)));
  append_tokens(mix64((static_cast<uint64_t>(scope) << 1) | 1) ^ static_cast<uint64_t>(hash_id), num_tokens, out);
  return out;
}

std::vector<int32_t> PromptSynthesizer::synthesize(const TraceRequest& request, uint64_t request_index) const {
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(0, request.input_len)));
  for (int64_t hash_id : request.hash_ids) {
    const int64_t left = request.input_len - static_cast<int64_t>(out.size());
    if (left <= 0) break;
    const std::vector<int32_t> block = block_tokens(request.scope, hash_id, std::min(left, request.block_size));
    out.insert(out.end(), block.begin(), block.end());
  }
  const int64_t tail = request.input_len - static_cast<int64_t>(out.size());
  // Tail keys come from request indices, mixed differently from block keys.
  if (tail > 0) append_tokens(mix64(request_index << 1) ^ 0x5bd1e995ULL, tail, out);
  return out;
}

PrefixHitStats theoretical_prefix_hits(const std::vector<TraceRequest>& requests,
                                       int64_t server_block_size) {
  PrefixHitStats stats;
  std::unordered_set<uint64_t> cached;  // chain hashes of full blocks seen so far
  for (const TraceRequest& r : requests) {
    stats.input_tokens += r.input_len;
    uint64_t chain = mix64(0xc0ffeeULL + r.scope);
    int64_t hit_blocks = 0;
    bool hitting = true;
    const int64_t full_blocks = r.block_size > 0 ? std::min<int64_t>(static_cast<int64_t>(r.hash_ids.size()), r.input_len / r.block_size) : 0;
    for (int64_t i = 0; i < full_blocks; ++i) {
      chain = mix64(chain ^ mix64(static_cast<uint64_t>(r.hash_ids[static_cast<size_t>(i)])));
      if (hitting && cached.count(chain) != 0) {
        ++hit_blocks;
      } else {
        hitting = false;
        cached.insert(chain);
      }
    }
    const int64_t hit = hit_blocks * r.block_size;
    stats.hit_tokens += hit;
    const int64_t bs = server_block_size > 0 ? server_block_size : r.block_size;
    stats.hit_tokens_server_blocks += bs > 0 ? hit / bs * bs : 0;
  }
  return stats;
}

}  // namespace m3::bench
