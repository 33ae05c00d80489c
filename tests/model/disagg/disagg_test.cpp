// Disaggregated prefill through two engines on a fresh tiny checkpoint: a producer exports a
// finished prompt's KV blocks (K, V and index keys of every layer), they cross the wire format,
// and a consumer that imports them serves the prompt with the same tokens and logprobs as a cold
// engine, its prefill a host-tier hit. Blocks of another layout, of another prompt, or for an
// engine without a host tier are refused by name; pages map between tensor-parallel sizes.
#include <gtest/gtest.h>

#include "m3serve/engine.h"
#include "../../support/engine_run.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("disagg_test_tiny", 23);
  return dir;
}

EngineConfig config(int tp = 1, int64_t offload = int64_t(16) << 20) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.device = "cpu";
  cfg.tensor_parallel_size = tp;
  cfg.num_kv_blocks = 64;
  cfg.max_num_batched_tokens = 64;  // prompts of > 64 tokens prefill in chunks
  cfg.kv_offload_bytes = offload;
  cfg.check_invariants = true;
  return cfg;
}

std::unique_ptr<Engine> make(const EngineConfig& cfg) {
  auto e = Engine::create(cfg);
  EXPECT_TRUE(e.is_ok()) << e.error();
  return e ? std::move(*e) : nullptr;
}

using Outcome = test::RunOutcome;

Outcome run(Engine& e, const std::vector<int32_t>& prompt, int max_tokens, bool kv_export = false) {
  return test::run_greedy(e, prompt, max_tokens, 3, kv_export);
}

// Bit for bit where both engines computed the KV alike (batch-invariant kernels, one tensor-parallel
// size); across sizes the ranks' all-reduces round the residual stream differently, so the KV of a
// prefill of another size is as close as two sizes' outputs are (the same tokens, logprobs within
// 1e-3, as model_tensor_parallel_engine checks).
void expect_same(const std::vector<TokenOutput>& a, const std::vector<TokenOutput>& b, bool exact = true) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token, b[i].token) << "token " << i;
    if (exact) EXPECT_EQ(a[i].logprob, b[i].logprob) << "token " << i;
    else EXPECT_NEAR(a[i].logprob, b[i].logprob, 1e-3) << "token " << i;
    ASSERT_EQ(a[i].top_logprobs.size(), b[i].top_logprobs.size());
    for (size_t j = 0; j < a[i].top_logprobs.size(); ++j)
      EXPECT_EQ(a[i].top_logprobs[j].token, b[i].top_logprobs[j].token);
  }
}

// The blocks as a decode server receives them: through the wire format.
KvBlocks over_the_wire(const KvBlocks& b) {
  auto p = parse_kv_blocks(serialize_kv_blocks(b));
  EXPECT_TRUE(p.is_ok()) << p.error();
  return p ? std::move(*p) : KvBlocks{};
}

// device: the producer leaves the pages in its backend memory (kv_export_device_bytes) and the
// consumer copies them into its KV cache; else they go through host memory and its host tier.
void check_round_trip(int producer_tp, int consumer_tp, bool device = false) {
  SCOPED_TRACE("TP " + std::to_string(producer_tp) + " -> " + std::to_string(consumer_tp) + (device ? ", device pages" : ""));
  const std::vector<int32_t> prompt = test::random_prompt(150, 5);  // 9 full blocks of 16, and 6 tokens
  EngineConfig pcfg = config(producer_tp);
  if (device) pcfg.kv_export_device_bytes = int64_t(16) << 20;
  auto producer = make(pcfg);
  auto consumer = make(config(consumer_tp, device ? 0 : int64_t(16) << 20));
  auto cold = make(config(consumer_tp, 0));
  ASSERT_TRUE(producer && consumer && cold);
  // The producer prefills (one token, as a disaggregated prefill does) and exports.
  const Outcome pre = run(*producer, prompt, 1, true);
  ASSERT_NE(pre.exported, nullptr);
  const KvBlocks& blocks = *pre.exported;
  EXPECT_EQ(blocks.num_blocks(), 149 / 16);  // the blocks a hit may cover: the last token is always computed
  EXPECT_EQ(blocks.layout, producer->kv_layout());
  EXPECT_EQ(blocks.tp, producer_tp);
  EXPECT_EQ(blocks.on_device(), device);
  const KvBlocks wire = over_the_wire(blocks);
  auto imported = consumer->import_kv(prompt, wire);
  ASSERT_TRUE(imported.is_ok()) << imported.error();
  EXPECT_EQ(imported->offered, 9);
  EXPECT_EQ(imported->imported, 9);
  EXPECT_EQ(imported->on_device + imported->present + imported->dropped, 0);
  // Importing again finds them all (in the host tier, or in the KV cache).
  auto again = consumer->import_kv(prompt, wire);
  ASSERT_TRUE(again.is_ok()) << again.error();
  EXPECT_EQ(device ? again->on_device : again->present, 9);
  // The decode: the prompt's blocks hit (loaded from the host tier, or already in the KV cache)
  // instead of being computed, and the output is a cold engine's.
  const Outcome dec = run(*consumer, prompt, 12);
  EXPECT_EQ(dec.cached, 144);
  EXPECT_EQ(dec.host_loaded, device ? 0 : 9);
  const Outcome ref = run(*cold, prompt, 12);
  EXPECT_EQ(ref.cached, 0);
  expect_same(dec.tokens, ref.tokens, producer_tp == consumer_tp);
  EXPECT_EQ(dec.tokens[0].token, pre.tokens[0].token);  // the prefill's one token, too
  EXPECT_TRUE(consumer->check_invariants().is_ok()) << consumer->check_invariants().message();
}

