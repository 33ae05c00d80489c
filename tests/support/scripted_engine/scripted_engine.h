#pragma once
// An Engine that answers every request with the same fixed token script, one token per step,
// then EOS. It stands in for a trained model when a client integration test or a demo needs
// known output (reasoning, tool calls) through the real HTTP stack. Test-only: it is linked
// into the unit tests and into `m3serve_scripted`, never into m3serve.

#include <map>
#include <memory>
#include <vector>

#include "m3serve/engine.h"

namespace m3::server {

struct ScriptedEngineConfig {
  std::vector<int32_t> script;  // the output every request receives
  int64_t vocab_size = 0;
  int32_t max_model_len = 4096;
  int32_t eos_token_id = 0;
  int32_t step_delay_ms = 0;  // each step sleeps this long (a slow model, for disconnect tests)
};

std::unique_ptr<Engine> make_scripted_engine(ScriptedEngineConfig config);

}  // namespace m3::server
