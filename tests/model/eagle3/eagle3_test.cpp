// EAGLE-3 speculative decoding on the CPU. The draft layer against a plain host implementation of
// the EAGLE-3 definition (vLLM's LlamaForCausalLMEagle3, from the checkpoint's raw tensors): the
// first pass over the target's captured hidden states and two chained tokens. Then the engine:
// outputs equal to decoding without drafts (greedy with logprobs, seeded sampling, preemption,
// prefix-cache hits, the host KV tier, chunked prefill, TP 2), every decoding step verifying a
// full draft, and the configurations a load refuses by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "engine/step_buffers.h"
#include "loader/safetensors.h"
#include "m3serve/engine.h"
#include "model/eagle3/make_draft.h"
#include "model/eagle3/model.h"
#include "model/minimax_m3/make_model.h"
#include "ops/host_runtime.h"
#include "tokenizer/tokenizer.h"
#include "../../support/tiny_model/tiny_model.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

std::string out_dir(const std::string& name) {
  const char* b = std::getenv("M3_BINARY_DIR");
  return (fs::path(b ? b : "/tmp") / name).string();
}

std::string source_path(const std::string& rel) {
  const char* src = std::getenv("M3_SOURCE_DIR");
  return std::string(src ? src : M3_SOURCE_DIR_DEFAULT) + "/" + rel;
}

const std::string& tiny_dir() {
  static const std::string dir = test::make_tiny_model("eagle3_test_tiny", 21);
  return dir;
}

// A random draft for the tiny target (4 layers): aux layers {1, 2, 3}, 4 heads / 2 KV heads of 32.
std::string make_draft_dir(const std::string& name, int64_t draft_vocab = 0, bool lm_head = true, uint64_t seed = 5) {
  auto target = MiniMaxM3Config::from_file(tiny_dir() + "/config.json");
  EXPECT_TRUE(target.is_ok());
  Eagle3Config c = default_draft_config(*target, {1, 2, 3});
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 192;
  if (draft_vocab > 0) c.draft_vocab_size = draft_vocab;
  MakeDraftOptions o;
  o.out_dir = out_dir(name);
  fs::remove_all(o.out_dir);
  o.config = c;
  o.with_lm_head = lm_head;
  o.seed = seed;
  EXPECT_TRUE(make_draft(o).is_ok());
  return o.out_dir;
}

// ---- A plain host EAGLE-3 layer from the checkpoint's tensors -------------------------------------

std::vector<float> tensor(const ModelDir& dir, const std::string& name) {
  const TensorInfo* t = dir.find(name);
  EXPECT_NE(t, nullptr) << name;
  std::vector<float> v(size_t(t->shape.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t->dtype == DType::kF32) std::memcpy(&v[i], t->data + 4 * i, 4);
    else {
      uint16_t h;
      std::memcpy(&h, t->data + 2 * i, 2);
      v[i] = bf16_to_f32(h);
    }
  }
  return v;
}

std::vector<float> matvec(const std::vector<float>& w, const std::vector<float>& x, int64_t rows) {
  const int64_t cols = int64_t(x.size());
  std::vector<float> y(size_t(rows), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c) s += double(w[size_t(r * cols + c)]) * x[size_t(c)];
    y[size_t(r)] = float(s);
  }
  return y;
}

std::vector<float> llama_norm(const std::vector<float>& x, const std::vector<float>& w, float eps) {
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const float inv = float(1.0 / std::sqrt(ss / double(x.size()) + eps));
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

// NeoX (rotate-half) rotation of every head's full width.
void rope(std::vector<float>& x, int heads, int D, int pos, double theta) {
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < D / 2; ++i) {
      const double f = double(pos) * std::pow(theta, -2.0 * i / D);
      const double c = std::cos(f), s = std::sin(f);
      float& a = x[size_t(h * D + i)];
      float& b = x[size_t(h * D + i + D / 2)];
      const double a0 = a, b0 = b;
      a = float(a0 * c - b0 * s);
      b = float(b0 * c + a0 * s);
    }
  }
}

struct NaiveDraft {
  Eagle3Config c;
  std::vector<float> fc, in_norm, hid_norm, post_norm, final_norm, q, k, v, o, gate, up, down, head, embed;
  std::vector<std::vector<float>> keys, values;  // per position

