#include "bench/load_runner.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "bench/progress.h"

namespace m3::bench {

LoadResult run_load(const LoadConfig& config, const std::vector<RequestSpec>& specs,
                    const std::vector<double>& arrival_s, ProgressBar* progress) {
  return run_load(config, specs.size(), [&specs](size_t i) { return specs[i]; }, arrival_s, progress);
}

LoadResult run_load(const LoadConfig& config, size_t num_requests,
                    const std::function<RequestSpec(size_t)>& make_spec,
                    const std::vector<double>& arrival_s, ProgressBar* progress,
                    const std::vector<RequestDependency>& dependencies) {
  LoadResult result;
  result.outcomes.resize(num_requests);
  if (num_requests == 0) return result;
  size_t num_workers = num_requests;
  if (config.max_concurrency > 0) num_workers = std::min<size_t>(num_workers, config.max_concurrency);
  num_workers = std::min<size_t>(num_workers, std::max(1, config.max_threads));

  std::atomic<size_t> next{0};
  const Clock::time_point start = Clock::now();
  // Completion times for dependent requests; requests are taken in index order, so the one
  // waited for is already in flight on another worker and the wait cannot deadlock.
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::vector<char> done(dependencies.empty() ? 0 : num_requests, 0);
  std::vector<Clock::time_point> done_at(done.size());
  auto offset = [&start](double seconds) {
    return start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  };
  auto worker = [&]() {
    HttpClient client(config.scheme_host_port, config.timeout_s);
    for (;;) {
      const size_t idx = next.fetch_add(1);
      if (idx >= num_requests) return;
      const RequestSpec spec = make_spec(idx);  // built before its arrival time, not after
      Clock::time_point send_at = start;
      if (idx < arrival_s.size() && arrival_s[idx] > 0) send_at = offset(arrival_s[idx]);
      if (!dependencies.empty() && dependencies[idx].after >= 0 &&
          static_cast<size_t>(dependencies[idx].after) < idx) {
        const auto after = static_cast<size_t>(dependencies[idx].after);
        std::unique_lock<std::mutex> lock(done_mu);
        done_cv.wait(lock, [&] { return done[after] != 0; });
        send_at = std::max(send_at, done_at[after] + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(dependencies[idx].gap_s)));
      }
      std::this_thread::sleep_until(send_at);
      RequestOutcome outcome = send_request(client, config.path, spec, config.options, start);
      const bool ok = outcome.success;
      result.outcomes[idx] = std::move(outcome);
      if (!done.empty()) {
        {
          std::lock_guard<std::mutex> lock(done_mu);
          done[idx] = 1;
          done_at[idx] = Clock::now();
        }
        done_cv.notify_all();
      }
      if (progress != nullptr) progress->add(ok);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(num_workers);
  for (size_t i = 0; i < num_workers; ++i) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();
  result.duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (progress != nullptr) progress->finish();
  return result;
}

std::vector<double> make_arrival_times(size_t n, double request_rate, double burstiness,
                                       uint64_t seed) {
  std::vector<double> out(n, 0.0);
  if (!std::isfinite(request_rate) || request_rate <= 0) return out;
  std::mt19937_64 rng(seed);
  const double shape = burstiness > 0 ? burstiness : 1.0;
  std::gamma_distribution<double> gap(shape, 1.0 / (request_rate * shape));
  double t = 0;
  for (size_t i = 0; i < n; ++i) {
    out[i] = t;  // the first request goes at once, as in vLLM
    t += gap(rng);
  }
  return out;
}

}  // namespace m3::bench