TEST(Disagg, ImportedBlocksServeThePromptLikeAColdEngine) { check_round_trip(1, 1); }

TEST(Disagg, TensorParallelRanksOnBothSides) { check_round_trip(2, 2); }

// Pages mapped between tensor-parallel sizes (the tiny model's 2 KV heads: split over 2 ranks,
// replicated over 4): each consumer rank takes its heads from the producer ranks holding them.
TEST(Disagg, PrefillAndDecodeOfDifferentTensorParallelSizes) {
  for (bool device : {false, true}) {
    check_round_trip(1, 2, device);
    check_round_trip(2, 1, device);
    check_round_trip(4, 2, device);
    check_round_trip(1, 4, device);
  }
}

TEST(Disagg, DevicePagesAtOneSize) {
  check_round_trip(1, 1, true);
  check_round_trip(2, 2, true);
}

TEST(Disagg, RefusesBlocksOfAnotherLayoutOrPrompt) {
  const std::vector<int32_t> prompt = test::random_prompt(70, 6);
  auto producer = make(config());
  ASSERT_TRUE(producer);
  const KvBlocks blocks = *run(*producer, prompt, 1, true).exported;
  ASSERT_EQ(blocks.num_blocks(), 4);
  auto refused = [&](const EngineConfig& cfg, const std::vector<int32_t>& p, const std::string& needle) {
    auto e = make(cfg);
    ASSERT_TRUE(e);
    auto r = e->import_kv(p, blocks);
    ASSERT_FALSE(r.is_ok()) << "imported, expected: " << needle;
    EXPECT_NE(r.error().find(needle), std::string::npos) << r.error();
    // Nothing was written: the prompt is computed as usual.
    EXPECT_EQ(run(*e, p, 2).cached, 0);
  };
  EngineConfig bf16 = config();
  bf16.kv_cache_dtype = "bf16";
  refused(bf16, prompt, "another KV layout");
  EngineConfig seeded = config();
  seeded.prefix_hash_seed = 99;
  refused(seeded, prompt, "another KV layout");
  KvBlocks odd = blocks;  // a producer size the model's 2 KV heads do not split over
  odd.tp = 3;
  odd.bytes.resize(size_t(odd.num_blocks()) * 3 * size_t(odd.page_bytes));
  {
    auto e = make(config(2));
    auto r = e->import_kv(prompt, odd);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.error().find("do not split over it"), std::string::npos) << r.error();
  }
  KvBlocks wrong_page = blocks;  // pages of a size no producer of this model writes
  wrong_page.page_bytes += 4;
  wrong_page.bytes.resize(size_t(wrong_page.num_blocks()) * size_t(wrong_page.page_bytes));
  {
    auto e = make(config(2));
    auto r = e->import_kv(prompt, wrong_page);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.error().find("expected for tensor-parallel size 1"), std::string::npos) << r.error();
  }
  std::vector<int32_t> other = prompt;
  other[40] += 1;  // block 2 differs
  refused(config(), other, "KV block 2 of the transfer is not block 2 of this prompt");
  refused(config(1, 0), prompt, "needs the host KV tier");
  // A damaged size never reaches the tier.
  KvBlocks cut = blocks;
  cut.bytes.resize(cut.bytes.size() - 1);
  auto e = make(config());
  auto r = e->import_kv(prompt, cut);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.error().find("bytes, got"), std::string::npos) << r.error();
}

