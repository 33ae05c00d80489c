// GPU parity: every op of ops::KernelTable run through the CUDA entries (a table holding only
// them, so nothing can fall back to the CPU) and through the CPU reference, over a shape sweep:
// ragged batches, block-size edges, exactly top_k and top_k + 1 blocks, single tokens, crafted
// ties. Prints one table and writes it as JSON to $M3_OUT (else $M3_BINARY_DIR, else ".").
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/graph_capture.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/device_pool.h"
#include "backend/cuda/linear_mma.h"
#include "device_test_util.h"
#include "parity_table.h"
#include "test_routing.h"

namespace m3 {
namespace {

// Per-op tolerance on max|gpu - cpu| / max|cpu| (per case). 0 = bit-identical. Integer outputs
// (indexer blocks, router expert ids) must always match exactly.
const std::map<std::string, double> kTolerance = {
    {"embedding", 0.0},         {"rms_norm", 1e-5},        {"rope", 1e-5},
    {"add", 0.0},               {"kv_write", 0.0},         {"attention_dense", 2e-5},
    {"attention_sparse", 2e-5}, {"indexer_topk", 0.0},     {"moe_router", 1e-5},
    {"linear", 2e-5},           {"linear_bf16", 5e-5},     {"linear_mxfp8", 2e-5},
    {"linear_group_bf16", 5e-5}, {"linear_group_mxfp8", 2e-5},
    {"dense_mlp", 5e-5},        {"dense_mlp_bf16", 1e-4},  {"dense_mlp_mxfp8", 5e-5},
    {"moe_experts", 5e-5},      {"moe_experts_bf16", 1e-4}, {"moe_experts_mxfp8", 5e-5},
    // Integer rows: 1 per bit-identical comparison (a row alone vs in its batch, x misaligned
    // vs aligned, graph replay vs eager).
    {"linear_invariance", 0.0}, {"dense_mlp_invariance", 0.0}, {"moe_invariance", 0.0},
    {"linear_group_bits", 0.0},  // a grouped projection vs its own ops::linear call
    {"router_invariance", 0.0},
    {"cuda_graph", 0.0},
    {"add_rms_norm", 1e-5},     {"attn_prologue", 1e-5},
    {"add_rms_norm_bits", 0.0}, {"attn_prologue_bits", 0.0},  // fused vs the separate CUDA entries
};

using cuda_test::Batch;
using cuda_test::dev;
using cuda_test::DevBuf;
using cuda_test::host;
using cuda_test::SeqSpec;

using Row = cuda_test::ParityRow;

class Harness : public cuda_test::ParityTable {
 public:
  Harness() : ParityTable(kTolerance, &gpu_stats_) {
    cpu::register_cpu_kernels(cpu_table_);
    cuda::register_cuda_kernels(gpu_table_);
  }
  ops::OpContext cpu() { return ops::OpContext{&cpu_table_, &cpu_stats_, Device::kCpu, true}; }
  ops::OpContext gpu(bool invariant = true) { return ops::OpContext{&gpu_table_, &gpu_stats_, Device::kCuda, invariant}; }