  NaiveDraft(const ModelDir& d, const ModelDir& target, const Eagle3Config& cfg) : c(cfg) {
    fc = tensor(d, "fc.weight");
    in_norm = tensor(d, "midlayer.input_layernorm.weight");
    hid_norm = tensor(d, "midlayer.hidden_norm.weight");
    post_norm = tensor(d, "midlayer.post_attention_layernorm.weight");
    final_norm = tensor(d, "norm.weight");
    q = tensor(d, "midlayer.self_attn.q_proj.weight");
    k = tensor(d, "midlayer.self_attn.k_proj.weight");
    v = tensor(d, "midlayer.self_attn.v_proj.weight");
    o = tensor(d, "midlayer.self_attn.o_proj.weight");
    gate = tensor(d, "midlayer.mlp.gate_proj.weight");
    up = tensor(d, "midlayer.mlp.up_proj.weight");
    down = tensor(d, "midlayer.mlp.down_proj.weight");
    head = d.find("lm_head.weight") ? tensor(d, "lm_head.weight") : tensor(target, "language_model.lm_head.weight");
    embed = tensor(target, "language_model.model.embed_tokens.weight");
  }

  // One position: hidden input h (fc already applied or the previous pre-norm), input token u.
  // Returns the logits; `prenorm` receives the layer's pre-norm output.
  std::vector<float> step(const std::vector<float>& h, int32_t u, int pos, std::vector<float>* prenorm) {
    const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
    std::vector<float> e(embed.begin() + u * H, embed.begin() + (u + 1) * H);
    std::vector<float> cat = llama_norm(e, in_norm, c.rms_norm_eps);
    const std::vector<float> xh = llama_norm(h, hid_norm, c.rms_norm_eps);
    cat.insert(cat.end(), xh.begin(), xh.end());
    std::vector<float> qv = matvec(q, cat, Hq * D), kv = matvec(k, cat, Hkv * D), vv = matvec(v, cat, Hkv * D);
    rope(qv, int(Hq), int(D), pos, c.rope_theta);
    rope(kv, int(Hkv), int(D), pos, c.rope_theta);
    keys.resize(size_t(pos) + 1);
    values.resize(size_t(pos) + 1);
    keys[size_t(pos)] = kv;
    values[size_t(pos)] = vv;
    std::vector<float> att(size_t(Hq * D), 0.0f);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t g = hq / (Hq / Hkv);
      std::vector<double> s(size_t(pos) + 1);
      double mx = -1e300;
      for (int p = 0; p <= pos; ++p) {
        double dot = 0;
        for (int64_t i = 0; i < D; ++i) dot += double(qv[size_t(hq * D + i)]) * keys[size_t(p)][size_t(g * D + i)];
        s[size_t(p)] = dot / std::sqrt(double(D));
        mx = std::max(mx, s[size_t(p)]);
      }
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - mx));
      for (int p = 0; p <= pos; ++p)
        for (int64_t i = 0; i < D; ++i)
          att[size_t(hq * D + i)] += float(s[size_t(p)] / z * values[size_t(p)][size_t(g * D + i)]);
    }
    std::vector<float> res = h;
    const std::vector<float> a = matvec(o, att, H);
    for (int64_t i = 0; i < H; ++i) res[size_t(i)] += a[size_t(i)];
    const std::vector<float> x = llama_norm(res, post_norm, c.rms_norm_eps);
    std::vector<float> g = matvec(gate, x, c.intermediate_size), uu = matvec(up, x, c.intermediate_size);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * uu[i];
    const std::vector<float> m = matvec(down, g, H);
    for (int64_t i = 0; i < H; ++i) res[size_t(i)] += m[size_t(i)];
    *prenorm = res;
    return matvec(head, llama_norm(res, final_norm, c.rms_norm_eps), c.draft_vocab_size);
  }
};

int32_t argmax(const std::vector<float>& v) { return int32_t(std::max_element(v.begin(), v.end()) - v.begin()); }

void expect_near_all(const float* got, const std::vector<float>& want, const std::string& what) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  EXPECT_LT(worst, 2e-4 * std::max(1.0, scale)) << what << ": max |diff| " << worst << " (scale " << scale << ")";
}

