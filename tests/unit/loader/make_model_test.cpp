// make-model (BF16 / MXFP8 random checkpoints) and the model-side weight reader.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "loader/model_dir.h"
#include "model/minimax_m3/make_model.h"
#include "model/minimax_m3/model.h"
#include "model/minimax_m3/weight_reader.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("m3_make_model_" + std::string(info->name()) + "_" + std::to_string(std::random_device{}()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string sub(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint64_t fnv1a(const uint8_t* p, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

MiniMaxM3Config tiny() {
  auto c = MiniMaxM3Config::preset("tiny");
  EXPECT_TRUE(c.is_ok()) << c.error();
  return c.value();
}

void make(const std::string& dir, bool mxfp8, uint64_t seed, size_t shard = size_t(64) << 20, int threads = 0) {
  MakeModelOptions o;
  o.out_dir = dir;
  o.config = tiny();
  o.mxfp8 = mxfp8;
  o.seed = seed;
  o.max_shard_bytes = shard;
  o.num_threads = threads;
  Status s = make_model(o);
  ASSERT_TRUE(s.is_ok()) << s.message();
}

std::unique_ptr<ModelDir> open_dir(const std::string& dir) {
  auto r = ModelDir::open(dir);
  EXPECT_TRUE(r.is_ok()) << r.error();
  return r.is_ok() ? std::move(r.value()) : nullptr;
}

