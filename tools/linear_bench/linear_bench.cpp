// Batch-invariant linear benchmark. M3's dense linear shapes at TP1 (MXFP8 projections and dense
// MLP, the BF16 LM head), for each row count M:
//   mma      the engine's table with batch invariance (linear.mma_hilo_invariant.sm90 /
//            dense_mlp.mma_hilo_invariant_swiglu_oai.sm90);
//   rowdot   the same table without the tensor-core entries (the fp32 row-dot it replaces);
//   cublas   BF16 weights only: the non-invariant cuBLAS hi+lo entry (two BF16 GEMMs).
// attn_proj: a layer's five projections of one x (q, k, v, index q, index k) as one linear_group
// call ("group") and as five linear calls ("separate"); max_rel is their difference (0 expected).
// --variants wgmma,wgmma_ov,narrow,nosplit,wide,auto: the same call on one kernel forced through
// cuda::MmaLinearRule (bypassing the table), to find where the engine's rule should switch:
//   wgmma    the wgmma kernel at any row count (MXFP8);      wgmma_ov the same, conversion overlapped
//   (the engine's form); wgmma_ovsplit the overlapped form with K split over work items at <= 256 rows;
//   narrow   32-token tiles at any count;
//   nosplit  narrow without the ragged-wave K split;         wide     the 128-token mma.sync tile;
//   auto     the engine's own rule, called directly.
// Each row's max_rel is against the table's output ("mma"): 0 expected, the bits do not depend on
// the kernel. A dense_mlp variant times its gate+up group and down projection (no SwiGLU between,
// max_rel against the same pair under the engine's rule).
// GPU time of one CUDA-graph replay with L2 flushed (median of --iters). Bytes that must move:
// weights (+ e8m0 scales) + x + y (F32); the ratio to the copy bandwidth of the same run. TFLOP/s
// on 2 M N K (the hi + lo pieces make our MMA work twice that); the BF16 ceiling is cuBLAS's BF16
// GEMM on 8192^3 in the same run (gpu_bench_ceiling.h). max_rel: max |mma - rowdot| / max |rowdot| on the same inputs.
// M3_BENCH_SCAN=1: MXFP8 weights without LinearWeight::scale_max (the kernels scan each row's scales).
//   linear_bench [--rows 1,8,32,128,512,4096,8192] [--iters 10] [--rowdot-max 4096]
//                [--shapes q_proj,o_proj,dense_mlp,kv_proj,lm_head,attn_proj] [--variants LIST]
//                [--json linear_bench.json]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/linear_mma.h"
#include "gpu_bench_ceiling.h"
#include "gpu_bench_common.h"
#include "moe_bench_fill.h"
#include "ops/ops.h"

