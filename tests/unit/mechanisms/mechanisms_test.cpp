// The M3 mechanisms checked against tiny loop references and hand-computed cases:
// indexer selection rules, per-group selection, SwiGLU-OAI clamps, router bias, partial RoPE.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"
#include "ops/host_runtime.h"

#include <unistd.h>

namespace m3 {
namespace {

struct Fixture {
  ops::KernelTable table;
  ops::DispatchStats stats;
  ops::OpContext ctx;
  Fixture() {
    cpu::register_cpu_kernels(table);
    ctx = {&table, &stats, Device::kCpu};
  }
};

// One sequence of `len` tokens, identity page table, all tokens queried.
struct OneSeq {
  std::vector<int32_t> query_start, positions, seq_lens, block_table;
  std::vector<int64_t> slots;
  ops::AttentionMetadata meta;
  OneSeq(int len, int block_size, int first_query = 0) {
    query_start = {0, len - first_query};
    for (int p = first_query; p < len; ++p) positions.push_back(p);
    seq_lens = {len};
    const int blocks = (len + block_size - 1) / block_size;
    // A shuffled page table proves reads go through it.
    block_table.resize(size_t(blocks));
    std::iota(block_table.begin(), block_table.end(), 0);
    std::reverse(block_table.begin(), block_table.end());
    meta.num_seqs = 1;
    meta.num_tokens = len - first_query;
    meta.query_start = query_start.data();
    meta.positions = positions.data();
    meta.seq_lens = seq_lens.data();
    meta.block_tables = block_table.data();
    meta.max_blocks_per_seq = blocks;
    meta.block_size = block_size;
    for (int p = first_query; p < len; ++p) slots.push_back(meta.slot_of(0, p));
    meta.slot_mapping = slots.data();
  }
};

TensorView f32(std::vector<float>& v, Shape s) { return TensorView{v.data(), DType::kF32, std::move(s), Device::kCpu}; }
TensorView i32(std::vector<int32_t>& v, Shape s) { return TensorView{v.data(), DType::kI32, std::move(s), Device::kCpu}; }

// Index keys with a chosen score per token: dim 1 keys, query 1.0, so score = key value.
struct IndexerCase {
  Fixture f;
  int block_size, top_k, heads;
  OneSeq seq;
  std::vector<float> iq, ik_cache;
  std::vector<int32_t> sel;
  IndexerCase(int len, int bs, int k, int h, const std::vector<std::vector<float>>& key_scores_per_head)
      : block_size(bs), top_k(k), heads(h), seq(len, bs) {
    // dim = heads: key j has component hh = score for head hh; query of head hh is e_hh.
    const int dim = heads;
    ik_cache.assign(size_t(seq.meta.max_blocks_per_seq * bs * dim), 0.0f);
    for (int j = 0; j < len; ++j)
      for (int hh = 0; hh < heads; ++hh) ik_cache[size_t(seq.meta.slot_of(0, j) * dim + hh)] = key_scores_per_head[size_t(hh)][size_t(j)];
    iq.assign(size_t(len * heads * dim), 0.0f);
    for (int t = 0; t < len; ++t)
      for (int hh = 0; hh < heads; ++hh) iq[size_t((t * heads + hh) * dim + hh)] = 1.0f;
    sel.assign(size_t(heads * len * k), 7777);
    ops::indexer_topk(f.ctx, f32(iq, {len, heads, dim}),
                      f32(ik_cache, {int64_t(ik_cache.size()) / dim, dim}), seq.meta,
                      ops::IndexerParams{bs, k}, i32(sel, {heads, len, k}));
  }
  std::vector<int32_t> at(int head, int t) const {
    auto b = sel.begin() + (int64_t(head) * seq.meta.num_tokens + t) * top_k;
    return std::vector<int32_t>(b, b + top_k);
  }
};

TEST(Indexer, FewerBlocksThanTopKIsDenseWithMinusOnePadding) {
  std::vector<float> scores(40, 0.0f);
  IndexerCase c(40, 16, 4, 1, {scores});
  EXPECT_EQ(c.at(0, 0), (std::vector<int32_t>{0, -1, -1, -1}));
  EXPECT_EQ(c.at(0, 15), (std::vector<int32_t>{0, -1, -1, -1}));
  EXPECT_EQ(c.at(0, 16), (std::vector<int32_t>{0, 1, -1, -1}));
  EXPECT_EQ(c.at(0, 39), (std::vector<int32_t>{0, 1, 2, -1}));
}

TEST(Indexer, LocalBlockForcedAndTopScoresKept) {
  // 6 blocks of 4; top-3. Block scores (max): b0=1, b1=9, b2=3, b3=8, b4=0.5, local b5 = -100.
  std::vector<float> s(24, -100.0f);
  s[1] = 1; s[6] = 9; s[9] = 3; s[13] = 8; s[17] = 0.5f;
  IndexerCase c(24, 4, 3, 1, {s});
  EXPECT_EQ(c.at(0, 23), (std::vector<int32_t>{1, 3, 5}));  // local 5 forced despite lowest score
  EXPECT_EQ(c.at(0, 20), (std::vector<int32_t>{1, 3, 5}));
  // Query at 19 (block 4 local): candidates b0..b3 -> b1, b3.
  EXPECT_EQ(c.at(0, 19), (std::vector<int32_t>{1, 3, 4}));
}

TEST(Indexer, TiesBreakTowardsLowerBlockIds) {
  std::vector<float> s(20, 2.0f);  // every block scores 2
  IndexerCase c(20, 4, 3, 1, {s});
  EXPECT_EQ(c.at(0, 19), (std::vector<int32_t>{0, 1, 4}));
}

TEST(Indexer, CausalCutBeforePoolingAndPartialLastBlock) {
  // Query at position 9 (block 2 local, partial). Block 1 holds a huge score at position 7 only.
  // Future tokens (positions > query) must not count: give position 10 (future, in local block)
  // a huge score — irrelevant since the local block is forced anyway; and for the query at
  // position 5 (block 1 local), block 1's position 7 is in the future and must not lift block 1.
  std::vector<float> s(12, 0.0f);
  s[7] = 50.0f;
  s[2] = 1.0f;  // block 0
  IndexerCase c(12, 4, 2, 1, {s});
  EXPECT_EQ(c.at(0, 9), (std::vector<int32_t>{1, 2}));   // block 1 (max 50) beats block 0
  EXPECT_EQ(c.at(0, 11), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(c.at(0, 5), (std::vector<int32_t>{0, 1}));   // only 2 valid blocks: dense
}

TEST(Indexer, SelectionIsPerKvGroup) {
  // Two index heads that prefer different blocks must select differently.
  std::vector<float> h0(32, 0.0f), h1(32, 0.0f);
  h0[1] = 5.0f;   // head 0 likes block 0
  h1[13] = 5.0f;  // head 1 likes block 3
  IndexerCase c(32, 4, 2, 2, {h0, h1});
  EXPECT_EQ(c.at(0, 31), (std::vector<int32_t>{0, 7}));
  EXPECT_EQ(c.at(1, 31), (std::vector<int32_t>{3, 7}));
}

TEST(Indexer, MatchesBruteForceReferenceOnRandomInput) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int len = 150, bs = 8, k = 5, heads = 2;
  std::vector<std::vector<float>> scores(heads, std::vector<float>(len));
  for (auto& h : scores) for (auto& x : h) x = nd(rng);
  IndexerCase c(len, bs, k, heads, scores);
  for (int hh = 0; hh < heads; ++hh) {
    for (int t = 0; t < len; ++t) {
      const int nb = t / bs + 1;
      std::vector<int32_t> want;
      if (nb <= k) {
        for (int b = 0; b < nb; ++b) want.push_back(b);
      } else {
        std::vector<std::pair<float, int>> cand;
        for (int b = 0; b < nb - 1; ++b) {
          float m = -1e30f;
          for (int j = b * bs; j < (b + 1) * bs; ++j) m = std::max(m, scores[size_t(hh)][size_t(j)]);
          cand.push_back({-m, b});
        }
        std::sort(cand.begin(), cand.end());
        for (int i = 0; i < k - 1; ++i) want.push_back(cand[size_t(i)].second);
        want.push_back(nb - 1);
        std::sort(want.begin(), want.end());
      }
      while (int(want.size()) < k) want.push_back(-1);
      ASSERT_EQ(c.at(hh, t), want) << "head " << hh << " t " << t;
    }
  }
}

TEST(SwigluOai, ClampsAndFormula) {
  ops::SwigluParams p;
  auto ref = [](float g, float u) {
    float gc = std::min(g, 7.0f), uc = std::max(-7.0f, std::min(u, 7.0f));
    return (uc + 1.0f) * gc / (1.0f + std::exp(-1.702f * gc));
  };
  EXPECT_FLOAT_EQ(ops::swiglu_oai(1.0f, 2.0f, p), ref(1.0f, 2.0f));
  // Gate clamp is upper-only: large negative gate is not clamped.
  EXPECT_FLOAT_EQ(ops::swiglu_oai(-20.0f, 1.0f, p), 2.0f * -20.0f / (1.0f + std::exp(1.702f * 20.0f)));
  EXPECT_FLOAT_EQ(ops::swiglu_oai(100.0f, 0.0f, p), ops::swiglu_oai(7.0f, 0.0f, p));
  // Up clamp is symmetric, and +1 is applied after the clamp.
  EXPECT_FLOAT_EQ(ops::swiglu_oai(1.0f, 50.0f, p), ops::swiglu_oai(1.0f, 7.0f, p));
  EXPECT_FLOAT_EQ(ops::swiglu_oai(1.0f, -50.0f, p), ops::swiglu_oai(1.0f, -7.0f, p));
  EXPECT_FLOAT_EQ(ops::swiglu_oai(1.0f, -1.0f, p), 0.0f);
  EXPECT_NE(ops::swiglu_oai(1.0f, 0.0f, p), 0.0f);  // not plain SiLU*up
}

TEST(Router, BiasChangesChoiceButNotWeights) {
  Fixture f;
  const int experts = 4, hidden = 2;
  // logits = x . w_e ; x = (1, 0) -> logits = w_e[0] = {2, 1, 0, -1}
  std::vector<float> w = {2, 0, 1, 0, 0, 0, -1, 0}, x = {1, 0};
  std::vector<float> no_bias(4, 0.0f), bias = {0, 0, 0, 10};
  std::vector<int32_t> ids(2);
  std::vector<float> wts(2);
  ops::moe_router(f.ctx, f32(x, {1, hidden}), f32(w, {experts, hidden}), f32(no_bias, {experts}),
                  ops::RouterParams{2, 2.0f, true}, i32(ids, {1, 2}), f32(wts, {1, 2}));
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1}));
  auto sig = [](float z) { return 1.0f / (1.0f + std::exp(-z)); };
  EXPECT_FLOAT_EQ(wts[0], 2.0f * sig(2) / (sig(2) + sig(1)));
  ops::moe_router(f.ctx, f32(x, {1, hidden}), f32(w, {experts, hidden}), f32(bias, {experts}),
                  ops::RouterParams{2, 2.0f, true}, i32(ids, {1, 2}), f32(wts, {1, 2}));
  EXPECT_EQ(ids, (std::vector<int32_t>{3, 0}));  // bias pulls expert 3 in...
  // ...but its weight comes from the unbiased sigmoid, renormalised, times 2.
  EXPECT_FLOAT_EQ(wts[0], 2.0f * sig(-1) / (sig(-1) + sig(2)));
  EXPECT_FLOAT_EQ(wts[1], 2.0f * sig(2) / (sig(-1) + sig(2)));
}

