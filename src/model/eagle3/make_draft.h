#pragma once
// make-draft: a random-weight EAGLE-3 draft checkpoint for a target config, in the layout EAGLE-3
// trainers ship (config.json with eagle_config, midlayer.* / fc / norm / lm_head tensors, and d2t
// when the draft vocabulary is smaller). Its drafts are rarely accepted: it exercises the whole
// speculative path (draft KV, chaining, verification) with the output fixed by the target.
#include <cstdint>
#include <string>

#include "core/status.h"
#include "model/eagle3/config.h"

namespace m3 {

struct MakeDraftOptions {
  std::string out_dir;
  Eagle3Config config;
  bool with_lm_head = true;       // false: the target's LM head stands in (needs the full vocabulary)
  bool with_embedding = false;    // true: an embed_tokens.weight of its own
  uint64_t seed = 0;
};

Status make_draft(const MakeDraftOptions& options);

// A draft config for `target`: its hidden size, heads of the target's head_dim, the given aux layers.
Eagle3Config default_draft_config(const MiniMaxM3Config& target, std::vector<int> aux_layer_ids);

}  // namespace m3
