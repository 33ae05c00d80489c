// The engine on the tiny random checkpoint: batching, chunked prefill, prefix caching and
// preemption must not change a single greedy token; abort frees blocks at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "exec/sequence_runner.h"
#include "m3serve/engine.h"
#include "loader/safetensors.h"
#include "model/minimax_m3/make_model.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("engine_test_tiny", 7);
  return dir;
}

std::vector<int32_t> prompt(int len, int seed) { return test::random_prompt(len, seed); }

SamplingParams greedy(int max_tokens) {
  SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  return s;
}

// Runs every request to completion, checking invariants after every step.
std::map<RequestId, std::vector<int32_t>> run_all(Engine& engine, int64_t* preemptions = nullptr,
                                                  int64_t* hit_tokens = nullptr) {
  std::map<RequestId, std::vector<int32_t>> out;
  int steps = 0;
  while (engine.has_unfinished_requests()) {
    EngineStepStats st;
    for (auto& ev : engine.step(&st))
      for (auto& t : ev.new_tokens) out[ev.request_id].push_back(t.token);
    if (preemptions) *preemptions += st.scheduler.num_preemptions;
    if (hit_tokens) *hit_tokens += st.scheduler.prefix_hit_tokens;
    EXPECT_TRUE(engine.check_invariants().is_ok()) << engine.check_invariants().message();
    if (++steps > 100000) { ADD_FAILURE() << "engine did not finish"; break; }
  }
  return out;
}

// One-at-a-time reference through the single-sequence runner (index keys cached as
// index_dtype; unset: F32 like K and V).
std::vector<int32_t> reference(const std::vector<int32_t>& p, int n, std::optional<DType> index_dtype = std::nullopt) {
  static auto model = std::move(*MiniMaxM3Model::load(tiny_dir()));
  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  ops::OpContext ctx{&table, nullptr, Device::kCpu};
  SequenceRunner r(*model, ctx, int64_t(p.size()) + n, DType::kF32, index_dtype);
  auto logits = r.extend(p, false);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t t = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(t);
    if (i + 1 < n) logits = r.extend({t}, false);
  }
  return out;
}

// Ten prompts of 5..158 tokens (seeds seed0..seed0 + 9) through the engine at once, 12 greedy
// tokens each, against the one-at-a-time runner over the same index-key cache type.
void expect_batched_equals_reference(Engine& engine, int seed0, std::optional<DType> index_dtype = std::nullopt) {
  std::vector<std::vector<int32_t>> prompts;
  std::map<RequestId, size_t> which;
  for (int i = 0; i < 10; ++i) {
    prompts.push_back(prompt(5 + i * 17, seed0 + i));
    auto id = engine.submit({prompts.back(), greedy(12)});
    ASSERT_TRUE(id.is_ok()) << id.error();
    which[*id] = size_t(i);
  }
  auto out = run_all(engine);
  ASSERT_EQ(out.size(), prompts.size());
  for (auto& [id, toks] : out) EXPECT_EQ(toks, reference(prompts[which[id]], 12, index_dtype)) << "request " << id;
}

TEST(Engine, BatchedChunkedEqualsOneAtATime) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.max_num_batched_tokens = 24;  // forces chunked prefill of most prompts
  cfg.max_num_seqs = 8;
  cfg.num_kv_blocks = 256;
  cfg.check_invariants = true;
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.is_ok()) << engine.error();
  expect_batched_equals_reference(**engine, 0);
}

