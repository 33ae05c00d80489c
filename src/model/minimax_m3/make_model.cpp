#include "model/minimax_m3/make_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "loader/safetensors.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // splitmix64 increment
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr int64_t kChunkElems = int64_t(1) << 22;  // elements generated per streamed piece
constexpr int64_t kMinParallelElems = int64_t(1) << 16;
constexpr int kMxBlock = 32;

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

uint64_t tensor_key(uint64_t seed, std::string_view name) { return mix64(mix64(seed + kGamma) ^ fnv1a64(name)); }

// The k-th output of the splitmix64 stream from `key`, as a double in (0, 1): the stream is
// counter-based, so any element can be produced without its predecessors.
double uniform_at(uint64_t key, uint64_t k) {
  return (double(mix64(key + (k + 1) * kGamma) >> 11) + 0.5) * 0x1p-53;
}

// ln(u) for u in (0, 1] from +, -, *, / only: libm's log / sin / cos may differ in the last
// bit between versions and CPU-specific variants, which would break bit-identical draws.
// (x86-64 without -mfma never contracts these into FMAs.)
double det_log(double u) {
  int k;
  double m = std::frexp(u, &k);  // exact: u = m * 2^k, m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    k -= 1;
  }
  // ln(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716
  const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
  double term = s, sum = s;
  for (int n = 3; n <= 27; n += 2) {
    term *= s2;
    sum += term * (1.0 / double(n));  // reciprocals of constants: folded when unrolled
  }
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  return double(k) * kLn2Hi + (2.0 * sum + double(k) * kLn2Lo);
}

// sin and cos of 2*pi*u for u in [0, 1], same rules as det_log.
void det_sincos_turns(double u, double& sin_out, double& cos_out) {
  const double q = std::nearbyint(u * 4.0);  // quadrant; u * 4 is exact
  const double x = (u - q * 0.25) * kTwoPi;  // the subtraction is exact; |x| <= pi/4
  const double x2 = x * x;
  double sn = 1.0, cs = 1.0;
  for (int n = 16; n >= 2; n -= 2) sn = 1.0 - x2 * (1.0 / double(n * (n + 1))) * sn;
  sn *= x;
  for (int n = 17; n >= 1; n -= 2) cs = 1.0 - x2 * (1.0 / double(n * (n + 1))) * cs;
  switch (int(q) & 3) {
    case 0: sin_out = sn; cos_out = cs; break;
    case 1: sin_out = cs; cos_out = -sn; break;
    case 2: sin_out = -sn; cos_out = -cs; break;
    default: sin_out = -cs; cos_out = sn; break;
  }
}

void normal_pair(uint64_t key, uint64_t pair, double& z0, double& z1) {
  const double u1 = uniform_at(key, 2 * pair), u2 = uniform_at(key, 2 * pair + 1);
  const double r = std::sqrt(-2.0 * det_log(u1));  // sqrt is correctly rounded everywhere
  double s, c;
  det_sincos_turns(u2, s, c);
  z0 = r * c;
  z1 = r * s;
}

// Elements [begin, begin + count) of the tensor's draw: element 2p is the cosine half of
// Box-Muller pair p, element 2p + 1 the sine half.
void fill_values(uint64_t key, double std_dev, int64_t begin, int64_t count, float* out) {
  int64_t i = begin;
  const int64_t end = begin + count;
  while (i < end) {
    double z0, z1;
    normal_pair(key, uint64_t(i / 2), z0, z1);
    if (i % 2 == 0) {
      out[i - begin] = float(z0 * std_dev);
      if (i + 1 < end) out[i + 1 - begin] = float(z1 * std_dev);
      i += 2;
    } else {
      out[i - begin] = float(z1 * std_dev);
      i += 1;
    }
  }
}

enum class Encoding { kF32, kBF16, kMxfp8 };

size_t encoded_bytes(Encoding e) { return e == Encoding::kF32 ? 4 : e == Encoding::kBF16 ? 2 : 1; }

struct TensorJob {
  std::string name;
  Shape shape;
  double std_dev = 1.0;
  Encoding encoding = Encoding::kBF16;
  uint64_t key = 0;
};

