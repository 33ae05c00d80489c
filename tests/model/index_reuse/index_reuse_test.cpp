// MSA index sharing (--msa-index-reuse) on the tiny random checkpoint (layer 0 dense, 1..3 MSA):
// a sharing layer attends exactly the blocks its group's first layer selected, the engine's
// batched and chunked run equals the one-at-a-time runner with the same setting, the index-key
// cache shrinks, and the option changes long prompts' outputs (it is an approximation).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "exec/sequence_runner.h"
#include "m3serve/engine.h"
#include "model/minimax_m3/make_model.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("index_reuse_test_tiny", 3);
  return dir;
}

std::vector<int32_t> prompt(int len, int seed) { return test::random_prompt(len, seed); }

// Greedy tokens one sequence at a time with index sharing `reuse`; the trace of the prompt pass.
std::vector<int32_t> reference(const std::vector<int32_t>& p, int n, int reuse, ForwardTrace* trace = nullptr) {
  auto model = std::move(*MiniMaxM3Model::load(tiny_dir()));
  model->set_msa_index_reuse(reuse);
  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  ops::OpContext ctx{&table, nullptr, Device::kCpu};
  SequenceRunner r(*model, ctx, int64_t(p.size()) + n);
  auto logits = r.extend(p, false, trace);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t t = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(t);
    if (i + 1 < n) logits = r.extend({t}, false);
  }
  return out;
}

TEST(IndexReuse, SharingLayersAttendTheirGroupsSelection) {
  auto model = std::move(*MiniMaxM3Model::load(tiny_dir()));
  MiniMaxM3Config c = model->config();
  EXPECT_FALSE(c.computes_index(0));  // dense
  EXPECT_TRUE(c.computes_index(1) && c.computes_index(2) && c.computes_index(3));
  c.msa_index_reuse = 2;
  EXPECT_TRUE(c.computes_index(1));
  EXPECT_FALSE(c.computes_index(2));
  EXPECT_TRUE(c.computes_index(3));
  ForwardTrace t1, t2;
  const auto p = prompt(150, 9);  // 10 blocks of 16, top 4 selected: the selection matters
  reference(p, 1, 1, &t1);
  reference(p, 1, 2, &t2);
  ASSERT_EQ(t2.selected_blocks.size(), 3u);  // one entry per sparse layer
  EXPECT_EQ(t2.selected_blocks[0], t1.selected_blocks[0]);  // layer 1: its own, as without sharing
  EXPECT_EQ(t2.selected_blocks[1], t2.selected_blocks[0]);  // layer 2 reuses layer 1's
  EXPECT_NE(t1.selected_blocks[1], t1.selected_blocks[0]);  // which layer 2 would not have chosen
}

TEST(IndexReuse, EngineBatchedEqualsOneAtATimeAndShrinksTheIndexCache) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.max_num_batched_tokens = 24;  // chunked prefill
  cfg.max_num_seqs = 8;
  cfg.kv_cache_memory_bytes = int64_t(8) << 20;
  cfg.check_invariants = true;
  auto plain = Engine::create(cfg);
  ASSERT_TRUE(plain.is_ok()) << plain.error();
  cfg.msa_index_reuse = 3;
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.is_ok()) << engine.error();
  EXPECT_EQ((*engine)->model().msa_index_reuse, 3);
  EXPECT_GT((*engine)->model().num_kv_blocks, (*plain)->model().num_kv_blocks);  // 1 index-key cache, not 3
  std::map<RequestId, std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    SamplingParams s;
    s.temperature = 0.0f;
    s.max_tokens = 8;
    s.ignore_eos = true;
    auto p = prompt(40 + 29 * i, 50 + i);
    auto id = (*engine)->submit({p, s});
    ASSERT_TRUE(id.is_ok()) << id.error();
    prompts[*id] = p;
  }
  std::map<RequestId, std::vector<int32_t>> out;
  while ((*engine)->has_unfinished_requests())
    for (auto& ev : (*engine)->step())
      for (auto& t : ev.new_tokens) out[ev.request_id].push_back(t.token);
  int differ = 0;
  for (auto& [id, toks] : out) {
    EXPECT_EQ(toks, reference(prompts[id], 8, 3)) << "request " << id;
    differ += toks != reference(prompts[id], 8, 1);
  }
  EXPECT_GT(differ, 0);  // an approximation: some long prompt's tokens change
  cfg.msa_index_reuse = 0;
  auto bad = Engine::create(cfg);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.error().find("msa_index_reuse"), std::string::npos);
}

}  // namespace
}  // namespace m3
