// MXFP8 MoE benchmark (issue 9). M3 shapes at TP1 by default: hidden 6144, 128 routed experts
// of intermediate 3072 plus the shared expert (3072), top-4, MXFP8 weights (~7.5 GB per layer).
// For each token count T, top-4 uniform random routing:
//   block_<path>    router -> output (router entry + the path's route/prep/GEMMs/combine);
//   experts_<path>  the MoE experts alone (routing + conversion + GEMMs + combine);
//   gemms_<path>    the grouped GEMMs alone (gate+up with SwiGLU, [W8A8: h quantisation], down);
//   router          the router alone (logits + selection);
//   (paths: w8a16 = mma.sync, w8a8 = wgmma e4m3, w8a16_wgmma = w8a16's bits on wgmma, from T = 128)
//   dispatch        router + ops::moe_experts through the engine's table (batch invariance off);
//   dispatch_invariant  the same with batch invariance on (the engine's default);
//   rowdot          the existing grouped row-dot entry (experts alone);
//   shared_*        the fused shared expert against the routed experts plus the shared expert run
//                   separately (our kernels as a one-expert group, and the dense_mlp entry) + add;
//   shared_side_w8a16  (T < 256) router + routed experts on one stream, the shared expert as a
//                   one-expert group on a second stream forked before the router, joined + add.
// Every timing is GPU time of one CUDA-graph replay (events around it), median of `iters`, with
// L2 flushed before each replay (gpu_bench_flush.h: a 256 MB read unless M3_BENCH_FLUSH=memset).
// Bytes that must be read: e4m3 data + e8m0 scales of the experts the routing touches (shared
// included) + x in + out (+ the router's weight for block rows); the ratio to the
// device-to-device copy bandwidth measured in the same run (read + write bytes per second, as
// msa_bench). TFLOP/s on the expert FLOPs (2 * rows * 3 *
// hidden * inter, rows = T * (top_k + 1)); the FP8 ceiling is cuBLASLt's e4m3 GEMM on 8192^3
// (fast accumulation) and our W8A8 kernel on one dense 16384-token expert.
//   moe_bench [--tokens 1,8,32,128,512,4096,16384] [--iters 20] [--hidden 6144] [--inter 3072]
//             [--experts 128] [--top-k 4] [--no-baseline] [--json moe_bench.json]
//             [--only block,router,...]   (time only the rows whose names start with one of these)
// M3_BENCH_WARM_CODE=1 (diagnostic) adds block_<path>_router_code_warm rows (T <= 512): the block
// with the router and routing run on twin buffers after each flush (their code warm, no data);
// M3_BENCH_WARM_CODE=3 adds block_<path>_code_warm rows (T <= 64): the whole block's kernels run on
// a twin first (its routed experts disjoint from the block's, no shared expert).
// M3_BENCH_MOE_TIMELINE=1 with a -DM3_MOE_TIMELINE=ON build prints each block row's CTA timeline.
// M3_BENCH_SCAN=1: the weights without LinearWeight::scale_max (the W8A16 kernels then scan each
// row's scales for its reference, as before the loader computed it).
// The gemms_routed_w8a16 row (select it with --only gemms_): the W8A16 GEMMs without the shared
// expert's items.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "gpu_bench_common.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/moe_mxfp8.h"
#include "backend/cuda/moe_timeline.cuh"
#include "moe_bench_fill.h"

namespace {

using namespace m3;
using namespace m3::gpu_bench;
namespace mx = cuda::moe_mxfp8;

#define LT_CHECK(call)                                                                               \
  do {                                                                                               \
    const cublasStatus_t st_ = (call);                                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(#call) + " failed: " + std::to_string(int(st_))); \
  } while (0)

// cuBLASLt e4m3 x e4m3 -> bf16 GEMM, m = n = k = 8192 (TN, fast accumulation): TFLOP/s, best of 10.
double cublaslt_fp8_tflops(cudaStream_t stream) {
  const int64_t m = 8192, n = 8192, k = 8192;
  Dev a(size_t(m * k)), b(size_t(n * k)), c(size_t(m * n) * 2), ws(size_t(64) << 20);
  moe_bench::fill_e4m3(a.as<uint8_t>(), a.bytes(), 11, stream);
  moe_bench::fill_e4m3(b.as<uint8_t>(), b.bytes(), 12, stream);
  cublasLtHandle_t lt = nullptr;
  LT_CHECK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  double best = 0;
  try {
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const int8_t fast = 1;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    LT_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(m), k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(n), k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, uint64_t(m), uint64_t(n), m));
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t wsb = ws.bytes();
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found));
    if (found == 0) throw std::runtime_error("no cuBLASLt FP8 algorithm");
    const float alpha = 1.0f, beta = 0.0f;
    cudaEvent_t e0, e1;
    M3_CUDA_CHECK(cudaEventCreate(&e0));
    M3_CUDA_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 12; ++i) {
      M3_CUDA_CHECK(cudaEventRecord(e0, stream));
      LT_CHECK(cublasLtMatmul(lt, op, &alpha, a.as<void>(), la, b.as<void>(), lb, &beta, c.as<void>(), lc, c.as<void>(), lc,
                              &heur.algo, ws.as<void>(), wsb, stream));
      M3_CUDA_CHECK(cudaEventRecord(e1, stream));
      M3_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      M3_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) best = std::max(best, 2.0 * double(m) * n * k / (double(ms) * 1e-3) / 1e12);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  } catch (...) {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(lt);
    throw;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  return best;
}