// Runs body(begin, end) over [0, count) on up to `threads` threads.
template <class F>
void parallel_rows(int64_t count, int threads, int64_t elems_per_row, F&& body) {
  const int64_t workers = std::min<int64_t>(threads, count);
  if (workers <= 1 || count * elems_per_row < kMinParallelElems) {
    body(int64_t(0), count);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (count + workers - 1) / workers;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t a = w * per, b = std::min(count, a + per);
    if (a < b) pool.emplace_back([&body, a, b] { body(a, b); });
  }
  for (auto& t : pool) t.join();
}

// Streams one tensor row-chunk by row-chunk; MXFP8 scales go to `scales` for the scale
// tensor's producer, which runs right after this one.
Status produce(const TensorJob& job, int threads, const ByteSink& sink, std::vector<uint8_t>* scales) {
  const int64_t numel = job.shape.numel();
  if (numel == 0) return Status::ok();
  const int64_t rows = job.shape.rank() >= 2 ? job.shape[0] : 1;
  const int64_t cols = numel / rows;
  const size_t eb = encoded_bytes(job.encoding);
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkElems / cols);
  std::vector<uint8_t> buf(size_t(std::min(chunk_rows, rows) * cols) * eb);
  if (job.encoding == Encoding::kMxfp8) scales->assign(size_t(rows * (cols / kMxBlock)), 0);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t nr = std::min(chunk_rows, rows - r0);
    parallel_rows(nr, threads, cols, [&](int64_t a, int64_t b) {
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = a; r < b; ++r) {
        fill_values(job.key, job.std_dev, (r0 + r) * cols, cols, row.data());
        uint8_t* dst = buf.data() + size_t(r * cols) * eb;
        switch (job.encoding) {
          case Encoding::kF32:
            std::memcpy(dst, row.data(), size_t(cols) * 4);
            break;
          case Encoding::kBF16:
            for (int64_t c = 0; c < cols; ++c) {
              const uint16_t h = f32_to_bf16(row[size_t(c)]);
              std::memcpy(dst + 2 * c, &h, 2);
            }
            break;
          case Encoding::kMxfp8:
            quantize_mxfp8_row(row.data(), cols, dst, scales->data() + size_t((r0 + r) * (cols / kMxBlock)));
            break;
        }
      }
    });
    M3_RETURN_IF_ERROR(sink(buf.data(), size_t(nr * cols) * eb));
  }
  return Status::ok();
}

Status write_json(const fs::path& path, const json& j) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::error("make_model: cannot create " + path.string());
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return Status::error("make_model: write failed: " + path.string());
  return Status::ok();
}

// "language_model.model.layers.0.self_attn.q_proj.weight" -> "model.layers.0.self_attn.q_proj"
std::string module_name(const std::string& weight_name) {
  std::string m = weight_name;
  const std::string prefix = kTextPrefix;
  if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
  const std::string suffix = ".weight";
  if (m.size() > suffix.size() && m.compare(m.size() - suffix.size(), suffix.size(), suffix) == 0)
    m.resize(m.size() - suffix.size());
  return m;
}

}  // namespace

double init_std(const WeightSpec& spec) {
  switch (spec.role) {
    case WeightRole::kEmbedding: return 1.0;
    case WeightRole::kLinear:
    case WeightRole::kLmHead:
    case WeightRole::kRouter: return 1.0 / std::sqrt(double(spec.shape[1]));
    case WeightRole::kNorm: return 0.1;
    case WeightRole::kRouterBias: return 0.05;
  }
  return 1.0;
}

float make_model_value(uint64_t seed, std::string_view tensor_name, double std_dev, int64_t index) {
  float v;
  fill_values(tensor_key(seed, tensor_name), std_dev, index, 1, &v);
  return v;
}