TEST(Disagg, LongerPromptUsesTheSharedBlocks) {
  // The decode prompt extends the prefilled one (a multi-turn follow-up): the transfer's blocks are
  // its leading blocks and the rest is computed.
  const std::vector<int32_t> prompt = test::random_prompt(70, 8);
  std::vector<int32_t> longer = prompt;
  for (int32_t t : test::random_prompt(40, 9)) longer.push_back(t);
  auto producer = make(config());
  auto consumer = make(config());
  auto cold = make(config(1, 0));
  const KvBlocks blocks = *run(*producer, prompt, 1, true).exported;
  auto imported = consumer->import_kv(longer, blocks);
  ASSERT_TRUE(imported.is_ok()) << imported.error();
  EXPECT_EQ(imported->imported, 4);
  const Outcome dec = run(*consumer, longer, 6);
  EXPECT_EQ(dec.cached, 64);
  expect_same(dec.tokens, run(*cold, longer, 6).tokens);
}

TEST(Disagg, SmallHostTierKeepsTheLeadingBlocks) {
  // A tier of 3 pages takes the first 3 of 9 blocks (more would evict the transfer's own first
  // blocks); the prompt hits 48 tokens and computes the rest.
  const std::vector<int32_t> prompt = test::random_prompt(150, 10);
  auto producer = make(config());
  const KvBlocks blocks = *run(*producer, prompt, 1, true).exported;
  EngineConfig small = config();
  const int64_t page = blocks.page_bytes;
  small.kv_offload_bytes = 3 * page + page / 2;
  auto consumer = make(small);
  ASSERT_EQ(consumer->model().num_host_kv_blocks, 3);
  auto imported = consumer->import_kv(prompt, blocks);
  ASSERT_TRUE(imported.is_ok()) << imported.error();
  EXPECT_EQ(imported->imported, 3);
  EXPECT_EQ(imported->dropped, 6);
  const Outcome dec = run(*consumer, prompt, 4);
  EXPECT_EQ(dec.cached, 48);
  auto cold = make(config(1, 0));
  expect_same(dec.tokens, run(*cold, prompt, 4).tokens);
}

TEST(Disagg, ExportNeedsPrefixCaching) {
  EngineConfig cfg = config(1, 0);
  cfg.enable_prefix_caching = false;
  auto e = make(cfg);
  GenerationRequest g;
  g.prompt_token_ids = test::random_prompt(20, 1);
  g.sampling.max_tokens = 1;
  g.kv_export = true;
  auto id = e->submit(g);
  ASSERT_FALSE(id.is_ok());
  EXPECT_NE(id.error().find("kv_export needs prefix caching"), std::string::npos) << id.error();
}

// Exports left in the producer's backend memory (the M3CudaIpcConnector's form; on the CPU the
// "device" memory is shared within the process): the consumer copies the pages straight into
// fresh KV cache blocks (no host tier), the output is a cold engine's, and released slots serve
// the next export.
TEST(Disagg, DevicePagesServeThePromptLikeAColdEngine) {
  const std::vector<int32_t> prompt = test::random_prompt(150, 11);
  EngineConfig pcfg = config(1, 0);
  pcfg.kv_export_device_bytes = int64_t(16) << 20;
  auto producer = make(pcfg);
  auto consumer = make(config(1, 0));
  auto cold = make(config(1, 0));
  ASSERT_TRUE(producer && consumer && cold);
  const Outcome pre = run(*producer, prompt, 1, true);
  ASSERT_NE(pre.exported, nullptr);
  const KvBlocks& blocks = *pre.exported;
  ASSERT_TRUE(blocks.on_device());
  EXPECT_TRUE(blocks.bytes.empty());
  ASSERT_EQ(blocks.device_slots.size(), 9u);
  ASSERT_EQ(blocks.device_memory.size(), 1u);
  const KvBlocks wire = over_the_wire(blocks);
  EXPECT_EQ(wire.device_slots, blocks.device_slots);
  auto imported = consumer->import_kv(prompt, wire);
  ASSERT_TRUE(imported.is_ok()) << imported.error();
  EXPECT_EQ(imported->imported, 9);
  EXPECT_EQ(imported->on_device + imported->dropped, 0);
  const Outcome dec = run(*consumer, prompt, 12);
  EXPECT_EQ(dec.cached, 144);
  EXPECT_EQ(dec.host_loaded, 0);  // a device hit: nothing loaded from a host tier
  expect_same(dec.tokens, run(*cold, prompt, 12).tokens);
  EXPECT_TRUE(consumer->check_invariants().is_ok()) << consumer->check_invariants().message();
  // The slots come back for the next export once released.
  producer->release_kv_export(blocks.device_slots);
  const Outcome again = run(*producer, test::random_prompt(150, 12), 1, true);
  ASSERT_NE(again.exported, nullptr);
  EXPECT_TRUE(again.exported->on_device());
}

