#include "sched/schedule_plan.h"

namespace m3 {

int32_t SchedulePlan::num_scheduled_tokens() const {
  int32_t total = 0;
  for (const ScheduledRequest& r : scheduled) total += r.num_scheduled_tokens();
  return total;
}

std::vector<int32_t> SchedulePlan::positions() const {
  std::vector<int32_t> out;
  out.reserve(num_scheduled_tokens());
  for (const ScheduledRequest& r : scheduled) {
    for (int32_t p = r.start_pos; p < r.end_pos; ++p) out.push_back(p);
  }
  return out;
}

std::vector<int64_t> SchedulePlan::slot_mapping() const {
  std::vector<int64_t> out;
  out.reserve(num_scheduled_tokens());
  for (const ScheduledRequest& r : scheduled) {
    for (int32_t p = r.start_pos; p < r.end_pos; ++p) out.push_back(r.slot(p, block_size_tokens));
  }
  return out;
}

std::vector<int32_t> SchedulePlan::query_start_offsets() const {
  std::vector<int32_t> out{0};
  out.reserve(scheduled.size() + 1);
  for (const ScheduledRequest& r : scheduled) out.push_back(out.back() + r.num_scheduled_tokens());
  return out;
}

std::vector<int32_t> SchedulePlan::seq_lens() const {
  std::vector<int32_t> out;
  out.reserve(scheduled.size());
  for (const ScheduledRequest& r : scheduled) out.push_back(r.end_pos);
  return out;
}

std::vector<int32_t> SchedulePlan::sample_token_indices() const {
  std::vector<int32_t> out;
  int32_t offset = 0;
  for (const ScheduledRequest& r : scheduled) {
    offset += r.num_scheduled_tokens();
    if (r.samples)
      for (int32_t j = r.num_spec_tokens; j >= 0; --j) out.push_back(offset - 1 - j);
  }
  return out;
}

}  // namespace m3
