// GPU decode-step benchmark on one checkpoint (e.g. m3-layers:N at M3's full widths, MXFP8):
// for each batch size, B sequences of `--context` tokens decode one token each. The KV pages
// are filled with random values instead of a prefill (the step reads the same bytes either
// way). Reports the whole step replayed as a CUDA graph, the per-layer times of an eager step
// (events between layers), and the HBM roofline: bytes that must move (weights of the layer,
// routed experts actually chosen, KV read: dense layers all of it, MSA layers the index keys
// plus the selected pages) over the copy bandwidth measured in the same run. Writes JSON.
//   decode_bench --model DIR [--batch-sizes 1,8,32,128] [--context 4096] [--kv-dtype bf16|f32]
//                [--iters 20] [--tp-shard N] [--json F]
// --tp-shard N: rank 0's slice of a tensor-parallel size N (MiniMaxM3Config::shard) on this one
// GPU, its collectives replaced by a stand-in that moves nothing: the per-rank compute of a TP N
// step at M3's TP-local shapes, with their dispatch trace; the all-reduces and the logits gather
// are not timed (and the logits are not the model's).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "model/minimax_m3/model.h"
#include "model/minimax_m3/tp_shard.h"
#include "step_projection.h"

namespace {

using Clock = std::chrono::steady_clock;
using m3::ops::DeviceBuffer;

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}

// Device-to-device copy bandwidth (bytes read + written per second), best of a few.
double copy_bandwidth(m3::ops::BackendRuntime* rt) {
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer a(rt, bytes), b(rt, bytes);
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    rt->clear_events();
    const int e0 = rt->record_event();
    rt->copy(b.data(), a.data(), bytes);
    const int e1 = rt->record_event();
    best = std::max(best, 2.0 * double(bytes) / (rt->elapsed_ms(e0, e1) * 1e-3));
  }
  rt->clear_events();
  return best;
}

// Random values in [-1, 1) (F32 or BF16) over a whole device buffer, through one host block.
void fill_random(m3::ops::BackendRuntime* rt, const DeviceBuffer& buf, m3::DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> block(size_t(1) << 22);
  for (auto& x : block) x = u(rng);
  std::vector<uint16_t> half;
  const void* src = block.data();
  size_t chunk = block.size() * 4;
  if (dtype == m3::DType::kBF16) {
    half.resize(block.size());
    for (size_t i = 0; i < block.size(); ++i) half[i] = m3::f32_to_bf16(block[i]);
    src = half.data();
    chunk = half.size() * 2;
  }
  for (size_t off = 0; off < buf.size_bytes(); off += chunk) {
    rt->upload(static_cast<char*>(buf.data()) + off, src, std::min(chunk, buf.size_bytes() - off));
  }
  rt->synchronize();
}

// One rank of a tensor-parallel group of `size` standing alone (--tp-shard): collectives do
// nothing, so a step costs that rank's compute only.
class SoloRank final : public m3::ops::Communicator {
 public:
  explicit SoloRank(int size) : size_(size) {}
  int size() const override { return size_; }
  int rank() const override { return 0; }
  std::string entry_name(const std::string& collective) const override { return collective + ".not_run.bench"; }
  void all_reduce_sum(const m3::TensorView&) override {}
  void all_gather_cols(const m3::TensorView&, const m3::TensorView&) override {}
  void abort() override {}

 private:
  int size_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, json_path = "decode_bench.json", batches = "1,8,32,128";
  int context = 4096, iters = 20;
  std::string kv_name = "bf16", disable;
  int index_reuse = 1, tp_shard = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_dir = v;
    else if (k == "--batch-sizes") batches = v;
    else if (k == "--context") context = std::stoi(v);
    else if (k == "--iters") iters = std::stoi(v);
    else if (k == "--json") json_path = v;
    else if (k == "--kv-dtype") kv_name = v;
    else if (k == "--disable-entries") disable = v;  // dispatch entries to drop: before/after in one binary
    else if (k == "--msa-index-reuse") index_reuse = std::stoi(v);  // MSA index sharing (1: off)
    else if (k == "--tp-shard") tp_shard = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (model_dir.empty() || context < 1 || (kv_name != "bf16" && kv_name != "f32")) {
    std::fprintf(stderr, "usage: decode_bench --model DIR [--batch-sizes 1,8] [--context N] [--iters N] [--json F] "
                 "[--disable-entries NAME,...] [--msa-index-reuse N]\n");
    return 2;
  }
  if (m3::cuda::device_count() == 0) {
    std::fprintf(stderr, "decode_bench: no CUDA device\n");
    return 2;
  }
  using namespace m3;
  auto rt = cuda::make_cuda_runtime(0);
  std::printf("device: %s\n", rt->describe().c_str());
  const double bw = copy_bandwidth(rt.get());
  std::printf("copy bandwidth: %.1f GB/s (read + write)\n", bw / 1e9);