// An FP8 (e4m3) index-key cache: the engine's batched, chunked run gives the one-at-a-time
// runner's tokens over the same FP8 cache; the pages cost fewer bytes, so a fixed budget holds
// more of them; prompts of up to 158 tokens (10 blocks of 16, top 4 selected) exercise the
// selection over FP8 keys. A bad name is refused with the option named.
TEST(Engine, Fp8IndexCache) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.max_num_batched_tokens = 24;
  cfg.max_num_seqs = 8;
  cfg.kv_cache_memory_bytes = int64_t(64) << 20;
  cfg.check_invariants = true;
  auto f32 = Engine::create(cfg);
  ASSERT_TRUE(f32.is_ok()) << f32.error();
  cfg.index_cache_dtype = "fp8";
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.is_ok()) << engine.error();
  EXPECT_GT((*engine)->model().num_kv_blocks, (*f32)->model().num_kv_blocks);
  expect_batched_equals_reference(**engine, 100, DType::kF8E4M3);
  cfg.index_cache_dtype = "e5m2";
  auto bad = Engine::create(cfg);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.error().find("index_cache_dtype"), std::string::npos) << bad.error();
}

TEST(Engine, PrefixHitReusesBlocksAndKeepsTokens) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 128;
  cfg.check_invariants = true;
  auto engine = std::move(*Engine::create(cfg));
  auto shared = prompt(100, 42);  // 6 full blocks of 16 + 4
  auto a = shared, b = shared;
  a.push_back(7);
  b.insert(b.end(), {9, 10, 11});
  ASSERT_TRUE(engine->submit({a, greedy(6)}).is_ok());
  auto first = run_all(*engine);
  int64_t hits = 0;
  auto id_b = engine->submit({b, greedy(6)});
  ASSERT_TRUE(id_b.is_ok());
  auto second = run_all(*engine, nullptr, &hits);
  EXPECT_EQ(hits, 96);  // the six full blocks of the shared prefix (index-K included)
  EXPECT_EQ(second[*id_b], reference(b, 6));
  // Whole-prompt hit: the same prompt again still computes its last token.
  int64_t hits2 = 0;
  auto id_a2 = engine->submit({a, greedy(6)});
  auto third = run_all(*engine, nullptr, &hits2);
  EXPECT_EQ(hits2, 96);
  EXPECT_EQ(third[*id_a2], first.begin()->second);
}

// With prefix caching the warm request's logits must equal a cold run's (compared through the
// full-precision logprobs the engine reports), including the MSA layers, whose index-K comes
// from the reused blocks.
TEST(Engine, PrefixHitLogprobsMatchColdRun) {
  auto shared = prompt(100, 77);
  auto b = shared;
  b.insert(b.end(), {12, 13, 14, 15, 16});
  SamplingParams s = greedy(4);
  s.logprobs = 8;
  auto run_one = [&](Engine& e, const std::vector<int32_t>& p) {
    auto id = *e.submit({p, s});
    std::vector<TokenOutput> toks;
    while (e.has_unfinished_requests())
      for (auto& ev : e.step())
        if (ev.request_id == id) toks.insert(toks.end(), ev.new_tokens.begin(), ev.new_tokens.end());
    return toks;
  };
  EngineConfig warm_cfg;
  warm_cfg.model_dir = tiny_dir();
  warm_cfg.num_kv_blocks = 64;
  auto warm = std::move(*Engine::create(warm_cfg));
  auto a = shared;
  a.push_back(3);
  run_one(*warm, a);  // fills the cache with the shared prefix
  EngineStepStats st;
  auto hit_id = *warm->submit({b, s});
  int64_t hits = 0;
  std::vector<TokenOutput> warm_out;
  while (warm->has_unfinished_requests()) {
    for (auto& ev : warm->step(&st))
      if (ev.request_id == hit_id) warm_out.insert(warm_out.end(), ev.new_tokens.begin(), ev.new_tokens.end());
    hits += st.scheduler.prefix_hit_tokens;
  }
  ASSERT_EQ(hits, 96);
  EngineConfig cold_cfg = warm_cfg;
  cold_cfg.enable_prefix_caching = false;
  auto cold = std::move(*Engine::create(cold_cfg));
  auto cold_out = run_one(*cold, b);
  ASSERT_EQ(warm_out.size(), cold_out.size());
  for (size_t i = 0; i < warm_out.size(); ++i) {
    EXPECT_EQ(warm_out[i].token, cold_out[i].token);
    ASSERT_EQ(warm_out[i].top_logprobs.size(), cold_out[i].top_logprobs.size());
    for (size_t k = 0; k < warm_out[i].top_logprobs.size(); ++k) {
      EXPECT_EQ(warm_out[i].top_logprobs[k].token, cold_out[i].top_logprobs[k].token);
      EXPECT_EQ(warm_out[i].top_logprobs[k].logprob, cold_out[i].top_logprobs[k].logprob) << "step " << i << " rank " << k;
    }
  }
}