TEST(Rope, RotatesExactlyTheFirst64DimsWithNeoxPairing) {
  Fixture f;
  const int head_dim = 128, rotary = 64;
  std::vector<float> x(head_dim);
  for (int i = 0; i < head_dim; ++i) x[size_t(i)] = float(i + 1) * 0.01f;
  std::vector<float> orig = x;
  std::vector<int32_t> pos = {1234};
  ops::rope(f.ctx, f32(x, {1, 1, head_dim}), pos.data(), rotary, 5e6);
  for (int d = 64; d < 128; ++d) EXPECT_EQ(x[size_t(d)], orig[size_t(d)]) << d;  // pass-through
  for (int d = 0; d < 32; ++d) {
    const double inv = 1.0 / std::pow(5e6, 2.0 * d / 64.0);
    const double a = 1234.0 * inv;
    const double want0 = orig[size_t(d)] * std::cos(a) - orig[size_t(d + 32)] * std::sin(a);
    const double want1 = orig[size_t(d + 32)] * std::cos(a) + orig[size_t(d)] * std::sin(a);
    EXPECT_NEAR(x[size_t(d)], want0, 2e-4) << d;
    EXPECT_NEAR(x[size_t(d + 32)], want1, 2e-4) << d;
  }
  EXPECT_NE(x[1], orig[1]);
}