// The draft's first pass over a prompt's positions and two chained tokens, against NaiveDraft fed
// the same captures. With the draft's own head or the target's.
void check_draft_layer(const std::string& draft_dir) {
  auto tdir = ModelDir::open(tiny_dir());
  auto ddir = ModelDir::open(draft_dir);
  ASSERT_TRUE(tdir.is_ok() && ddir.is_ok());
  auto target = MiniMaxM3Model::load(**tdir);
  ASSERT_TRUE(target.is_ok()) << target.error();
  auto draft = Eagle3Model::load(**ddir, **target, LoadOptions{});
  ASSERT_TRUE(draft.is_ok()) << draft.error();
  const MiniMaxM3Config& tc = (*target)->config();
  const Eagle3Config& c = (*draft)->config();
  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  ops::DispatchStats stats;
  const ops::OpContext ctx{&table, &stats, Device::kCpu, true, nullptr};
  ops::BackendRuntime* rt = ops::host_runtime();
  const int bs = tc.index_block_size, n = 37;
  const std::vector<int32_t> prompt = test::random_prompt(n, 3);
  std::vector<int32_t> table_ids = {0, 1, 2, 3, 4};  // 80 positions
  auto kv = BackendKvCache::allocate(rt, tc, 8, bs);
  auto dkv = Eagle3KvCache::allocate(rt, c, 8, bs, DType::kF32);
  auto ws = (*target)->make_workspace(n, 1);
  auto dws = (*draft)->make_workspace(n, 1);
  StepBuffers sb(rt, n, 1, 1, 8);
  sb.begin();
  sb.add_sequence(prompt, 0, table_ids, bs);
  sb.set_logits_rows({n - 1});
  sb.upload();
  ForwardBatch fb;
  fb.token_ids = sb.device_tokens();
  fb.meta = sb.metadata(bs);
  fb.logits_rows = {n - 1};
  for (size_t i = 0; i < c.aux_layer_ids.size(); ++i) fb.captures.emplace_back(c.aux_layer_ids[i], dws->aux[i].data());
  (*target)->forward(ctx, fb, kv.views(Device::kCpu), *ws);
  const int32_t next = argmax(std::vector<float>(ws->logits.as<float>(), ws->logits.as<float>() + tc.vocab_size));

  // Pass 1: inputs shifted by one, the sampled token last.
  std::vector<int32_t> inputs(prompt.begin() + 1, prompt.end());
  inputs.push_back(next);
  sb.begin();
  sb.add_sequence(inputs, 0, table_ids, bs);
  sb.set_logits_rows({n - 1});
  sb.upload();
  Eagle3Batch b;
  b.token_ids = sb.device_tokens();
  b.meta = sb.metadata(bs);
  b.logits_rows = sb.device_logits_rows();
  b.num_logits_rows = 1;
  (*draft)->forward(ctx, b, dkv, *dws);

  NaiveDraft naive(**ddir, **tdir, c);
  const int64_t Ht = tc.hidden_size;
  std::vector<float> pre, logits;
  for (int p = 0; p < n; ++p) {
    std::vector<float> aux;
    for (const auto& buf : dws->aux) aux.insert(aux.end(), buf.as<float>() + p * Ht, buf.as<float>() + (p + 1) * Ht);
    logits = naive.step(matvec(naive.fc, aux, c.hidden_size), inputs[size_t(p)], p, &pre);
    expect_near_all(dws->res.as<float>() + int64_t(p) * c.hidden_size, pre, "pre-norm output at " + std::to_string(p));
  }
  expect_near_all(dws->logits.as<float>(), logits, "pass 1 logits");
  int32_t token = (*draft)->target_id(argmax(logits));
  // Two chained tokens: the previous pass's pre-norm row as the hidden input.
  int32_t src_row = n - 1;
  for (int j = 1; j <= 2; ++j) {
    sb.begin();
    sb.add_sequence({token}, n - 1 + j, table_ids, bs);
    sb.set_logits_rows({0});
    sb.upload();
    std::vector<int32_t> rows = {src_row};
    Eagle3Batch cb;
    cb.token_ids = sb.device_tokens();
    cb.meta = sb.metadata(bs);
    cb.from_target = false;
    cb.hidden_rows = rows.data();
    cb.logits_rows = sb.device_logits_rows();
    cb.num_logits_rows = 1;
    (*draft)->forward(ctx, cb, dkv, *dws);
    logits = naive.step(pre, token, n - 1 + j, &pre);
    expect_near_all(dws->logits.as<float>(), logits, "chained token " + std::to_string(j));
    token = (*draft)->target_id(argmax(logits));
    src_row = 0;
  }
  // The dispatch trace shows the draft's ops.
  bool rope_seen = false;
  for (const auto& s : stats.take_step_paths()) rope_seen = rope_seen || s.rfind("rope=", 0) == 0;
  EXPECT_TRUE(rope_seen);
}

