#pragma once
// One request run alone to completion on an engine, greedily, for the model tests that compare a
// request's outputs across engines (disaggregated prefill on the CPU and the GPU): its tokens,
// its cached prompt tokens, the host-tier blocks the engine loaded meanwhile, and the KV blocks it
// exported (with kv_export, on its last event only).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "m3serve/engine.h"

namespace m3::test {

struct RunOutcome {
  std::vector<TokenOutput> tokens;
  int32_t cached = -1;
  int64_t host_loaded = 0;
  std::shared_ptr<const KvBlocks> exported;
};

inline RunOutcome run_greedy(Engine& e, const std::vector<int32_t>& prompt, int max_tokens, int logprobs,
                             bool kv_export = false) {
  GenerationRequest g;
  g.prompt_token_ids = prompt;
  g.sampling.temperature = 0.0f;
  g.sampling.max_tokens = max_tokens;
  g.sampling.ignore_eos = true;
  g.sampling.logprobs = logprobs;
  g.kv_export = kv_export;
  auto id = e.submit(g);
  EXPECT_TRUE(id.is_ok()) << id.error();
  RunOutcome r;
  while (e.has_unfinished_requests()) {
    EngineStepStats st;
    for (auto& ev : e.step(&st)) {
      if (ev.request_id != *id) continue;
      r.tokens.insert(r.tokens.end(), ev.new_tokens.begin(), ev.new_tokens.end());
      r.cached = ev.num_cached_prompt_tokens;
      if (ev.finished) r.exported = ev.kv_export;
      EXPECT_EQ(ev.kv_export != nullptr, kv_export && ev.finished);
    }
    r.host_loaded += st.scheduler.kv_loaded_blocks;
  }
  return r;
}

}  // namespace m3::test