// One MoE layer's MXFP8 weights in one allocation (16-byte aligned pieces).
struct LayerWeights {
  int routed = 0, hidden = 0, inter = 0;
  Dev slab, refs;  // refs: each row's largest scale byte (LinearWeight::scale_max), apart from the slab
  std::vector<ops::LinearWeight> gate, up, down;
  double expert_bytes = 0;  // data + scales of one expert
  LayerWeights(int routed_, int hidden_, int inter_, cudaStream_t stream) : routed(routed_), hidden(hidden_), inter(inter_) {
    const int total = routed + 1;
    // Per matrix: e4m3 data and e8m0 scales in the slab, each row's largest scale byte in `refs`
    // (left out with M3_BENCH_SCAN=1: the kernels then scan the scale rows).
    const size_t mat = size_t(hidden) * inter, sc = mat / 32;
    const bool scan = std::getenv("M3_BENCH_SCAN") != nullptr;
    const size_t per = 3 * (mat + sc), per_ref = scan ? 0 : size_t(2 * inter + hidden);
    slab = Dev(per * total);
    if (!scan) refs = Dev(per_ref * total);
    expert_bytes = double(per + per_ref);
    uint8_t* p = slab.as<uint8_t>();
    moe_bench::fill_e4m3(p, per * total, 3, stream);
    for (int e = 0; e < total; ++e) {
      for (int m = 0; m < 3; ++m) {
        uint8_t* data = p + size_t(e) * per + size_t(m) * (mat + sc);
        uint8_t* scale = data + mat;
        const int64_t out = m < 2 ? inter : hidden, in = m < 2 ? hidden : inter;
        moe_bench::fill_bytes(scale, sc, 116, 121, uint32_t(100 + 3 * e + m), stream);  // ~2^-9: weights ~0.1..1
        ops::LinearWeight w;
        w.data = TensorView{data, DType::kF8E4M3, {out, in}, Device::kCuda};
        w.scale = TensorView{scale, DType::kU8, {out, in / 32}, Device::kCuda};
        if (!scan) {
          uint8_t* ref = refs.as<uint8_t>() + size_t(e) * per_ref + size_t(m) * inter;  // gate, up, then down
          moe_bench::row_max_bytes(scale, out, in / 32, ref, stream);
          w.scale_max = TensorView{ref, DType::kU8, {out}, Device::kCuda};
        }
        (m == 0 ? gate : m == 1 ? up : down).push_back(w);
      }
    }
  }
  ops::ExpertWeights all() const { return {routed, true, gate.data(), up.data(), down.data()}; }
  ops::ExpertWeights routed_only() const { return {routed, false, gate.data(), up.data(), down.data()}; }
  ops::ExpertWeights shared_as_group() const {  // the shared expert as a one-expert layer
    return {1, false, gate.data() + routed, up.data() + routed, down.data() + routed};
  }
};

// top_k distinct experts per token, uniformly at random; weights in (0, 1].
void uniform_routing(int tokens, int routed, int top_k, std::mt19937& rng, std::vector<int32_t>& ids,
                     std::vector<float>& wts) {
  std::vector<int> all(static_cast<size_t>(routed));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  ids.resize(size_t(tokens) * top_k);
  wts.resize(ids.size());
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      std::uniform_int_distribution<int> pick(j, routed - 1);
      std::swap(all[size_t(j)], all[size_t(pick(rng))]);
      ids[size_t(t) * top_k + j] = all[size_t(j)];
      wts[size_t(t) * top_k + j] = uw(rng);
    }
  }
}