// config.json defaults as vLLM reads them: KV heads = heads, head_dim = hidden / heads, the draft
// vocabulary = the target's, aux layers 2, L/2, L-3; and what is refused.
TEST(Eagle3, ConfigDefaultsAndChecks) {
  MiniMaxM3Config target = *MiniMaxM3Config::preset("m3");
  nlohmann::json j = {{"hidden_size", 6144}, {"intermediate_size", 16384}, {"num_attention_heads", 48},
                      {"vocab_size", 200064}};
  auto c = Eagle3Config::from_json(j, target);
  ASSERT_TRUE(c.is_ok()) << c.error();
  EXPECT_EQ(c->num_key_value_heads, 48);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->draft_vocab_size, 200064);
  EXPECT_EQ(c->target_hidden_size, 6144);
  EXPECT_EQ(c->aux_layer_ids, (std::vector<int>{2, 30, 57}));  // M3's 60 layers
  EXPECT_EQ(c->fc_in(), 3 * 6144);
  EXPECT_FALSE(c->norm_before_residual);
  const Eagle3Config tp4 = c->shard(4, 3);
  EXPECT_EQ(tp4.num_attention_heads, 12);
  EXPECT_EQ(tp4.num_key_value_heads, 12);
  EXPECT_EQ(tp4.intermediate_size, 4096);
  EXPECT_EQ(tp4.tp_rank, 3);
  // Round trip through to_json.
  auto back = Eagle3Config::from_json(c->to_json(), target);
  ASSERT_TRUE(back.is_ok()) << back.error();
  EXPECT_EQ(back->aux_layer_ids, c->aux_layer_ids);
  const std::pair<nlohmann::json, const char*> bad[] = {
      {{{"num_hidden_layers", 2}}, "num_hidden_layers is 2"},
      {{{"hidden_act", "gelu"}}, "hidden_act 'gelu'"},
      {{{"draft_vocab_size", 300000}}, "draft_vocab_size must be in"},
      {{{"target_hidden_size", 4096}}, "target_hidden_size 4096"},
      {{{"num_key_value_heads", 5}}, "multiple of num_key_value_heads"},
      {{{"eagle_config", {{"use_aux_hidden_state", false}}}}, "EAGLE-1/2 drafts"},
      {{{"hidden_size", "big"}}, "hidden_size has the wrong type"},
  };
  for (const auto& [patch, needle] : bad) {
    nlohmann::json k = j;
    k.merge_patch(patch);
    auto r = Eagle3Config::from_json(k, target);
    ASSERT_FALSE(r.is_ok()) << patch.dump();
    EXPECT_NE(r.error().find(needle), std::string::npos) << patch.dump() << " -> " << r.error();
  }
  nlohmann::json no_vocab = j;
  no_vocab.erase("vocab_size");
  auto r = Eagle3Config::from_json(no_vocab, target);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.error().find("missing required field vocab_size"), std::string::npos) << r.error();
}

TEST(Eagle3, DraftLayerMatchesTheHostDefinition) { check_draft_layer(make_draft_dir("eagle3_layer_draft")); }

TEST(Eagle3, DraftLayerWithTheTargetsLmHead) {
  check_draft_layer(make_draft_dir("eagle3_layer_draft_shared", 0, /*lm_head=*/false));
}

// ---- The engine ------------------------------------------------------------------------------------

struct RunResult {
  std::map<RequestId, std::vector<TokenOutput>> tokens;
  int64_t steps = 0, drafts = 0, draft_tokens = 0, accepted = 0, preemptions = 0, prefix_hits = 0, host_hits = 0;
};

struct RunSetup {
  std::string draft;  // "" = no speculation
  int k = 3;
  int tp = 1;
  int32_t num_blocks = 256;
  int32_t batched_tokens = 64;
  int64_t kv_offload_bytes = 0;
  bool full_drafts = false;
};

RunResult run_engine(const std::vector<std::vector<int32_t>>& prompts, const std::vector<SamplingParams>& params,
                     const RunSetup& s) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.max_num_batched_tokens = s.batched_tokens;
  cfg.max_num_seqs = 8;
  cfg.num_kv_blocks = s.num_blocks;
  cfg.check_invariants = true;
  cfg.tensor_parallel_size = s.tp;
  cfg.kv_offload_bytes = s.kv_offload_bytes;
  if (!s.draft.empty()) {
    cfg.speculative_method = "eagle3";
    cfg.speculative_model = s.draft;
    cfg.ngram.num_speculative_tokens = s.k;
    cfg.spec_cuda_graphs = s.full_drafts;
  }
  auto engine = Engine::create(cfg);
  EXPECT_TRUE(engine.is_ok()) << engine.error();
  RunResult r;
  if (!engine) return r;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = (*engine)->submit({prompts[i], params[i % params.size()]});
    EXPECT_TRUE(id.is_ok()) << id.error();
  }
  while ((*engine)->has_unfinished_requests() && r.steps < 10000) {
    EngineStepStats st;
    for (auto& ev : (*engine)->step(&st))
      for (auto& t : ev.new_tokens) r.tokens[ev.request_id].push_back(t);
    ++r.steps;
    r.drafts += st.spec_num_drafts;
    r.draft_tokens += st.spec_num_draft_tokens;
    r.accepted += st.spec_num_accepted_tokens;
    r.preemptions += st.scheduler.num_preemptions;
    r.prefix_hits += st.scheduler.prefix_hit_tokens;
    r.host_hits += st.scheduler.prefix_host_hit_tokens;
    EXPECT_EQ(st.scheduler.num_spec_tokens, st.spec_num_draft_tokens);
  }
  EXPECT_FALSE((*engine)->has_unfinished_requests());
  return r;
}