// The engine (batched, chunked) reproduces the HF oracle's greedy continuations.
TEST(Engine, ReproducesOracleGreedyContinuations) {
  const char* src = std::getenv("M3_SOURCE_DIR");
  auto golden = SafetensorsFile::open(std::string(src ? src : M3_SOURCE_DIR_DEFAULT) +
                                      "/tests/fixtures/goldens/tiny_bf16/golden.safetensors");
  ASSERT_TRUE(golden.is_ok()) << golden.error();
  EngineConfig cfg;
  cfg.model_dir = test::make_tiny_model("engine_test_golden_tiny", std::stoull((*golden)->metadata().at("m3_seed")));
  cfg.max_num_batched_tokens = 40;  // the 300-token prompt prefills in 8 chunks
  cfg.num_kv_blocks = 64;
  cfg.check_invariants = true;
  auto engine = std::move(*Engine::create(cfg));
  std::map<RequestId, std::vector<int32_t>> want;
  for (int p = 0;; ++p) {
    const TensorInfo* ids = (*golden)->find("prompt." + std::to_string(p) + ".input_ids");
    if (!ids) break;
    const TensorInfo* g = (*golden)->find("prompt." + std::to_string(p) + ".greedy");
    std::vector<int32_t> prompt_ids(size_t(ids->shape.numel())), greedy_ids(size_t(g->shape.numel()));
    std::memcpy(prompt_ids.data(), ids->data, ids->size_bytes);
    std::memcpy(greedy_ids.data(), g->data, g->size_bytes);
    want[*engine->submit({prompt_ids, greedy(int(greedy_ids.size()))})] = greedy_ids;
  }
  ASSERT_EQ(want.size(), 2u);
  auto out = run_all(*engine);
  for (auto& [id, toks] : want) EXPECT_EQ(out[id], toks) << "request " << id;
}

TEST(Engine, PreemptionUnderTinyPoolKeepsOutputs) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 12;  // 192 tokens for 6 requests of ~60 tokens: must preempt
  cfg.max_num_batched_tokens = 64;
  cfg.enable_prefix_caching = false;
  cfg.check_invariants = true;
  auto engine = std::move(*Engine::create(cfg));
  std::vector<std::vector<int32_t>> prompts;
  std::map<RequestId, size_t> which;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(prompt(40 + i * 3, 100 + i));
    which[*engine->submit({prompts.back(), greedy(20)})] = size_t(i);
  }
  int64_t preemptions = 0;
  auto out = run_all(*engine, &preemptions);
  EXPECT_GT(preemptions, 0);
  for (auto& [id, toks] : out) EXPECT_EQ(toks, reference(prompts[which[id]], 20));
  EngineStepStats st;
  engine->step(&st);
  EXPECT_EQ(st.scheduler.kv_blocks_used, 0);  // nothing leaked
}

// Prompt logprobs (vLLM's prompt_logprobs): position p's from the logits at p - 1 of the whole
// prompt's forward, each position once and before the first token, through chunked prefill,
// LM-head passes of max_num_seqs rows, preemption (recompute) and a prefix the cache holds.
std::vector<float> reference_logits(const std::vector<int32_t>& p) {
  static auto model = std::move(*MiniMaxM3Model::load(tiny_dir()));
  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  ops::OpContext ctx{&table, nullptr, Device::kCpu};
  SequenceRunner r(*model, ctx, int64_t(p.size()) + 1, DType::kF32);
  return r.extend(p, true);
}

