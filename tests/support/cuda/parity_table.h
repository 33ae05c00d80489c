// Test support for the GPU parity tests: one row per checked op or property, the largest error
// relative to max|reference| over its cases, exact integer outputs, the first error, and (when
// given dispatch stats) the kernel entries that ran. Each test prints and judges its own rows.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ops/dispatch.h"

namespace m3::cuda_test {

struct ParityRow {
  std::string name;
  std::set<std::string> entries;  // kernel entries credited to this row
  int cases = 0;
  double max_abs = 0, max_rel = 0;
  bool has_ints = false, ints_exact = true;
  std::string error, worst;  // first error; the case that gave max_rel
  const std::map<std::string, double>* tolerances = nullptr;
  double tol() const { return tolerances->at(name); }
  bool pass() const { return error.empty() && cases > 0 && max_rel <= tol() && ints_exact; }
};

class ParityTable {
 public:
  // tolerances: per row name (0 = bit-identical); entry_stats: the GPU context's dispatch
  // stats, whose new step paths are credited to the row of each comparison (may be null).
  ParityTable(const std::map<std::string, double>& tolerances, ops::DispatchStats* entry_stats)
      : tolerances_(&tolerances), entry_stats_(entry_stats) {}

  ParityRow& row(const std::string& name) {
    for (auto& r : rows_) {
      if (r.name == name) return r;
    }
    ParityRow r;
    r.name = name;
    r.tolerances = tolerances_;
    rows_.push_back(r);
    return rows_.back();
  }
  // One case: max |got - ref| / max |ref| (infinite when sizes differ or a value is not finite
  // or above 1e30, e.g. the 0x7f poison of an unwritten element).
  void compare(const std::string& name, const std::vector<float>& got, const std::vector<float>& ref,
               const std::string& what = "") {
    ParityRow& r = row(name);
    note_entries(r);
    double ref_max = 0, err = 0;
    bool finite = got.size() == ref.size();
    for (size_t i = 0; i < ref.size() && finite; ++i) {
      if (!std::isfinite(got[i]) || std::fabs(got[i]) > 1e30) finite = false;
      ref_max = std::max(ref_max, double(std::fabs(ref[i])));
      err = std::max(err, double(std::fabs(got[i] - ref[i])));
    }
    const double rel = finite ? (ref_max > 0 ? err / ref_max : err) : INFINITY;
    r.cases++;
    r.max_abs = std::max(r.max_abs, finite ? err : INFINITY);
    if (rel >= r.max_rel) {
      r.max_rel = rel;
      r.worst = what;
    }
  }
  // Integer outputs must match exactly. new_case: false when the same case also had a float
  // output compared under this row.
  void compare_ints(const std::string& name, const std::vector<int32_t>& got, const std::vector<int32_t>& ref,
                    const std::string& what = "", bool new_case = true) {
    ParityRow& r = row(name);
    note_entries(r);
    r.has_ints = true;
    if (new_case) r.cases++;
    if (got == ref) return;
    r.ints_exact = false;
    size_t bad = 0;
    while (bad < ref.size() && bad < got.size() && got[bad] == ref[bad]) ++bad;
    if (r.error.empty()) {
      r.error = (what.empty() ? "" : what + ": ") + "first integer mismatch at " + std::to_string(bad) + " (gpu " +
                (bad < got.size() ? std::to_string(got[bad]) : "-") + ", want " +
                (bad < ref.size() ? std::to_string(ref[bad]) : "-") + ")";
    }
  }
  // Runs one row's checks; a thrown error (CUDA, cuBLAS, no kernel) fails that row.
  template <class F>
  void guarded(const std::string& name, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      ParityRow& r = row(name);
      if (r.error.empty()) r.error = e.what();
      cudaGetLastError();
    }
  }
  std::deque<ParityRow>& rows() { return rows_; }

 private:
  void note_entries(ParityRow& r) {
    if (!entry_stats_) return;
    for (const auto& p : entry_stats_->take_step_paths()) r.entries.insert(p.substr(p.find('=') + 1));
  }
  const std::map<std::string, double>* tolerances_;
  ops::DispatchStats* entry_stats_;
  std::deque<ParityRow> rows_;  // stable references while rows are added
};

}  // namespace m3::cuda_test
