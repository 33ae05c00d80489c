#include "exec/ngram_proposer.h"

#include <algorithm>

namespace m3 {

Status NgramConfig::validate() const {
  if (num_speculative_tokens < 0 || num_speculative_tokens > 32)
    return Status::error("num_speculative_tokens must be in [0, 32], got " + std::to_string(num_speculative_tokens));
  if (prompt_lookup_min < 1) return Status::error("prompt_lookup_min must be >= 1, got " + std::to_string(prompt_lookup_min));
  if (disable_by_batch_size < 0)
    return Status::error("disable_by_batch_size must be >= 0, got " + std::to_string(disable_by_batch_size));
  if (prompt_lookup_max < prompt_lookup_min)
    return Status::error("prompt_lookup_max (" + std::to_string(prompt_lookup_max) + ") must be >= prompt_lookup_min (" +
                         std::to_string(prompt_lookup_min) + ")");
  return Status::ok();
}

std::vector<int32_t> propose_ngram(std::span<const int32_t> prompt, std::span<const int32_t> output,
                                   const NgramConfig& config, int32_t max_draft) {
  const int64_t np = int64_t(prompt.size()), len = np + int64_t(output.size());
  auto at = [&](int64_t i) { return i < np ? prompt[size_t(i)] : output[size_t(i - np)]; };
  const int32_t k = std::min(config.num_speculative_tokens, max_draft);
  const int64_t max_n = std::min<int64_t>(config.prompt_lookup_max, len - 1);
  if (k <= 0 || max_n < config.prompt_lookup_min) return {};
  // One backward scan: for each earlier end position e, how many of the last max_n tokens match
  // the tokens ending at e. The first e reaching the best length is the most recent one.
  const int32_t last = at(len - 1);
  int64_t best_end = -1, best_n = 0;
  for (int64_t e = len - 2; e >= 0; --e) {
    if (at(e) != last) continue;
    int64_t n = 1;
    while (n < max_n && e - n >= 0 && at(e - n) == at(len - 1 - n)) ++n;
    if (n > best_n) {
      best_n = n;
      best_end = e;
      if (n == max_n) break;
    }
  }
  if (best_n < config.prompt_lookup_min) return {};
  std::vector<int32_t> draft;
  for (int64_t i = best_end + 1; i < len && int32_t(draft.size()) < k; ++i) draft.push_back(at(i));
  return draft;
}

}  // namespace m3