TEST(Attention, SparseWithAllBlocksSelectedEqualsDense) {
  Fixture f;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int len = 37, bs = 8, hq = 4, hkv = 2, d = 16;
  OneSeq seq(len, bs);
  const int64_t slots = int64_t(seq.meta.max_blocks_per_seq) * bs;
  std::vector<float> q(size_t(len * hq * d)), kc(size_t(slots * hkv * d)), vc(kc.size()), o1(q.size()), o2(q.size());
  for (auto* v : {&q, &kc, &vc}) for (auto& e : *v) e = nd(rng);
  const int top_k = 5;  // 5 blocks cover all 37 tokens
  std::vector<int32_t> sel(size_t(hkv * len * top_k), -1);
  for (int g = 0; g < hkv; ++g)
    for (int t = 0; t < len; ++t)
      for (int b = 0; b <= t / bs; ++b) sel[size_t((g * len + t) * top_k + b)] = b;
  ops::attention(f.ctx, f32(q, {len, hq, d}), f32(kc, {slots, hkv, d}), f32(vc, {slots, hkv, d}), seq.meta, TensorView{}, 0,
                 f32(o1, {len, hq, d}));
  ops::attention(f.ctx, f32(q, {len, hq, d}), f32(kc, {slots, hkv, d}), f32(vc, {slots, hkv, d}), seq.meta,
                 i32(sel, {hkv, len, top_k}), top_k, f32(o2, {len, hq, d}));
  for (size_t i = 0; i < o1.size(); ++i) ASSERT_FLOAT_EQ(o1[i], o2[i]);
  // Dropping block 0 for group 1 changes only group 1's heads (2, 3) at positions >= 8.
  for (int t = 8; t < len; ++t) {
    auto* s = &sel[size_t((1 * len + t) * top_k)];
    std::remove(s, s + top_k, 0);
    s[top_k - 1] = -1;
  }
  ops::attention(f.ctx, f32(q, {len, hq, d}), f32(kc, {slots, hkv, d}), f32(vc, {slots, hkv, d}), seq.meta,
                 i32(sel, {hkv, len, top_k}), top_k, f32(o2, {len, hq, d}));
  for (int t = 0; t < len; ++t)
    for (int h = 0; h < hq; ++h) {
      const bool changed = h >= 2 && t >= 8;
      float diff = 0;
      for (int e = 0; e < d; ++e) diff += std::fabs(o1[size_t((t * hq + h) * d + e)] - o2[size_t((t * hq + h) * d + e)]);
      if (changed) EXPECT_GT(diff, 1e-4f) << t << " " << h;
      else EXPECT_EQ(diff, 0.0f) << t << " " << h;
    }
}

