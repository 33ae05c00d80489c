#pragma once
// Speculative decoding's counters summed over engine steps (vLLM's spec_decode metrics and the
// "SpecDecoding metrics" stats line read the same sums).
#include <cstdint>
#include <vector>

#include "m3serve/engine.h"

namespace m3::server {

struct SpecDecodeCounts {
  int64_t drafts = 0, draft_tokens = 0, accepted = 0;
  std::vector<int64_t> accepted_per_pos;  // accepted drafts by position in the draft

  void add(const EngineStepStats& s) {
    drafts += s.spec_num_drafts;
    draft_tokens += s.spec_num_draft_tokens;
    accepted += s.spec_num_accepted_tokens;
    if (accepted_per_pos.size() < s.spec_accepted_per_pos.size()) accepted_per_pos.resize(s.spec_accepted_per_pos.size());
    for (size_t p = 0; p < s.spec_accepted_per_pos.size(); ++p) accepted_per_pos[p] += s.spec_accepted_per_pos[p];
  }
};

}  // namespace m3::server
