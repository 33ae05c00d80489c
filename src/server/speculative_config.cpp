#include "server/speculative_config.h"

#include <nlohmann/json.hpp>

namespace m3::server {

std::optional<std::string> parse_speculative_config(const std::string& text, EngineConfig& config) {
  const std::string flag = "--speculative-config: ";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return flag + "not JSON (" + e.what() + ")";
  }
  if (!j.is_object()) return flag + "give a JSON object, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}";
  std::string method;
  if (auto m = j.find("method"); m != j.end()) {
    if (!m->is_string()) return flag + "method must be a string";
    method = m->get<std::string>();
  } else if (j.contains("model")) {
    method = "draft_model";
  } else {
    return flag + "method is required (ngram or eagle3)";
  }
  if (method != "ngram" && method != "eagle3")
    return flag + "method '" + method + "' is not supported; use \"ngram\" (prompt lookup) or \"eagle3\" (an EAGLE-3 draft)";
  const bool eagle3 = method == "eagle3";
  NgramConfig ng;
  std::string model;
  bool have_k = false, have_min = false, have_max = false;
  for (const auto& [key, value] : j.items()) {
    if (key == "method") continue;
    if (eagle3 && key == "model") {
      if (!value.is_string() || value.get<std::string>().empty()) return flag + "model must be a directory path";
      model = value.get<std::string>();
      continue;
    }
    // The draft runs whole on every rank: any draft TP size gives the same drafts.
    if (eagle3 && key == "draft_tensor_parallel_size") {
      if (!value.is_number_integer() || value.get<int64_t>() < 1) return flag + key + " must be an integer >= 1";
      continue;
    }
    const bool lookup = key == "prompt_lookup_max" || key == "prompt_lookup_min";
    int32_t* field = key == "num_speculative_tokens"     ? &ng.num_speculative_tokens
                     : lookup && !eagle3                 ? (key == "prompt_lookup_max" ? &ng.prompt_lookup_max
                                                                                      : &ng.prompt_lookup_min)
                     : key == "disable_by_batch_size"    ? &ng.disable_by_batch_size
                                                         : nullptr;
    if (!field)
      return flag + "unknown key '" + key + "' for method " + method +
             (eagle3 ? " (model, num_speculative_tokens, disable_by_batch_size, draft_tensor_parallel_size)"
                     : " (num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, disable_by_batch_size)");
    if (!value.is_number_integer()) return flag + key + " must be an integer";
    const int64_t v = value.get<int64_t>();
    if (v < 0 || v > 1024) return flag + key + " out of range: " + std::to_string(v);
    *field = int32_t(v);
    have_k = have_k || key == "num_speculative_tokens";
    have_min = have_min || key == "prompt_lookup_min";
    have_max = have_max || key == "prompt_lookup_max";
  }
  if (eagle3 && model.empty()) return flag + "method eagle3 needs \"model\": the draft checkpoint's directory";
  if (!have_k) return flag + "num_speculative_tokens is required";
  if (ng.num_speculative_tokens < 1) return flag + "num_speculative_tokens must be >= 1";
  // One bound given: the other follows it where the default would contradict it.
  if (have_min && !have_max) ng.prompt_lookup_max = std::max(ng.prompt_lookup_max, ng.prompt_lookup_min);
  if (have_max && !have_min) ng.prompt_lookup_min = std::min(ng.prompt_lookup_min, ng.prompt_lookup_max);
  if (Status st = ng.validate(); !st.is_ok()) return flag + st.message();
  config.speculative_method = method;
  config.ngram = ng;
  config.speculative_model = model;
  return std::nullopt;
}

}  // namespace m3::server