// The reference attention and indexer spread tokens over host threads past kParallelMinWork: the
// bits must not depend on the thread count (the GPU parity tests compare against them).
TEST(Attention, ThreadedReferenceGivesTheSameBitsAsOneThread) {
  Fixture f;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const int len = 700, bs = 16, hq = 8, hkv = 2, d = 64, heads = 2, top_k = 6;
  OneSeq seq(len, bs);
  const int64_t slots = int64_t(seq.meta.max_blocks_per_seq) * bs;
  // Work of one call: ~len^2 / 2 keys x hq x d = 125 M > kParallelMinWork, so it is threaded.
  ASSERT_GT(int64_t(len) * (len + 1) / 2 * hq * d, cpu::kParallelMinWork);
  std::vector<float> q(size_t(len * hq * d)), kc(size_t(slots * hkv * d)), vc(kc.size());
  std::vector<float> iq(size_t(len * heads * d));
  std::vector<uint16_t> ik(size_t(slots * d));
  for (auto* v : {&q, &kc, &vc, &iq}) for (auto& e : *v) e = nd(rng);
  for (auto& e : ik) e = f32_to_bf16(nd(rng));
  const TensorView ikv{ik.data(), DType::kBF16, {slots, d}, Device::kCpu};
  auto run = [&](int threads, std::vector<int32_t>& sel, std::vector<float>& dense, std::vector<float>& sparse) {
    cpu::set_cpu_threads(threads);
    sel.assign(size_t(heads * len * top_k), 7777);
    dense.assign(q.size(), 0.0f);
    sparse.assign(q.size(), 0.0f);
    ops::indexer_topk(f.ctx, f32(iq, {len, heads, d}), ikv, seq.meta, ops::IndexerParams{bs, top_k},
                      i32(sel, {heads, len, top_k}));
    ops::attention(f.ctx, f32(q, {len, hq, d}), f32(kc, {slots, hkv, d}), f32(vc, {slots, hkv, d}), seq.meta,
                   TensorView{}, 0, f32(dense, {len, hq, d}));
    ops::attention(f.ctx, f32(q, {len, hq, d}), f32(kc, {slots, hkv, d}), f32(vc, {slots, hkv, d}), seq.meta,
                   i32(sel, {hkv, len, top_k}), top_k, f32(sparse, {len, hq, d}));
  };
  std::vector<int32_t> sel1, sel4;
  std::vector<float> dense1, sparse1, dense4, sparse4;
  run(1, sel1, dense1, sparse1);
  run(4, sel4, dense4, sparse4);
  cpu::set_cpu_threads(0);
  EXPECT_EQ(sel1, sel4);
  EXPECT_EQ(std::count(sel1.begin(), sel1.end(), 7777), 0);
  ASSERT_EQ(dense1.size(), dense4.size());
  EXPECT_EQ(std::memcmp(dense1.data(), dense4.data(), dense1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(sparse1.data(), sparse4.data(), sparse1.size() * 4), 0);
  EXPECT_NE(std::memcmp(dense1.data(), sparse1.data(), dense1.size() * 4), 0);  // the selection mattered
}

// The batch-invariant CPU GEMM spreads its weight tiles over host threads: the bits must not depend
// on the thread count, nor a row's on the rows around it.
TEST(Linear, ThreadedInvariantGemmGivesTheSameBitsAsOneThreadAndOneRow) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int64_t m = 48, n = 2048, k = 1024;
  ASSERT_GT(m * n * k, cpu::kParallelMinWork);
  std::vector<float> x(size_t(m * k)), w(size_t(n * k)), y1(size_t(m * n)), y4(y1.size()), row(static_cast<size_t>(n));
  for (auto* v : {&x, &w}) for (auto& e : *v) e = nd(rng);
  cpu::set_cpu_threads(1);
  cpu::sgemm_xwt(x.data(), w.data(), y1.data(), m, n, k, true);
  cpu::set_cpu_threads(4);
  cpu::sgemm_xwt(x.data(), w.data(), y4.data(), m, n, k, true);
  EXPECT_EQ(std::memcmp(y1.data(), y4.data(), y1.size() * 4), 0);
  for (int64_t r : {int64_t(0), int64_t(17), m - 1}) {
    cpu::sgemm_xwt(x.data() + r * k, w.data(), row.data(), 1, n, k, true);
    EXPECT_EQ(std::memcmp(row.data(), y4.data() + r * n, size_t(n) * 4), 0) << r;
  }
  cpu::set_cpu_threads(0);
}