void expect_same_tokens(const RunResult& a, const RunResult& b, bool logprobs) {
  ASSERT_EQ(a.tokens.size(), b.tokens.size());
  for (const auto& [id, toks] : a.tokens) {
    const auto& other = b.tokens.at(id);
    ASSERT_EQ(toks.size(), other.size()) << "request " << id;
    for (size_t t = 0; t < toks.size(); ++t) {
      EXPECT_EQ(toks[t].token, other[t].token) << "request " << id << " token " << t;
      if (logprobs) {
        EXPECT_EQ(toks[t].logprob, other[t].logprob) << "request " << id << " token " << t;
      }
    }
  }
}

SamplingParams greedy(int max_tokens, int logprobs) {
  SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  s.logprobs = logprobs;
  return s;
}

std::vector<std::vector<int32_t>> prompts(int n, int base = 20) {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < n; ++i) p.push_back(test::random_prompt(base + 13 * i, 100 + i));
  return p;
}

TEST(Eagle3, EngineGreedyOutputIsPlainDecodings) {
  const std::string draft = make_draft_dir("eagle3_engine_draft");
  const auto p = prompts(5);
  const SamplingParams s = greedy(24, 2);
  const RunResult plain = run_engine(p, {s}, RunSetup{}), spec = run_engine(p, {s}, RunSetup{draft, 3});
  expect_same_tokens(plain, spec, /*logprobs=*/true);
  // Every decode step after the first token verifies a draft of min(3, room) tokens.
  EXPECT_GE(spec.drafts, 5 * 16);
  EXPECT_GE(spec.draft_tokens, 3 * spec.drafts - 5 * 3);
  std::printf("eagle3 greedy: %lld drafts, %lld draft tokens, %lld accepted\n", (long long)spec.drafts,
              (long long)spec.draft_tokens, (long long)spec.accepted);
}

TEST(Eagle3, SeededSamplingAndASmallDraftVocabulary) {
  const std::string draft = make_draft_dir("eagle3_engine_draft_d2t", /*draft_vocab=*/128);
  std::vector<SamplingParams> params;
  for (int i = 0; i < 3; ++i) {
    SamplingParams s;
    s.temperature = 0.7f + 0.2f * float(i);
    s.top_k = i == 1 ? 20 : 0;
    s.repetition_penalty = i == 2 ? 1.1f : 1.0f;
    s.seed = 700 + i;
    s.max_tokens = 20;
    s.ignore_eos = true;
    params.push_back(s);
  }
  const auto p = prompts(6);
  const RunResult plain = run_engine(p, params, RunSetup{}), spec = run_engine(p, params, RunSetup{draft, 2});
  expect_same_tokens(plain, spec, /*logprobs=*/false);
  EXPECT_GT(spec.draft_tokens, 0);
}

// Preemption (a pool too small for all), prefix-cache hits (repeated prompts) served from the host
// tier, chunked prefill (8-token budget per step) and full-length drafts: still plain decoding's output.
TEST(Eagle3, UnderPreemptionPrefixHitsHostTierAndChunking) {
  const std::string draft = make_draft_dir("eagle3_engine_draft_pressure");
  auto p = prompts(4, 30);
  p.push_back(p[0]);
  p.push_back(p[1]);
  const SamplingParams s = greedy(20, 1);
  RunSetup plain_setup;
  plain_setup.num_blocks = 14;
  plain_setup.batched_tokens = 24;
  plain_setup.kv_offload_bytes = 1 << 20;
  RunSetup spec_setup = plain_setup;
  spec_setup.draft = draft;
  spec_setup.k = 3;
  spec_setup.full_drafts = true;
  const RunResult plain = run_engine(p, {s}, plain_setup), spec = run_engine(p, {s}, spec_setup);
  expect_same_tokens(plain, spec, /*logprobs=*/true);
  EXPECT_GT(spec.preemptions, 0);
  EXPECT_GT(spec.prefix_hits, 0);
  EXPECT_GT(spec.drafts, 0);
}