void quantize_mxfp8_row(const float* w, int64_t k, uint8_t* q, uint8_t* scales) {
  for (int64_t b = 0; b < k / kMxBlock; ++b) {
    const float* x = w + b * kMxBlock;
    float amax = 0.0f;
    for (int i = 0; i < kMxBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    // Smallest e with 448 * 2^e >= amax, found exactly (no log2 rounding).
    int e = -127;
    if (amax > 0.0f) {
      int fe;
      std::frexp(double(amax) / 448.0, &fe);  // amax/448 in [2^(fe-1), 2^fe)
      e = fe;
      while (e > -127 && std::ldexp(448.0, e - 1) >= double(amax)) --e;
      while (e < 127 && std::ldexp(448.0, e) < double(amax)) ++e;
    }
    e = std::clamp(e, -127, 127);
    scales[b] = uint8_t(e + 127);
    const double inv_scale = std::ldexp(1.0, -e);  // exact power of two; products are exact in double
    for (int i = 0; i < kMxBlock; ++i) q[b * kMxBlock + i] = f32_to_fp8_e4m3(float(double(x[i]) * inv_scale));
  }
}

Status make_model(const MakeModelOptions& options) {
  if (options.out_dir.empty()) return Status::error("make_model: out_dir is empty");
  MiniMaxM3Config config = options.config;
  if (options.mxfp8) {
    config.quant_method = QuantMethod::kMxfp8;
    config.quant_block_k = kMxBlock;
    if (config.quant_ignored_layers.empty())
      config.quant_ignored_layers = {"lm_head", "model.embed_tokens", "re:.*block_sparse_moe\\.gate$"};
  } else {
    config.quant_method = QuantMethod::kNone;
  }
  const auto problems = config.validate();
  if (!problems.empty()) {
    std::string msg = "make_model: invalid config: ";
    for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
    return Status::error(msg);
  }
  const int threads =
      options.num_threads > 0 ? options.num_threads : std::max(1, int(std::thread::hardware_concurrency()));

  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec) return Status::error("make_model: cannot create " + options.out_dir + ": " + ec.message());
  // config.json is written last: a run that fails midway leaves no loadable directory.
  fs::remove(fs::path(options.out_dir) / "config.json", ec);

  SafetensorsWriter writer(options.out_dir, options.max_shard_bytes);
  auto add_job = [&](TensorJob job, DType dtype) {
    job.key = tensor_key(options.seed, job.name);
    const std::string name = job.name;
    const Shape shape = job.shape;
    writer.add_streamed(name, dtype, shape, [job = std::move(job), threads](const ByteSink& sink) {
      return produce(job, threads, sink, nullptr);
    });
  };
  for (const WeightSpec& spec : weight_specs(config)) {
    TensorJob job{spec.name, spec.shape, init_std(spec), Encoding::kBF16, 0};
    if (spec.role == WeightRole::kRouter || spec.role == WeightRole::kRouterBias) {
      job.encoding = Encoding::kF32;
      add_job(std::move(job), DType::kF32);
      continue;
    }
    const bool quantise = options.mxfp8 && spec.role == WeightRole::kLinear &&
                          !is_quant_ignored(config, module_name(spec.name));
    if (!quantise) {
      add_job(std::move(job), DType::kBF16);
      continue;
    }
    const int64_t out = spec.shape[0], in = spec.shape[1];
    if (in % kMxBlock != 0) {
      return Status::error("make_model: " + spec.name + " has in_features " + std::to_string(in) +
                           ", expected a multiple of 32 for MXFP8");
    }
    job.encoding = Encoding::kMxfp8;
    job.key = tensor_key(options.seed, job.name);
    // The weight's producer leaves its scales here; the scale tensor follows it directly.
    auto stash = std::make_shared<std::vector<uint8_t>>();
    writer.add_streamed(spec.name, DType::kF8E4M3, spec.shape, [job, stash, threads](const ByteSink& sink) {
      return produce(job, threads, sink, stash.get());
    });
    const std::string scale_name = scale_name_for(spec.name);
    const size_t scale_bytes = size_t(out * (in / kMxBlock));
    writer.add_streamed(scale_name, DType::kU8, {out, in / kMxBlock},
                        [stash, scale_name, scale_bytes](const ByteSink& sink) -> Status {
                          if (stash->size() != scale_bytes)
                            return Status::error("make_model: scales for " + scale_name + " were not produced");
                          Status s = sink(stash->data(), stash->size());
                          std::vector<uint8_t>().swap(*stash);
                          return s;
                        });
  }
  add_job(TensorJob{kMakeModelVisionTensor, {32}, 0.1, Encoding::kBF16, 0}, DType::kBF16);
  M3_RETURN_IF_ERROR(writer.finish());

  json gen = {{"bos_token_id", config.bos_token_id},
              {"eos_token_id", config.eos_token_ids.size() == 1 ? json(config.eos_token_ids[0])
                                                                : json(config.eos_token_ids)}};
  M3_RETURN_IF_ERROR(write_json(fs::path(options.out_dir) / "generation_config.json", gen));
  return write_json(fs::path(options.out_dir) / "config.json", config.to_json());
}

}  // namespace m3