 private:
  ops::KernelTable cpu_table_, gpu_table_;
  ops::DispatchStats cpu_stats_, gpu_stats_;
};

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Small integers: exact dot products in any summation order, so crafted ties stay ties.
std::vector<float> rand_int(size_t n, std::mt19937& rng, int lo, int hi) {
  std::uniform_int_distribution<int> ud(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = float(ud(rng));
  return v;
}

// ---------------------------------------------------------------------------------------------
void check_elementwise(Harness& h, std::mt19937& rng) {
  h.guarded("embedding", [&] {
    for (int tokens : {1, 37}) {
      const int vocab = 1000, dim = 96;
      auto table = randn(size_t(vocab) * dim, rng);
      std::vector<int32_t> ids(static_cast<size_t>(tokens));
      std::uniform_int_distribution<int> ud(0, vocab - 1);
      for (auto& i : ids) i = ud(rng);
      ids[0] = tokens > 1 ? 0 : vocab - 1;
      if (tokens > 1) ids.back() = vocab - 1;
      std::vector<float> ref(size_t(tokens) * dim);
      ops::embedding(h.cpu(), ids.data(), tokens, host(table.data(), DType::kF32, {vocab, dim}),
                     host(ref.data(), DType::kF32, {tokens, dim}));
      DevBuf d_table(table), d_ids(ids), d_out(ref.size() * 4);
      d_out.poison();
      ops::embedding(h.gpu(), d_ids.as<int32_t>(), tokens, dev(d_table, DType::kF32, {vocab, dim}),
                     dev(d_out, DType::kF32, {tokens, dim}));
      h.compare("embedding", d_out.get<float>(ref.size()), ref);
      // A vocab-parallel slice (rows 300..699 of the vocabulary): ids outside it give zero rows.
      std::vector<float> ref_slice(ref.size());
      ops::embedding(h.cpu(), ids.data(), tokens, host(table.data() + 300 * dim, DType::kF32, {400, dim}),
                     host(ref_slice.data(), DType::kF32, {tokens, dim}), 300);
      d_out.poison();
      ops::embedding(h.gpu(), d_ids.as<int32_t>(), tokens,
                     TensorView{d_table.as<float>() + 300 * dim, DType::kF32, {400, dim}, Device::kCuda},
                     dev(d_out, DType::kF32, {tokens, dim}), 300);
      h.compare("embedding", d_out.get<float>(ref.size()), ref_slice);
    }
  });
  h.guarded("rms_norm", [&] {
    for (auto [rows, dim] : std::vector<std::pair<int, int>>{{1, 128}, {37, 3072}, {148, 128}, {5, 80}}) {
      auto x = randn(size_t(rows) * dim, rng, 3.0f), w = randn(size_t(dim), rng, 0.2f);
      std::vector<float> ref(x.size());
      ops::rms_norm(h.cpu(), host(x.data(), DType::kF32, {rows, dim}), host(w.data(), DType::kF32, {dim}), 1e-6f,
                    host(ref.data(), DType::kF32, {rows, dim}));
      DevBuf dx(x), dw(w), dy(x.size() * 4);
      dy.poison();
      ops::rms_norm(h.gpu(), dev(dx, DType::kF32, {rows, dim}), dev(dw, DType::kF32, {dim}), 1e-6f,
                    dev(dy, DType::kF32, {rows, dim}));
      h.compare("rms_norm", dy.get<float>(x.size()), ref);
    }
  });
  h.guarded("rope", [&] {
    struct Case {
      int tokens, heads, head_dim, rotary;
      double theta;
    };
    for (const Case& c : {Case{37, 4, 128, 64, 5e6}, Case{1, 1, 64, 64, 1e4}, Case{9, 1, 128, 64, 5e6},
                          Case{12, 3, 96, 32, 1e6}}) {
      auto x = randn(size_t(c.tokens) * c.heads * c.head_dim, rng);
      std::vector<int32_t> pos(static_cast<size_t>(c.tokens));
      std::uniform_int_distribution<int> ud(0, 200000);
      for (auto& p : pos) p = ud(rng);
      pos[0] = 0;
      if (c.tokens > 3) {
        pos[1] = 1;
        pos[2] = 1048575;
      }
      std::vector<float> ref = x;
      ops::rope(h.cpu(), host(ref.data(), DType::kF32, {c.tokens, c.heads, c.head_dim}), pos.data(), c.rotary, c.theta);
      DevBuf dx(x), dpos(pos);
      ops::rope(h.gpu(), dev(dx, DType::kF32, {c.tokens, c.heads, c.head_dim}), dpos.as<int32_t>(), c.rotary, c.theta);
      h.compare("rope", dx.get<float>(x.size()), ref);
    }
  });
  h.guarded("add", [&] {
    for (int n : {1, 37 * 96, 100003}) {
      auto x = randn(size_t(n), rng), y = randn(size_t(n), rng);
      std::vector<float> ref = x;
      ops::add(h.cpu(), host(ref.data(), DType::kF32, {n}), host(y.data(), DType::kF32, {n}));
      DevBuf dx(x), dy(y);
      ops::add(h.gpu(), dev(dx, DType::kF32, {n}), dev(dy, DType::kF32, {n}));
      h.compare("add", dx.get<float>(x.size()), ref);
    }
  });
  h.guarded("kv_write", [&] {
    for (auto [tokens, row_elems] : std::vector<std::pair<int, int>>{{20, 128}, {1, 64}, {33, 32}}) {
      const int slots_total = 200;
      auto src = randn(size_t(tokens) * row_elems, rng);
      auto cache = randn(size_t(slots_total) * row_elems, rng);
      std::vector<int64_t> all(slots_total);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int64_t> slots(all.begin(), all.begin() + tokens);
      for (size_t i = 3; i < slots.size(); i += 4) slots[i] = -1;  // padding tokens are skipped
      std::vector<float> ref = cache;
      ops::kv_write(h.cpu(), host(src.data(), DType::kF32, {tokens, row_elems}), slots.data(),
                    host(ref.data(), DType::kF32, {slots_total, row_elems}));
      DevBuf dsrc(src), dslots(slots), dcache(cache);
      ops::kv_write(h.gpu(), dev(dsrc, DType::kF32, {tokens, row_elems}), dslots.as<int64_t>(),
                    dev(dcache, DType::kF32, {slots_total, row_elems}));
      h.compare("kv_write", dcache.get<float>(cache.size()), ref);
      // BF16 and F8E4M3 caches: the stored bytes equal the CPU's conversions (RNE; FP8 saturating:
      // the values scaled past +-448 here).
      for (DType dt : {DType::kBF16, DType::kF8E4M3}) {
        std::vector<float> big = src;
        for (float& v : big) v *= dt == DType::kF8E4M3 ? 200.0f : 1.0f;
        const size_t es = dtype_size_bytes(dt), bytes = size_t(slots_total) * row_elems * es;
        std::vector<uint8_t> cref(bytes);
        for (size_t i = 0; i < bytes; ++i) cref[i] = uint8_t(i * 37 + 11);  // untouched slots keep their bytes
        DevBuf dbig(big), dq(cref);
        ops::kv_write(h.cpu(), host(big.data(), DType::kF32, {tokens, row_elems}), slots.data(),
                      host(cref.data(), dt, {slots_total, row_elems}));
        ops::kv_write(h.gpu(), dev(dbig, DType::kF32, {tokens, row_elems}), dslots.as<int64_t>(),
                      dev(dq, dt, {slots_total, row_elems}));
        const auto got = dq.get<uint8_t>(bytes);
        h.compare_ints("kv_write", std::vector<int32_t>(got.begin(), got.end()),
                       std::vector<int32_t>(cref.begin(), cref.end()));
      }
    }
  });
}

int32_t same_bits(const float* a, const float* b, size_t n);

// The fused per-row ops against the CPU, and bit for bit against the separate CUDA entries.
void check_fused_rows(Harness& h, std::mt19937& rng) {
  h.guarded("add_rms_norm", [&] {
    for (auto [rows, dim] : std::vector<std::pair<int, int>>{{1, 6144}, {37, 3072}, {148, 128}, {5, 80}, {3, 7000}}) {
      auto x = randn(size_t(rows) * dim, rng, 3.0f), y = randn(size_t(rows) * dim, rng), w = randn(size_t(dim), rng, 0.2f);
      std::vector<float> rx = x, ref(x.size());
      ops::add_rms_norm(h.cpu(), host(rx.data(), DType::kF32, {rows, dim}), host(y.data(), DType::kF32, {rows, dim}),
                        host(w.data(), DType::kF32, {dim}), 1e-6f, host(ref.data(), DType::kF32, {rows, dim}));
      DevBuf dx(x), dy(y), dw(w), dout(x.size() * 4), sx(x), sout(x.size() * 4);
      dout.poison();
      sout.poison();
      ops::add_rms_norm(h.gpu(), dev(dx, DType::kF32, {rows, dim}), dev(dy, DType::kF32, {rows, dim}),
                        dev(dw, DType::kF32, {dim}), 1e-6f, dev(dout, DType::kF32, {rows, dim}));
      const auto got = dout.get<float>(x.size()), got_x = dx.get<float>(x.size());
      h.compare("add_rms_norm", got, ref);
      h.compare("add_rms_norm", got_x, rx);
      ops::add(h.gpu(), dev(sx, DType::kF32, {rows, dim}), dev(dy, DType::kF32, {rows, dim}));
      ops::rms_norm(h.gpu(), dev(sx, DType::kF32, {rows, dim}), dev(dw, DType::kF32, {dim}), 1e-6f,
                    dev(sout, DType::kF32, {rows, dim}));
      h.compare_ints("add_rms_norm_bits",
                     {same_bits(got.data(), sout.get<float>(x.size()).data(), x.size()),
                      same_bits(got_x.data(), sx.get<float>(x.size()).data(), x.size())},
                     {1, 1});
    }
  });
  h.guarded("attn_prologue", [&] {
    struct Case {
      int tokens, hq, hkv, d, hi, di, rotary;
      DType kv, ik;
      double theta;
    };
    for (const Case& c : {Case{1, 64, 4, 128, 4, 128, 64, DType::kBF16, DType::kBF16, 5e6},
                          Case{1, 64, 4, 128, 4, 128, 64, DType::kBF16, DType::kF8E4M3, 5e6},
                          Case{37, 16, 1, 128, 1, 128, 64, DType::kF32, DType::kF32, 5e6},
                          Case{9, 8, 2, 96, 0, 0, 32, DType::kBF16, DType::kBF16, 1e6},
                          Case{6, 4, 2, 80, 2, 64, 32, DType::kF8E4M3, DType::kF8E4M3, 1e4}}) {
      const bool sparse = c.hi > 0;
      const int T = c.tokens, slots_total = 64 + 2 * T;
      std::vector<int32_t> pos(static_cast<size_t>(T));
      std::vector<int64_t> slots(static_cast<size_t>(T));
      std::uniform_int_distribution<int> up(0, 200000);
      std::vector<int64_t> all(static_cast<size_t>(slots_total));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (int t = 0; t < T; ++t) {
        pos[size_t(t)] = up(rng);
        slots[size_t(t)] = t % 4 == 3 ? -1 : all[size_t(t)];  // padding tokens are not cached
      }
      auto q = randn(size_t(T) * c.hq * c.d, rng, 2.0f), k = randn(size_t(T) * c.hkv * c.d, rng, 2.0f);
      auto v = randn(size_t(T) * c.hkv * c.d, rng), qn = randn(size_t(c.d), rng, 0.2f), kn = randn(size_t(c.d), rng, 0.2f);
      auto iq = randn(size_t(T) * std::max(c.hi, 1) * std::max(c.di, 1), rng, 2.0f);
      auto ik = randn(size_t(T) * std::max(c.di, 1), rng, 2.0f);
      auto iqn = randn(size_t(std::max(c.di, 1)), rng, 0.2f), ikn = randn(size_t(std::max(c.di, 1)), rng, 0.2f);
      const size_t kv_bytes = size_t(slots_total) * c.hkv * c.d * dtype_size_bytes(c.kv);
      const size_t ik_bytes = size_t(slots_total) * std::max(c.di, 1) * dtype_size_bytes(c.ik);
      // Three runs: the CPU reference, the fused entry, the separate CUDA entries (the fallback's
      // sequence with the GPU table).
      struct Bufs {
        std::vector<float> q, k, iq, ik;
        std::vector<uint8_t> kc, vc, ikc;
      };
      auto make = [&](auto&& view, Bufs& b, auto&& run) {
        ops::AttnPrologue p;
        p.q = view(b.q.data(), DType::kF32, Shape{T, c.hq, c.d});
        p.k = view(b.k.data(), DType::kF32, Shape{T, c.hkv, c.d});
        p.v = view(v.data(), DType::kF32, Shape{T, c.hkv, c.d});
        p.q_norm = view(qn.data(), DType::kF32, Shape{c.d});
        p.k_norm = view(kn.data(), DType::kF32, Shape{c.d});
        p.k_cache = view(b.kc.data(), c.kv, Shape{slots_total, c.hkv, c.d});
        p.v_cache = view(b.vc.data(), c.kv, Shape{slots_total, c.hkv, c.d});
        if (sparse) {
          p.index_q = view(b.iq.data(), DType::kF32, Shape{T, c.hi, c.di});
          p.index_k = view(b.ik.data(), DType::kF32, Shape{T, 1, c.di});
          p.index_q_norm = view(iqn.data(), DType::kF32, Shape{c.di});
          p.index_k_norm = view(ikn.data(), DType::kF32, Shape{c.di});
          p.index_k_cache = view(b.ikc.data(), c.ik, Shape{slots_total, c.di});
        }
        p.rotary_dim = c.rotary;
        p.theta = c.theta;
        p.eps = 1e-6f;
        run(p);
      };
      Bufs init{q, k, iq, ik, std::vector<uint8_t>(kv_bytes, 0x11), std::vector<uint8_t>(kv_bytes, 0x22),
                std::vector<uint8_t>(ik_bytes, 0x33)};
      Bufs ref = init;
      make([](void* p, DType dt, Shape s) { return host(p, dt, std::move(s)); }, ref, [&](ops::AttnPrologue& p) {
        p.positions = pos.data();
        p.slot_mapping = slots.data();
        ops::attn_prologue(h.cpu(), p);
      });
      Bufs out[2];
      for (int fused = 0; fused < 2; ++fused) {
        std::deque<DevBuf> bufs;
        Bufs& b = out[fused];
        b = init;
        auto to_dev = [&](void* p, DType dt, Shape s) {
          const size_t bytes = size_t(s.numel()) * dtype_size_bytes(dt);
          bufs.emplace_back(bytes);
          M3_CUDA_CHECK(cudaMemcpy(bufs.back().as<void>(), p, bytes, cudaMemcpyHostToDevice));
          return dev(bufs.back(), dt, std::move(s));
        };
        DevBuf dpos(pos), dslots(slots);
        ops::AttnPrologue dp;
        make(to_dev, b, [&](ops::AttnPrologue& p) {
          p.positions = dpos.as<int32_t>();
          p.slot_mapping = dslots.as<int64_t>();
          dp = p;
          if (fused) {
            ops::attn_prologue(h.gpu(), p);
          } else {
            ops::KernelTable only;  // the CUDA table without the fused entry: the separate ops
            cuda::register_cuda_kernels(only);
            if (!only.remove_entry("attn_prologue.fused_rows.sm90")) throw std::runtime_error("no fused prologue entry");
            ops::attn_prologue(ops::OpContext{&only, nullptr, Device::kCuda, true}, p);
          }
        });
        M3_CUDA_CHECK(cudaDeviceSynchronize());
        auto back = [](const TensorView& t, auto& vec) {
          if (t.data) M3_CUDA_CHECK(cudaMemcpy(vec.data(), t.data, vec.size() * sizeof(vec[0]), cudaMemcpyDeviceToHost));
        };
        back(dp.q, b.q);
        back(dp.k, b.k);
        back(dp.k_cache, b.kc);
        back(dp.v_cache, b.vc);
        if (sparse) {
          back(dp.index_q, b.iq);
          back(dp.index_k, b.ik);
          back(dp.index_k_cache, b.ikc);
        }
      }
      const Bufs& f = out[1];
      h.compare("attn_prologue", f.q, ref.q);
      h.compare("attn_prologue", f.k, ref.k);
      if (sparse) {
        h.compare("attn_prologue", f.iq, ref.iq);
        h.compare("attn_prologue", f.ik, ref.ik);
      }
      auto as_f32 = [](const std::vector<uint8_t>& b) {
        std::vector<float> v(b.size() / 4);
        std::memcpy(v.data(), b.data(), v.size() * 4);
        return v;
      };
      if (c.kv == DType::kF32) {
        h.compare("attn_prologue", as_f32(f.kc), as_f32(ref.kc));
        h.compare("attn_prologue", as_f32(f.vc), as_f32(ref.vc));
      }
      if (sparse && c.ik == DType::kF32) h.compare("attn_prologue", as_f32(f.ikc), as_f32(ref.ikc));
      const Bufs& s = out[0];
      h.compare_ints("attn_prologue_bits",
                     {same_bits(f.q.data(), s.q.data(), f.q.size()), same_bits(f.k.data(), s.k.data(), f.k.size()),
                      same_bits(f.iq.data(), s.iq.data(), f.iq.size()), same_bits(f.ik.data(), s.ik.data(), f.ik.size()),
                      int32_t(f.kc == s.kc), int32_t(f.vc == s.vc), int32_t(f.ikc == s.ikc),
                      int32_t(f.vc != init.vc)},  // the values were written
                     {1, 1, 1, 1, 1, 1, 1, 1});
    }
  });
}

// ---------------------------------------------------------------------------------------------
struct AttnCase {
  std::vector<SeqSpec> seqs;
  int block_size, q_heads, kv_heads, head_dim, top_k, index_dim;
  bool integer_index;  // small-integer index q/k: exact dots, many crafted ties
};

void check_attention(Harness& h, std::mt19937& rng) {
  const std::vector<AttnCase> cases = {
      // Ragged: single token at 0; prefill over positions 0..bs+1 (bs-1, bs, bs+1); an empty
      // sequence; exactly top_k blocks (pos 63); top_k + 1 (pos 64); a decode chunk; a long chunk.
      {{{0, 1}, {0, 18}, {5, 0}, {63, 1}, {64, 1}, {83, 7}, {100, 30}}, 16, 4, 2, 64, 4, 32, false},
      {{{0, 1}, {0, 18}, {63, 1}, {64, 1}, {150, 50}}, 16, 4, 2, 64, 4, 8, true},
      {{{700, 3}, {255, 1}, {256, 1}, {0, 65}}, 64, 8, 2, 128, 4, 64, false},
      {{{37, 1}}, 16, 6, 3, 80, 2, 16, false},
      {{{400, 2}}, 8, 2, 1, 256, 6, 8, true},
      // 10k blocks of 8: the indexer's shared memory passes 48 KB (opt-in path); top_k 16.
      {{{80000, 2}, {130, 1}}, 8, 2, 1, 32, 16, 8, false},
  };
  for (const AttnCase& c : cases) {
    Batch batch(c.seqs, c.block_size, rng);
    const int T = batch.num_tokens;
    const int64_t slots = batch.num_slots();
    auto q = randn(size_t(T) * c.q_heads * c.head_dim, rng);
    auto kc = randn(size_t(slots) * c.kv_heads * c.head_dim, rng);
    auto vc = randn(kc.size(), rng);
    auto iq = c.integer_index ? rand_int(size_t(T) * c.kv_heads * c.index_dim, rng, -1, 1)
                              : randn(size_t(T) * c.kv_heads * c.index_dim, rng);
    auto ik = c.integer_index ? rand_int(size_t(slots) * c.index_dim, rng, -1, 1)
                              : randn(size_t(slots) * c.index_dim, rng);
    const Shape qs{T, c.q_heads, c.head_dim}, ks{slots, c.kv_heads, c.head_dim};
    const Shape sel_shape{c.kv_heads, T, c.top_k};
    DevBuf dq(q), dk(kc), dv(vc), diq(iq), dik(ik), dout(q.size() * 4), dsel(size_t(c.kv_heads) * T * c.top_k * 4);
    // Indexer.
    std::vector<int32_t> sel(size_t(c.kv_heads) * T * c.top_k);
    h.guarded("indexer_topk", [&] {
      const ops::IndexerParams ip{c.block_size, c.top_k};
      ops::indexer_topk(h.cpu(), host(iq.data(), DType::kF32, {T, c.kv_heads, c.index_dim}),
                        host(ik.data(), DType::kF32, {slots, c.index_dim}), batch.host_meta, ip,
                        host(sel.data(), DType::kI32, sel_shape));
      dsel.poison();
      ops::indexer_topk(h.gpu(), dev(diq, DType::kF32, {T, c.kv_heads, c.index_dim}),
                        dev(dik, DType::kF32, {slots, c.index_dim}), batch.dev_meta, ip, dev(dsel, DType::kI32, sel_shape));
      h.compare_ints("indexer_topk", dsel.get<int32_t>(sel.size()), sel);
    });
    h.guarded("attention_dense", [&] {
      std::vector<float> ref(q.size());
      ops::attention(h.cpu(), host(q.data(), DType::kF32, qs), host(kc.data(), DType::kF32, ks),
                     host(vc.data(), DType::kF32, ks), batch.host_meta, TensorView{}, 0,
                     host(ref.data(), DType::kF32, qs));
      dout.poison();
      ops::attention(h.gpu(), dev(dq, DType::kF32, qs), dev(dk, DType::kF32, ks), dev(dv, DType::kF32, ks),
                     batch.dev_meta, TensorView{}, 0, dev(dout, DType::kF32, qs));
      h.compare("attention_dense", dout.get<float>(q.size()), ref);
    });
    h.guarded("attention_sparse", [&] {
      // The CPU indexer's selection, then a random one with -1, repeats and out-of-range ids.
      std::vector<int32_t> random_sel(sel.size());
      std::uniform_int_distribution<int> ud(-1, batch.max_blocks + 1);
      for (auto& b : random_sel) b = ud(rng);
      for (const auto* s : {&sel, &random_sel}) {
        std::vector<float> ref(q.size());
        std::vector<int32_t> hs = *s;
        ops::attention(h.cpu(), host(q.data(), DType::kF32, qs), host(kc.data(), DType::kF32, ks),
                       host(vc.data(), DType::kF32, ks), batch.host_meta, host(hs.data(), DType::kI32, sel_shape),
                       c.top_k, host(ref.data(), DType::kF32, qs));
        DevBuf ds(hs);
        dout.poison();
        ops::attention(h.gpu(), dev(dq, DType::kF32, qs), dev(dk, DType::kF32, ks), dev(dv, DType::kF32, ks),
                       batch.dev_meta, dev(ds, DType::kI32, sel_shape), c.top_k, dev(dout, DType::kF32, qs));
        h.compare("attention_sparse", dout.get<float>(q.size()), ref);
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
void check_router(Harness& h, std::mt19937& rng) {
  struct Case {
    int tokens, experts, hidden, top_k;
    bool use_bias, crafted;
  };
  for (const Case& c : {Case{37, 16, 64, 4, true, false}, Case{37, 16, 64, 4, false, false}, Case{1, 16, 64, 4, true, false},
                        Case{29, 16, 32, 4, true, true}, Case{5, 64, 96, 8, true, false}, Case{23, 8, 16, 3, true, true},
                        // An M3-like width (segment kernel, 8-token tiles), and a width not divisible
                        // by 4 (row-dot fallback).
                        Case{70, 128, 1536, 4, true, false}, Case{9, 16, 18, 4, true, false},
                        // The tiled kernel past 256 tokens (the decode kernel for the lone tokens): groups of
                        // several segments, a width not a multiple of 32, experts not a multiple of 4;
                        // small integers (exact logits, ties) at the wide widths.
                        Case{300, 128, 6144, 4, true, true}, Case{520, 30, 200, 3, true, false},
                        Case{4100, 40, 2112, 4, true, true}, Case{260, 16, 64, 4, true, true},
                        // 256 experts (two expert tiles; eight pairs per selecting thread) and a
                        // width that is a multiple of 4 but not of the tiled kernel's 16-k stage.
                        Case{600, 256, 1540, 8, true, false}}) {
    h.guarded("moe_router", [&] {
      std::vector<float> x, w, bias;
      if (c.crafted) {
        // Small integers: exact logits. Experts 1, 5, 9, ... copy expert 0's row (logit ties),
        // and biases repeat in pairs (choice ties through the bias as well).
        x = rand_int(size_t(c.tokens) * c.hidden, rng, -2, 2);
        w = rand_int(size_t(c.experts) * c.hidden, rng, -1, 1);
        for (int e = 1; e < c.experts; e += 4) std::copy_n(w.begin(), c.hidden, w.begin() + int64_t(e) * c.hidden);
        bias.resize(size_t(c.experts));
        for (int e = 0; e < c.experts; ++e) bias[size_t(e)] = 0.125f * float(e / 2 % 3);
      } else {
        x = randn(size_t(c.tokens) * c.hidden, rng);
        w = randn(size_t(c.experts) * c.hidden, rng, 0.3f);
        bias = randn(size_t(c.experts), rng, 0.05f);
      }
      const ops::RouterParams rp{c.top_k, 2.5f, c.use_bias};
      std::vector<int32_t> ids(size_t(c.tokens) * c.top_k);
      std::vector<float> wts(ids.size());
      ops::moe_router(h.cpu(), host(x.data(), DType::kF32, {c.tokens, c.hidden}),
                      host(w.data(), DType::kF32, {c.experts, c.hidden}), host(bias.data(), DType::kF32, {c.experts}),
                      rp, host(ids.data(), DType::kI32, {c.tokens, c.top_k}),
                      host(wts.data(), DType::kF32, {c.tokens, c.top_k}));
      DevBuf dx(x), dw(w), db(bias), dids(ids.size() * 4), dwts(wts.size() * 4);
      dids.poison();
      dwts.poison();
      ops::moe_router(h.gpu(), dev(dx, DType::kF32, {c.tokens, c.hidden}), dev(dw, DType::kF32, {c.experts, c.hidden}),
                      dev(db, DType::kF32, {c.experts}), rp, dev(dids, DType::kI32, {c.tokens, c.top_k}),
                      dev(dwts, DType::kF32, {c.tokens, c.top_k}));
      h.compare_ints("moe_router", dids.get<int32_t>(ids.size()), ids, "", false);
      const auto batch_w = dwts.get<float>(wts.size());
      h.compare("moe_router", batch_w, wts);
      // Batch invariance: a token routed alone gets its batch row's ids and weights, bit for bit.
      std::vector<int> same, want;
      for (int t : {0, c.tokens / 2, c.tokens - 1}) {
        DevBuf one_x(std::vector<float>(x.begin() + int64_t(t) * c.hidden, x.begin() + int64_t(t + 1) * c.hidden));
        DevBuf one_ids(size_t(c.top_k) * 4), one_w(size_t(c.top_k) * 4);
        ops::moe_router(h.gpu(), dev(one_x, DType::kF32, {1, c.hidden}), dev(dw, DType::kF32, {c.experts, c.hidden}),
                        dev(db, DType::kF32, {c.experts}), rp, dev(one_ids, DType::kI32, {1, c.top_k}),
                        dev(one_w, DType::kF32, {1, c.top_k}));
        const auto oi = one_ids.get<int32_t>(size_t(c.top_k));
        const auto ow = one_w.get<float>(size_t(c.top_k));
        const bool eq = std::equal(oi.begin(), oi.end(), dids.get<int32_t>(ids.size()).begin() + int64_t(t) * c.top_k) &&
                        std::memcmp(ow.data(), batch_w.data() + int64_t(t) * c.top_k, size_t(c.top_k) * 4) == 0;
        same.push_back(eq ? 1 : 0);
        want.push_back(1);
      }
      h.compare_ints("router_invariance", same, want);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// A weight as both backends hold it: F32 for the CPU (BF16 and MXFP8 weights dequantised
// exactly, as the loader does), and the device copy in its own encoding.
struct Weight {
  std::vector<float> f32;
  std::unique_ptr<DevBuf> device, device_scale, device_max;
  // dev_w_scan: MXFP8 without scale_max (the kernels then scan each row's scales for its reference).
  ops::LinearWeight host_w, dev_w, dev_w_scan;
  Weight(int64_t out, int64_t in, DType dt, std::mt19937& rng) {
    f32 = randn(size_t(out * in), rng, 1.0f / std::sqrt(float(in)));
    if (dt == DType::kBF16) {
      std::vector<uint16_t> bits(f32.size());
      for (size_t i = 0; i < f32.size(); ++i) {
        bits[i] = f32_to_bf16(f32[i]);
        f32[i] = bf16_to_f32(bits[i]);
      }
      device = std::make_unique<DevBuf>(bits);
    } else if (dt == DType::kF8E4M3) {
      // MXFP8 as make_model writes it: per 1x32 block the smallest e with 448 * 2^e >= amax,
      // scale byte e + 127, q = e4m3(w * 2^-e). Rows get spread magnitudes (2^-12 .. 2^6) so
      // the scales, e4m3 subnormals and the e8m0 range are all exercised.
      std::vector<uint8_t> q(f32.size()), s(size_t(out * (in / 32)));
      for (int64_t o = 0; o < out; ++o) {
        const float row_scale = std::ldexp(1.0f, int(o % 19) - 12);
        for (int64_t b = 0; b < in / 32; ++b) {
          float* x = f32.data() + o * in + b * 32;
          float amax = 0.0f;
          for (int i = 0; i < 32; ++i) {
            x[i] *= row_scale;
            amax = std::max(amax, std::fabs(x[i]));
          }
          int e = -127;
          if (amax > 0.0f) {
            int fe;
            std::frexp(double(amax) / 448.0, &fe);
            e = fe;
            while (e > -127 && std::ldexp(448.0, e - 1) >= double(amax)) --e;
            while (e < 127 && std::ldexp(448.0, e) < double(amax)) ++e;
          }
          const uint8_t sb = uint8_t(std::clamp(e, -127, 127) + 127);
          s[size_t(o * (in / 32) + b)] = sb;
          for (int i = 0; i < 32; ++i) {
            uint8_t& qi = q[size_t(o * in + b * 32 + i)];
            qi = f32_to_fp8_e4m3(float(double(x[i]) * std::ldexp(1.0, -(int(sb) - 127))));
            x[i] = fp8_e4m3_to_f32(qi) * e8m0_to_f32(sb);  // exact: the loader's dequantisation
          }
        }
      }
      device = std::make_unique<DevBuf>(q);
      device_scale = std::make_unique<DevBuf>(s);
      dev_w.scale = dev(*device_scale, DType::kU8, {out, in / 32});
      std::vector<uint8_t> smax(static_cast<size_t>(out));
      e8m0_row_max(s.data(), out, in / 32, smax.data());
      device_max = std::make_unique<DevBuf>(smax);
    } else {
      device = std::make_unique<DevBuf>(f32);
    }
    host_w.data = host(f32.data(), DType::kF32, {out, in});
    dev_w.data = dev(*device, dt, {out, in});
    dev_w_scan = dev_w;
    if (device_max) dev_w.scale_max = dev(*device_max, DType::kU8, {out});
  }
};

std::string gemm_row(const char* op, DType dt) {
  return std::string(op) + (dt == DType::kBF16 ? "_bf16" : dt == DType::kF8E4M3 ? "_mxfp8" : "");
}

constexpr DType kWeightTypes[] = {DType::kF32, DType::kBF16, DType::kF8E4M3};

// Bit-exact comparison of float vectors, as an integer row (1 = identical).
int32_t same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0 ? 1 : 0; }

void check_linear(Harness& h, std::mt19937& rng) {
  struct Case {
    int m, n, k;
  };
  // Ragged K (77: scalar-load path, K % 8 != 0), narrow outputs with deep K (fixed K split:
  // 48 x 4096 -> 8 splits, 33 x 4096, 20 x 6144 router-like), token counts 1, 2, 7, 33, 130.
  const std::vector<Case> cases = {{1, 64, 128},  {37, 200, 96},  {130, 256, 520}, {3, 33, 77},   {2, 48, 4096},
                                   {7, 33, 4096}, {33, 20, 6144}, {130, 256, 512}, {1, 1000, 96}, {2, 130, 100},
                                   // Tensor-core entry (BF16/MXFP8, K >= 1024): 16- and 128-token tiles, K
                                   // segments in separate CTAs (m <= 256, few tiles) or in one (300 rows),
                                   // ragged N; the rows alone take the split narrow tile.
                                   {130, 300, 1024}, {1, 520, 2048}, {200, 1000, 3072}, {300, 256, 1024},
                                   {37, 2000, 1024}, {16, 129, 1152},
                                   // One or two rows: the x split inside the GEMM launch (split K, and
                                   // 133 tiles that run their whole K in one CTA).
                                   {1, 17000, 1024}, {2, 700, 3072},
                                   // 33-128 rows: 32-token narrow tiles, K split (100 rows, 4 x 4 tiles).
                                   {100, 520, 3072},
                                   // 129-256 rows: 32-token tiles; 48 x 6 tiles fill 55 % of their last wave, so
                                   // K is split over CTAs as well.
                                   {192, 6144, 3072},
                                   // From 512 rows MXFP8 takes the wgmma kernel (row alone: mma.sync): ragged
                                   // N and M, K of 18 stages (odd segments), deep K.
                                   {600, 300, 1024}, {700, 520, 3072}, {1030, 1000, 1152}, {512, 128, 6144}};
  for (DType dt : kWeightTypes) {
    for (bool invariant : {true, false}) {
      const std::string lin = gemm_row("linear", dt);
      h.guarded(lin, [&] {
        for (const Case& c : cases) {
          if (dt == DType::kF8E4M3 && c.k % 32 != 0) continue;
          const int m = c.m, n = c.n, k = c.k;
          Weight w(n, k, dt, rng);
          auto x = randn(size_t(m) * k, rng);
          std::vector<float> ref(size_t(m) * n);
          ops::linear(h.cpu(), host(x.data(), DType::kF32, {m, k}), w.host_w, host(ref.data(), DType::kF32, {m, n}));
          DevBuf dx(x), dy(ref.size() * 4);
          dy.poison();
          ops::linear(h.gpu(invariant), dev(dx, DType::kF32, {m, k}), w.dev_w, dev(dy, DType::kF32, {m, n}));
          const auto batch = dy.get<float>(ref.size());
          h.compare(lin, batch, ref);
          // MXFP8 always runs the row-dot entry, so it is batch-invariant in either mode.
          if (!invariant && dt != DType::kF8E4M3) continue;
          std::vector<int32_t> same, want;
          // Each row alone gives the same bits as inside the batch.
          for (int r : {0, m / 2, m - 1}) {
            TensorView xr{dx.as<float>() + int64_t(r) * k, DType::kF32, {1, k}, Device::kCuda};
            DevBuf one(size_t(n) * 4);
            one.poison();
            ops::linear(h.gpu(invariant), xr, w.dev_w, dev(one, DType::kF32, {1, n}));
            const auto alone = one.get<float>(size_t(n));
            same.push_back(same_bits(alone.data(), batch.data() + int64_t(r) * n, size_t(n)));
            want.push_back(1);
          }
          // x 4 bytes off 16-byte alignment: the scalar-load kernel gives the vector kernel's bits.
          DevBuf shifted(x.size() * 4 + 16);
          M3_CUDA_CHECK(cudaMemcpy(shifted.as<float>() + 1, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
          dy.poison();
          ops::linear(h.gpu(invariant), TensorView{shifted.as<float>() + 1, DType::kF32, {m, k}, Device::kCuda},
                      w.dev_w, dev(dy, DType::kF32, {m, n}));
          const auto unaligned = dy.get<float>(ref.size());
          same.push_back(same_bits(unaligned.data(), batch.data(), batch.size()));
          want.push_back(1);
          // Every kernel of the tensor-core entry, forced at this size through a rule (the
          // engine's switches moved), gives the batch's bits: wgmma in both forms (MXFP8), the
          // 32-token tiles with and without the ragged-wave split, the wide tile; wgmma's overlapped
          // form for BF16 weights too.
          if (invariant && cuda::mma_linear_eligible(dt, n, k).empty()) {
            constexpr int64_t kNever = int64_t(1) << 62;
            std::vector<cuda::MmaLinearRule> rules = {{kNever, kNever, 85, false}, {kNever, kNever, 0, false},
                                                      {kNever, 0, 0, false}};
            if (dt == DType::kF8E4M3) {
              rules.insert(rules.end(), {{1, 256, 85, false}, {1, 256, 85, true}, {1, 256, 85, true}});
              rules.back().wgmma_split = true;  // the overlapped form with K split over work items
            } else if (dt == DType::kBF16) {  // BF16 weights: the overlapped form, K unsplit and split
              rules.insert(rules.end(), {{1, 256, 85, true}, {1, 256, 85, true}});
              rules.back().wgmma_split = true;
              rules[rules.size() - 2].wgmma_bf16 = rules.back().wgmma_bf16 = true;
            }
            for (cuda::MmaLinearRule& rule : rules) rule.wgmma_wide_min_rows = rule.wgmma_min_rows;
            for (const cuda::MmaLinearRule& rule : rules) {
              // MXFP8: with the weight's scale_max and without it (each row's scales scanned).
              for (const ops::LinearWeight* lw : {&w.dev_w, &w.dev_w_scan}) {
                if (lw == &w.dev_w_scan && dt != DType::kF8E4M3) continue;
                dy.poison();
                cuda::mma_linear(dx.as<float>(), k, m, *lw, dy.as<float>(), n, true, rule);
                const auto forced = dy.get<float>(ref.size());
                same.push_back(same_bits(forced.data(), batch.data(), batch.size()));
                want.push_back(1);
              }
            }
          }
          h.compare_ints("linear_invariance", same, want);
        }
      });
    }
  }
}

// A layer's projections of one x (ops::linear_group: q/k/v and the index projections): every
// output has the bits of its own ops::linear call, and the CPU reference within tolerance. Groups
// of 3 and 6 (the most one launch takes) mix wide and narrow N (k/v-like 128 and 64, ragged 300),
// at row counts that take each narrow tile (1, 2, 5, 8: 8 tokens; 16, 24: 16; 33, 100, 192: 32); K
// segments split over CTAs throughout. (Wide tiles, past 256 rows, launch per GEMM: check_linear.)
void check_linear_group(Harness& h, std::mt19937& rng) {
  const int k = 2048;
  const std::vector<int> ns = {1024, 128, 128, 256, 64, 300};
  for (DType dt : {DType::kBF16, DType::kF8E4M3}) {
    const std::string row = gemm_row("linear_group", dt);
    h.guarded(row, [&] {
      std::vector<std::unique_ptr<Weight>> ws;
      for (int n : ns) ws.push_back(std::make_unique<Weight>(n, k, dt, rng));
      for (int m : {1, 2, 5, 8, 16, 24, 33, 100, 192}) {
        auto x = randn(size_t(m) * k, rng);
        DevBuf dx(x);
        for (int count : {3, 6}) {
          std::vector<const ops::LinearWeight*> dw;
          std::vector<std::unique_ptr<DevBuf>> outs;
          std::vector<TensorView> ys;
          for (int i = 0; i < count; ++i) {
            dw.push_back(&ws[size_t(i)]->dev_w);
            outs.push_back(std::make_unique<DevBuf>(size_t(m) * ns[size_t(i)] * 4));
            outs.back()->poison();
            ys.push_back(dev(*outs.back(), DType::kF32, {m, ns[size_t(i)]}));
          }
          ops::linear_group(h.gpu(true), dev(dx, DType::kF32, {m, k}), dw.data(), ys.data(), count);
          std::vector<int32_t> same, want;
          for (int i = 0; i < count; ++i) {
            const int n = ns[size_t(i)];
            const auto got = outs[size_t(i)]->get<float>(size_t(m) * n);
            std::vector<float> ref(size_t(m) * n);
            ops::linear(h.cpu(), host(x.data(), DType::kF32, {m, k}), ws[size_t(i)]->host_w,
                        host(ref.data(), DType::kF32, {m, n}));
            h.compare(row, got, ref);
            DevBuf alone(size_t(m) * n * 4);
            alone.poison();
            ops::linear(h.gpu(true), dev(dx, DType::kF32, {m, k}), ws[size_t(i)]->dev_w, dev(alone, DType::kF32, {m, n}));
            same.push_back(same_bits(got.data(), alone.get<float>(size_t(m) * n).data(), size_t(m) * n));
            want.push_back(1);
          }
          h.compare_ints("linear_group_bits", same, want);
        }
      }
    });
  }
}

void check_dense_mlp(Harness& h, std::mt19937& rng) {
  struct Case {
    int hidden, inter;
  };
  for (DType dt : kWeightTypes) {
    // F32/BF16: a K % 8 != 0 hidden (77) and a TP-local 48; MXFP8 needs multiples of 32. The
    // 2048 x 32 case splits K in the fused gate+up kernel; 1024 x 1152 takes the tensor-core entry.
    const std::vector<Case> shapes = dt == DType::kF8E4M3 ? std::vector<Case>{{96, 160}, {128, 96}, {2048, 32}, {1024, 1152}}
                                                          : std::vector<Case>{{96, 160}, {77, 48}, {2048, 32}, {1024, 1152}};
    for (bool invariant : {true, false}) {
      const std::string mlp = gemm_row("dense_mlp", dt);
      h.guarded(mlp, [&] {
        for (const Case& s : shapes) {
          for (int m : {1, 2, 7, 33, 130}) {
            if (s.hidden >= 2048 && m > 7) continue;
            const int hidden = s.hidden, inter = s.inter;
            Weight g(inter, hidden, dt, rng), u(inter, hidden, dt, rng), d(hidden, inter, dt, rng);
            auto x = randn(size_t(m) * hidden, rng, 2.0f);
            std::vector<float> ref(x.size());
            const ops::SwigluParams act;
            ops::dense_mlp(h.cpu(), host(x.data(), DType::kF32, {m, hidden}), g.host_w, u.host_w, d.host_w, act,
                           host(ref.data(), DType::kF32, {m, hidden}));
            DevBuf dx(x), dy(x.size() * 4);
            dy.poison();
            ops::dense_mlp(h.gpu(invariant), dev(dx, DType::kF32, {m, hidden}), g.dev_w, u.dev_w, d.dev_w, act,
                           dev(dy, DType::kF32, {m, hidden}));
            const auto batch = dy.get<float>(ref.size());
            h.compare(mlp, batch, ref);
            if ((!invariant && dt != DType::kF8E4M3) || m == 1) continue;
            std::vector<int32_t> same, want;
            for (int r : {0, m - 1}) {
              TensorView xr{dx.as<float>() + int64_t(r) * hidden, DType::kF32, {1, hidden}, Device::kCuda};
              DevBuf one(size_t(hidden) * 4);
              one.poison();
              ops::dense_mlp(h.gpu(invariant), xr, g.dev_w, u.dev_w, d.dev_w, act, dev(one, DType::kF32, {1, hidden}));
              const auto alone = one.get<float>(size_t(hidden));
              same.push_back(same_bits(alone.data(), batch.data() + int64_t(r) * hidden, size_t(hidden)));
              want.push_back(1);
            }
            h.compare_ints("dense_mlp_invariance", same, want);
          }
        }
      });
    }
  }
}

using cuda_test::make_routing;

void check_moe(Harness& h, std::mt19937& rng) {
  struct Case {
    int tokens;
    bool shared;
    int routed, top_k, hidden, inter, shared_inter;  // shared_inter: the shared expert's own size
    double skew;
    bool dup, from_router;
  };
  for (DType dt : kWeightTypes) {
    const bool mx = dt == DType::kF8E4M3;
    std::vector<Case> cases = {
        {37, true, 8, 3, 64, 96, 96, 0.0, false, true},   {1, true, 8, 3, 64, 96, 96, 0.0, false, true},
        {19, false, 8, 3, 64, 96, 96, 0.0, false, true},  {2, true, 32, 4, 64, 96, 96, 0.0, false, false},
        {7, true, 32, 4, 96, 64, 64, 1.0, false, false},  {33, true, 16, 4, 64, 96, 96, 2.0, false, false},
        {130, true, 16, 4, 64, 96, 96, 2.0, false, false}, {130, false, 64, 6, 96, 64, 64, 0.5, false, false},
    };
    if (!mx) {
      // Shapes MXFP8 cannot take: TP-local 48, odd hidden, hidden % 8 != 0, a shared expert of
      // another size; and duplicate experts within a token.
      cases.push_back({33, true, 16, 4, 64, 48, 96, 1.0, false, false});
      cases.push_back({7, true, 16, 4, 67, 48, 48, 0.0, false, false});
      cases.push_back({130, true, 16, 4, 68, 48, 32, 2.0, false, false});
      cases.push_back({13, true, 8, 3, 64, 48, 48, 0.0, true, false});
    }
    for (bool invariant : {true, false}) {
      const std::string moe = gemm_row("moe_experts", dt);
      h.guarded(moe, [&] {
        for (const Case& c : cases) {
          const int tokens = c.tokens, hidden = c.hidden, routed = c.routed, top_k = c.top_k;
          std::vector<Weight> gw, uw, dw;
          for (int e = 0; e < routed + (c.shared ? 1 : 0); ++e) {
            const int inter = e == routed ? c.shared_inter : c.inter;
            gw.emplace_back(inter, hidden, dt, rng);
            uw.emplace_back(inter, hidden, dt, rng);
            dw.emplace_back(hidden, inter, dt, rng);
          }
          std::vector<ops::LinearWeight> hg, hu, hd, dg, du, dd;
          for (size_t e = 0; e < gw.size(); ++e) {
            hg.push_back(gw[e].host_w), hu.push_back(uw[e].host_w), hd.push_back(dw[e].host_w);
            dg.push_back(gw[e].dev_w), du.push_back(uw[e].dev_w), dd.push_back(dw[e].dev_w);
          }
          auto x = randn(size_t(tokens) * hidden, rng, 2.0f);
          std::vector<int32_t> ids(size_t(tokens) * top_k);
          std::vector<float> wts(ids.size());
          if (c.from_router) {  // the CPU router's assignment
            auto rw = randn(size_t(routed) * hidden, rng, 0.3f), rb = randn(size_t(routed), rng, 0.05f);
            ops::moe_router(h.cpu(), host(x.data(), DType::kF32, {tokens, hidden}),
                            host(rw.data(), DType::kF32, {routed, hidden}), host(rb.data(), DType::kF32, {routed}),
                            ops::RouterParams{top_k, 2.0f, true}, host(ids.data(), DType::kI32, {tokens, top_k}),
                            host(wts.data(), DType::kF32, {tokens, top_k}));
          } else {
            make_routing(tokens, routed, top_k, c.skew, c.dup, rng, ids, wts);
          }
          // Experts nobody picked: their device weights become NaN (0xff bytes), which would
          // reach the output if the GPU ran them (it must skip zero-count experts entirely).
          std::vector<int> picked(static_cast<size_t>(routed), 0);
          for (int32_t e : ids) picked[size_t(e)] = 1;
          for (int e = 0; e < routed; ++e) {
            if (picked[size_t(e)]) continue;
            for (Weight* w : {&gw[size_t(e)], &uw[size_t(e)], &dw[size_t(e)]}) {
              M3_CUDA_CHECK(cudaMemset(w->dev_w.data.data, 0xff, w->dev_w.data.size_bytes()));
            }
          }
          const ops::SwigluParams act;
          std::vector<float> ref(x.size());
          ops::moe_experts(h.cpu(), host(x.data(), DType::kF32, {tokens, hidden}),
                           host(ids.data(), DType::kI32, {tokens, top_k}), host(wts.data(), DType::kF32, {tokens, top_k}),
                           ops::ExpertWeights{routed, c.shared, hg.data(), hu.data(), hd.data()}, act,
                           host(ref.data(), DType::kF32, {tokens, hidden}));
          DevBuf dx(x), dids(ids), dwts(wts), dy(x.size() * 4);
          dy.poison();
          const ops::ExpertWeights dexperts{routed, c.shared, dg.data(), du.data(), dd.data()};
          ops::moe_experts(h.gpu(invariant), dev(dx, DType::kF32, {tokens, hidden}),
                           dev(dids, DType::kI32, {tokens, top_k}), dev(dwts, DType::kF32, {tokens, top_k}), dexperts,
                           act, dev(dy, DType::kF32, {tokens, hidden}));
          const auto batch = dy.get<float>(ref.size());
          h.compare(moe, batch, ref);
          if (!invariant || tokens == 1) continue;
          // Each token alone (its own routing row) gives the same bits as inside the batch.
          std::vector<int32_t> same, want;
          for (int r : {0, tokens / 2, tokens - 1}) {
            DevBuf one(size_t(hidden) * 4);
            one.poison();
            ops::moe_experts(h.gpu(true), TensorView{dx.as<float>() + int64_t(r) * hidden, DType::kF32, {1, hidden}, Device::kCuda},
                             TensorView{dids.as<int32_t>() + int64_t(r) * top_k, DType::kI32, {1, top_k}, Device::kCuda},
                             TensorView{dwts.as<float>() + int64_t(r) * top_k, DType::kF32, {1, top_k}, Device::kCuda},
                             dexperts, act, dev(one, DType::kF32, {1, hidden}));
            const auto alone = one.get<float>(size_t(hidden));
            same.push_back(same_bits(alone.data(), batch.data() + int64_t(r) * hidden, size_t(hidden)));
            want.push_back(1);
          }
          h.compare_ints("moe_invariance", same, want);
        }
      });
    }
  }
}

// Router + MoE experts + linear (row-dot, and cuBLAS SGEMM) on a non-default stream, captured
// into a CUDA graph and replayed twice: bit-identical to the eager run, and nothing in the
// capture may synchronise with the host (capture would fail).
void check_graph(Harness& h, std::mt19937& rng) {
  h.guarded("cuda_graph", [&] {
    const int tokens = 5, hidden = 128, inter = 64, routed = 16, top_k = 4, n_out = 96;
    for (DType dt : {DType::kBF16, DType::kF8E4M3}) {
      std::vector<Weight> gw, uw, dw;
      for (int e = 0; e <= routed; ++e) {
        gw.emplace_back(inter, hidden, dt, rng);
        uw.emplace_back(inter, hidden, dt, rng);
        dw.emplace_back(hidden, inter, dt, rng);
      }
      std::vector<ops::LinearWeight> dg, du, dd;
      for (size_t e = 0; e < gw.size(); ++e) dg.push_back(gw[e].dev_w), du.push_back(uw[e].dev_w), dd.push_back(dw[e].dev_w);
      const ops::ExpertWeights experts{routed, true, dg.data(), du.data(), dd.data()};
      Weight lw(n_out, hidden, dt, rng), lf(n_out, hidden, DType::kF32, rng);
      auto x = randn(size_t(tokens) * hidden, rng, 2.0f);
      auto rw = randn(size_t(routed) * hidden, rng, 0.3f), rb = randn(size_t(routed), rng, 0.05f);
      DevBuf dx(x), drw(rw), drb(rb), dids(size_t(tokens) * top_k * 4), dwts(size_t(tokens) * top_k * 4),
          dmoe(x.size() * 4), dlin(size_t(tokens) * n_out * 4), dsg(size_t(tokens) * n_out * 4);
      cuda_test::ScopedStream scoped;  // after the uploads above (legacy stream)
      const cudaStream_t stream = scoped.get();
      auto step = [&] {
        ops::moe_router(h.gpu(), dev(dx, DType::kF32, {tokens, hidden}), dev(drw, DType::kF32, {routed, hidden}),
                        dev(drb, DType::kF32, {routed}), ops::RouterParams{top_k, 2.0f, true},
                        dev(dids, DType::kI32, {tokens, top_k}), dev(dwts, DType::kF32, {tokens, top_k}));
        ops::moe_experts(h.gpu(), dev(dx, DType::kF32, {tokens, hidden}), dev(dids, DType::kI32, {tokens, top_k}),
                         dev(dwts, DType::kF32, {tokens, top_k}), experts, ops::SwigluParams{},
                         dev(dmoe, DType::kF32, {tokens, hidden}));
        ops::linear(h.gpu(), dev(dmoe, DType::kF32, {tokens, hidden}), lw.dev_w, dev(dlin, DType::kF32, {tokens, n_out}));
        ops::linear(h.gpu(false), dev(dmoe, DType::kF32, {tokens, hidden}), lf.dev_w,
                    dev(dsg, DType::kF32, {tokens, n_out}));  // cuBLAS SGEMM
      };
      auto fetch = [&] {
        M3_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<float> all = dwts.get<float>(size_t(tokens) * top_k);
        for (const DevBuf* b : {&dmoe, &dlin, &dsg}) {
          const auto v = b->get<float>(b == &dmoe ? x.size() : size_t(tokens) * n_out);
          all.insert(all.end(), v.begin(), v.end());
        }
        const auto ids = dids.get<int32_t>(size_t(tokens) * top_k);
        for (int32_t i : ids) all.push_back(float(i));
        return all;
      };
      auto poison = [&] {
        for (DevBuf* b : {&dids, &dwts, &dmoe, &dlin, &dsg}) b->poison();
        M3_CUDA_CHECK(cudaDeviceSynchronize());
      };
      poison();
      step();  // eager (also creates the cuBLAS handle and workspace for this stream)
      const auto eager = fetch();
      cudaGraphExec_t exec = m3::cuda::capture_graph(stream, step);
      std::vector<int32_t> same, want;
      for (int replay = 0; replay < 2; ++replay) {
        poison();
        M3_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        const auto replayed = fetch();
        same.push_back(replayed.size() == eager.size() && same_bits(replayed.data(), eager.data(), eager.size()));
        want.push_back(1);
      }
      cudaGraphExecDestroy(exec);
      h.compare_ints("cuda_graph", same, want);
    }
  });
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

void report(Harness& h) {
  nlohmann::json out = nlohmann::json::array();
  std::printf("\n%-20s %-5s %-10s %-10s %-8s %-11s %-6s %s\n", "op", "cases", "max_abs", "max_rel", "tol",
              "ints_exact", "result", "entries");
  for (const Row& r : h.rows()) {
    std::string entries;
    for (const auto& e : r.entries) entries += (entries.empty() ? "" : ",") + e;
    const char* ints = r.has_ints ? (r.ints_exact ? "yes" : "NO") : "n/a";
    std::printf("%-20s %-5d %-10s %-10s %-8s %-11s %-6s %s\n", r.name.c_str(), r.cases, fmt(r.max_abs).c_str(),
                fmt(r.max_rel).c_str(), fmt(r.tol()).c_str(), ints, r.pass() ? "PASS" : "FAIL", entries.c_str());
    if (!r.error.empty()) std::printf("    error: %s\n", r.error.c_str());
    out.push_back({{"op", r.name}, {"cases", r.cases}, {"max_abs_err", r.max_abs}, {"max_rel_err", r.max_rel},
                   {"tolerance", r.tol()}, {"integer_outputs_exact", r.has_ints ? nlohmann::json(r.ints_exact) : nullptr},
                   {"pass", r.pass()}, {"entries", r.entries}, {"error", r.error}});
  }
  const char* dir = std::getenv("M3_OUT");
  if (!dir || !*dir) dir = std::getenv("M3_BINARY_DIR");
  const std::string path = std::string(dir && *dir ? dir : ".") + "/cuda_parity.json";
  std::ofstream(path) << out.dump(2) << "\n";
  std::printf("wrote %s\n", path.c_str());
}

// The 8- and 16-token linear tiles' launches get the CTAs per SM their rule asks for: with MXFP8
// weights three as compiled (at most 80 registers), two with the padded shared memory; with BF16
// weights (larger rings) two either way. A kernel whose registers grow past its count fails here.
TEST(CudaParity, NarrowLinearTileOccupancy) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: the occupancy check needs one";
  for (int ct : {8, 16}) {
    EXPECT_EQ(cuda::narrow_occupancy_check(ct, true, 0), 3) << ct << "-token FP8";
    EXPECT_EQ(cuda::narrow_occupancy_check(ct, true, 3), 3) << ct << "-token FP8";
    EXPECT_EQ(cuda::narrow_occupancy_check(ct, true, 2), 2) << ct << "-token FP8";
    EXPECT_EQ(cuda::narrow_occupancy_check(ct, false, 2), 2) << ct << "-token BF16";
  }
  // The 32-token tile runs two per SM (the split rule's waves assume it).
  EXPECT_EQ(cuda::narrow_occupancy_check(32, true, 0), 2) << "32-token FP8";
  EXPECT_EQ(cuda::narrow_occupancy_check(32, false, 0), 2) << "32-token BF16";
}

TEST(CudaParity, EveryOpMatchesTheCpuReference) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU parity test needs one";
  const cuda::DeviceInfo info = cuda::device_info(0);
  std::printf("device 0: cc %d.%d, %d SMs, %.1f GiB\n", info.cc_major, info.cc_minor, info.sm_count,
              double(info.total_memory_bytes) / (1 << 30));
  Harness h;
  std::mt19937 rng(20261130);
  check_elementwise(h, rng);
  check_fused_rows(h, rng);
  check_attention(h, rng);
  check_router(h, rng);
  check_linear(h, rng);
  check_linear_group(h, rng);
  check_dense_mlp(h, rng);
  check_moe(h, rng);
  check_graph(h, rng);
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  report(h);
  for (const Row& r : h.rows()) {
    EXPECT_TRUE(r.pass()) << r.name << ": max_rel " << r.max_rel << " (tol " << r.tol() << ")" << (r.error.empty() ? "" : ", ")
                          << r.error;
    for (const auto& e : r.entries) EXPECT_NE(e.find(".sm90"), std::string::npos) << r.name << " ran " << e;
  }
  EXPECT_GE(h.rows().size(), 29u);
}

}  // namespace
}  // namespace m3