// The shared expert run as a one-expert group: every token routed to expert 0 with weight 1.
struct SharedGroupRouting {
  Dev ids, weights;
  TensorView ids_view, weights_view;
  explicit SharedGroupRouting(int tokens)
      : ids(upload(std::vector<int32_t>(size_t(tokens), 0))), weights(upload(std::vector<float>(size_t(tokens), 1.0f))),
        ids_view{ids.as<void>(), DType::kI32, {tokens, 1}, Device::kCuda},
        weights_view{weights.as<void>(), DType::kF32, {tokens, 1}, Device::kCuda} {}
};

// A twin of the block's inputs (its own x, router weights, ids, output and workspace), for the
// M3_BENCH_WARM_CODE diagnostics: the same kernels run on it leave their code, not the block's
// data, in L2.
struct TwinBlock {
  Dev x, rw, rb, ids, wts, out, ws;
  TensorView xv, ov, rwv, rbv, iv, wv;
  TwinBlock(int t, int hidden, int routed, int top_k, size_t ws_bytes, cudaStream_t stream)
      : x(size_t(t) * hidden * 4), rw(size_t(routed) * hidden * 4), rb(size_t(routed) * 4), ids(size_t(t) * top_k * 4),
        wts(size_t(t) * top_k * 4), out(size_t(t) * hidden * 4), ws(ws_bytes),
        xv{x.as<void>(), DType::kF32, {t, hidden}, Device::kCuda},
        ov{out.as<void>(), DType::kF32, {t, hidden}, Device::kCuda},
        rwv{rw.as<void>(), DType::kF32, {routed, hidden}, Device::kCuda},
        rbv{rb.as<void>(), DType::kF32, {routed}, Device::kCuda},
        iv{ids.as<void>(), DType::kI32, {t, top_k}, Device::kCuda},
        wv{wts.as<void>(), DType::kF32, {t, top_k}, Device::kCuda} {
    moe_bench::fill_f32(x.as<float>(), size_t(t) * hidden, 1.0f, 31, stream);
    moe_bench::fill_f32(rw.as<float>(), size_t(routed) * hidden, 0.02f, 32, stream);
    moe_bench::fill_f32(rb.as<float>(), size_t(routed), 0.01f, 33, stream);
  }
};

int experts_touched(const std::vector<int32_t>& ids) { return int(std::set<int32_t>(ids.begin(), ids.end()).size()); }

std::string entries_of(ops::DispatchStats& st) {
  std::string out;
  for (const auto& p : st.take_step_paths()) out += (out.empty() ? "" : " ") + p;
  return out;
}

