#pragma once
// Drives a list of requests against one endpoint: each is sent no earlier than its arrival
// time, with at most max_concurrency in flight (requests are taken in order, so a full
// window delays later ones exactly as a semaphore would).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/openai_stream.h"
#include "bench/request.h"

namespace m3::bench {

class ProgressBar;

struct LoadConfig {
  std::string scheme_host_port;  // "http://host:port"
  std::string path;              // "/v1/completions"
  RequestOptions options;
  double timeout_s = 600.0;  // per read; generous because long prefills under load are slow
  int max_concurrency = 0;   // 0: unlimited (bounded by max_threads)
  int max_threads = 4096;
};

struct LoadResult {
  std::vector<RequestOutcome> outcomes;  // same order as the specs
  double duration_s = 0.0;               // first send to last completion
};

// arrival_s: offsets from the start, one per spec (non-decreasing); empty means all at once.
LoadResult run_load(const LoadConfig& config, const std::vector<RequestSpec>& specs,
                    const std::vector<double>& arrival_s, ProgressBar* progress);

// Request i may wait for an earlier request to finish (a conversation's next turn): it is
// sent no earlier than that request's completion plus gap_s (and its own arrival time).
struct RequestDependency {
  int64_t after = -1;  // index of an earlier request, or -1
  double gap_s = 0.0;
};

// The same, with request i built by make_spec(i) on a worker thread just before it is sent
// (so a long trace's prompts need not all be held at once); make_spec must be thread-safe.
// dependencies: empty, or one per request.
LoadResult run_load(const LoadConfig& config, size_t num_requests,
                    const std::function<RequestSpec(size_t)>& make_spec,
                    const std::vector<double>& arrival_s, ProgressBar* progress,
                    const std::vector<RequestDependency>& dependencies = {});

// Arrival offsets for n requests at request_rate per second: gamma-distributed gaps with
// shape `burstiness` (1 = Poisson) and mean 1/rate; all zero when the rate is infinite.
std::vector<double> make_arrival_times(size_t n, double request_rate, double burstiness,
                                       uint64_t seed);

}  // namespace m3::bench