// TP 2 splits the draft's heads (4 / 2 -> 2 / 1 per rank) and MLP like the target's; a draft whose
// heads do not divide (3 / 3) runs whole on every rank. Outputs stay plain decoding's.
TEST(Eagle3, TensorParallelTwoRanks) {
  const std::string draft = make_draft_dir("eagle3_engine_draft_tp");
  const auto p = prompts(3);
  const SamplingParams s = greedy(16, -1);
  RunSetup tp1{draft, 3}, tp2{draft, 3};
  tp2.tp = 2;
  const RunResult a = run_engine(p, {s}, tp1), b = run_engine(p, {s}, tp2);
  expect_same_tokens(a, b, /*logprobs=*/false);
  EXPECT_EQ(a.draft_tokens, b.draft_tokens);
  // Split: each rank holds half of q/k/v/o and the MLP.
  auto target = MiniMaxM3Config::from_file(tiny_dir() + "/config.json");
  auto dir = ModelDir::open(draft);
  ASSERT_TRUE(target.is_ok() && dir.is_ok());
  auto cfg = Eagle3Config::from_json((*dir)->config_json(), *target);
  ASSERT_TRUE(cfg.is_ok()) << cfg.error();
  const Eagle3Config half = cfg->shard(2, 1);
  EXPECT_EQ(half.tp_size, 2);
  EXPECT_EQ(half.num_attention_heads, 2);
  EXPECT_EQ(half.num_key_value_heads, 1);
  EXPECT_EQ(half.intermediate_size, 96);
  Eagle3Config odd = *cfg;
  odd.num_attention_heads = odd.num_key_value_heads = 3;
  EXPECT_EQ(odd.shard(2, 1).tp_size, 1);  // replicated
}

// The bundled draft at TP 2 (its 4 / 2 heads and 768-wide MLP split): plain decoding's tokens and
// about TP 1's acceptance (the split sums can move near-tie argmaxes).
TEST(Eagle3, BundledDraftAtTensorParallelTwo) {
  auto tok = Tokenizer::from_dir(source_path("models/m3-small"));
  ASSERT_TRUE(tok.is_ok()) << tok.error();
  const std::vector<std::vector<int32_t>> p = {
      (*tok)->encode("The old sailor walked slowly along the harbour wall, looking at the ships in the bay.", false),
      (*tok)->encode("When the letter arrived, the young man read it twice before he understood it.", false)};
  std::map<int, size_t> bytes;  // the draft's weight bytes per rank
  auto run = [&](int tp) {
    EngineConfig cfg;
    cfg.model_dir = source_path("models/m3-small");
    cfg.max_num_seqs = 4;
    cfg.num_kv_blocks = 64;
    cfg.tensor_parallel_size = tp;
    cfg.speculative_method = "eagle3";
    cfg.speculative_model = source_path("models/m3-small-eagle3");
    cfg.ngram.num_speculative_tokens = 3;
    RunResult r;
    auto engine = Engine::create(cfg);
    EXPECT_TRUE(engine.is_ok()) << engine.error();
    if (!engine) return r;
    bytes[tp] = (*engine)->model().draft_weight_bytes;
    for (const auto& q : p) EXPECT_TRUE((*engine)->submit({q, greedy(40, -1)}).is_ok());
    while ((*engine)->has_unfinished_requests()) {
      EngineStepStats st;
      for (auto& ev : (*engine)->step(&st))
        for (auto& t : ev.new_tokens) r.tokens[ev.request_id].push_back(t);
      r.drafts += st.spec_num_drafts;
      r.accepted += st.spec_num_accepted_tokens;
    }
    return r;
  };
  const RunResult one = run(1), two = run(2);
  expect_same_tokens(one, two, /*logprobs=*/false);
  const double a = 1.0 + double(one.accepted) / double(std::max<int64_t>(1, one.drafts));
  const double b = 1.0 + double(two.accepted) / double(std::max<int64_t>(1, two.drafts));
  std::printf("bundled draft: mean acceptance length %.2f at TP 1, %.2f at TP 2\n", a, b);
  EXPECT_NEAR(a, b, 0.2);
  EXPECT_GE(b, 2.3);
  // A rank holds half of the split projections (fc, norms and the head stay whole).
  EXPECT_LT(double(bytes[2]), 0.8 * double(bytes[1])) << bytes[2] << " of " << bytes[1];
}