int run(int argc, char** argv) {
  std::vector<int> tokens_list = {1, 8, 32, 128, 512, 4096, 16384};
  int iters = 20, hidden = 6144, inter = 3072, routed = 128, top_k = 4;
  bool baseline = true;
  std::string json_path = "moe_bench.json";
  std::vector<std::string> only;
  for (Options o(argc, argv); o.next();) {
    if (o.key() == "--tokens") tokens_list = parse_list(o.value());
    else if (o.key() == "--iters") iters = std::stoi(o.value());
    else if (o.key() == "--hidden") hidden = std::stoi(o.value());
    else if (o.key() == "--inter") inter = std::stoi(o.value());
    else if (o.key() == "--experts") routed = std::stoi(o.value());
    else if (o.key() == "--top-k") top_k = std::stoi(o.value());
    else if (o.key() == "--no-baseline") baseline = false;
    else if (o.key() == "--json") json_path = o.value();
    else if (o.key() == "--only") {
      std::stringstream ss(o.value());
      for (std::string p; std::getline(ss, p, ',');) only.push_back(p);
    } else o.unknown();
  }
  BenchDevice bench_device = open_bench_device();
  auto& [prop, stream, flush, copy_bw] = bench_device;
  double lt_tflops = 0;
  std::string lt_error;
  try {
    lt_tflops = cublaslt_fp8_tflops(stream);
  } catch (const std::exception& e) {
    lt_error = e.what();
    cudaGetLastError();
  }
  std::printf("device %s, %d SMs, L2 %.0f MB; copy bandwidth %.0f GB/s (read + write); cuBLASLt FP8 8192^3 %.0f TFLOP/s%s; L2 flush: %s\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy_bw / 1e9, lt_tflops,
              lt_error.empty() ? "" : (" (" + lt_error + ")").c_str(), flush_name(flush_mode()));

  LayerWeights L(routed, hidden, inter, stream);
  std::printf("layer: %d routed + 1 shared experts, hidden %d, intermediate %d, top-%d: %.2f GB of MXFP8 weights\n",
              routed, hidden, inter, top_k, L.expert_bytes * (routed + 1) / 1e9);
  ops::KernelTable table, old_table;
  cuda::register_cuda_kernels(table);  // the engine's table
  cuda::register_gemm(old_table);      // the grouped row-dot entry alone (plus router, dense_mlp)
  cuda::register_elementwise(old_table);
  ops::DispatchStats stats, old_stats;
  const ops::SwigluParams act;
  const double flops_per_row = 2.0 * 3.0 * double(hidden) * double(inter);
  std::mt19937 rng(1234);

  // Router weights and the largest activations, allocated once.
  const int max_t = *std::max_element(tokens_list.begin(), tokens_list.end());
  Dev router_w(size_t(routed) * hidden * 4), router_b(size_t(routed) * 4), xbuf(size_t(max_t) * hidden * 4),
      outbuf(size_t(max_t) * hidden * 4), out2(size_t(max_t) * hidden * 4), dids(size_t(max_t) * top_k * 4),
      dwts(size_t(max_t) * top_k * 4), rids(size_t(max_t) * top_k * 4), rwts(size_t(max_t) * top_k * 4);
  moe_bench::fill_f32(router_w.as<float>(), size_t(routed) * hidden, 0.02f, 21, stream);
  moe_bench::fill_f32(router_b.as<float>(), size_t(routed), 0.01f, 22, stream);
  moe_bench::fill_f32(xbuf.as<float>(), size_t(max_t) * hidden, 1.0f, 23, stream);
  const double router_bytes = double(routed) * hidden * 4;

  // Our W8A8 kernel on one dense expert (16384 tokens, top-1, no shared): an FP8 ceiling of ours.
  double own_dense_tflops = 0;
  {
    const int t = 16384;
    if (t <= max_t) {
      std::vector<int32_t> ids(size_t(t), 0);
      std::vector<float> w(size_t(t), 1.0f);
      Dev i1 = upload(ids), w1 = upload(w);
      const ops::ExpertWeights one = L.shared_as_group();
      Dev ws(mx::workspace_bytes(t, 1, one, hidden, mx::Path::kW8A8));
      const TensorView xv{xbuf.as<void>(), DType::kF32, {t, hidden}, Device::kCuda};
      const TensorView ov{outbuf.as<void>(), DType::kF32, {t, hidden}, Device::kCuda};
      const TensorView iv{i1.as<void>(), DType::kI32, {t, 1}, Device::kCuda};
      const TensorView wv{w1.as<void>(), DType::kF32, {t, 1}, Device::kCuda};
      mx::run(xv, iv, wv, one, act, ov, mx::Path::kW8A8, ws.as<void>(), mx::kRoute | mx::kPrep);
      const Timing tm = time_graph([&] { mx::run(xv, iv, wv, one, act, ov, mx::Path::kW8A8, ws.as<void>(), mx::kGemms); },
                                   stream, flush, std::max(3, iters / 4));
      own_dense_tflops = double(t) * flops_per_row / (tm.median_us * 1e-6) / 1e12;
    }
  }
  const double fp8_ceiling = std::max(lt_tflops, own_dense_tflops);
  std::printf("FP8 ceiling: cuBLASLt %.0f, our W8A8 on one dense expert (16384 tokens) %.0f TFLOP/s\n\n", lt_tflops,
              own_dense_tflops);

  auto want = [&](const std::string& name) {
    return only.empty() || std::any_of(only.begin(), only.end(), [&](const std::string& p) { return name.rfind(p, 0) == 0; });
  };
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%6s %-16s | %10s %9s %8s %6s %8s %6s | %-10s %s\n", "T", "what", "us", "MB_read", "GB/s", "%copy",
              "TFLOP/s", "%fp8", "target", "entries");
  auto emit = [&](int t, const std::string& what, const Timing& tm, double bytes, double flops, const std::string& target,
                  const std::string& entries) {
    const double s = tm.median_us * 1e-6;
    nlohmann::json r = {{"tokens", t},
                        {"what", what},
                        {"us", tm.median_us},
                        {"min_us", tm.min_us},
                        {"bytes", bytes},
                        {"gbps", bytes / s / 1e9},
                        {"copy_ratio", bytes / s / copy_bw},
                        {"tflops", flops / s / 1e12},
                        {"fp8_ceiling_ratio", fp8_ceiling > 0 ? flops / s / 1e12 / fp8_ceiling : 0.0},
                        {"target", target},
                        {"entries", entries}};
    // The layout the row's GEMMs ran with (moe_mxfp8::gemm_plan, as the dispatch trace prints it).
    const auto ends = [&](const char* sfx) {
      const std::string x(sfx);
      return what.size() >= x.size() && what.compare(what.size() - x.size(), x.size(), x) == 0;
    };
    if (ends("_w8a16_wgmma")) r["plan"] = mx::plan_text(mx::gemm_plan(mx::Path::kW8A16Wg, t, inter, hidden));
    else if (ends("_w8a8")) r["plan"] = mx::plan_text(mx::gemm_plan(mx::Path::kW8A8, t, inter, hidden));
    else if (ends("_w8a16")) r["plan"] = mx::plan_text(mx::gemm_plan(mx::Path::kW8A16, t, inter, hidden));
    std::printf("%6d %-16s | %10.1f %9.1f %8.0f %5.1f%% %8.1f %5.1f%% | %-10s %s\n", t, what.c_str(), tm.median_us,
                bytes / 1e6, bytes / s / 1e9, 100 * bytes / s / copy_bw, flops / s / 1e12,
                100 * r["fp8_ceiling_ratio"].get<double>(), target.c_str(), entries.c_str());
    std::fflush(stdout);
    rows.push_back(r);
    return r;
  };

  const char* tl_env = std::getenv("M3_BENCH_MOE_TIMELINE");
  const bool moe_timeline_wanted = tl_env && *tl_env == '1';
  if (moe_timeline_wanted && !cuda::moe_tl::enabled()) std::printf("%s", cuda::moe_tl::report().c_str());
  for (const int t : tokens_list) {
    std::vector<int32_t> ids;
    std::vector<float> wts;
    uniform_routing(t, routed, top_k, rng, ids, wts);
    M3_CUDA_CHECK(cudaMemcpy(dids.as<void>(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    M3_CUDA_CHECK(cudaMemcpy(dwts.as<void>(), wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
    const TensorView xv{xbuf.as<void>(), DType::kF32, {t, hidden}, Device::kCuda};
    const TensorView ov{outbuf.as<void>(), DType::kF32, {t, hidden}, Device::kCuda};
    const TensorView o2{out2.as<void>(), DType::kF32, {t, hidden}, Device::kCuda};
    const TensorView iv{dids.as<void>(), DType::kI32, {t, top_k}, Device::kCuda};
    const TensorView wv{dwts.as<void>(), DType::kF32, {t, top_k}, Device::kCuda};
    const TensorView riv{rids.as<void>(), DType::kI32, {t, top_k}, Device::kCuda};
    const TensorView rwv{rwts.as<void>(), DType::kF32, {t, top_k}, Device::kCuda};
    const TensorView rw{router_w.as<void>(), DType::kF32, {routed, hidden}, Device::kCuda};
    const TensorView rb{router_b.as<void>(), DType::kF32, {routed}, Device::kCuda};
    const ops::RouterParams rp{top_k, 2.0f, true};
    const double io = 2.0 * double(t) * hidden * 4;
    const double bytes = double(experts_touched(ids) + 1) * L.expert_bytes + io;
    const double flops = double(t) * (top_k + 1) * flops_per_row;
    const int it = t >= 4096 ? std::max(3, iters / 4) : iters;
    const ops::OpContext ctx{&table, &stats, Device::kCuda, false};
    const ops::ExpertWeights all = L.all();
    // Bytes of a router -> output row, from the experts the router itself chose (in rids).
    auto router_block_bytes = [&] {
      std::vector<int32_t> rids_host(ids.size());
      M3_CUDA_CHECK(cudaMemcpy(rids_host.data(), rids.as<void>(), rids_host.size() * 4, cudaMemcpyDeviceToHost));
      return double(experts_touched(rids_host) + 1) * L.expert_bytes + io + router_bytes;
    };

    for (mx::Path path : {mx::Path::kW8A16, mx::Path::kW8A8, mx::Path::kW8A16Wg}) {
      if (path == mx::Path::kW8A16Wg && t < 128) continue;  // the table takes it from kW8A16WgMinTokens
      const std::string pn = path == mx::Path::kW8A16 ? "w8a16" : path == mx::Path::kW8A8 ? "w8a8" : "w8a16_wgmma";
      Dev ws(mx::workspace_bytes(t, top_k, all, hidden, path));
      // Block: router -> output. Its bytes use the router's own choice of experts.
      if (want("block_" + pn)) {
        // M3_BENCH_MOE_TIMELINE=1 with a -DM3_MOE_TIMELINE=ON build: the last replay's CTA
        // timeline of the block's kernels, printed after its row (moe_timeline.cuh).
        const bool timeline = moe_timeline_wanted && t <= 64;
        if (timeline) cuda::moe_tl::reset();
        auto block_step = [&] {
          ops::moe_router(ctx, xv, rw, rb, rp, riv, rwv);
          mx::run(xv, riv, rwv, all, act, ov, path, ws.as<void>());
        };
        const Timing tb = time_graph(block_step, stream, flush, it);
        stats.take_step_paths();
        const double block_bytes = router_block_bytes();
        std::string target;
        if (t <= 512) {
          target = (block_bytes / (tb.median_us * 1e-6) / copy_bw >= 0.88 ? "MET" : "MISSED") + std::string(" >=88%");
        }
        emit(t, "block_" + pn, tb, block_bytes, flops, target, "");
        if (timeline) std::printf("%s", cuda::moe_tl::report().c_str());
        // The block again, `twin` replayed after each flush outside the timing (M3_BENCH_WARM_CODE).
        auto emit_code_warm = [&](const std::function<void()>& twin, const char* suffix) {
          const Timing tw = time_graph(block_step, stream, flush, it, twin);
          stats.take_step_paths();
          emit(t, "block_" + pn + suffix, tw, block_bytes, flops, "", "");
        };
        // M3_BENCH_WARM_CODE=1 (diagnostic, T <= 512): the same block with the router and the routing
        // run on twin buffers (their own x, router weights, ids, workspace) after each flush, so
        // that the code of the chain before the GEMMs is in L2 and none of the block's data is.
        const char* wc_env = std::getenv("M3_BENCH_WARM_CODE");
        const char warm_code = wc_env ? *wc_env : '\0';
        if (warm_code == '1' && t <= 512) {
          const TwinBlock tw2(t, hidden, routed, top_k, ws.bytes(), stream);
          const TensorView &x2v = tw2.xv, &o2v = tw2.ov, &rw2v = tw2.rwv, &rb2v = tw2.rbv, &i2v = tw2.iv, &w2v = tw2.wv;
          auto twin = [&] {
            ops::moe_router(ctx, x2v, rw2v, rb2v, rp, i2v, w2v);
            mx::run(x2v, i2v, w2v, all, act, o2v, path, tw2.ws.as<void>(), mx::kRoute | mx::kPrep);
          };
          emit_code_warm(twin, "_router_code_warm");
        }
        // M3_BENCH_WARM_CODE=3 (diagnostic, T <= 64): after each flush the whole block's kernels run
        // once on a twin (its own x, router weights and workspace; the experts' GEMMs over the routed
        // experts only, on ids disjoint from the block's own), so that every kernel's code is in L2
        // and none of the block's weights are (the shared expert is left out of the twin).
        if (warm_code == '3' && t <= 64) {
          std::vector<int32_t> own(size_t(t) * top_k);
          M3_CUDA_CHECK(cudaMemcpy(own.data(), rids.as<void>(), own.size() * 4, cudaMemcpyDeviceToHost));
          const std::set<int32_t> used(own.begin(), own.end());
          std::vector<int32_t> free_ids;
          for (int e = 0; e < routed; ++e) {
            if (!used.count(e)) free_ids.push_back(e);
          }
          if (free_ids.size() < size_t(top_k)) {
            std::printf("%6d block_%s_code_warm skipped: the block's routing leaves fewer than top_k experts free\n", t,
                        pn.c_str());
          } else {
            // Consecutive free experts per token: distinct within a token since free_ids >= top_k.
            std::vector<int32_t> tid(size_t(t) * top_k);
            for (size_t i = 0; i < tid.size(); ++i) tid[i] = free_ids[i % free_ids.size()];
            const std::vector<float> twt(tid.size(), 0.5f);
            const Dev tids = upload(tid), twts = upload(twt);
            const TwinBlock tw2(t, hidden, routed, top_k, ws.bytes(), stream);
            const TensorView &x2v = tw2.xv, &o2v = tw2.ov, &rw2v = tw2.rwv, &rb2v = tw2.rbv, &i2v = tw2.iv, &w2v = tw2.wv;
            const TensorView tiv{tids.as<void>(), DType::kI32, {t, top_k}, Device::kCuda};
            const TensorView twv{twts.as<void>(), DType::kF32, {t, top_k}, Device::kCuda};
            const ops::ExpertWeights ro = L.routed_only();
            auto twin = [&] {
              ops::moe_router(ctx, x2v, rw2v, rb2v, rp, i2v, w2v);
              mx::run(x2v, tiv, twv, ro, act, o2v, path, tw2.ws.as<void>());
            };
            emit_code_warm(twin, "_code_warm");
          }
        }
      }
      if (want("experts_" + pn)) {
        const Timing te = time_graph([&] { mx::run(xv, iv, wv, all, act, ov, path, ws.as<void>()); }, stream, flush, it);
        emit(t, "experts_" + pn, te, bytes, flops, "", "");
      }
      if (!want("gemms_" + pn)) continue;
      mx::run(xv, iv, wv, all, act, ov, path, ws.as<void>(), mx::kRoute | mx::kPrep);
      const Timing tg = time_graph([&] { mx::run(xv, iv, wv, all, act, ov, path, ws.as<void>(), mx::kGemms); }, stream,
                                   flush, it);
      std::string target;
      if (path == mx::Path::kW8A8 && t >= 4096) {
        target = (flops / (tg.median_us * 1e-6) / 1e12 >= 1000 ? "MET" : "MISSED") + std::string(" >=1000TF");
      }
      if (path == mx::Path::kW8A16 && t <= 512) {
        target = (bytes / (tg.median_us * 1e-6) / copy_bw >= 0.88 ? "MET" : "MISSED") + std::string(" >=88%");
      }
      emit(t, "gemms_" + pn, tg, bytes, flops, target, "");
      // Diagnostic: the same GEMMs over the routed experts only (the shared expert's items left
      // out), to tell whether a launch of fewer items ends sooner (bytes-bound) or not (each CTA's
      // own pace-bound): what an early start of the shared expert could gain.
      if (want("gemms_routed_" + pn) && path == mx::Path::kW8A16) {
        const ops::ExpertWeights ro = L.routed_only();
        Dev ws_ro(mx::workspace_bytes(t, top_k, ro, hidden, path));
        mx::run(xv, iv, wv, ro, act, ov, path, ws_ro.as<void>(), mx::kRoute | mx::kPrep);
        const Timing tr = time_graph([&] { mx::run(xv, iv, wv, ro, act, ov, path, ws_ro.as<void>(), mx::kGemms); },
                                     stream, flush, it);
        emit(t, "gemms_routed_" + pn, tr, double(experts_touched(ids)) * L.expert_bytes + io, double(t) * top_k * flops_per_row, "", "");
      }
    }
    // The router alone (logits + selection): its share of the block, which block - experts only
    // approximates (the block runs on the router's own, less uniform, routing).
    if (want("router")) {
      const Timing tr = time_graph([&] { ops::moe_router(ctx, xv, rw, rb, rp, riv, rwv); }, stream, flush, it);
      emit(t, "router", tr, router_bytes + double(t) * hidden * 4, 2.0 * double(t) * routed * hidden, "",
           entries_of(stats));
    }
    // The engine's table (router + experts), with batch invariance off and on (the engine's default).
    for (const bool invariant : {false, true}) {
      if (!want(invariant ? "dispatch_invariant" : "dispatch")) continue;
      const ops::OpContext dctx{&table, &stats, Device::kCuda, invariant};
      const Timing td = time_graph(
          [&] {
            ops::moe_router(dctx, xv, rw, rb, rp, riv, rwv);
            ops::moe_experts(dctx, xv, riv, rwv, all, act, ov);
          },
          stream, flush, it);
      emit(t, invariant ? "dispatch_invariant" : "dispatch", td, bytes + router_bytes, flops, "", entries_of(stats));
    }
    // Shared expert fused vs separate, on the path the table takes at this T.
    if (want("shared")) {
      const mx::Path path = t >= mx::kW8A8MinTokens ? mx::Path::kW8A8 : mx::Path::kW8A16;
      const std::string pn = path == mx::Path::kW8A16 ? "w8a16" : "w8a8";
      const ops::ExpertWeights ro = L.routed_only(), sh = L.shared_as_group();
      const SharedGroupRouting one(t);
      const TensorView &zv = one.ids_view, &onev = one.weights_view;
      Dev ws_all(mx::workspace_bytes(t, top_k, all, hidden, path)), ws_ro(mx::workspace_bytes(t, top_k, ro, hidden, path)),
          ws_sh(mx::workspace_bytes(t, 1, sh, hidden, path));
      const Timing tf = time_graph([&] { mx::run(xv, iv, wv, all, act, ov, path, ws_all.as<void>()); }, stream, flush, it);
      const Timing ts = time_graph(
          [&] {
            mx::run(xv, iv, wv, ro, act, ov, path, ws_ro.as<void>());
            mx::run(xv, zv, onev, sh, act, o2, path, ws_sh.as<void>());
            ops::add(ctx, ov, o2);
          },
          stream, flush, it);
      const Timing tm = time_graph(
          [&] {
            mx::run(xv, iv, wv, ro, act, ov, path, ws_ro.as<void>());
            ops::dense_mlp(ctx, xv, L.gate[size_t(routed)], L.up[size_t(routed)], L.down[size_t(routed)], act, o2);
            ops::add(ctx, ov, o2);
          },
          stream, flush, t >= 4096 ? 3 : it);
      const std::string mlp_entries = entries_of(stats);
      const bool faster = tf.median_us < ts.median_us && tf.median_us < tm.median_us;
      emit(t, "shared_fused_" + pn, tf, bytes, flops, faster ? "MET fused<sep" : "MISSED fused<sep", "");
      emit(t, "shared_sep_" + pn, ts, bytes, flops, "", "routed + shared as a 1-expert group + add");
      emit(t, "shared_sep_mlp", tm, bytes, flops, "", mlp_entries);
    }
    // The shared expert on a side stream beside the router and the routed experts (the other way
    // to read its bytes while the router runs), against the fused block above: the router, then
    // the routed experts, on one stream; the shared expert as a one-expert group on another,
    // forked before the router; joined, then added. (docs/moe_kernels.md, thirty-ninth session.)
    if (want("shared_side") && t < mx::kW8A8MinTokens) {
      const mx::Path path = mx::Path::kW8A16;
      const ops::ExpertWeights ro = L.routed_only(), sh = L.shared_as_group();
      const SharedGroupRouting one(t);
      const TensorView &zv = one.ids_view, &onev = one.weights_view;
      Dev ws_ro(mx::workspace_bytes(t, top_k, ro, hidden, path)), ws_sh(mx::workspace_bytes(t, 1, sh, hidden, path));
      cudaStream_t side = nullptr, main_s = nullptr;
      M3_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
      M3_CUDA_CHECK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
      cudaEvent_t ev_fork, ev_side, ev_main;
      for (cudaEvent_t* e : {&ev_fork, &ev_side, &ev_main}) M3_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
      const Timing ts = time_graph(
          [&] {
            M3_CUDA_CHECK(cudaEventRecord(ev_fork, stream));
            M3_CUDA_CHECK(cudaStreamWaitEvent(side, ev_fork, 0));
            M3_CUDA_CHECK(cudaStreamWaitEvent(main_s, ev_fork, 0));
            cuda::set_current_stream(side);
            mx::run(xv, zv, onev, sh, act, o2, path, ws_sh.as<void>());
            M3_CUDA_CHECK(cudaEventRecord(ev_side, side));
            cuda::set_current_stream(main_s);
            ops::moe_router(ctx, xv, rw, rb, rp, riv, rwv);
            mx::run(xv, riv, rwv, ro, act, ov, path, ws_ro.as<void>());
            M3_CUDA_CHECK(cudaEventRecord(ev_main, main_s));
            cuda::set_current_stream(stream);
            M3_CUDA_CHECK(cudaStreamWaitEvent(stream, ev_side, 0));
            M3_CUDA_CHECK(cudaStreamWaitEvent(stream, ev_main, 0));
            ops::add(ctx, ov, o2);
          },
          stream, flush, it);
      stats.take_step_paths();
      const double block_bytes = router_block_bytes();
      emit(t, "shared_side_w8a16", ts, block_bytes, flops, "", "router + routed | shared on a side stream, + add");
      for (cudaEvent_t e : {ev_fork, ev_side, ev_main}) cudaEventDestroy(e);
      cudaStreamDestroy(side);
      cudaStreamDestroy(main_s);
    }
    // The existing grouped row-dot entry (experts alone).
    if (baseline && want("rowdot")) {
      const ops::OpContext octx{&old_table, &old_stats, Device::kCuda, true};
      const Timing tr = time_graph([&] { ops::moe_experts(octx, xv, iv, wv, all, act, ov); }, stream, flush,
                                   t >= 4096 ? 2 : std::max(3, iters / 2));
      emit(t, "rowdot", tr, bytes, flops, "", entries_of(old_stats));
    }
  }
  nlohmann::json doc = {{"device", prop.name},
                        {"sms", prop.multiProcessorCount},
                        {"copy_bandwidth_gbps", copy_bw / 1e9},
                        {"cublaslt_fp8_tflops", lt_tflops},
                        {"cublaslt_error", lt_error},
                        {"own_w8a8_dense_tflops", own_dense_tflops},
                        {"shapes", {{"hidden", hidden}, {"inter", inter}, {"routed", routed}, {"shared", 1}, {"top_k", top_k}}},
                        {"timing", "median GPU time of a CUDA graph replay (events), L2 flushed before each (see l2_flush)"},
                        {"rows", rows}};
  finish_bench(json_path, doc, bench_device);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return m3::gpu_bench::bench_main("moe_bench", run, argc, argv); }
