#pragma once
// One dispatch table per op. Each entry states its eligibility for a problem (empty reason =
// eligible, otherwise why not); selection takes the first eligible entry and records it, so
// "is this supported?" and "which kernel runs?" can never disagree (llama.cpp's lesson).
// DispatchStats is per engine (no globals): counts per (op, entry), a histogram of the
// local shapes each op saw, and a first-use trace with the reason.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/tensor.h"

namespace m3::ops {

struct AttentionMetadata;  // ops/attention_metadata.h

// What an entry's eligibility check sees: the op's local problem shape.
struct Problem {
  const char* op = "";
  Device device = Device::kCpu;
  DType dtype = DType::kF32;  // the dominant operand type (weights for GEMMs)
  int64_t m = 0, n = 0, k = 0;
  int64_t extra = 0;          // op-specific (e.g. top-k, block size)
  bool batch_invariant = false;  // each row's result must not depend on the batch around it
  // attention / indexer_topk: the batch's layout and the KV heads, for the entries' plans (their
  // splits follow the sequences and contexts). Points into the caller's frame: read while the
  // entry is selected, never kept (recorded selections drop it).
  const AttentionMetadata* attention = nullptr;
  int64_t kv_heads = 0;
  std::string shape_class() const;  // bucketed (M, N, K) used for first-use tracing
};
// The problem an op builds (the ops:: functions, and documents that ask the tables what runs a
// shape, as `m3serve kernel-paths` does).
Problem make_problem(const char* op, Device device, DType dtype, int64_t m, int64_t n, int64_t k, int64_t extra,
                     bool batch_invariant);

struct DispatchRecord {
  std::string op, entry, shape_class, reason;
  std::string plan;  // "m=M: ..." how the entry ran the class's first problem (tiles, splits), if it says
};

// An entry's account of how it runs a problem ("" when it has nothing to add): traced with the
// first use of each shape class, so the trace shows the kernel and tiling that ran, not only the
// entry.
using PlanFn = std::function<std::string(const Problem&)>;

class DispatchStats {
 public:
  explicit DispatchStats(bool trace_to_log = false) : trace_to_log_(trace_to_log) {}
  // plan (may be null or empty) is called only for a shape class's first use and while recording.
  void record(const Problem& problem, const std::string& entry, const std::string& reason,
              const PlanFn* plan = nullptr);
  void set_trace(bool on) { trace_to_log_ = on; }

  std::map<std::pair<std::string, std::string>, int64_t> entry_counts() const;
  // op -> ((m, n, k) -> count)
  std::map<std::string, std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t>> shape_histogram() const;
  std::vector<DispatchRecord> first_uses() const;
  // Entries chosen since the last call (for per-step stats), as "op=entry".
  std::vector<std::string> take_step_paths();

  // A recorded graph runs its kernels without passing through select(): capture records the
  // selections made while recording, and each replay counts them again.
  struct Selection {
    Problem problem;
    std::string entry, reason, plan;
  };
  void begin_recording();
  std::vector<Selection> end_recording();
  void replay(const std::vector<Selection>& selections);

 private:
  mutable std::mutex mu_;
  bool trace_to_log_;
  std::map<std::pair<std::string, std::string>, int64_t> counts_;
  std::map<std::string, std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t>> shapes_;
  std::set<std::tuple<std::string, std::string, std::string>> seen_;
  std::vector<DispatchRecord> first_uses_;
  std::set<std::string> step_paths_;
  bool recording_ = false;
  std::vector<Selection> recorded_;
  void record_locked(const Problem& problem, const std::string& entry, const std::string& reason, const PlanFn* plan,
                     const std::string* plan_text);
};

template <class Fn>
struct KernelEntry {
  std::string name;       // "<op>.<variant>.<arch>", the exact string traces print
  std::string condition;  // human-readable eligibility rule (for docs/kernel_paths.md)
  std::function<std::string(const Problem&)> ineligible;  // "" when eligible
  Fn fn;
  PlanFn plan = nullptr;  // optional: how it runs a problem (traced at first use)
};

template <class Fn>
class OpTable {
 public:
  explicit OpTable(const char* op) : op_(op) {}
  void add(KernelEntry<Fn> entry) { entries_.push_back(std::move(entry)); }
  // Drops the entry of that name (benchmarks' before/after in one binary); false if absent.
  bool remove(const std::string& name) {
    const auto n = entries_.size();
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [&](const KernelEntry<Fn>& e) { return e.name == name; }),
                   entries_.end());
    return entries_.size() != n;
  }
  const std::vector<KernelEntry<Fn>>& entries() const { return entries_; }
  const char* op() const { return op_; }

  // The first eligible entry; throws std::runtime_error listing every entry's reason if none.
  const KernelEntry<Fn>& select(const Problem& problem, DispatchStats* stats) const {
    if (const KernelEntry<Fn>* e = find(problem, stats)) return *e;
    std::string reasons;
    for (const auto& e : entries_) reasons += "\n  " + e.name + ": " + e.ineligible(problem);
    throw_no_kernel(problem, reasons);
  }
  // The first eligible entry (recorded), or null: for ops with a generic fallback outside the table.
  const KernelEntry<Fn>* find(const Problem& problem, DispatchStats* stats) const {
    for (const auto& e : entries_) {
      if (e.ineligible(problem).empty()) {
        if (stats) stats->record(problem, e.name, e.condition, e.plan ? &e.plan : nullptr);
        return &e;
      }
    }
    return nullptr;
  }

 private:
  [[noreturn]] static void throw_no_kernel(const Problem& problem, const std::string& reasons);
  const char* op_;
  std::vector<KernelEntry<Fn>> entries_;
};

[[noreturn]] void throw_no_kernel_error(const Problem& problem, const std::string& reasons);

template <class Fn>
void OpTable<Fn>::throw_no_kernel(const Problem& problem, const std::string& reasons) {
  throw_no_kernel_error(problem, reasons);
}

}  // namespace m3::ops