namespace {

using namespace m3;
using namespace m3::gpu_bench;

struct Mat {
  // scale: e8m0 [n, k / 32]; ref: each row's largest scale byte [n] (LinearWeight::scale_max), a
  // separate allocation so that the weights lie where they did before it (the 16-token tiles'
  // second read of a weight tile hits L2 or not with the layout: +17 % at 32 rows measured).
  Dev data, scale, ref;
  ops::LinearWeight w;
  double bytes = 0;
  Mat(int64_t n, int64_t k, bool mxfp8, uint32_t seed, cudaStream_t stream) {
    if (mxfp8) {
      data = Dev(size_t(n * k));
      scale = Dev(size_t(n * k / 32));
      moe_bench::fill_e4m3(data.as<uint8_t>(), size_t(n * k), seed, stream);
      moe_bench::fill_bytes(scale.as<uint8_t>(), size_t(n * k / 32), 118, 121, seed + 1, stream);
      w.data = TensorView{data.as<void>(), DType::kF8E4M3, {n, k}, Device::kCuda};
      w.scale = TensorView{scale.as<void>(), DType::kU8, {n, k / 32}, Device::kCuda};
      if (std::getenv("M3_BENCH_SCAN") == nullptr) {  // =1: without it (the kernels scan the scale rows)
        ref = Dev(size_t(n));
        moe_bench::row_max_bytes(scale.as<uint8_t>(), n, k / 32, ref.as<uint8_t>(), stream);
        w.scale_max = TensorView{ref.as<void>(), DType::kU8, {n}, Device::kCuda};
      }
      bytes = double(n) * k * (1.0 + 1.0 / 32) + (w.scale_max.data ? double(n) : 0.0);
    } else {
      // BF16 weights: small floats written as bf16 bit patterns by a float fill + truncation.
      data = Dev(size_t(n * k) * 2);
      Dev tmp(size_t(n * k) * 4);
      moe_bench::fill_f32(tmp.as<float>(), size_t(n * k), 0.02f, seed, stream);
      std::vector<float> host(size_t(n * k));
      M3_CUDA_CHECK(cudaMemcpyAsync(host.data(), tmp.as<void>(), host.size() * 4, cudaMemcpyDeviceToHost, stream));
      M3_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<__nv_bfloat16> hb(host.size());
      for (size_t i = 0; i < host.size(); ++i) hb[i] = __float2bfloat16_rn(host[i]);
      M3_CUDA_CHECK(cudaMemcpy(data.as<void>(), hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
      w.data = TensorView{data.as<void>(), DType::kBF16, {n, k}, Device::kCuda};
      bytes = double(n) * k * 2;
    }
  }
};

// max |a - b| / max |b| over the first n floats of two device buffers.
double max_rel_diff(const Dev& a, const Dev& b, size_t n) {
  std::vector<float> ha(n), hb(n);
  M3_CUDA_CHECK(cudaMemcpy(ha.data(), a.as<void>(), n * 4, cudaMemcpyDeviceToHost));
  M3_CUDA_CHECK(cudaMemcpy(hb.data(), b.as<void>(), n * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, double(std::fabs(ha[i] - hb[i])));
    den = std::max(den, double(std::fabs(hb[i])));
  }
  return den > 0 ? num / den : num;
}

// One timed row: printed as a table line and kept for the JSON.
struct Row {
  const char* shape;
  int m;
  int64_t n, k;
  bool mlp;
  const char* weights;
  const char* what;
  Timing tm;
  double bytes, flops, max_rel;
  std::string entry;
};
void emit_row(const Row& r, double copy_bw, double bf16_tf, nlohmann::json& rows) {
  const double sec = r.tm.median_us * 1e-6;
  std::printf("%-10s %6d %-7s | %10.1f %9.1f %8.0f %5.1f%% %8.1f %6.1f%% | %9.2e | %s\n", r.shape, r.m, r.what,
              r.tm.median_us, r.bytes / 1e6, r.bytes / sec / 1e9, 100 * r.bytes / sec / copy_bw, r.flops / sec / 1e12,
              100 * r.flops / sec / 1e12 / bf16_tf, r.max_rel, r.entry.c_str());
  std::fflush(stdout);
  rows.push_back({{"shape", r.shape}, {"m", r.m}, {"n", r.n}, {"k", r.k}, {"mlp", r.mlp}, {"weights", r.weights},
                  {"what", r.what}, {"us", r.tm.median_us}, {"min_us", r.tm.min_us}, {"bytes", r.bytes},
                  {"gbps", r.bytes / sec / 1e9}, {"copy_ratio", r.bytes / sec / copy_bw},
                  {"tflops", r.flops / sec / 1e12}, {"bf16_ceiling_ratio", r.flops / sec / 1e12 / bf16_tf},
                  {"max_rel", r.max_rel}, {"entry", r.entry}});
}

// A forced kernel choice (--variants): whether wgmma is allowed, and the rule.
struct Variant {
  std::string name;
  bool wgmma;
  cuda::MmaLinearRule rule;
};
Variant variant_of(const std::string& name) {
  constexpr int64_t kNever = int64_t(1) << 62;
  Variant v{name, true, {}};
  if (name == "wgmma") v.rule.wgmma_min_rows = 1, v.rule.wgmma_overlap = false;
  else if (name == "wgmma_ov") v.rule.wgmma_min_rows = 1, v.rule.wgmma_overlap = true;
  else if (name == "wgmma_ovsplit") v.rule.wgmma_min_rows = 1, v.rule.wgmma_overlap = true, v.rule.wgmma_split = true;
  else if (name == "narrow") v.rule = {kNever, kNever, cuda::MmaLinearRule{}.split_fill};
  else if (name == "nosplit") v.rule = {kNever, kNever, 0};
  else if (name == "wide") v.rule = {kNever, 0, 0};
  else if (name != "auto") {
    throw std::runtime_error("--variants: unknown variant '" + name +
                             "' (wgmma, wgmma_ov, wgmma_ovsplit, narrow, nosplit, wide, auto)");
  }
  if (name == "narrow" || name == "nosplit" || name == "wide") v.rule.wgmma_wide_min_rows = kNever;
  if (name.rfind("wgmma", 0) == 0) v.rule.wgmma_bf16 = true;  // BF16 weights (the LM head) too, where the form allows
  return v;
}

// What the plan of a forced call is, for the entry column (the dispatch trace's words).
std::string plan_name(int64_t m, const ops::LinearWeight& w, const Variant& v) {
  const cuda::MmaLinearPlan p = cuda::mma_linear_plan(m, w.out_features(), w.in_features(), w.data.dtype, v.wgmma, v.rule);
  const bool overlap = p.kernel == cuda::MmaLinearKernel::kWgmma && v.rule.wgmma_overlap;
  return "forced " + cuda::mma_linear_plan_text(p) + (overlap ? ", overlapped" : "");
}

int run(int argc, char** argv) {
  std::vector<int> rows_list = {1, 8, 32, 128, 512, 4096, 8192};
  int iters = 10, rowdot_max = 4096;
  std::string json_path = "linear_bench.json", only;
  std::vector<Variant> variants;
  for (Options o(argc, argv); o.next();) {
    if (o.key() == "--rows") rows_list = parse_list(o.value());
    else if (o.key() == "--iters") iters = std::stoi(o.value());
    else if (o.key() == "--rowdot-max") rowdot_max = std::stoi(o.value());
    else if (o.key() == "--json") json_path = o.value();
    else if (o.key() == "--shapes") (only = ",").append(o.value()).append(",");
    else if (o.key() == "--variants") {
      for (const std::string& n : parse_words(o.value())) variants.push_back(variant_of(n));
    }
    else o.unknown();
  }
  BenchDevice bench_device = open_bench_device();
  auto& [prop, stream, flush, copy_bw] = bench_device;
  // BF16 operands: random bytes below 0x40, so every value is finite and positive.
  const double bf16_tf = bf16_gemm_tflops(stream, [&](void* p, size_t count, unsigned seed) {
    moe_bench::fill_bytes(static_cast<uint8_t*>(p), count * 2, 0, 0x3f, seed, stream);
  });
  std::printf("device %s, %d SMs; copy bandwidth %.0f GB/s (read + write); cuBLAS BF16 8192^3 %.0f TFLOP/s; L2 flush: %s\n",
              prop.name, prop.multiProcessorCount, copy_bw / 1e9, bf16_tf, flush_name(flush_mode()));

  ops::KernelTable full, old;
  cuda::register_cuda_kernels(full);
  for (const auto& e : full.linear.entries())
    if (e.name.find("mma_hilo") == std::string::npos) old.linear.add(e);
  for (const auto& e : full.mlp.entries())
    if (e.name.find("mma_hilo") == std::string::npos) old.mlp.add(e);
  ops::DispatchStats stats, old_stats;
  auto ctx = [&](bool mine, bool invariant) {
    return ops::OpContext{mine ? &full : &old, mine ? &stats : &old_stats, Device::kCuda, invariant};
  };
  auto entry_of = [&](ops::DispatchStats& st) {  // the entries chosen since the last call
    std::string e;
    for (const auto& p : st.take_step_paths()) e += (e.empty() ? "" : " ") + p;
    return e;
  };

  struct Shape {
    const char* name;
    int64_t n, k;
    bool mxfp8, mlp;
    int max_rows;
  };
  const std::vector<Shape> shapes = {
      {"q_proj", 8192, 6144, true, false, 1 << 30},    {"o_proj", 6144, 8192, true, false, 1 << 30},
      {"dense_mlp", 12288, 6144, true, true, 1 << 30}, {"kv_proj", 512, 6144, true, false, 1 << 30},
      {"lm_head", 200064, 6144, false, false, 512},
  };
  const int max_m = *std::max_element(rows_list.begin(), rows_list.end());
  Dev xbuf(size_t(max_m) * 12288 * 4);
  moe_bench::fill_f32(xbuf.as<float>(), size_t(max_m) * 12288, 1.0f, 7, stream);

  nlohmann::json rows = nlohmann::json::array();
  std::printf("\n%-10s %6s %-7s | %10s %9s %8s %6s %8s %7s | %9s | %s\n", "shape", "M", "what", "us", "MB", "GB/s", "%copy",
              "TFLOP/s", "%bf16", "max_rel", "entry");
  for (const Shape& s : shapes) {
    std::string key = ",";
    key.append(s.name).append(",");
    if (!only.empty() && only.find(key) == std::string::npos) continue;
    Mat a(s.n, s.k, s.mxfp8, 11, stream);
    Mat up(s.mlp ? s.n : 1, s.mlp ? s.k : 32, s.mxfp8, 12, stream);
    Mat down(s.mlp ? s.k : 1, s.mlp ? s.n : 32, s.mxfp8, 13, stream);
    const int64_t out_n = s.mlp ? s.k : s.n;
    const double wbytes = a.bytes + (s.mlp ? up.bytes + down.bytes : 0.0);
    for (const int m : rows_list) {
      if (m > s.max_rows) continue;
      Dev y(size_t(m) * out_n * 4), y_old(size_t(m) * out_n * 4);
      const TensorView xv{xbuf.as<void>(), DType::kF32, {m, s.k}, Device::kCuda};
      const ops::SwigluParams act;
      auto call = [&](const ops::OpContext& c, Dev& out) {
        const TensorView yv{out.as<void>(), DType::kF32, {m, out_n}, Device::kCuda};
        if (s.mlp) ops::dense_mlp(c, xv, a.w, up.w, down.w, act, yv);
        else ops::linear(c, xv, a.w, yv);
      };
      const double flops = 2.0 * m * double(s.n) * s.k * (s.mlp ? 3.0 : 1.0);
      const double bytes = wbytes + double(m) * s.k * 4 + double(m) * out_n * 4;
      auto emit = [&](const char* what, const Timing& tm, double max_rel, const std::string& entry) {
        emit_row(Row{s.name, m, s.n, s.k, s.mlp, s.mxfp8 ? "mxfp8" : "bf16", what, tm, bytes, flops, max_rel, entry},
                 copy_bw, bf16_tf, rows);
      };
      stats.take_step_paths();
      const Timing t_new = time_graph([&] { call(ctx(true, true), y); }, stream, flush, iters);
      const std::string e_new = entry_of(stats);
      double max_rel = -1;
      if (m <= rowdot_max) {
        old_stats.take_step_paths();
        const Timing t_old = time_graph([&] { call(ctx(false, true), y_old); }, stream, flush, std::max(3, iters / 3));
        const std::string e_old = entry_of(old_stats);
        max_rel = max_rel_diff(y, y_old, size_t(m) * out_n);
        emit("mma", t_new, max_rel, e_new);
        emit("rowdot", t_old, 0.0, e_old);
      } else {
        emit("mma", t_new, max_rel, e_new);
      }
      if (!s.mxfp8) {
        const Timing t_cb = time_graph([&] { call(ctx(true, false), y_old); }, stream, flush, iters);
        emit("cublas", t_cb, 0.0, entry_of(stats));
      }
      // Forced kernels: a linear's output against the table's; a dense MLP's gate+up and down
      // (down fed x's first 12288 columns) against the same pair under the engine's rule.
      Dev g(s.mlp ? size_t(m) * s.n * 4 : 4), u(s.mlp ? size_t(m) * s.n * 4 : 4);
      auto forced = [&](const Variant& v, Dev& out) {
        if (!s.mlp) {
          cuda::mma_linear(xbuf.as<const float>(), s.k, m, a.w, out.as<float>(), s.n, v.wgmma, v.rule);
          return;
        }
        const ops::LinearWeight* gu[2] = {&a.w, &up.w};
        float* gy[2] = {g.as<float>(), u.as<float>()};
        const int64_t ld[2] = {s.n, s.n};
        cuda::mma_linear_group(xbuf.as<const float>(), s.k, m, gu, gy, ld, 2, v.wgmma, v.rule);
        cuda::mma_linear(xbuf.as<const float>(), s.n, m, down.w, out.as<float>(), s.k, v.wgmma, v.rule);
      };
      if (!variants.empty() && s.mlp) {
        forced(variant_of("auto"), y);
        M3_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      for (const Variant& v : variants) {
        // BF16 weights (the LM head) take the wgmma kernel only in its overlapped forms.
        if (v.name == "wgmma" && !s.mxfp8) continue;
        const Timing t_v = time_graph([&] { forced(v, y_old); }, stream, flush, iters);
        emit(v.name.c_str(), t_v, max_rel_diff(y_old, y, size_t(m) * out_n),
             plan_name(m, a.w, v) + (s.mlp ? " (gate+up, down; no SwiGLU)" : ""));
      }
    }
  }
  // A layer's projections of one x at M3 TP1 (q, k, v, index q, index k; MXFP8 6144 -> 8192, 512,
  // 512, 512, 128): one ops::linear_group call against the five ops::linear calls it replaces.
  // max_rel is the largest difference between the two (0: the same bits).
  if (only.empty() || only.find(",attn_proj,") != std::string::npos) {
    const int64_t k = 6144;
    const std::vector<int64_t> ns = {8192, 512, 512, 512, 128};
    std::vector<std::unique_ptr<Mat>> mats;
    std::vector<const ops::LinearWeight*> wp;
    int64_t total_n = 0;
    double wbytes = 0;
    for (size_t i = 0; i < ns.size(); ++i) {
      mats.push_back(std::make_unique<Mat>(ns[i], k, true, unsigned(21 + i), stream));
      wp.push_back(&mats.back()->w);
      total_n += ns[i];
      wbytes += mats.back()->bytes;
    }
    for (const int m : rows_list) {
      if (m > 4096) continue;
      Dev yg(size_t(m) * total_n * 4), ys(size_t(m) * total_n * 4);
      const TensorView xv{xbuf.as<void>(), DType::kF32, {m, k}, Device::kCuda};
      auto views = [&](Dev& out) {
        std::vector<TensorView> v;
        int64_t off = 0;
        for (int64_t n : ns) {
          v.push_back(TensorView{out.as<float>() + m * off, DType::kF32, {m, n}, Device::kCuda});
          off += n;
        }
        return v;
      };
      const std::vector<TensorView> vg = views(yg), vs = views(ys);
      entry_of(stats);
      const Timing t_g = time_graph([&] { ops::linear_group(ctx(true, true), xv, wp.data(), vg.data(), int(wp.size())); },
                                    stream, flush, iters);
      const std::string e_g = entry_of(stats);
      const Timing t_s = time_graph(
          [&] {
            for (size_t i = 0; i < wp.size(); ++i) ops::linear(ctx(true, true), xv, *wp[i], vs[i]);
          },
          stream, flush, iters);
      const std::string e_s = entry_of(stats);
      const double max_rel = max_rel_diff(yg, ys, size_t(m) * total_n);
      const double bytes = wbytes + double(m) * k * 4 + double(m) * total_n * 4;
      const double flops = 2.0 * m * double(total_n) * k;
      emit_row(Row{"attn_proj", m, total_n, k, false, "mxfp8", "group", t_g, bytes, flops, max_rel, e_g}, copy_bw, bf16_tf,
               rows);
      emit_row(Row{"attn_proj", m, total_n, k, false, "mxfp8", "separate", t_s, bytes, flops, 0.0, e_s}, copy_bw,
               bf16_tf, rows);
      std::vector<float*> yp;  // the forced group's outputs, in ys
      std::vector<int64_t> ld;
      for (const TensorView& t : vs) {
        yp.push_back(t.as<float>());
        ld.push_back(t.shape[1]);
      }
      for (const Variant& v : variants) {
        cuda::MmaLinearRule group_rule = v.rule;  // groups never take the wide-weight path (mma_group_rule)
        group_rule.wgmma_wide_min_rows = cuda::mma_group_rule().wgmma_wide_min_rows;
        const Timing t_v = time_graph(
            [&] {
              cuda::mma_linear_group(xbuf.as<const float>(), k, m, wp.data(), yp.data(), ld.data(), int(wp.size()),
                                     v.wgmma, group_rule);
            },
            stream, flush, iters);
        emit_row(Row{"attn_proj", m, total_n, k, false, "mxfp8", v.name.c_str(), t_v, bytes, flops,
                     max_rel_diff(ys, yg, size_t(m) * total_n), plan_name(m, *wp[0], v) + " (q_proj's plan)"},
                 copy_bw, bf16_tf, rows);
      }
    }
  }
  nlohmann::json doc = {{"device", prop.name},          {"sms", prop.multiProcessorCount}, {"copy_gbps", copy_bw / 1e9},
                        {"bf16_gemm_tflops", bf16_tf}, {"rows", rows}};
  finish_bench(json_path, doc, bench_device);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return m3::gpu_bench::bench_main("linear_bench", run, argc, argv); }