  auto dir = ModelDir::open(model_dir);
  if (!dir) {
    std::fprintf(stderr, "%s\n", dir.error().c_str());
    return 1;
  }
  LoadOptions lo;
  lo.runtime = rt.get();
  lo.linear_format = LinearFormat::kNative;
  lo.tp_size = tp_shard;  // rank 0's slice
  auto t0 = Clock::now();
  auto loaded = MiniMaxM3Model::load(**dir, {}, lo);
  if (!loaded) {
    std::fprintf(stderr, "%s\n", loaded.error().c_str());
    return 1;
  }
  (*loaded)->set_msa_index_reuse(index_reuse);
  const MiniMaxM3Model& model = **loaded;
  const MiniMaxM3Config& c = model.config();
  std::printf("loaded %s (%d layers, %.2f GiB of weights on the device) in %.1f s\n", model_dir.c_str(),
              c.num_hidden_layers, double(model.weight_bytes()) / double(1ull << 30),
              std::chrono::duration<double>(Clock::now() - t0).count());

  ops::KernelTable table;
  cuda::register_cuda_kernels(table);
  cpu::register_cpu_kernels(table);
  std::vector<std::string> disabled;
  for (size_t p = 0; !disable.empty() && p <= disable.size();) {
    const size_t q = std::min(disable.find(',', p), disable.size());
    disabled.push_back(disable.substr(p, q - p));
    if (!table.remove_entry(disabled.back())) {
      std::fprintf(stderr, "decode_bench: no dispatch entry named %s\n", disabled.back().c_str());
      return 2;
    }
    p = q + 1;
  }
  ops::DispatchStats stats;
  SoloRank solo(tp_shard);
  ops::OpContext ctx{&table, &stats, Device::kCuda, true, tp_shard > 1 ? &solo : nullptr};
  if (tp_shard > 1)
    std::printf("one rank of tensor parallel size %d: %d query heads, %d KV heads, expert width %lld; "
                "collectives not run\n", tp_shard, c.num_attention_heads, c.num_key_value_heads,
                static_cast<long long>(c.intermediate_size));
  const int bs = c.index_block_size, L = c.num_hidden_layers;
  const m3::MiniMaxM3Config m3_target = *m3::MiniMaxM3Config::preset("m3");  // the projection's layer list
  const DType kv_dtype = kv_name == "bf16" ? DType::kBF16 : DType::kF32;
  const double kv_elem = kv_dtype == DType::kBF16 ? 2.0 : 4.0;
  const int blocks_per_seq = (context + bs - 1) / bs;

  nlohmann::json out;
  out["device"] = rt->describe();
  out["model"] = model_dir;
  out["copy_bandwidth_gbs"] = bw / 1e9;
  out["context"] = context;
  out["kv_dtype"] = kv_name;
  out["disabled_entries"] = disabled;
  out["msa_index_reuse"] = index_reuse;
  out["tp_shard"] = tp_shard;  // > 1: one rank's compute, collectives not run
  size_t head_bytes = model.weight_bytes();
  for (size_t b : model.layer_weight_bytes()) head_bytes -= b;  // embedding + final norm + LM head
  // BF16 (never quantised); a tensor-parallel rank holds its vocabulary slice.
  const TpSlice vocab = vocab_slice(c);
  const int64_t head_rows = vocab.whole() ? c.vocab_size : vocab.count;
  const size_t lm_head_bytes = size_t(head_rows) * size_t(c.hidden_size) * 2;