const WeightSpec& spec_named(const std::vector<WeightSpec>& specs, const std::string& suffix) {
  for (const auto& s : specs) {
    if (s.name.size() >= suffix.size() && s.name.compare(s.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return s;
  }
  ADD_FAILURE() << "no spec ending in " << suffix;
  return specs.front();
}

void expect_contains(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "message: " << text << "\nmissing: " << needle;
}

// Tensor bytes of a whole checkpoint, by name (independent of sharding).
std::map<std::string, uint64_t> tensor_hashes(const ModelDir& d) {
  std::map<std::string, uint64_t> h;
  for (const auto& n : d.tensor_names()) {
    const TensorInfo* t = d.find(n);
    h[n] = fnv1a(t->data, t->size_bytes);
  }
  return h;
}

TEST(MakeModel, TinyBf16Layout) {
  TempDir tmp;
  const std::string dir = tmp.sub("bf16");
  make(dir, false, 7);
  auto d = open_dir(dir);
  ASSERT_TRUE(d);
  auto cfg = MiniMaxM3Config::from_json(d->config_json());
  ASSERT_TRUE(cfg.is_ok()) << cfg.error();
  EXPECT_EQ(cfg->quant_method, QuantMethod::kNone);
  EXPECT_FALSE(d->config_json().contains("quantization_config"));
  EXPECT_EQ(cfg->hidden_size, 128);
  EXPECT_EQ(cfg->num_hidden_layers, 4);
  EXPECT_EQ(cfg->to_json(), tiny().to_json());  // config.json round-trips the preset exactly
  json gen = json::parse(slurp(fs::path(dir) / "generation_config.json"));
  EXPECT_EQ(gen["bos_token_id"], 1);
  EXPECT_EQ(gen["eos_token_id"], 2);

  const auto specs = weight_specs(*cfg);
  ASSERT_TRUE(validate_checkpoint(*d, *cfg).is_ok()) << validate_checkpoint(*d, *cfg).message();
  EXPECT_EQ(d->tensor_names().size(), specs.size() + 1);  // + the vision tensor
  auto vision = d->get(kMakeModelVisionTensor, DType::kBF16, {32});
  ASSERT_TRUE(vision.is_ok()) << vision.error();
  for (const auto& s : specs) {
    const TensorInfo* t = d->find(s.name);
    ASSERT_NE(t, nullptr) << s.name;
    const bool fp32 = s.role == WeightRole::kRouter || s.role == WeightRole::kRouterBias;
    EXPECT_EQ(t->dtype, fp32 ? DType::kF32 : DType::kBF16) << s.name;
  }

  // Stored values are exactly bf16(draw) / the fp32 draw.
  for (const char* suffix : {"layers.1.self_attn.q_proj.weight", "layers.1.block_sparse_moe.gate.weight",
                             "layers.0.input_layernorm.weight", "block_sparse_moe.e_score_correction_bias"}) {
    const WeightSpec& s = spec_named(specs, suffix);
    auto v = read_f32(*d, s, false);
    ASSERT_TRUE(v.is_ok()) << v.error();
    const bool fp32 = s.role == WeightRole::kRouter || s.role == WeightRole::kRouterBias;
    for (int64_t i = 0; i < s.shape.numel(); i += 7) {
      const float draw = make_model_value(7, s.name, init_std(s), i);
      const float want = fp32 ? draw : bf16_to_f32(f32_to_bf16(draw));
      ASSERT_EQ((*v)[size_t(i)], want) << s.name << " element " << i;
    }
  }

  // The draws have the intended spread.
  for (const char* suffix : {"embed_tokens.weight", "layers.2.block_sparse_moe.experts.3.w2.weight"}) {
    const WeightSpec& s = spec_named(specs, suffix);
    auto v = read_f32(*d, s, false);
    ASSERT_TRUE(v.is_ok());
    double sum = 0, sq = 0;
    for (float x : *v) sum += x, sq += double(x) * x;
    const double n = double(v->size()), mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
    EXPECT_NEAR(mean, 0.0, 4 * init_std(s) / std::sqrt(n)) << s.name;
    EXPECT_NEAR(sd / init_std(s), 1.0, 0.05) << s.name;
  }
}

TEST(MakeModel, DeterministicAcrossRunsThreadsAndSharding) {
  TempDir tmp;
  make(tmp.sub("a"), false, 11, size_t(64) << 20, 1);
  make(tmp.sub("b"), false, 11, size_t(64) << 20, 4);
  make(tmp.sub("c"), false, 11, 100 << 10, 3);  // sharded differently
  make(tmp.sub("d"), false, 12);
  for (const char* f : {"model.safetensors", "config.json", "generation_config.json"}) {
    EXPECT_EQ(slurp(fs::path(tmp.sub("a")) / f), slurp(fs::path(tmp.sub("b")) / f)) << f;
  }
  EXPECT_TRUE(fs::exists(fs::path(tmp.sub("c")) / "model.safetensors.index.json"));
  auto a = open_dir(tmp.sub("a")), c = open_dir(tmp.sub("c")), d = open_dir(tmp.sub("d"));
  ASSERT_TRUE(a && c && d);
  EXPECT_GT(c->num_files(), 1u);
  EXPECT_EQ(tensor_hashes(*a), tensor_hashes(*c));
  auto ha = tensor_hashes(*a), hd = tensor_hashes(*d);
  size_t same = 0;
  for (const auto& [name, h] : ha) same += hd[name] == h;
  EXPECT_EQ(same, 0u) << "a different seed must change every tensor";
}

// Pinned values: a change here changes every checkpoint make-model writes.
TEST(MakeModel, KnownValuesAndChecksums) {
  const uint32_t expected_bits[4] = {0x3fc4f6c9u, 0xbfa12ab6u, 0xbfa29a5cu, 0x3e9e066fu};
  for (int i = 0; i < 4; ++i) {
    const float v = make_model_value(0, "language_model.model.embed_tokens.weight", 1.0, i);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    EXPECT_EQ(bits, expected_bits[i]) << "element " << i << " = " << v;
  }
  TempDir tmp;
  make(tmp.sub("bf16"), false, 0);
  make(tmp.sub("mx"), true, 0);
  auto b = open_dir(tmp.sub("bf16")), m = open_dir(tmp.sub("mx"));
  ASSERT_TRUE(b && m);
  auto hb = tensor_hashes(*b), hm = tensor_hashes(*m);
  // FNV-1a 64 of the stored bytes; cross-checked against an independent Python implementation
  // of the same definition (splitmix64, Box-Muller, RNE bf16, nearest-even e4m3 by table).
  EXPECT_EQ(hb.at("language_model.model.embed_tokens.weight"), 0x23360459fb1ad5a5ull);
  EXPECT_EQ(hb.at("language_model.model.layers.3.block_sparse_moe.gate.weight"), 0xcd5d7c37696efe33ull);
  EXPECT_EQ(hm.at("language_model.model.layers.3.self_attn.q_proj.weight"), 0x5802b40ac9b2239eull);
  EXPECT_EQ(hm.at("language_model.model.layers.3.self_attn.q_proj.weight_scale_inv"), 0x50bffa1f673eef98ull);
  // The unquantised tensors of the MXFP8 checkpoint are the BF16 checkpoint's.
  EXPECT_EQ(hm.at("language_model.model.embed_tokens.weight"), 0x23360459fb1ad5a5ull);
}

TEST(MakeModel, Mxfp8MatchesBf16Draws) {
  TempDir tmp;
  make(tmp.sub("bf16"), false, 5);
  make(tmp.sub("mx"), true, 5, 64 << 10);
  auto b = open_dir(tmp.sub("bf16")), m = open_dir(tmp.sub("mx"));
  ASSERT_TRUE(b && m);
  auto cfg = MiniMaxM3Config::from_json(m->config_json());
  ASSERT_TRUE(cfg.is_ok()) << cfg.error();
  ASSERT_EQ(cfg->quant_method, QuantMethod::kMxfp8);
  MiniMaxM3Config want = tiny();
  want.quant_method = QuantMethod::kMxfp8;
  EXPECT_EQ(cfg->to_json(), want.to_json());
  const json& qc = m->config_json()["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "mxfp8");
  EXPECT_EQ(qc["weight_block_size"], json({1, 32}));
  EXPECT_FALSE(qc["ignored_layers"].empty());
  ASSERT_TRUE(validate_checkpoint(*m, *cfg).is_ok()) << validate_checkpoint(*m, *cfg).message();

  size_t linears = 0;
  for (const WeightSpec& s : weight_specs(*cfg)) {
    const TensorInfo* t = m->find(s.name);
    ASSERT_NE(t, nullptr);
    auto mv = read_f32(*m, s, true);
    auto bv = read_f32(*b, s, false);
    ASSERT_TRUE(mv.is_ok() && bv.is_ok()) << s.name;
    if (s.role != WeightRole::kLinear) {
      EXPECT_NE(t->dtype, DType::kF8E4M3) << s.name;
      EXPECT_EQ(*mv, *bv) << s.name;  // untouched by quantisation
      continue;
    }
    ++linears;
    ASSERT_EQ(t->dtype, DType::kF8E4M3) << s.name;
    const TensorInfo* scale = m->find(scale_name_for(s.name));
    ASSERT_NE(scale, nullptr);
    const int64_t in = s.shape[1];
    for (int64_t i = 0; i < s.shape.numel(); ++i) {
      const int64_t row = i / in, block = (i % in) / 32;
      const int e = int(scale->data[row * (in / 32) + block]) - 127;
      const double w = (*bv)[size_t(i)];  // bf16(draw): within 2^-9 relative of the draw
      const double bound = std::ldexp(1.0, -4) * std::fabs(w) * (1 + std::ldexp(1.0, -8)) +
                           std::ldexp(1.0, -9) * std::fabs(w) + std::ldexp(1.0, e - 10);
      ASSERT_LE(std::fabs((*mv)[size_t(i)] - w), bound) << s.name << " element " << i;
    }
    // Bit-exact against quantising the fp32 draws directly.
    std::vector<float> row(static_cast<size_t>(in));
    std::vector<uint8_t> q(static_cast<size_t>(in)), sc(static_cast<size_t>(in / 32));
    for (int64_t k = 0; k < in; ++k) row[size_t(k)] = make_model_value(5, s.name, init_std(s), k);
    quantize_mxfp8_row(row.data(), in, q.data(), sc.data());
    EXPECT_EQ(std::memcmp(q.data(), t->data, size_t(in)), 0) << s.name;
    EXPECT_EQ(std::memcmp(sc.data(), scale->data, sc.size()), 0) << s.name;
  }
  // tiny: 4 layers x 4 attention projections, 3 sparse layers x 2 indexer projections,
  // 1 dense MLP x 3, 3 MoE layers x (8 experts x 3 + shared 3).
  EXPECT_EQ(linears, 4u * 4 + 3 * 2 + 3 + 3 * (8 * 3 + 3));
}

TEST(MakeModel, QuantizeRowEdgeCases) {
  std::vector<float> w(64, 0.0f);
  std::vector<uint8_t> q(64), s(2);
  w[32] = 448.0f;  // exactly representable at e = 0
  w[33] = -1.0f;
  quantize_mxfp8_row(w.data(), 64, q.data(), s.data());
  EXPECT_EQ(s[0], 0);  // amax == 0 -> e = -127
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q[size_t(i)], 0);
  EXPECT_EQ(s[1], 127);
  EXPECT_EQ(q[32], 0x7e);
  EXPECT_EQ(fp8_e4m3_to_f32(q[33]), -1.0f);

  w[32] = 448.01f;  // just past 448 -> e = 1
  quantize_mxfp8_row(w.data(), 64, q.data(), s.data());
  EXPECT_EQ(s[1], 128);
  w[32] = 1.0f;  // ceil(log2(1/448)) = -8
  quantize_mxfp8_row(w.data(), 64, q.data(), s.data());
  EXPECT_EQ(s[1], 119);
  EXPECT_EQ(fp8_e4m3_to_f32(q[32]) * std::ldexp(1.0f, -8), 1.0f);
  w[32] = 3.0e38f;  // ceil(log2(3e38 / 448)) = 120
  quantize_mxfp8_row(w.data(), 64, q.data(), s.data());
  EXPECT_EQ(s[1], 247);
  EXPECT_EQ(fp8_e4m3_to_f32(q[32]), 224.0f);  // 3e38 / 2^120 = 225.7, nearest e4m3 is 224
  for (float& x : w) x = 0.0f;
  w[40] = 1e-45f;  // ceil(log2(2^-149 / 448)) = -157 clamps to -127
  quantize_mxfp8_row(w.data(), 64, q.data(), s.data());
  EXPECT_EQ(s[1], 0);
}

TEST(MakeModel, M3PresetsValidateAndCountTensors) {
  for (int layers : {1, 2, 3, 4, 60}) {
    auto c = MiniMaxM3Config::preset("m3-layers:" + std::to_string(layers));
    ASSERT_TRUE(c.is_ok()) << c.error();
    EXPECT_TRUE(c->validate().empty());
    size_t expected = 3;  // embed, final norm, lm_head
    for (int l = 0; l < layers; ++l) expected += c->is_moe_layer(l) ? 401 : (c->is_sparse_layer(l) ? 15 : 11);
    EXPECT_EQ(weight_specs(*c).size(), expected) << layers;
  }
  auto full = MiniMaxM3Config::preset("m3");
  ASSERT_TRUE(full.is_ok());
  EXPECT_EQ(weight_specs(*full).size(), 22893u);  // the audited text tensor count
  EXPECT_FALSE(MiniMaxM3Config::preset("m3-layers:0").is_ok());

  MakeModelOptions bad;
  bad.out_dir = "";
  bad.config = tiny();
  EXPECT_FALSE(make_model(bad).is_ok());
  bad.out_dir = "/tmp/unused";
  bad.config.moe_layer_freq.pop_back();
  Status s = make_model(bad);
  ASSERT_FALSE(s.is_ok());
  expect_contains(s.message(), "moe_layer_freq");
}

// ----- weight reader errors -----

struct Custom {
  std::string name;
  DType dtype;
  Shape shape;
};

std::unique_ptr<ModelDir> write_custom(const std::string& dir, const std::vector<Custom>& tensors) {
  SafetensorsWriter w(dir, 1 << 20);
  for (const auto& t : tensors) {
    std::vector<uint8_t> zeros(size_t(t.shape.numel()) * dtype_size_bytes(t.dtype), 0x3c);
    w.add(t.name, t.dtype, t.shape, zeros.data());
  }
  EXPECT_TRUE(w.finish().is_ok());
  std::ofstream(fs::path(dir) / "config.json") << "{}";
  return open_dir(dir);
}

// The engine's load formats: MoE experts stay native MXFP8 wherever the MXFP8 MoE kernels can
// read them (with or without batch invariance), dense linears go BF16 without invariance.
TEST(LoadFormats, EngineKeepsMxfp8ExpertsNative) {
  const LoadOptions cpu = engine_load_options(nullptr, true, false, false);
  EXPECT_EQ(cpu.linear_format, LinearFormat::kF32);
  EXPECT_FALSE(cpu.expert_format.has_value());
  const LoadOptions inv = engine_load_options(nullptr, false, false, true);
  EXPECT_EQ(inv.linear_format, LinearFormat::kNative);
  EXPECT_EQ(inv.expert_format, LinearFormat::kNative);
  const LoadOptions fast = engine_load_options(nullptr, false, false, false);
  EXPECT_EQ(fast.linear_format, LinearFormat::kBF16);
  EXPECT_EQ(fast.expert_format, LinearFormat::kNative);
  const LoadOptions deq = engine_load_options(nullptr, false, true, false);
  EXPECT_EQ(deq.linear_format, LinearFormat::kBF16);
  EXPECT_EQ(deq.expert_format, LinearFormat::kBF16);
}

// The loader honours the experts' format separately: an MXFP8 checkpoint with BF16 dense
// linears keeps its experts as e4m3 + e8m0 (1 + 1/32 bytes per weight), BF16 takes 2.
TEST(LoadFormats, ExpertsLoadInTheirOwnFormat) {
  TempDir t;
  const std::string dir = t.sub("mx");
  make(dir, true, 7);
  const MiniMaxM3Config c = tiny();
  int moe = -1;
  for (int l = 0; l < c.num_hidden_layers && moe < 0; ++l) moe = c.is_moe_layer(l) ? l : -1;
  ASSERT_GE(moe, 0) << "the tiny preset has no MoE layer";
  const size_t weights = size_t(3) * size_t(c.intermediate_size) * size_t(c.hidden_size);
  auto expert_bytes = [&](std::optional<LinearFormat> experts) -> size_t {
    auto d = open_dir(dir);
    if (!d) return 0;
    LoadOptions o;
    o.linear_format = LinearFormat::kBF16;
    o.expert_format = experts;
    auto m = MiniMaxM3Model::load(*d, {}, o);
    EXPECT_TRUE(m.is_ok()) << m.error();
    return m.is_ok() ? (*m)->routed_expert_bytes()[size_t(moe)] : 0;
  };
  EXPECT_EQ(expert_bytes(LinearFormat::kNative), weights + weights / 32);
  EXPECT_EQ(expert_bytes(LinearFormat::kBF16), 2 * weights);
  EXPECT_EQ(expert_bytes(std::nullopt), 2 * weights);  // unset: as the dense linears
}

TEST(WeightReader, ErrorsNameFileTensorAndExpectation) {
  TempDir tmp;
  const std::string dir = tmp.sub("w");
  const std::string lin = "language_model.model.layers.0.self_attn.q_proj.weight";
  const std::string norm = "language_model.model.norm.weight";
  auto d = write_custom(dir, {{lin, DType::kF8E4M3, {8, 64}},
                              {lin + "_scale_inv", DType::kU8, {8, 3}},
                              {norm, DType::kF8E4M3, {16}},
                              {"language_model.model.layers.0.mlp.up_proj.weight", DType::kI32, {4, 4}},
                              {"model.layers.0.mlp.down_proj.weight", DType::kBF16, {4, 32}},
                              {"language_model.model.layers.1.self_attn.k_proj.weight", DType::kF8E4M3, {4, 32}},
                              {"language_model.model.layers.1.self_attn.k_proj.weight_scale_inv", DType::kF32, {4, 1}}});
  ASSERT_TRUE(d);
  const std::string file = fs::path(dir) / "model.safetensors";

  WeightSpec q{lin, {8, 64}, WeightRole::kLinear, 0};
  auto r = read_f32(*d, q, true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), file);
  expect_contains(r.error(), "tensor '" + lin + "_scale_inv': shape [8, 3], expected [8, 2]");

  r = read_f32(*d, q, false);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "tensor '" + lin + "': dtype F8_E4M3, expected BF16, F32 or F16");
  expect_contains(r.error(), "no mxfp8 quantization_config");

  r = read_f32(*d, WeightSpec{lin, {8, 32}, WeightRole::kLinear, 0}, true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "tensor '" + lin + "': shape [8, 64], expected [8, 32]");

  r = read_f32(*d, WeightSpec{norm, {16}, WeightRole::kNorm, -1}, true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), file + ", tensor '" + norm + "': dtype F8_E4M3");

  r = read_f32(*d, WeightSpec{"language_model.model.layers.0.mlp.up_proj.weight", {4, 4}, WeightRole::kLinear, 0}, true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "dtype I32, expected F8_E4M3 (+ U8 scale) or BF16/F32/F16");

  r = read_f32(*d, WeightSpec{"language_model.model.layers.1.self_attn.k_proj.weight", {4, 32}, WeightRole::kLinear, 1},
               true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "k_proj.weight_scale_inv': dtype F32, expected U8");

  r = read_f32(*d, WeightSpec{"language_model.model.layers.9.mlp.up_proj.weight", {4, 4}, WeightRole::kLinear, 9}, true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "model dir " + dir + ": tensor 'language_model.model.layers.9.mlp.up_proj.weight' not found");

  // A BF16 linear inside an MXFP8 checkpoint (ignored layer), saved text-only: accepted.
  r = read_f32(*d, WeightSpec{"language_model.model.layers.0.mlp.down_proj.weight", {4, 32}, WeightRole::kLinear, 0},
               true);
  ASSERT_TRUE(r.is_ok()) << r.error();
  EXPECT_EQ((*r)[0], bf16_to_f32(0x3c3c));
}