void expect_prompt_logprobs(const std::vector<int32_t>& p, const std::vector<PromptLogprob>& got, int top_n,
                            int64_t vocab) {
  ASSERT_EQ(got.size(), p.size() - 1);
  const std::vector<float> logits = reference_logits(p);
  std::vector<float> logp;
  for (size_t i = 0; i < got.size(); ++i) {
    const PromptLogprob& e = got[i];
    ASSERT_EQ(e.position, int32_t(i) + 1);
    ASSERT_EQ(e.token, p[i + 1]);
    log_softmax(logits.data() + i * size_t(vocab), vocab, logp);
    EXPECT_EQ(e.logprob, logp[size_t(e.token)]) << "position " << e.position;
    EXPECT_EQ(e.rank, 1 + std::count_if(logp.begin(), logp.end(), [&](float v) { return v > e.logprob; }));
    const auto top = top_logprobs(logp, top_n);
    ASSERT_EQ(e.top.size(), top.size());
    for (size_t k = 0; k < top.size(); ++k) EXPECT_EQ(e.top[k].token, top[k].token);
  }
}

TEST(Engine, PromptLogprobsCoverEveryPositionOnce) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 12;  // preempts, as PreemptionUnderTinyPoolKeepsOutputs
  cfg.max_num_batched_tokens = 64;
  cfg.max_num_seqs = 4;     // LM-head passes of at most 4 rows
  cfg.check_invariants = true;
  auto engine = std::move(*Engine::create(cfg));
  const int64_t vocab = engine->model().vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  std::map<RequestId, size_t> which;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(prompt(40 + i * 3, 300 + i));
    SamplingParams s = greedy(20);
    s.prompt_logprobs = i % 3;
    which[*engine->submit({prompts.back(), s})] = size_t(i);
  }
  std::map<RequestId, std::vector<PromptLogprob>> lps;
  std::map<RequestId, size_t> tokens_before;
  int64_t preemptions = 0;
  while (engine->has_unfinished_requests()) {
    EngineStepStats st;
    for (auto& ev : engine->step(&st)) {
      if (!ev.prompt_logprobs.empty()) {
        EXPECT_EQ(tokens_before[ev.request_id], 0u) << "prompt logprobs after a token";
      }
      lps[ev.request_id].insert(lps[ev.request_id].end(), ev.prompt_logprobs.begin(), ev.prompt_logprobs.end());
      tokens_before[ev.request_id] += ev.new_tokens.size();
    }
    preemptions += st.scheduler.num_preemptions;
  }
  EXPECT_GT(preemptions, 0);
  ASSERT_EQ(lps.size(), prompts.size());
  for (auto& [id, got] : lps) expect_prompt_logprobs(prompts[which[id]], got, int(which[id] % 3), vocab);
}

TEST(Engine, PromptLogprobsComputeACachedPrefix) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 64;
  cfg.max_num_batched_tokens = 48;
  auto engine = std::move(*Engine::create(cfg));
  const auto p = prompt(100, 91);
  auto drain = [&](RequestId want, std::vector<PromptLogprob>* out, int64_t* hits, int64_t* queries) {
    while (engine->has_unfinished_requests()) {
      EngineStepStats st;
      for (auto& ev : engine->step(&st))
        if (ev.request_id == want && out) out->insert(out->end(), ev.prompt_logprobs.begin(), ev.prompt_logprobs.end());
      *hits += st.scheduler.prefix_hit_tokens;
      *queries += st.scheduler.prefix_query_tokens;
    }
  };
  int64_t hits = 0, queries = 0;
  drain(*engine->submit({p, greedy(2)}), nullptr, &hits, &queries);  // the cache now holds p's blocks
  EXPECT_EQ(queries, 100);
  SamplingParams s = greedy(2);
  s.prompt_logprobs = 1;
  std::vector<PromptLogprob> got;
  hits = queries = 0;
  drain(*engine->submit({p, s}), &got, &hits, &queries);
  EXPECT_EQ(hits, 0);     // computed, not read from the cache
  EXPECT_EQ(queries, 0);  // and no lookup counted against the hit rate
  expect_prompt_logprobs(p, got, 1, engine->model().vocab_size);
  hits = queries = 0;
  drain(*engine->submit({p, greedy(2)}), nullptr, &hits, &queries);
  EXPECT_EQ(hits, 96);  // the cache still serves the others
}