  for (int B : parse_list(batches)) {
    // KV: B sequences of `context` tokens, pages laid out sequence after sequence.
    const int64_t num_blocks = int64_t(B) * blocks_per_seq;
    BackendKvCache cache = BackendKvCache::allocate(rt.get(), c, num_blocks, bs, kv_dtype);
    uint32_t seed = 1;
    for (auto* bufs : {&cache.k, &cache.v, &cache.index_k})
      for (auto& buf : *bufs)
        if (buf.data()) fill_random(rt.get(), buf, kv_dtype, seed++);
    // Each sequence decodes the token at position context - 1.
    const size_t nb = static_cast<size_t>(B);
    std::vector<int32_t> tokens(nb), positions(nb, context - 1), query_start(nb + 1), seq_lens(nb, context),
        tables(static_cast<size_t>(num_blocks)), rows(nb);
    std::vector<int64_t> slots(nb);
    std::mt19937 rng(7);
    for (int i = 0; i < B; ++i) {
      tokens[size_t(i)] = int32_t(rng() % uint32_t(c.vocab_size));
      query_start[size_t(i) + 1] = i + 1;
      rows[size_t(i)] = i;
      for (int b = 0; b < blocks_per_seq; ++b) tables[size_t(i) * blocks_per_seq + b] = i * blocks_per_seq + b;
      slots[size_t(i)] = int64_t(tables[size_t(i) * blocks_per_seq + (context - 1) / bs]) * bs + (context - 1) % bs;
    }
    auto up = [&](const auto& v) {
      DeviceBuffer d(rt.get(), v.size() * sizeof(v[0]));
      rt->upload(d.data(), v.data(), v.size() * sizeof(v[0]));
      return d;
    };
    DeviceBuffer d_tok = up(tokens), d_pos = up(positions), d_qs = up(query_start), d_len = up(seq_lens),
                 d_tab = up(tables), d_rows = up(rows), d_slots = up(slots);
    rt->synchronize();
    ForwardBatch batch;
    batch.token_ids = d_tok.as<int32_t>();
    batch.logits_rows = rows;
    batch.logits_rows_ptr = d_rows.as<int32_t>();
    auto& m = batch.meta;
    m.num_seqs = B;
    m.num_tokens = B;
    m.query_start = d_qs.as<int32_t>();
    m.positions = d_pos.as<int32_t>();
    m.seq_lens = d_len.as<int32_t>();
    m.block_tables = d_tab.as<int32_t>();
    m.max_blocks_per_seq = blocks_per_seq;
    m.block_size = bs;
    m.slot_mapping = d_slots.as<int64_t>();
    auto ws = model.make_workspace(B, B);
    const KvCacheTensors views = cache.views(Device::kCuda);

    // Eager step with the routing traced (experts actually touched) and layer events.
    ForwardTrace trace;
    model.forward(ctx, batch, views, *ws, &trace);
    rt->synchronize();
    std::vector<double> layer_ms(size_t(L) + 2, 0.0);  // [0] embedding, [1..L] layers, [L+1] final norm + head
    const int eager_reps = 5;
    for (int r = 0; r < eager_reps; ++r) {
      rt->clear_events();
      std::vector<int> ev;
      ForwardHooks hooks;
      hooks.after_layer = [&](int) { ev.push_back(rt->record_event()); };
      const int start = rt->record_event();
      model.forward(ctx, batch, views, *ws, nullptr, &hooks);
      rt->synchronize();
      int prev = start;
      for (size_t i = 0; i < ev.size() && i < layer_ms.size(); ++i) {
        layer_ms[i] += rt->elapsed_ms(prev, ev[i]) / eager_reps;
        prev = ev[i];
      }
    }
    rt->clear_events();

    // The step as the engine runs decode: one graph replay.
    ops::OpContext quiet = ctx;
    quiet.stats = nullptr;
    const int graph = rt->capture([&] { model.forward(quiet, batch, views, *ws); });
    rt->replay(graph);
    rt->synchronize();
    std::vector<double> step_ms;
    for (int i = 0; i < iters; ++i) {
      const int e0 = rt->record_event();
      rt->replay(graph);
      const int e1 = rt->record_event();
      step_ms.push_back(rt->elapsed_ms(e0, e1));
    }
    rt->clear_events();
    std::sort(step_ms.begin(), step_ms.end());
    const double graph_ms = step_ms[step_ms.size() / 2];

    // Bytes that must move per layer.
    nlohmann::json layers = nlohmann::json::array();
    double eager_total = 0, bytes_total = 0;
    size_t moe_idx = 0;
    std::printf("\nbatch %d, context %d: graph step %.3f ms (median of %d)\n", B, context, graph_ms, iters);
    std::printf("  %-6s %-10s %10s %12s %10s %8s\n", "layer", "kind", "eager ms", "bytes (MB)", "roofline", "ratio");
    for (int l = -1; l <= L; ++l) {
      const double ms = layer_ms[size_t(l + 1)];
      double bytes = 0;
      std::string kind;
      int touched = 0;
      if (l == -1) {
        kind = "embed";
        bytes = double(B) * c.hidden_size * 4.0;
      } else if (l == L) {
        kind = "head";
        bytes = double(lm_head_bytes) + double(B) * double(head_rows) * 4.0;
      } else {
        const bool sparse = c.is_sparse_layer(l), moe = c.is_moe_layer(l);
        kind = m3::bench::layer_kind(c, l);
        const size_t expert = model.routed_expert_bytes()[size_t(l)];
        double w = double(model.layer_weight_bytes()[size_t(l)]);
        if (moe) {
          std::set<int32_t> used(trace.expert_ids[moe_idx].begin(), trace.expert_ids[moe_idx].end());
          ++moe_idx;
          touched = int(used.size());
          w -= double(expert) * double(c.num_local_experts - touched);
        }
        const double kv_row = double(c.num_key_value_heads) * c.head_dim * kv_elem * 2.0;  // K + V
        double kv;
        if (sparse) {
          const double selected = std::min(context, c.index_topk_blocks * bs);
          kv = double(B) * (double(context) * c.index_head_dim * kv_elem + selected * kv_row);
        } else {
          kv = double(B) * double(context) * kv_row;
        }
        bytes = w + kv;
      }
      const double roof_ms = bytes / bw * 1e3;  // HBM moves bw bytes/s in all (a copy: read + write)
      eager_total += ms;
      bytes_total += bytes;
      std::printf("  %-6d %-10s %10.4f %12.2f %10.4f %7.1f%%%s\n", l, kind.c_str(), ms, bytes / 1e6, roof_ms,
                  100.0 * roof_ms / ms, touched ? ("  experts " + std::to_string(touched)).c_str() : "");
      layers.push_back({{"layer", l}, {"kind", kind}, {"eager_ms", ms}, {"bytes", bytes}, {"roofline_ms", roof_ms},
                        {"ratio", roof_ms / ms}, {"experts_touched", touched}});
    }
    const double roof_total = bytes_total / bw * 1e3;
    std::printf("  step: eager %.3f ms, graph %.3f ms, %.1f MB must move -> roofline %.3f ms = %.1f%% of the graph step\n",
                eager_total, graph_ms, bytes_total / 1e6, roof_total, 100.0 * roof_total / graph_ms);
    // MiniMax-M3's 60 layers from this checkpoint's per-kind layer times: an estimate, labelled.
    nlohmann::json projection = nullptr;
    if (m3_target.num_hidden_layers != L) {
      const std::vector<double> per_layer(layer_ms.begin() + 1, layer_ms.begin() + 1 + L);
      const auto p = m3::bench::project_step(m3_target, c, per_layer, layer_ms[0], layer_ms[size_t(L) + 1], graph_ms);
      if (p.ok) {
        std::printf("  projection to MiniMax-M3 (%d layers; each at its kind's mean eager time here, an estimate%s): "
                    "eager %.3f ms, graph ~%.3f ms, ~%.0f tokens/s\n",
                    p.layers, tp_shard > 1 ? "; one rank's compute, collectives not included" : "", p.eager_ms,
                    p.graph_ms, B / p.graph_ms * 1e3);
        projection = {{"estimate", true}, {"layers", p.layers}, {"eager_step_ms", p.eager_ms},
                      {"graph_step_ms", p.graph_ms}, {"tokens_per_s", B / p.graph_ms * 1e3},
                      {"basis", "each M3 layer at the mean eager time of this checkpoint's layers of its kind; "
                                "graph step scaled as the eager one"}};
      } else {
        std::printf("  no projection to MiniMax-M3: this checkpoint has no %s layer\n", p.missing.c_str());
      }
    }
    out["batches"].push_back({{"batch", B},
                              {"projection_m3", projection},
                              {"graph_step_ms", graph_ms},
                              {"eager_step_ms", eager_total},
                              {"bytes", bytes_total},
                              {"roofline_ms", roof_total},
                              {"ratio", roof_total / graph_ms},
                              {"tokens_per_s", B / graph_ms * 1e3},
                              {"layers", layers}});
  }
  nlohmann::json paths;
  for (const auto& r : stats.first_uses()) {
    paths.push_back({{"op", r.op}, {"entry", r.entry}, {"shape", r.shape_class}, {"plan", r.plan}});
  }
  out["dispatch_first_uses"] = paths;
  std::ofstream(json_path) << out.dump(2);
  std::printf("\nwrote %s\n", json_path.c_str());
  return 0;
}