// The CPU kernels' thread pool: every item once, from two callers at once (tensor-parallel ranks
// are threads of one process) and from inside an item (a nested call must not wait on its own pool).
TEST(Parallel, EveryItemOnceWithConcurrentAndNestedCalls) {
  cpu::set_cpu_threads(4);
  constexpr int64_t kOuter = 64, kInner = 32;
  auto fill = [&](std::vector<std::atomic<int>>& hits) {
    cpu::parallel_for(kOuter, cpu::kParallelMinWork, [&](int64_t i) {
      cpu::parallel_for(kInner, cpu::kParallelMinWork, [&](int64_t j) { hits[size_t(i * kInner + j)].fetch_add(1); });
    });
  };
  for (int round = 0; round < 20; ++round) {
    std::vector<std::atomic<int>> a(kOuter * kInner), b(kOuter * kInner);
    std::thread other([&] { fill(b); });
    fill(a);
    other.join();
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].load(), 1) << "round " << round << " item " << i;
      ASSERT_EQ(b[i].load(), 1) << "round " << round << " item " << i;
    }
  }
  cpu::set_cpu_threads(0);
}

// Host memory comes zeroed; large buffers (a CPU engine's KV cache) must not be touched before use:
// a memset of a GB-sized cache was 2.3 s of page faults at every engine start.
size_t resident_bytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(f);
  return size_t(resident) * size_t(sysconf(_SC_PAGESIZE));
}