TEST(Engine, AbortFreesBlocksImmediately) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 64;
  cfg.check_invariants = true;
  auto engine = std::move(*Engine::create(cfg));
  auto id = *engine->submit({prompt(70, 3), greedy(50)});
  EngineStepStats st;
  engine->step(&st);
  engine->step(&st);
  EXPECT_GT(st.scheduler.kv_blocks_used, 0);
  ASSERT_TRUE(engine->abort(id).is_ok());
  EXPECT_TRUE(engine->check_invariants().is_ok());
  auto events = engine->step(&st);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].finish_reason, FinishReason::kAborted);
  EXPECT_EQ(st.scheduler.kv_blocks_used, 0);
  EXPECT_FALSE(engine->has_unfinished_requests());
}

TEST(Engine, RejectsBadRequestsWithClearErrors) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 8;  // 128 tokens
  auto engine = std::move(*Engine::create(cfg));
  auto too_long = engine->submit({prompt(200, 1), greedy(4)});
  EXPECT_FALSE(too_long.is_ok());
  auto bad_id = engine->submit({{1, 2, 100000}, greedy(4)});
  ASSERT_FALSE(bad_id.is_ok());
  EXPECT_NE(bad_id.error().find("outside the vocabulary"), std::string::npos);
  SamplingParams s = greedy(4);
  s.temperature = -1;
  auto bad_t = engine->submit({{1, 2}, s});
  ASSERT_FALSE(bad_t.is_ok());
  EXPECT_NE(bad_t.error().find("temperature"), std::string::npos);
}

// Host memory is mapped lazily, so a CPU KV cache beyond the host's memory must be refused when the
// engine starts (naming the flag), not found by the OOM killer mid-run.
TEST(Engine, RefusesACpuKvCacheBeyondTheHostsMemory) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.kv_cache_memory_bytes = int64_t(1) << 40;  // 1 TiB
  auto engine = Engine::create(cfg);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.error().find("does not fit the host's available memory"), std::string::npos) << engine.error();
  EXPECT_NE(engine.error().find("--kv-cache-memory"), std::string::npos) << engine.error();
}

TEST(Engine, SeededSamplingIsReproducibleAndLogprobsReported) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 64;
  auto engine = std::move(*Engine::create(cfg));
  SamplingParams s;
  s.temperature = 0.8f;
  s.top_p = 0.9f;
  s.top_k = 50;
  s.seed = 1234;
  s.max_tokens = 10;
  s.ignore_eos = true;
  s.logprobs = 3;
  auto p = prompt(30, 5);
  auto a = *engine->submit({p, s});
  auto b = *engine->submit({p, s});
  std::map<RequestId, std::vector<TokenOutput>> out;
  while (engine->has_unfinished_requests())
    for (auto& ev : engine->step())
      for (auto& t : ev.new_tokens) out[ev.request_id].push_back(t);
  ASSERT_EQ(out[a].size(), 10u);
  for (size_t i = 0; i < out[a].size(); ++i) {
    EXPECT_EQ(out[a][i].token, out[b][i].token);
    ASSERT_EQ(out[a][i].top_logprobs.size(), 3u);
    EXPECT_LE(out[a][i].logprob, 0.0f);
    EXPECT_GE(out[a][i].top_logprobs[0].logprob, out[a][i].top_logprobs[1].logprob);
  }
}

}  // namespace
}  // namespace m3
