#include "ops/dispatch.h"

#include <stdexcept>

#include "core/log.h"

namespace m3::ops {
namespace {
// Shapes are bucketed to powers of two so a trace line appears once per regime, not per size.
std::string bucket(int64_t v) {
  if (v <= 1) return std::to_string(v);
  int64_t p = 1;
  while (p < v) p <<= 1;
  return "<=" + std::to_string(p);
}
const char* device_name(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }
}  // namespace

Problem make_problem(const char* op, Device device, DType dtype, int64_t m, int64_t n, int64_t k, int64_t extra,
                     bool batch_invariant) {
  Problem p;
  p.op = op;
  p.device = device;
  p.dtype = dtype;
  p.m = m;
  p.n = n;
  p.k = k;
  p.extra = extra;
  p.batch_invariant = batch_invariant;
  return p;
}

std::string Problem::shape_class() const {
  return std::string(device_name(device)) + " " + std::string(dtype_name(dtype)) + " m" + bucket(m) + " n" +
         bucket(n) + " k" + bucket(k) + (extra ? " x" + std::to_string(extra) : "") + (batch_invariant ? " batch-invariant" : "");
}

void DispatchStats::record(const Problem& problem, const std::string& entry, const std::string& reason,
                           const PlanFn* plan) {
  std::lock_guard<std::mutex> lock(mu_);
  record_locked(problem, entry, reason, plan, nullptr);
}

// plan_text: a plan already computed (a replayed selection); else plan is asked when needed.
void DispatchStats::record_locked(const Problem& problem, const std::string& entry, const std::string& reason,
                                  const PlanFn* plan, const std::string* plan_text) {
  counts_[{problem.op, entry}]++;
  shapes_[problem.op][{problem.m, problem.n, problem.k}]++;
  step_paths_.insert(std::string(problem.op) + "=" + entry);
  auto key = std::make_tuple(std::string(problem.op), entry, problem.shape_class());
  const bool first = seen_.insert(key).second;
  std::string how;
  if (plan_text) how = *plan_text;
  else if ((first || recording_) && plan && *plan) how = (*plan)(problem);
  if (recording_) {
    recorded_.push_back({problem, entry, reason, how});
    recorded_.back().problem.attention = nullptr;  // the caller's metadata does not outlive the call
  }
  if (first) {
    const std::string at = how.empty() ? "" : "m=" + std::to_string(problem.m) + ": " + how;
    first_uses_.push_back({problem.op, entry, problem.shape_class(), reason, at});
    if (trace_to_log_) {
      log_line(LogLevel::kInfo, "dispatch: " + std::string(problem.op) + " -> " + entry + " [" +
                                    problem.shape_class() + "] because " + reason + (at.empty() ? "" : "; plan " + at));
    }
  }
}

std::map<std::pair<std::string, std::string>, int64_t> DispatchStats::entry_counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

std::map<std::string, std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t>> DispatchStats::shape_histogram() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shapes_;
}

std::vector<DispatchRecord> DispatchStats::first_uses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_uses_;
}

std::vector<std::string> DispatchStats::take_step_paths() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out(step_paths_.begin(), step_paths_.end());
  step_paths_.clear();
  return out;
}

void DispatchStats::begin_recording() {
  std::lock_guard<std::mutex> lock(mu_);
  recording_ = true;
  recorded_.clear();
}

std::vector<DispatchStats::Selection> DispatchStats::end_recording() {
  std::lock_guard<std::mutex> lock(mu_);
  recording_ = false;
  return std::move(recorded_);
}

void DispatchStats::replay(const std::vector<Selection>& selections) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : selections) record_locked(s.problem, s.entry, s.reason, nullptr, &s.plan);
}

void throw_no_kernel_error(const Problem& problem, const std::string& reasons) {
  throw std::runtime_error("no eligible kernel for op " + std::string(problem.op) + " [" + problem.shape_class() +
                           "]:" + reasons);
}

}  // namespace m3::ops
