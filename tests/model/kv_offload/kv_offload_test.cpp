// The host KV tier through the engine on the tiny random checkpoint: a prompt whose blocks were
// evicted from a small KV pool comes back as a prefix hit loaded from host memory (K, V and the
// MSA index keys of every layer), and its tokens and logprobs equal a cold run's.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <random>

#include "m3serve/engine.h"
#include "model/minimax_m3/make_model.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("kv_offload_test_tiny", 5);
  return dir;
}

std::vector<int32_t> prompt(int len, int seed) { return test::random_prompt(len, seed); }

struct Outcome {
  std::vector<TokenOutput> tokens;
  int64_t hit = 0, host_hit = 0, loads = 0, offloads = 0;
};

Outcome run_one(Engine& e, const std::vector<int32_t>& p, int max_tokens = 6) {
  SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  s.logprobs = 4;
  auto id = e.submit({p, s});
  EXPECT_TRUE(id.is_ok()) << id.error();
  Outcome o;
  while (e.has_unfinished_requests()) {
    EngineStepStats st;
    for (auto& ev : e.step(&st))
      if (ev.request_id == *id) o.tokens.insert(o.tokens.end(), ev.new_tokens.begin(), ev.new_tokens.end());
    o.hit += st.scheduler.prefix_hit_tokens;
    o.host_hit += st.scheduler.prefix_host_hit_tokens;
    o.loads += st.scheduler.kv_loaded_blocks;
    o.offloads += st.scheduler.kv_offloaded_blocks;
    EXPECT_TRUE(e.check_invariants().is_ok()) << e.check_invariants().message();
  }
  return o;
}

TEST(KvOffload, EvictedPrefixComesBackFromHostMemory) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 20;  // 320 tokens: two 150-token prompts evict everything else
  cfg.kv_offload_bytes = int64_t(64) << 20;
  cfg.check_invariants = true;
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.is_ok()) << engine.error();
  EXPECT_GT((*engine)->model().num_host_kv_blocks, 40);
  const auto a = prompt(100, 1);
  run_one(**engine, a);
  int64_t offloads = run_one(**engine, prompt(150, 2)).offloads;
  offloads += run_one(**engine, prompt(150, 3)).offloads;
  EXPECT_GE(offloads, 5);
  auto a2 = a;
  a2.insert(a2.end(), {7, 8, 9});
  const Outcome warm = run_one(**engine, a2);
  // Six full blocks of 16 hit: those evicted (freed tail first, so all but the first) from host
  // memory, the rest still on the device.
  EXPECT_EQ(warm.hit, 96);
  EXPECT_GE(warm.host_hit, 80);
  EXPECT_EQ(warm.loads * 16, warm.host_hit);

  EngineConfig cold_cfg = cfg;
  cold_cfg.kv_offload_bytes = 0;
  cold_cfg.num_kv_blocks = 64;
  auto cold = Engine::create(cold_cfg);
  ASSERT_TRUE(cold.is_ok()) << cold.error();
  const Outcome ref = run_one(**cold, a2);
  EXPECT_EQ(ref.hit, 0);
  ASSERT_EQ(warm.tokens.size(), ref.tokens.size());
  for (size_t t = 0; t < ref.tokens.size(); ++t) {
    EXPECT_EQ(warm.tokens[t].token, ref.tokens[t].token) << t;
    EXPECT_EQ(warm.tokens[t].logprob, ref.tokens[t].logprob) << t;
  }
  // Without the tier the same sequence finds only what stayed on the device.
  cfg.kv_offload_bytes = 0;
  auto plain = Engine::create(cfg);
  ASSERT_TRUE(plain.is_ok());
  run_one(**plain, a);
  run_one(**plain, prompt(150, 2));
  run_one(**plain, prompt(150, 3));
  EXPECT_EQ(run_one(**plain, a2).hit, 96 - warm.host_hit);
}

TEST(KvOffload, ConfigErrors) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 16;
  cfg.kv_offload_bytes = 1;
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("holds no KV block"), std::string::npos) << e.error();
  cfg.kv_offload_bytes = int64_t(1) << 20;
  cfg.enable_prefix_caching = false;
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("prefix caching"), std::string::npos) << e.error();
}

}  // namespace
}  // namespace m3