// A draft that copies its input token: its own embedding holds a token code (a random vector)
// in the first half and ones in the second; q and k read the ones (attention then peaks at the
// query's own position, RoPE's offset 0), v the code, o_proj puts it back in the residual
// (fc = 0, MLP = 0), and the head's rows are the codes. Its drafts are [t, t, ...] for the input t,
// so in the engine every draft repeats the request's last token, and the acceptance it must reach
// follows from plain decoding's output alone: this checks which token each pass is fed.
std::string make_copy_draft(const std::string& name) {
  auto target = MiniMaxM3Config::from_file(tiny_dir() + "/config.json");
  EXPECT_TRUE(target.is_ok());
  Eagle3Config c = default_draft_config(*target, {1, 2, 3});
  const int64_t H = c.hidden_size, V = c.vocab_size, half = H / 2;
  c.num_attention_heads = c.num_key_value_heads = 4;
  c.head_dim = 32;
  c.intermediate_size = 64;
  const std::string dir = out_dir(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  SafetensorsWriter w(dir, size_t(1) << 30);
  auto put = [&](const std::string& n, const Shape& shape, const std::vector<float>& v) {
    w.add(n, DType::kF32, shape, v.data());
  };
  std::vector<float> embed(size_t(V * H)), head(size_t(V * H), 0.0f);
  for (int64_t t = 0; t < V; ++t)
    for (int64_t i = 0; i < H; ++i) {
      embed[size_t(t * H + i)] = i < half ? make_model_value(9, "code", 1.0, t * half + i) : 1.0f;
      if (i < half) head[size_t(t * H + i)] = embed[size_t(t * H + i)];
    }
  std::vector<float> qk(size_t(H * 2 * H), 0.0f), v(size_t(H * 2 * H), 0.0f), o(size_t(H * H), 0.0f);
  for (int64_t r = 0; r < H; ++r) {
    qk[size_t(r * 2 * H + half + r % half)] = 10.0f;  // every q/k dim: a multiple of a ones dim
    if (r < half) v[size_t(r * 2 * H + r)] = 1.0f;    // the code half, to the first half of the heads
    if (r < half) o[size_t(r * H + r)] = 1.0f;
  }
  put("fc.weight", {H, c.fc_in()}, std::vector<float>(size_t(H * c.fc_in()), 0.0f));
  for (const char* n : {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                        "midlayer.post_attention_layernorm.weight", "norm.weight"})
    put(n, {H}, std::vector<float>(size_t(H), 1.0f));
  put("midlayer.self_attn.q_proj.weight", {H, 2 * H}, qk);
  put("midlayer.self_attn.k_proj.weight", {H, 2 * H}, qk);
  put("midlayer.self_attn.v_proj.weight", {H, 2 * H}, v);
  put("midlayer.self_attn.o_proj.weight", {H, H}, o);
  put("midlayer.mlp.gate_proj.weight", {64, H}, std::vector<float>(size_t(64 * H), 0.0f));
  put("midlayer.mlp.up_proj.weight", {64, H}, std::vector<float>(size_t(64 * H), 0.0f));
  put("midlayer.mlp.down_proj.weight", {H, 64}, std::vector<float>(size_t(64 * H), 0.0f));
  put("lm_head.weight", {V, H}, head);
  put("embed_tokens.weight", {V, H}, embed);
  EXPECT_TRUE(w.finish().is_ok());
  std::ofstream(dir + "/config.json") << c.to_json().dump(2);
  return dir;
}

TEST(Eagle3, EngineFeedsEachPassTheRightToken) {
  const std::string draft = make_copy_draft("eagle3_copy_draft");
  // Prompts of one repeated token lead the random target into runs of repeats.
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < 4; ++i) p.push_back(std::vector<int32_t>(size_t(20 + 7 * i), 5 + 40 * i));
  const int k = 3, max_tokens = 32;
  const SamplingParams s = greedy(max_tokens, -1);
  const RunResult plain = run_engine(p, {s}, RunSetup{}), spec = run_engine(p, {s}, RunSetup{draft, k});
  expect_same_tokens(plain, spec, /*logprobs=*/false);
  // What a draft of repeats of the last token must get accepted, from the plain output alone.
  int64_t want_drafted = 0, want_accepted = 0;
  for (const auto& [id, toks] : plain.tokens) {
    for (int i = 0; i + 1 < int(toks.size());) {
      const int len = std::min(k, max_tokens - (i + 1) - 1);
      int a = 0;
      while (a < len && toks[size_t(i + 1 + a)].token == toks[size_t(i)].token) ++a;
      want_drafted += len;
      want_accepted += a;
      i += a + 1;
    }
  }
  EXPECT_EQ(spec.draft_tokens, want_drafted);
  EXPECT_EQ(spec.accepted, want_accepted);
  EXPECT_GT(want_accepted, 10) << "the prompts gave too few repeats to check anything";
  std::printf("copy draft: %lld of %lld drafted tokens accepted (%lld steps plain, %lld with drafts)\n",
              (long long)spec.accepted, (long long)spec.draft_tokens, (long long)plain.steps, (long long)spec.steps);
}

// The bundled draft of the bundled model (models/m3-small-eagle3, trained by tools/train_eagle3.py
// on the target's own hidden states and greedy text; docs/architecture.md): its drafts must be
// accepted on text it never saw (2.64 tokens per step here), and far less often when fed the wrong
// layers' hidden states (aux layers 0, 0, 0: 1.30), which checks that the engine hands the draft
// the rows of the right tokens.
struct Acceptance {
  RunResult run;
  double mean_length = 0;
};