TEST(HostRuntime, AllocationsAreZeroedAndLargeOnesUntouchedUntilWritten) {
  ops::BackendRuntime* rt = ops::host_runtime();
  for (size_t bytes : {size_t(100), size_t(4096) + 3}) {
    auto* p = static_cast<unsigned char*>(rt->allocate(bytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    EXPECT_TRUE(std::all_of(p, p + bytes, [](unsigned char c) { return c == 0; }));
    rt->release(p);
  }
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/statm: resident size not readable here";
  const size_t big = size_t(256) << 20;
  const size_t before = resident_bytes();
  auto* p = static_cast<unsigned char*>(rt->allocate(big));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_LT(resident_bytes(), before + (size_t(32) << 20)) << "a large allocation was touched up front";
  for (size_t i = 0; i < big; i += size_t(1) << 20) EXPECT_EQ(p[i], 0) << i;  // reads keep it untouched too
  std::memset(p, 1, big);
  EXPECT_GT(resident_bytes(), before + (size_t(200) << 20));  // the measure itself works
  rt->release(p);
  EXPECT_LT(resident_bytes(), before + (size_t(32) << 20)) << "released memory stayed resident";
  auto* q = static_cast<unsigned char*>(rt->allocate_host(big));
  EXPECT_EQ(q[big - 1], 0);
  rt->release_host(q);
}

TEST(Dispatch, TraceRecordsEntryAndReasonAndNoKernelErrorListsReasons) {
  Fixture f;
  std::vector<float> x(8, 1.0f), w(4, 0.0f), y(8);
  ops::rms_norm(f.ctx, f32(x, {2, 4}), f32(w, {4}), 1e-6f, f32(y, {2, 4}));
  auto uses = f.stats.first_uses();
  ASSERT_EQ(uses.size(), 1u);
  EXPECT_EQ(uses[0].entry, "rms_norm.gemma.cpu");
  EXPECT_FLOAT_EQ(y[0], 1.0f / std::sqrt(1.0f + 1e-6f));
  std::vector<uint16_t> xb(8);
  TensorView bad{xb.data(), DType::kBF16, {2, 4}, Device::kCpu};
  try {
    ops::rms_norm(f.ctx, bad, f32(w, {4}), 1e-6f, f32(y, {2, 4}));
    FAIL() << "expected no eligible kernel";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rms_norm.gemma.cpu: CPU reference takes F32"), std::string::npos) << e.what();
  }
}

// An entry's plan (how it runs a problem) is asked at a shape class's first use only, kept with
// the first use and in recorded selections, and a replay into fresh stats carries it.
TEST(Dispatch, PlanIsTracedAtFirstUseAndSurvivesReplay) {
  ops::OpTable<ops::LinearFn> table("linear");
  int asked = 0;
  ops::KernelEntry<ops::LinearFn> e{"linear.stand_in.cpu", "always", [](const ops::Problem&) { return std::string(); },
                                     nullptr};
  e.plan = [&](const ops::Problem& p) {
    ++asked;
    return "tiles of " + std::to_string(p.m);
  };
  table.add(e);
  ops::KernelEntry<ops::LinearFn> quiet{"linear.quiet.cpu", "m > 100", [](const ops::Problem& p) {
                                          return p.m > 100 ? std::string() : std::string("small");
                                        }, nullptr};
  ops::OpTable<ops::LinearFn> second("linear");
  second.add(quiet);
  ops::DispatchStats stats;
  ops::Problem p;
  p.op = "linear";
  p.m = 5, p.n = 64, p.k = 64;
  ASSERT_NE(table.find(p, &stats), nullptr);
  p.m = 7;  // same class (m <= 8): not asked again
  ASSERT_NE(table.find(p, &stats), nullptr);
  EXPECT_EQ(asked, 1);
  auto uses = stats.first_uses();
  ASSERT_EQ(uses.size(), 1u);
  EXPECT_EQ(uses[0].plan, "m=5: tiles of 5");
  EXPECT_EQ(uses[0].reason, "always");
  // Recorded (asked even for a seen class), replayed into fresh stats without asking again. The
  // batch layout an attention problem points to is the caller's: the plan reads it, the
  // recording does not keep it.
  stats.begin_recording();
  p.m = 6;
  ops::AttentionMetadata meta;
  meta.num_seqs = 3;
  p.attention = &meta;
  p.kv_heads = 4;
  e.plan = [&](const ops::Problem& q) {
    ++asked;
    return "tiles of " + std::to_string(q.m) + (q.attention ? " over " + std::to_string(q.attention->num_seqs) + " sequences" : "");
  };
  ops::OpTable<ops::LinearFn> with_layout("linear");
  with_layout.add(e);
  with_layout.find(p, &stats);
  p.attention = nullptr;
  const auto sel = stats.end_recording();
  ASSERT_EQ(sel.size(), 1u);
  EXPECT_EQ(sel[0].plan, "tiles of 6 over 3 sequences");
  EXPECT_EQ(sel[0].problem.attention, nullptr);
  EXPECT_EQ(sel[0].problem.kv_heads, 4);
  EXPECT_EQ(asked, 2);
  ops::DispatchStats fresh;
  fresh.replay(sel);
  EXPECT_EQ(asked, 2);
  ASSERT_EQ(fresh.first_uses().size(), 1u);
  EXPECT_EQ(fresh.first_uses()[0].plan, "m=6: tiles of 6 over 3 sequences");
  // An entry without a plan records none.
  p.m = 200;
  ASSERT_NE(second.find(p, &fresh), nullptr);
  EXPECT_EQ(fresh.first_uses().back().entry, "linear.quiet.cpu");
  EXPECT_EQ(fresh.first_uses().back().plan, "");
}

// ops::linear_group: a run of weights of one dtype and in_features goes to the first eligible
// linear_group entry, one weight alone (or a table without group entries) to the linear table.
// The stand-in entry counts its calls and computes the same products as the CPU linear.
int g_group_calls = 0, g_group_last_count = 0;
void group_stand_in(const TensorView& x, const ops::LinearWeight* const* w, const TensorView* y, int count) {
  ++g_group_calls;
  g_group_last_count = count;
  const int64_t m = x.shape[0], k = x.shape[1];
  for (int i = 0; i < count; ++i)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t o = 0; o < w[i]->out_features(); ++o) {
        float acc = 0.0f;
        for (int64_t e = 0; e < k; ++e) acc += x.as<const float>()[r * k + e] * w[i]->data.as<const float>()[o * k + e];
        y[i].as<float>()[r * w[i]->out_features() + o] = acc;
      }
}

TEST(Dispatch, LinearGroupTakesTheGroupEntryOrEachLinear) {
  const int m = 3, k = 4;
  std::vector<float> x(m * k), w0(5 * k), w1(2 * k), w2(2 * k);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 7) - 3.0f;
  for (auto* w : {&w0, &w1, &w2})
    for (size_t i = 0; i < w->size(); ++i) (*w)[i] = float((i * 5 + w->size()) % 9) * 0.25f - 1.0f;
  const ops::LinearWeight lw0{f32(w0, {5, k}), {}, {}}, lw1{f32(w1, {2, k}), {}, {}}, lw2{f32(w2, {2, k}), {}, {}};
  const ops::LinearWeight* ws[3] = {&lw0, &lw1, &lw2};
  auto run = [&](const ops::OpContext& ctx, int count, std::vector<std::vector<float>>& out) {
    const int64_t ns[3] = {5, 2, 2};
    out.assign(3, {});
    std::vector<TensorView> ys;
    for (int i = 0; i < 3; ++i) {
      out[size_t(i)].assign(size_t(m * ns[i]), -7.0f);
      ys.push_back(f32(out[size_t(i)], {m, ns[i]}));
    }
    ops::linear_group(ctx, f32(x, {m, k}), ws, ys.data(), count);
  };
  // Reference: each weight through ops::linear.
  Fixture ref;
  std::vector<std::vector<float>> want(3);
  const int64_t ns[3] = {5, 2, 2};
  for (int i = 0; i < 3; ++i) {
    want[size_t(i)].resize(size_t(m * ns[i]));
    ops::linear(ref.ctx, f32(x, {m, k}), *ws[i], f32(want[size_t(i)], {m, ns[i]}));
  }

  // No group entries (the CPU table): each weight through linear, same values.
  Fixture plain;
  std::vector<std::vector<float>> got;
  run(plain.ctx, 3, got);
  EXPECT_EQ(got, want);
  for (const auto& u : plain.stats.first_uses()) EXPECT_EQ(u.op, "linear") << u.entry;

  // With a group entry: the three weights in one call; one weight alone still takes linear.
  Fixture grouped;
  grouped.table.linear_group.add({"linear_group.stand_in.cpu", "test stand-in",
                                  [](const ops::Problem& p) { return p.extra >= 2 ? "" : "one weight"; },
                                  group_stand_in});
  g_group_calls = 0;
  run(grouped.ctx, 3, got);
  EXPECT_EQ(g_group_calls, 1);
  EXPECT_EQ(g_group_last_count, 3);
  for (int i = 0; i < 3; ++i)
    for (size_t j = 0; j < want[size_t(i)].size(); ++j) EXPECT_FLOAT_EQ(got[size_t(i)][j], want[size_t(i)][j]);
  const auto uses = grouped.stats.first_uses();
  ASSERT_EQ(uses.size(), 1u);
  EXPECT_EQ(uses[0].entry, "linear_group.stand_in.cpu");
  g_group_calls = 0;
  run(grouped.ctx, 1, got);
  EXPECT_EQ(g_group_calls, 0);
  EXPECT_EQ(got[0], want[0]);
  EXPECT_EQ(got[1], std::vector<float>(size_t(m * 2), -7.0f));  // not asked for: untouched
}