TEST(Disagg, DeviceExportFallsBackToHostMemoryWhenSlotsRunOut) {
  const std::vector<int32_t> prompt = test::random_prompt(150, 13);
  auto probe = make(config(1, 0));
  const int64_t page = run(*probe, test::random_prompt(40, 1), 1, true).exported->page_bytes;
  EngineConfig pcfg = config(1, 0);
  pcfg.kv_export_device_bytes = 3 * page;  // 3 slots for 9 blocks
  auto producer = make(pcfg);
  const Outcome pre = run(*producer, prompt, 1, true);
  ASSERT_NE(pre.exported, nullptr);
  EXPECT_FALSE(pre.exported->on_device());
  EXPECT_EQ(pre.exported->bytes.size(), size_t(9 * page));
}

// Adopting blocks evicts cached ones: with a host tier their KV is offloaded before the adopted
// pages overwrite them, so a prompt whose blocks were evicted still comes back right.
TEST(Disagg, AdoptionOffloadsTheBlocksItEvicts) {
  const std::vector<int32_t> first = test::random_prompt(100, 14), second = test::random_prompt(150, 15);
  EngineConfig pcfg = config(1, 0);
  pcfg.kv_export_device_bytes = int64_t(16) << 20;
  auto producer = make(pcfg);
  EngineConfig ccfg = config(1, int64_t(16) << 20);
  ccfg.num_kv_blocks = 12;  // the first prompt's 6 blocks, then 9 adopted: 3 of them evicted
  auto consumer = make(ccfg);
  EngineConfig rcfg = config(1, 0);
  auto cold = make(rcfg);
  const Outcome first_ref = run(*cold, first, 6);
  const Outcome first_run = run(*consumer, first, 6);
  expect_same(first_run.tokens, first_ref.tokens);
  const KvBlocks blocks = *run(*producer, second, 1, true).exported;
  auto imported = consumer->import_kv(second, blocks);
  ASSERT_TRUE(imported.is_ok()) << imported.error();
  EXPECT_EQ(imported->imported, 9);
  EXPECT_TRUE(consumer->check_invariants().is_ok()) << consumer->check_invariants().message();
  const Outcome again = run(*consumer, first, 6);
  EXPECT_GT(again.host_loaded, 0);  // some of its blocks came back from the host tier
  expect_same(again.tokens, first_ref.tokens);
  expect_same(run(*consumer, second, 6).tokens, run(*cold, second, 6).tokens);
}

TEST(Disagg, DevicePagesOfAnotherProcessNeedABackendThatMapsThem) {
  const std::vector<int32_t> prompt = test::random_prompt(70, 16);
  EngineConfig pcfg = config(1, 0);
  pcfg.kv_export_device_bytes = int64_t(16) << 20;
  auto producer = make(pcfg);
  const KvBlocks blocks = *run(*producer, prompt, 1, true).exported;
  ASSERT_TRUE(blocks.on_device());
  KvBlocks elsewhere = blocks;  // another process's memory: the CPU maps only its own
  const size_t at = elsewhere.device_memory[0].find("pid=") + 4;
  elsewhere.device_memory[0].replace(at, elsewhere.device_memory[0].find(' ', at) - at, "1");
  auto consumer = make(config(1, 0));
  auto r = consumer->import_kv(prompt, elsewhere);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.error().find("cannot be mapped"), std::string::npos) << r.error();
  EXPECT_EQ(run(*consumer, prompt, 2).cached, 0);  // nothing was adopted
}

}  // namespace
}  // namespace m3