TEST(WeightReader, MissingScaleAndValidateCheckpoint) {
  TempDir tmp;
  const std::string dir = tmp.sub("mx");
  make(dir, true, 3);
  auto cfg = MiniMaxM3Config::from_json(open_dir(dir)->config_json());
  ASSERT_TRUE(cfg.is_ok());
  // Drop one scale tensor and one norm by rewriting the checkpoint without them.
  {
    auto d = open_dir(dir);
    SafetensorsWriter w(tmp.sub("broken"), 1 << 20);
    for (const auto& n : d->tensor_names()) {
      if (n.find("layers.2.self_attn.o_proj.weight_scale_inv") != std::string::npos) continue;
      if (n.find("layers.0.input_layernorm") != std::string::npos) continue;
      const TensorInfo* t = d->find(n);
      w.add(n, t->dtype, t->shape, t->data);
    }
    ASSERT_TRUE(w.finish().is_ok());
    fs::copy_file(fs::path(dir) / "config.json", fs::path(tmp.sub("broken")) / "config.json");
  }
  auto broken = open_dir(tmp.sub("broken"));
  ASSERT_TRUE(broken);
  const auto specs = weight_specs(*cfg);
  auto r = read_f32(*broken, spec_named(specs, "layers.2.self_attn.o_proj.weight"), true);
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "MXFP8 scale tensor for language_model.model.layers.2.self_attn.o_proj.weight");
  expect_contains(r.error(), "'language_model.model.layers.2.self_attn.o_proj.weight_scale_inv' not found");

  Status s = validate_checkpoint(*broken, *cfg);
  ASSERT_FALSE(s.is_ok());
  expect_contains(s.message(), "(2 problems)");
  expect_contains(s.message(), "layers.0.input_layernorm.weight' not found");
}

}  // namespace
}  // namespace m3