// Gemma RMSNorm of one row, then the NeoX rotation of its first `rot` dims at `pos`: what a
// prologue row must hold (computed here by the separate ops on a copy).
std::vector<float> norm_rope(Fixture& f, std::vector<float> row, std::vector<float>& w, int pos, int rot, double theta) {
  const int64_t d = int64_t(row.size());
  ops::rms_norm(f.ctx, f32(row, {1, d}), f32(w, {d}), 1e-6f, f32(row, {1, d}));
  const int32_t p[1] = {pos};
  ops::rope(f.ctx, f32(row, {1, 1, d}), p, rot, theta);
  return row;
}

// The fused ops' CPU path is the separate ops in the model's order: each cache holds the rotated
// key (not the raw projection), a -1 slot is not written, values are cached as they are.
TEST(Dispatch, AttnPrologueWithoutAnEntryRunsTheSeparateOpsInOrder) {
  Fixture f;
  const int T = 3, hq = 2, hkv = 1, d = 8, hi = 1, di = 8, rot = 4, slots = 6;
  const double theta = 1e4;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
  };
  auto q = rnd(T * hq * d), k = rnd(T * hkv * d), v = rnd(T * hkv * d), iq = rnd(T * hi * di), ik = rnd(T * di);
  auto qn = rnd(d), kn = rnd(d), iqn = rnd(di), ikn = rnd(di);
  std::vector<float> kc(slots * hkv * d, -9.0f), vc(kc.size(), -9.0f), ikc(slots * di, -9.0f);
  const std::vector<int32_t> pos = {5, 6, 7};
  const std::vector<int64_t> slot = {4, -1, 1};
  const auto q0 = q, k0 = k, iq0 = iq, ik0 = ik;
  ops::AttnPrologue p;
  p.q = f32(q, {T, hq, d});
  p.k = f32(k, {T, hkv, d});
  p.v = f32(v, {T, hkv, d});
  p.q_norm = f32(qn, {d});
  p.k_norm = f32(kn, {d});
  p.k_cache = f32(kc, {slots, hkv, d});
  p.v_cache = f32(vc, {slots, hkv, d});
  p.index_q = f32(iq, {T, hi, di});
  p.index_k = f32(ik, {T, 1, di});
  p.index_q_norm = f32(iqn, {di});
  p.index_k_norm = f32(ikn, {di});
  p.index_k_cache = f32(ikc, {slots, di});
  p.positions = pos.data();
  p.slot_mapping = slot.data();
  p.rotary_dim = rot;
  p.theta = theta;
  p.eps = 1e-6f;
  ops::attn_prologue(f.ctx, p);
  Fixture r;
  auto row = [](const std::vector<float>& a, int i, int n) {
    return std::vector<float>(a.begin() + i * n, a.begin() + (i + 1) * n);
  };
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < hq; ++h)
      EXPECT_EQ(row(q, t * hq + h, d), norm_rope(r, row(q0, t * hq + h, d), qn, pos[size_t(t)], rot, theta));
    const auto kr = norm_rope(r, row(k0, t, d), kn, pos[size_t(t)], rot, theta);
    const auto ikr = norm_rope(r, row(ik0, t, di), ikn, pos[size_t(t)], rot, theta);
    EXPECT_EQ(row(k, t, d), kr);
    EXPECT_EQ(row(iq, t, di), norm_rope(r, row(iq0, t, di), iqn, pos[size_t(t)], rot, theta));
    EXPECT_EQ(row(ik, t, di), ikr);
    if (slot[size_t(t)] < 0) continue;
    const int s = int(slot[size_t(t)]);
    EXPECT_EQ(row(kc, s, d), kr) << "the key cache holds the rotated key";
    EXPECT_EQ(row(vc, s, d), row(v, t, d));
    EXPECT_EQ(row(ikc, s, di), ikr);
  }
  for (int s : {0, 2, 3, 5}) EXPECT_EQ(row(kc, s, d), std::vector<float>(d, -9.0f)) << "slot " << s << " untouched";
  std::vector<std::string> ops_seen;
  for (const auto& u : f.stats.first_uses()) ops_seen.push_back(u.op);
  EXPECT_EQ(std::count(ops_seen.begin(), ops_seen.end(), "attn_prologue"), 0) << "the CPU table has no fused entry";
  EXPECT_GT(std::count(ops_seen.begin(), ops_seen.end(), "kv_write"), 0);
}

