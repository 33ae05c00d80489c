#pragma once
// Trace files and prompt synthesis for `bench replay`.
//
// Mooncake traces (JSONL: timestamp in ms, input_length, output_length, hash_ids on
// 512-token blocks; the last id may cover a partial block) and agentic-coding traces (JSON:
// requests with t in s, in, out, hash_ids on 64-token full blocks, and "subagent" entries
// whose own requests' t are relative to the sub-agent's start). Hash ids are scoped to one
// file. A prompt is synthesised so that equal hash ids give equal token blocks: block
// content is a pure function of (seed, scope, hash id); tokens beyond the blocks are unique
// to the request. The server therefore sees the trace's real prefix sharing.
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace m3::bench {

enum class TraceFormat { kMooncake, kAgentic };

struct TraceRequest {
  double arrival_s = 0;  // from the start of its trace file
  int64_t input_len = 0;
  int64_t output_len = 0;
  int64_t block_size = 0;
  std::vector<int64_t> hash_ids;
  double api_time_s = 0;  // agentic: how long the recorded call took (0 if unknown)
  uint32_t scope = 0;  // which file: hash ids are only comparable within one
  std::string agent;   // sub-agent id, "" for the main session
};

struct Trace {
  std::string path;
  TraceFormat format = TraceFormat::kMooncake;
  int64_t block_size = 0;
  std::vector<TraceRequest> requests;  // sorted by arrival
};

Result<Trace> load_mooncake_trace(const std::string& path, int64_t block_size = 512);
Result<Trace> load_agentic_trace(const std::string& path);
// By content: a JSON object with "requests" is agentic, JSON lines are Mooncake.
Result<Trace> load_trace(const std::string& path);
// Trace files of a directory (*.json, *.jsonl), sorted by name; a file path gives itself.
Result<std::vector<std::string>> list_trace_files(const std::string& path);

// All requests of several traces on one timeline (file k starts at k * stagger_s), each
// file its own hash scope, sorted by arrival.
std::vector<TraceRequest> merge_traces(const std::vector<Trace>& traces, double stagger_s);

// Agentic sessions as conversations: each request of a session (file and agent) depends on
// the session's previous one, with the recorded gap between that call's end and this call's
// start (t - previous t - previous api_time, at least 0), times time_scale.
struct SessionLink {
  int64_t after = -1;
  double gap_s = 0;
};
std::vector<SessionLink> session_links(const std::vector<TraceRequest>& requests, double time_scale);

class PromptSynthesizer {
 public:
  // pool: token ids to draw from (see word_token_pool: they keep their length as text).
  PromptSynthesizer(std::vector<int32_t> pool, uint64_t seed);
  // The first num_tokens tokens of the block for (scope, hash_id).
  std::vector<int32_t> block_tokens(uint32_t scope, int64_t hash_id, int64_t num_tokens) const;
  // input_len tokens: the request's blocks in order, then tokens unique to request_index.
  std::vector<int32_t> synthesize(const TraceRequest& request, uint64_t request_index) const;

 private:
  void append_tokens(uint64_t key, int64_t num_tokens, std::vector<int32_t>& out) const;
  std::vector<int32_t> pool_;
  uint64_t seed_;
};

struct PrefixHitStats {
  int64_t input_tokens = 0;
  int64_t hit_tokens = 0;  // at the trace's block granularity
  int64_t hit_tokens_server_blocks = 0;  // rounded down to server_block_size per request
  double hit_rate() const { return input_tokens > 0 ? static_cast<double>(hit_tokens) / static_cast<double>(input_tokens) : 0.0; }
  double hit_rate_server_blocks() const { return input_tokens > 0 ? static_cast<double>(hit_tokens_server_blocks) / static_cast<double>(input_tokens) : 0.0; }
};
// The prefix hit rate an infinite cache would reach serving requests in order: a request
// hits its leading full blocks whose whole chain of hash ids some earlier request had as
// full blocks. server_block_size 0 means the trace's own block size.
PrefixHitStats theoretical_prefix_hits(const std::vector<TraceRequest>& requests,
                                       int64_t server_block_size);

}  // namespace m3::bench
