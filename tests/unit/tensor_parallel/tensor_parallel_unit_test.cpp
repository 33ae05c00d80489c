// Tensor parallelism's pieces without a forward pass: the per-rank config (MiniMaxM3Config::shard),
// which slice of each checkpoint tensor a rank loads (tp_slice, slice_mxfp8 against the
// dequantised whole tensor), and the in-process group's all_reduce (rank-order sums, the same bits
// on every rank).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/dtype.h"
#include "dist/in_process_group.h"
#include "loader/model_dir.h"
#include "model/minimax_m3/config.h"
#include "model/minimax_m3/tp_shard.h"
#include "model/minimax_m3/weight_reader.h"

namespace m3 {
namespace {

MiniMaxM3Config m3_preset() { return *MiniMaxM3Config::preset("m3"); }

TEST(TpConfig, M3SplitsHeadsAndWidthsAndReplicatesKvHeadsPastFour) {
  const MiniMaxM3Config whole = m3_preset();
  for (int tp : {2, 4, 8}) {
    for (int r = 0; r < tp; ++r) {
      auto c = whole.shard(tp, r);
      ASSERT_TRUE(c.is_ok()) << c.error();
      EXPECT_EQ(c->tp_size, tp);
      EXPECT_EQ(c->tp_rank, r);
      EXPECT_EQ(c->num_attention_heads, 64 / tp);
      EXPECT_EQ(c->num_key_value_heads, tp <= 4 ? 4 / tp : 1);
      EXPECT_EQ(c->index_n_heads, c->num_key_value_heads);
      // The rank's query heads belong to the KV heads it holds.
      const int first_q = r * c->num_attention_heads;
      EXPECT_EQ(first_q / 16, c->kv_head_offset) << "tp " << tp << " rank " << r;
      EXPECT_EQ(c->intermediate_size, 3072 / tp);
      EXPECT_EQ(c->shared_intermediate_size, 3072 / tp);
      EXPECT_EQ(c->dense_intermediate_size, 12288 / tp);
      EXPECT_EQ(c->hidden_size, whole.hidden_size);
      EXPECT_EQ(c->vocab_size, whole.vocab_size);
      EXPECT_TRUE(c->validate().empty());
    }
  }
}

TEST(TpConfig, RefusesWhatDoesNotDivideByName) {
  const MiniMaxM3Config whole = m3_preset();
  auto three = whole.shard(3, 0);
  ASSERT_FALSE(three.is_ok());
  EXPECT_NE(three.error().find("num_attention_heads 64"), std::string::npos) << three.error();
  auto sixteen_kv = whole.shard(16, 0);  // 16 divides 64 query heads, and 4 KV heads divide 16: fine
  EXPECT_TRUE(sixteen_kv.is_ok());
  EXPECT_FALSE(whole.shard(2, 2).is_ok());
  EXPECT_FALSE(whole.shard(0, 0).is_ok());
  EXPECT_FALSE(whole.shard(2, 0)->shard(2, 0).is_ok()) << "a shard is not sharded again";
  // MXFP8: a rank's share of a row-parallel K must be whole 32-wide scale blocks.
  MiniMaxM3Config tiny = *MiniMaxM3Config::preset("tiny");  // intermediate 64
  tiny.quant_method = QuantMethod::kMxfp8;
  EXPECT_TRUE(tiny.shard(2, 1).is_ok());
  auto four = tiny.shard(4, 0);
  ASSERT_FALSE(four.is_ok());
  EXPECT_NE(four.error().find("intermediate_size 64"), std::string::npos) << four.error();
  EXPECT_NE(four.error().find("MXFP8"), std::string::npos) << four.error();
}

TEST(TpSlice, ColumnAndRowParallelRules) {
  const MiniMaxM3Config whole = m3_preset();
  const MiniMaxM3Config c = *whole.shard(8, 5);  // 8 query heads (40..47), KV head 2
  auto find = [&](const std::string& tail) {
    for (const auto& s : weight_specs(whole))
      if (s.name.size() >= tail.size() && s.name.compare(s.name.size() - tail.size(), tail.size(), tail) == 0) return s;
    ADD_FAILURE() << tail;
    return WeightSpec{};
  };
  auto expect = [&](const std::string& tail, int dim, int64_t offset, int64_t count) {
    const TpSlice s = tp_slice(find(tail), c);
    EXPECT_EQ(s.dim, dim) << tail;
    EXPECT_EQ(s.offset, offset) << tail;
    EXPECT_EQ(s.count, count) << tail;
  };
  expect("layers.3.self_attn.q_proj.weight", 0, 40 * 128, 8 * 128);
  expect("layers.3.self_attn.k_proj.weight", 0, 2 * 128, 128);
  expect("layers.3.self_attn.v_proj.weight", 0, 2 * 128, 128);
  expect("layers.3.self_attn.index_q_proj.weight", 0, 2 * 128, 128);
  expect("layers.3.self_attn.index_k_proj.weight", -1, 0, 0);
  expect("layers.3.self_attn.o_proj.weight", 1, 40 * 128, 8 * 128);
  expect("layers.3.block_sparse_moe.experts.7.w1.weight", 0, 5 * 384, 384);
  expect("layers.3.block_sparse_moe.experts.7.w3.weight", 0, 5 * 384, 384);
  expect("layers.3.block_sparse_moe.experts.7.w2.weight", 1, 5 * 384, 384);
  expect("layers.3.block_sparse_moe.shared_experts.up_proj.weight", 0, 5 * 384, 384);
  expect("layers.3.block_sparse_moe.shared_experts.down_proj.weight", 1, 5 * 384, 384);
  expect("layers.0.mlp.gate_proj.weight", 0, 5 * 1536, 1536);
  expect("layers.0.mlp.down_proj.weight", 1, 5 * 1536, 1536);
  expect("layers.3.block_sparse_moe.gate.weight", -1, 0, 0);
  expect("layers.3.self_attn.q_norm.weight", -1, 0, 0);
  expect("lm_head.weight", 0, 5 * 25008, 25008);  // vocab-parallel: 200064 / 8
  expect("embed_tokens.weight", 0, 5 * 25008, 25008);
  EXPECT_EQ(sliced_shape(Shape{6144, 8192}, TpSlice{1, 1024, 1024}), (Shape{6144, 1024}));
}

TEST(TpSlice, SliceBytesRowsAndColumns) {
  std::vector<uint8_t> t(6 * 5);
  for (size_t i = 0; i < t.size(); ++i) t[i] = uint8_t(i);
  EXPECT_EQ(slice_bytes(t.data(), Shape{6, 5}, 1, TpSlice{0, 2, 3}),
            std::vector<uint8_t>(t.begin() + 10, t.begin() + 25));
  const auto cols = slice_bytes(t.data(), Shape{6, 5}, 1, TpSlice{1, 1, 2});
  ASSERT_EQ(cols.size(), 12u);
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(cols[size_t(2 * r)], t[size_t(5 * r + 1)]);
    EXPECT_EQ(cols[size_t(2 * r + 1)], t[size_t(5 * r + 2)]);
  }
  EXPECT_EQ(slice_bytes(t.data(), Shape{6, 5}, 1, TpSlice{}), t);
}

// Every MXFP8 linear of the bundled small checkpoint: the native slice (e4m3 + its scales),
// dequantised, is exactly the slice of the whole tensor dequantised.
TEST(TpSlice, Mxfp8SlicesDequantiseToTheWholeTensorsSlice) {
  const char* src = std::getenv("M3_SOURCE_DIR");
  const std::string path = std::string(src ? src : M3_SOURCE_DIR_DEFAULT) + "/models/m3-small-mxfp8";
  if (!std::filesystem::exists(path + "/config.json")) GTEST_SKIP() << "no " << path;
  auto dir = ModelDir::open(path);
  ASSERT_TRUE(dir.is_ok()) << dir.error();
  const MiniMaxM3Config whole = *MiniMaxM3Config::from_json((*dir)->config_json());
  ASSERT_EQ(whole.quant_method, QuantMethod::kMxfp8);
  int checked = 0, columns = 0;
  for (int tp : {2, 4}) {
    const MiniMaxM3Config c = *whole.shard(tp, tp - 1);
    for (const WeightSpec& spec : weight_specs(whole)) {
      if (spec.role != WeightRole::kLinear) continue;
      auto stored = locate_weight(**dir, spec, true);
      ASSERT_TRUE(stored.is_ok()) << stored.error();
      if (!stored->is_mxfp8()) continue;
      const TpSlice s = tp_slice(spec, c);
      const Mxfp8Slice part = slice_mxfp8(*stored, s, c.quant_block_k);
      const auto full = read_f32(**dir, spec, true);
      ASSERT_TRUE(full.is_ok());
      const auto want = slice_bytes(reinterpret_cast<const uint8_t*>(full->data()), spec.shape, 4, s);
      const int64_t rows = part.weight_shape[0], cols = part.weight_shape[1];
      ASSERT_EQ(size_t(rows * cols) * 4, want.size()) << spec.name;
      ASSERT_EQ(part.scale_shape, (Shape{rows, cols / 32})) << spec.name;
      for (int64_t i = 0; i < rows * cols; ++i) {
        const float v = std::ldexp(fp8_e4m3_to_f32(part.weight[size_t(i)]),
                                   int(part.scale[size_t((i / cols) * (cols / 32) + (i % cols) / 32)]) - 127);
        float w;
        std::memcpy(&w, want.data() + 4 * i, 4);
        ASSERT_EQ(v, w) << spec.name << " element " << i;
      }
      ++checked;
      columns += s.dim == 1;
    }
  }
  EXPECT_GT(checked, 50);
  EXPECT_GT(columns, 10) << "row-parallel (column-sliced) tensors with their scales";
}

// Sums in rank order, every rank gets the same bits, and repeated calls of varying sizes do not
// interfere.
TEST(InProcessGroup, AllReduceSumsInRankOrderWithTheSameBitsEverywhere) {
  for (int size : {1, 2, 3, 4}) {
    dist::InProcessGroup group(size);
    // Rank 0's 1e8 swallows small addends unless they are summed in order after it.
    auto value = [](int r, int i) { return (r == 0 ? 1e8f : 1.0f) + 0.1f * float(i) * float(r + 1); };
    std::vector<std::vector<std::vector<float>>> out(static_cast<size_t>(size));
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        auto comm = group.communicator(r);
        EXPECT_EQ(comm->size(), size);
        EXPECT_EQ(comm->rank(), r);
        for (int n : {1, 7, 1000, 3}) {
          std::vector<float> x(static_cast<size_t>(n));
          for (int i = 0; i < n; ++i) x[size_t(i)] = value(r, i);
          comm->all_reduce_sum(TensorView{x.data(), DType::kF32, {1, n}, Device::kCpu});
          out[size_t(r)].push_back(x);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 1; r < size; ++r) EXPECT_EQ(out[size_t(r)], out[0]) << "rank " << r << " of " << size;
    // Rank order: ((x0 + x1) + x2) + ... in fp32.
    for (size_t call = 0; call < out[0].size(); ++call)
      for (size_t i = 0; i < out[0][call].size(); ++i) {
        float acc = value(0, int(i));
        for (int r = 1; r < size; ++r) acc += value(r, int(i));
        ASSERT_EQ(out[0][call][i], acc) << size << " ranks, element " << i;
      }
  }
}

// Every rank's [rows, cols] block side by side on every rank.
TEST(InProcessGroup, AllGatherColumnsPutsRanksSideBySide) {
  const int size = 3, rows = 4, cols = 5;
  dist::InProcessGroup group(size);
  std::vector<std::vector<float>> out(static_cast<size_t>(size), std::vector<float>(size_t(rows * cols * size)));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto comm = group.communicator(r);
      std::vector<float> local(static_cast<size_t>(rows * cols));
      for (int i = 0; i < rows * cols; ++i) local[size_t(i)] = float(100 * r + i);
      comm->all_gather_cols(TensorView{local.data(), DType::kF32, {rows, cols}, Device::kCpu},
                            TensorView{out[size_t(r)].data(), DType::kF32, {rows, cols * size}, Device::kCpu});
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r)
    for (int i = 0; i < rows; ++i)
      for (int k = 0; k < size; ++k)
        for (int c = 0; c < cols; ++c)
          ASSERT_EQ(out[size_t(r)][size_t(i * cols * size + k * cols + c)], float(100 * k + i * cols + c));
}

// A rank that fails aborts the group: the ranks waiting for it in a collective, and any later
// collective, throw instead of hanging.
TEST(InProcessGroup, AbortReleasesTheOtherRanks) {
  const int size = 3;
  dist::InProcessGroup group(size);
  std::vector<int> threw(static_cast<size_t>(size), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto comm = group.communicator(r);
      std::vector<float> x(16, 1.0f);
      const TensorView v{x.data(), DType::kF32, {1, 16}, Device::kCpu};
      comm->all_reduce_sum(v);  // one that completes
      if (r == 1) {
        group.abort();  // rank 1 fails before the next collective
        return;
      }
      try {
        comm->all_reduce_sum(v);
      } catch (const std::runtime_error& e) {
        threw[size_t(r)] = std::string(e.what()).find("aborted") != std::string::npos;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(threw, (std::vector<int>{1, 0, 1}));
  auto late = group.communicator(0);
  std::vector<float> y(4, 1.0f);
  EXPECT_THROW(late->all_reduce_sum(TensorView{y.data(), DType::kF32, {1, 4}, Device::kCpu}), std::runtime_error);
}

}  // namespace
}  // namespace m3