TEST(Dispatch, AddRmsNormWithoutAnEntryIsAddThenRmsNorm) {
  Fixture f;
  std::vector<float> x = {1, -2, 3, 0.5f, 4, 4, -1, 2}, y = {0.5f, 1, -1, 2, 0, -3, 1, 1}, w = {0.1f, -0.2f, 0, 0.3f};
  std::vector<float> out(8), want_x = x, want(8);
  for (size_t i = 0; i < x.size(); ++i) want_x[i] += y[i];
  Fixture r;
  ops::rms_norm(r.ctx, f32(want_x, {2, 4}), f32(w, {4}), 1e-6f, f32(want, {2, 4}));
  ops::add_rms_norm(f.ctx, f32(x, {2, 4}), f32(y, {2, 4}), f32(w, {4}), 1e-6f, f32(out, {2, 4}));
  EXPECT_EQ(x, want_x);
  EXPECT_EQ(out, want);
}

TEST(Dispatch, RemoveEntryDropsItFromItsTable) {
  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  const auto has = [&](const std::string& name) {
    for (const auto& e : table.describe())
      if (e.entry == name) return true;
    return false;
  };
  ASSERT_TRUE(has("rms_norm.gemma.cpu"));
  EXPECT_TRUE(table.remove_entry("rms_norm.gemma.cpu"));
  EXPECT_FALSE(has("rms_norm.gemma.cpu"));
  EXPECT_TRUE(has("rope.neox_partial.cpu"));
  EXPECT_FALSE(table.remove_entry("rms_norm.gemma.cpu"));
  EXPECT_FALSE(table.remove_entry("no.such.entry"));
}

}  // namespace
}  // namespace m3
