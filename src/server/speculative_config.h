#pragma once
// vLLM's --speculative-config JSON for `m3serve serve`: {"method": "ngram",
// "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M,
// "disable_by_batch_size": B}, or {"method": "eagle3", "model": DRAFT_DIR,
// "num_speculative_tokens": K, "disable_by_batch_size": B}.
#include <optional>
#include <string>

#include "m3serve/engine.h"

namespace m3::server {

// Fills config.speculative_method and config.ngram, or returns what is wrong with the text
// (not JSON, an unknown key, an unsupported method, eagle3 without its model, a value out of range).
std::optional<std::string> parse_speculative_config(const std::string& text, EngineConfig& config);

}  // namespace m3::server