Acceptance trained_run(const std::string& draft, const std::vector<std::vector<int32_t>>& prompts) {
  EngineConfig cfg;
  cfg.model_dir = source_path("models/m3-small");
  cfg.max_num_batched_tokens = 1024;
  cfg.max_num_seqs = 4;
  cfg.num_kv_blocks = 64;
  if (!draft.empty()) {
    cfg.speculative_method = "eagle3";
    cfg.speculative_model = draft;
    cfg.ngram.num_speculative_tokens = 3;
  }
  auto engine = Engine::create(cfg);
  EXPECT_TRUE(engine.is_ok()) << engine.error();
  Acceptance a;
  if (!engine) return a;
  for (const auto& p : prompts) EXPECT_TRUE((*engine)->submit({p, greedy(48, -1)}).is_ok());
  while ((*engine)->has_unfinished_requests()) {
    EngineStepStats st;
    for (auto& ev : (*engine)->step(&st))
      for (auto& t : ev.new_tokens) a.run.tokens[ev.request_id].push_back(t);
    a.run.drafts += st.spec_num_drafts;
    a.run.accepted += st.spec_num_accepted_tokens;
  }
  a.mean_length = a.run.drafts ? 1.0 + double(a.run.accepted) / double(a.run.drafts) : 1.0;
  return a;
}

TEST(Eagle3, TrainedDraftOfTheBundledModel) {
  const std::string draft = source_path("models/m3-small-eagle3");
  auto tok = Tokenizer::from_dir(source_path("models/m3-small"));
  ASSERT_TRUE(tok.is_ok()) << tok.error();
  const char* texts[] = {
      "The old sailor walked slowly along the harbour wall, looking at the ships that lay at anchor in the bay. "
      "He had been away from the town for many years, and no one now remembered his name.",
      "When the letter arrived, the young man read it twice before he understood what his father had written. "
      "Then he went to the window and stood there for a long time without speaking.",
      "The count rose from his chair, and, turning towards the door, said in a low voice that he would return "
      "before evening, if the weather permitted him to cross the river.",
  };
  std::vector<std::vector<int32_t>> prompts;
  for (const char* t : texts) prompts.push_back((*tok)->encode(t, false));
  const Acceptance plain = trained_run("", prompts), spec = trained_run(draft, prompts);
  expect_same_tokens(plain.run, spec.run, /*logprobs=*/false);
  // Wrong hidden states: the same draft told to read the residual stream entering layer 0 thrice.
  const std::string wrong = out_dir("eagle3_wrong_layers");
  fs::remove_all(wrong);
  fs::create_directories(wrong);
  fs::copy_file(draft + "/model.safetensors", wrong + "/model.safetensors");
  std::ifstream in(draft + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {0, 0, 0};
  std::ofstream(wrong + "/config.json") << j.dump();
  const Acceptance control = trained_run(wrong, prompts);
  expect_same_tokens(plain.run, control.run, /*logprobs=*/false);
  std::printf("bundled draft: mean acceptance length %.2f (wrong layers %.2f), %lld drafts\n", spec.mean_length,
              control.mean_length, (long long)spec.run.drafts);
  EXPECT_GE(spec.mean_length, 2.3);
  EXPECT_GE(spec.mean_length - control.mean_length, 0.8);
}

TEST(Eagle3, LoadErrorsNameTheProblem) {
  EngineConfig cfg;
  cfg.model_dir = tiny_dir();
  cfg.num_kv_blocks = 32;
  cfg.speculative_method = "eagle3";
  cfg.ngram.num_speculative_tokens = 3;
  cfg.speculative_model = out_dir("eagle3_no_such_draft");
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("speculative model"), std::string::npos) << e.error();

  const std::string dir = make_draft_dir("eagle3_broken_draft");
  auto edit = [&](const std::function<void(nlohmann::json&)>& f) {
    std::ifstream in(dir + "/config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    f(j);
    std::ofstream(dir + "/config.json") << j.dump();
  };
  cfg.speculative_model = dir;
  edit([](nlohmann::json& j) { j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 2, 9}; });
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("aux hidden state layer 9"), std::string::npos) << e.error();
  edit([](nlohmann::json& j) {
    j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 2, 3};
    j["vocab_size"] = 1000;
  });
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("vocab_size 1000"), std::string::npos) << e.error();
  edit([](nlohmann::json& j) {
    j["vocab_size"] = 512;
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  });
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("llama3"), std::string::npos) << e.error();
  edit([](nlohmann::json& j) {
    j["rope_scaling"] = nullptr;
    j["intermediate_size"] = 100;  // the MLP tensors are 192 wide
  });
  e = Engine::create(cfg);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.error().find("midlayer.mlp.gate_proj.weight"), std::string::npos) << e.error();
  edit([](nlohmann::json& j) { j["intermediate_size"] = 192; });
  e = Engine::create(cfg);
  ASSERT_TRUE(e.is_ok()) << e.error();
  EXPECT_EQ((*e)->model().speculative_method, "eagle3");
  EXPECT_GT((*e)->model().draft_weight_bytes, 0u);
}

}  // namespace
}  // namespace m3
