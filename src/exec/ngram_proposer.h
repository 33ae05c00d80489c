#pragma once
// Prompt-lookup ("ngram") speculation: the draft for the next tokens is what followed the most
// recent earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
// prompt_lookup_min). No draft model: it pays off where the output repeats its context (code
// edits, agents quoting tool results, summaries, extraction), and costs one scan of the tokens.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace m3 {

struct NgramConfig {
  int32_t num_speculative_tokens = 0;  // longest draft; 0 = speculation off
  int32_t prompt_lookup_min = 2;       // shortest suffix that may match
  int32_t prompt_lookup_max = 4;       // longest suffix tried
  // vLLM's disable_by_batch_size: no drafts while more requests than this are running or
  // waiting (verification costs more than it saves once steps stop being bound by weight reads).
  // 0 = always draft.
  int32_t disable_by_batch_size = 0;
  Status validate() const;
};

// Draft tokens to follow `prompt` + `output` (viewed as one sequence), at most
// min(config.num_speculative_tokens, max_draft). Empty when no suffix of length >=
// prompt_lookup_min occurs earlier. Among the longest matches the most recent wins.
std::vector<int32_t> propose_ngram(std::span<const int32_t> prompt, std::span<const int32_t> output,
                                   const NgramConfig& config, int32_t max_draft);

}  // namespace m3
