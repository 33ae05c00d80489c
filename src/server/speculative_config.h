#pragma once
// vLLM's --speculative-config JSON for `m3serve serve`: {"method": "ngram",
// "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M,
// "disable_by_batch_size": B}.
#include <optional>
#include <string>

#include "m3serve/engine.h"

namespace m3::server {

// Fills config.speculative_method and config.ngram, or returns what is wrong with the text
// (not JSON, an unknown key, a method that needs a draft model, a value out of range).
std::optional<std::string> parse_speculative_config(const std::string& text, EngineConfig& config);

}  // namespace m3::server
