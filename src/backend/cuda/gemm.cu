// GEMM-based entries: linear and the dense SwiGLU-OAI MLP (the MoE router and experts are in
// moe.cu). Batch-invariant entries use the tensor-core GEMM of linear_mma.cu for BF16 / MXFP8
// weights of layer size, else the tiled row-dot kernels of rowdot.cuh (F32, BF16 or MXFP8
// weights); both fix each output's reduction order. The others use cuBLAS (F32: SGEMM with
// pedantic math, no TF32; BF16 weights: activations split into bf16 hi + lo, two tensor-core
// GEMMs accumulating in fp32). Everything runs on current_stream() with no host
// synchronisation, so a decode step can be captured into a CUDA graph.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/linear_mma.h"
#include "backend/cuda/rowdot.cuh"

namespace m3::cuda {
namespace {

using rowdot::WType;

void check_cublas(cublasStatus_t st, const char* what, int line) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLAS error in ") + what + " at gemm.cu:" + std::to_string(line) + ": " +
                             cublasGetStatusString(st));
  }
}
#define M3_CUBLAS_CHECK(call) check_cublas((call), #call, __LINE__)

bool stream_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    cudaGetLastError();
    return true;  // e.g. the legacy stream while another stream captures: treat as capturing
  }
  return st != cudaStreamCaptureStatusNone;
}

// One cuBLAS handle per (host thread, device), bound to current_stream() on every call, with a
// user workspace per stream so cuBLAS never allocates inside graph capture. Handle and
// workspace are created on first use on that stream, which must happen outside capture (the
// engine runs an eager step before capturing).
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

cublasHandle_t cublas_handle() {
  struct PerDevice {
    cublasHandle_t h = nullptr;
    std::map<cudaStream_t, void*> workspace;
  };
  struct Holder {
    std::map<int, PerDevice> devices;
    ~Holder() {
      for (auto& [dev, d] : devices) {
        for (auto& [s, p] : d.workspace) cudaFree(p);
        if (d.h) cublasDestroy(d.h);
      }
    }
  };
  thread_local Holder holder;
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  PerDevice& d = holder.devices[device];
  const cudaStream_t stream = current_stream();
  auto it = d.workspace.find(stream);
  if (!d.h || it == d.workspace.end()) {
    if (stream_capturing(stream)) {
      throw std::runtime_error(
          "gemm.cu: first cuBLAS use on this stream happens inside CUDA graph capture; run one eager step on the "
          "stream before capturing (the cuBLAS handle and workspace are allocated then)");
    }
    if (!d.h) M3_CUBLAS_CHECK(cublasCreate(&d.h));
    void* ws = nullptr;
    M3_CUDA_CHECK(cudaMalloc(&ws, kCublasWorkspaceBytes));
    it = d.workspace.emplace(stream, ws).first;
  }
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the workspace comes second.
  M3_CUBLAS_CHECK(cublasSetStream(d.h, stream));
  M3_CUBLAS_CHECK(cublasSetWorkspace(d.h, it->second, kCublasWorkspaceBytes));
  return d.h;
}

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

__global__ void split_bf16_kernel(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
  hi[i] = h;
  lo[i] = __float2bfloat16_rn(x[i] - __bfloat162float(h));
}

// ops::swiglu_oai on device, in place into g (the cuBLAS dense MLP).
__global__ void swiglu_oai_kernel(float* g, const float* u, int64_t n, rowdot::Act p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  g[i] = rowdot::swiglu(g[i], u[i], p);
}

// y[r, c] = sum over splits s, ascending, of partial[s][r][c]; fused: swiglu of the gate sum
// (column c) and the up sum (column n + c).
__global__ void splitk_reduce_kernel(const float* partial, int splits, int rows, int n, bool fused, float* y,
                                     int64_t ldy, rowdot::Act act) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * n) return;
  const int64_t r = i / n, c = i % n;
  const int64_t pw = fused ? 2 * int64_t(n) : int64_t(n), stride = int64_t(rows) * pw;
  const float* p = partial + r * pw + c;
  float g = p[0];
  for (int s = 1; s < splits; ++s) g = __fadd_rn(g, p[s * stride]);
  if (!fused) {
    y[r * ldy + c] = g;
    return;
  }
  float u = p[n];
  for (int s = 1; s < splits; ++s) u = __fadd_rn(u, p[n + s * stride]);
  y[r * ldy + c] = rowdot::swiglu(g, u, act);
}

template <WType WT, bool kFused>
void launch_direct_t(bool vec, dim3 grid, const rowdot::DirectArgs& a) {
  if (vec) rowdot::rowdot_direct_kernel<WT, kFused, true><<<grid, rowdot::kThreads, 0, current_stream()>>>(a);
  else rowdot::rowdot_direct_kernel<WT, kFused, false><<<grid, rowdot::kThreads, 0, current_stream()>>>(a);
}

template <bool kFused>
void launch_direct(WType wt, bool vec, dim3 grid, const rowdot::DirectArgs& a) {
  switch (wt) {
    case WType::kF32: launch_direct_t<WType::kF32, kFused>(vec, grid, a); break;
    case WType::kBF16: launch_direct_t<WType::kBF16, kFused>(vec, grid, a); break;
    case WType::kFP8: launch_direct_t<WType::kFP8, kFused>(vec, grid, a); break;
  }
  M3_CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int vec_elems(WType wt) { return wt == WType::kF32 ? 4 : wt == WType::kBF16 ? 8 : 16; }

// The K split: a function of (n, k, weight type, fused) only, never of the rows, so the
// reduction order of every output is fixed. Splits only when the columns alone give too few
// warps (e.g. the router: 128 columns of 6144), keeping >= 2 chunk steps per split.
struct KSplit {
  int splits, kseg;
};
KSplit choose_split(int64_t n, int64_t k, WType wt, bool fused) {
  const int64_t step = 32 * int64_t(vec_elems(wt));
  const int64_t steps = std::max<int64_t>(1, (k + step - 1) / step);
  const int64_t warps = fused ? n : (n + 1) / 2;
  int64_t s = 1;
  while (s < 64 && warps * s * 2 <= 4096 && (steps + 2 * s - 1) / (2 * s) >= 2) s *= 2;
  const int64_t kseg = (steps + s - 1) / s * step;
  return {int(std::max<int64_t>(1, (k + kseg - 1) / kseg)), int(kseg)};
}

// The row-dot on the direct problem: y = x W0^T (plain) or swiglu(x W0^T, x W1^T) (fused).
void rowdot_run(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& w0, const ops::LinearWeight* w1,
                const ops::SwigluParams& act, float* y, int64_t ldy) {
  const int64_t n = w0.out_features(), k = w0.in_features();
  if (m == 0 || n == 0) return;
  const bool fused = w1 != nullptr;
  for (const ops::LinearWeight* w : {&w0, w1}) {
    if (!w) continue;
    const std::string why = rowdot_weight_problem(*w);
    if (!why.empty()) throw std::runtime_error("rowdot.sm90: " + why);
  }
  if (fused && (w1->data.dtype != w0.data.dtype || !(w1->data.shape == w0.data.shape))) {
    throw std::runtime_error("rowdot.sm90: gate and up weights must have the same dtype and shape");
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || ldx < k) {
    throw std::runtime_error("rowdot.sm90: problem too large or x row stride < in_features");
  }
  const WType wt = rowdot_wtype(w0.data.dtype);
  const int64_t wbytes = int64_t(dtype_size_bytes(w0.data.dtype));
  const bool vec = aligned16(x) && ldx % 4 == 0 && aligned16(w0.data.data) && (!fused || aligned16(w1->data.data)) &&
                   (k * wbytes) % 16 == 0;
  const KSplit split = choose_split(n, k, wt, fused);
  const int64_t cols_per_cta = int64_t(rowdot::kWarps) * (fused ? 1 : 2);
  const int64_t col_tiles = (n + cols_per_cta - 1) / cols_per_cta;
  if (col_tiles > 65535) throw std::runtime_error("rowdot.sm90: too many output columns");
  const dim3 grid(unsigned((m + rowdot::kRowsPerItem - 1) / rowdot::kRowsPerItem), unsigned(col_tiles),
                  unsigned(split.splits));
  rowdot::DirectArgs a{};
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.m0 = rowdot::Mat{w0.data.data, w0.scale.as<const uint8_t>()};
  a.m1 = fused ? rowdot::Mat{w1->data.data, w1->scale.as<const uint8_t>()} : a.m0;
  a.n = int(n);
  a.k = int(k);
  a.rows = int(m);
  a.kseg = split.kseg;
  a.partial = nullptr;
  a.act = rowdot_act(act);
  if (split.splits == 1) {
    fused ? launch_direct<true>(wt, vec, grid, a) : launch_direct<false>(wt, vec, grid, a);
    return;
  }
  const int64_t pw = fused ? 2 * n : n;
  Scratch partial(size_t(split.splits) * size_t(m) * size_t(pw) * 4);
  a.partial = partial.as<float>();
  fused ? launch_direct<true>(wt, vec, grid, a) : launch_direct<false>(wt, vec, grid, a);
  splitk_reduce_kernel<<<blocks_for(m * n, 256), 256, 0, current_stream()>>>(a.partial, split.splits, int(m), int(n),
                                                                              fused, y, ldy, a.act);
  M3_CUDA_CHECK_LAUNCH();
}

std::string need_device(const ops::Problem& p) {
  return p.device == Device::kCuda ? "" : "tensors are not in device memory";
}

// F32 / BF16 / MXFP8 device weights (Problem::dtype is the weight dtype, k the in features).
std::string need_rowdot_weight(const ops::Problem& p) {
  std::string why = need_device(p);
  if (!why.empty()) return why;
  if (p.dtype == DType::kF32 || p.dtype == DType::kBF16) return "";
  if (p.dtype == DType::kF8E4M3) return p.k % 32 == 0 ? "" : "MXFP8 weights need in_features % 32 == 0";
  return "F32, BF16 or MXFP8 (F8E4M3 + e8m0 scale) device weights, got " + std::string(dtype_name(p.dtype));
}

// The row-dot entries: when invariance is asked for, and always for MXFP8 (no cuBLAS path).
std::string need_rowdot(const ops::Problem& p) {
  std::string why = need_rowdot_weight(p);
  if (!why.empty()) return why;
  if (!p.batch_invariant && p.dtype != DType::kF8E4M3) {
    return "batch invariance not requested and the weight is F32/BF16 (the cuBLAS entry is faster)";
  }
  return "";
}

// The tensor-core invariant entries: where the row-dot would run, for BF16 / MXFP8 weights of
// layer-sized K (linear: N x K; dense MLP: gate/up inter x hidden and down hidden x inter).
std::string need_mma(const ops::Problem& p) {
  std::string why = need_rowdot(p);
  if (!why.empty()) return why;
  return mma_linear_eligible(p.dtype, p.n, p.k);
}
std::string need_mma_mlp(const ops::Problem& p) {
  std::string why = need_mma(p);
  if (!why.empty()) return why;
  why = mma_linear_eligible(p.dtype, p.k, p.n);
  return why.empty() ? "" : "down projection: " + why;
}

// The wgmma form of the invariant linear: MXFP8 or BF16 weights (BF16: the LM head), prefill-sized
// calls or wide weights at decode batches (the plan decides), on top of the mma.sync entry's own
// conditions.
std::string wg_only(const ops::Problem& p, std::string why, const MmaLinearRule& rule = {}) {
  if (!why.empty()) return why;
  if (p.dtype != DType::kF8E4M3 && p.dtype != DType::kBF16) return "MXFP8 or BF16 weights only";
  if (mma_linear_plan(p.m, p.n, p.k, p.dtype, true, rule).kernel != MmaLinearKernel::kWgmma) {
    std::string r = "fewer than " + std::to_string(rule.wgmma_min_rows) + " rows";
    const int64_t wide_min = p.dtype == DType::kBF16 ? rule.wgmma_bf16_wide_min_rows : rule.wgmma_wide_min_rows;
    if (wide_min < rule.wgmma_min_rows)
      r += ", or than " + std::to_string(wide_min) + " with >= " + std::to_string(rule.wgmma_wide_n) + " outputs";
    return r + " (mma.sync tiles)";
  }
  return "";
}
// Groups of weights (p.n: their outputs summed): where the wide weight would take wgmma alone and
// the group not, separate calls are faster (MmaLinearRule::group_separate_min_rows).
std::string need_mma_group(const ops::Problem& p) {
  std::string why = need_mma(p);
  if (!why.empty()) return why;
  const MmaLinearRule rule;
  if (p.dtype == DType::kF8E4M3 && p.n >= rule.wgmma_wide_n && p.m >= rule.group_separate_min_rows &&
      p.m < rule.wgmma_min_rows) {
    return std::to_string(rule.group_separate_min_rows) + ".." + std::to_string(rule.wgmma_min_rows - 1) +
           " rows with >= " + std::to_string(rule.wgmma_wide_n) +
           " outputs in all: separate calls (the wide weight on wgmma) are faster";
  }
  return "";
}
std::string need_wg(const ops::Problem& p) { return wg_only(p, need_mma(p)); }
std::string need_wg_group(const ops::Problem& p) { return wg_only(p, need_mma_group(p), mma_group_rule()); }
std::string need_wg_mlp(const ops::Problem& p) { return wg_only(p, need_mma_mlp(p)); }

// The dispatch trace's plan of the tensor-core entries (the kernel, its tiles, the K split).
template <bool kWg>
std::string plan_linear(const ops::Problem& p) {
  return mma_linear_plan_text(mma_linear_plan(p.m, p.n, p.k, p.dtype, kWg));
}
// A group's problem carries the summed outputs: the kernel and token tile are the group's, the
// K split each weight's own.
template <bool kWg>
std::string plan_group(const ops::Problem& p) {
  const MmaLinearPlan plan = mma_linear_plan(p.m, p.n, p.k, p.dtype, kWg, mma_group_rule());
  return mma_linear_tile_text(plan) + " for each of " + std::to_string(p.extra) + " weights (K split per weight as linear" +
         (plan.ctas_per_sm > 0 ? "; CTAs per SM by the launch's sum" : "") + ")";
}
// Gate and up run in one launch: its CTAs per SM follow their sum.
template <bool kWg>
std::string plan_mlp(const ops::Problem& p) {
  MmaLinearPlan gate_up = mma_linear_plan(p.m, p.n, p.k, p.dtype, kWg);
  if (gate_up.ctas_per_sm > 0) {
    gate_up.ctas_per_sm = narrow_ctas_per_sm(2 * gate_up.grid_x * gate_up.grid_y * gate_up.grid_z, MmaLinearRule{}.narrow_ctas_per_sm);
  }
  return "gate, up: " + mma_linear_plan_text(gate_up) + " (one launch)" +
         "; down: " + mma_linear_plan_text(mma_linear_plan(p.m, p.k, p.n, p.dtype, kWg));
}

std::string need_cublas_weight(const ops::Problem& p) {
  std::string why = need_device(p);
  if (!why.empty()) return why;
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
    return "F32 or BF16 device weights (MXFP8 runs on the row-dot entry), got " + std::string(dtype_name(p.dtype));
  }
  return "";
}

std::string need_cublas_f32(const ops::Problem& p) {
  std::string why = need_cublas_weight(p);
  if (!why.empty()) return why;
  return p.dtype == DType::kF32 ? "" : "F32 weights only";
}

std::string need_cublas_bf16(const ops::Problem& p) {
  std::string why = need_cublas_weight(p);
  if (!why.empty()) return why;
  return p.dtype == DType::kBF16 ? "" : "BF16 weights only";
}

void check_rows(const TensorView& x, int64_t in, const char* what) {
  if (x.shape.rank() != 2 || x.shape[1] != in) {
    throw std::runtime_error(std::string(what) + ": activation shape " + x.shape.str() + " does not match in_features " +
                             std::to_string(in));
  }
}

void linear_rowdot(const TensorView& x, const ops::LinearWeight& w, const TensorView& y) {
  check_rows(x, w.in_features(), "linear.rowdot_invariant.sm90");
  rowdot_linear(x.as<const float>(), x.shape[1], x.shape[0], w, y.as<float>(), w.out_features());
}

template <bool kWg>
void linear_mma(const TensorView& x, const ops::LinearWeight& w, const TensorView& y) {
  check_rows(x, w.in_features(), kWg ? "linear.wgmma_hilo_invariant.sm90" : "linear.mma_hilo_invariant.sm90");
  mma_linear(x.as<const float>(), x.shape[1], x.shape[0], w, y.as<float>(), w.out_features(), kWg);
}

template <bool kWg>
void linear_group_mma(const TensorView& x, const ops::LinearWeight* const* w, const TensorView* y, int count) {
  std::vector<float*> ys(static_cast<size_t>(count));
  std::vector<int64_t> ldy(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    check_rows(x, w[i]->in_features(), "linear_group.mma_hilo_invariant.sm90");
    if (y[i].shape.rank() != 2 || y[i].shape[0] != x.shape[0] || y[i].shape[1] != w[i]->out_features()) {
      throw std::runtime_error("linear_group.mma_hilo_invariant.sm90: output " + std::to_string(i) + " shape " +
                               y[i].shape.str() + " does not match [" + std::to_string(x.shape[0]) + ", " +
                               std::to_string(w[i]->out_features()) + "]");
    }
    ys[size_t(i)] = y[i].as<float>();
    ldy[size_t(i)] = w[i]->out_features();
  }
  mma_linear_group(x.as<const float>(), x.shape[1], x.shape[0], w, ys.data(), ldy.data(), count, kWg, mma_group_rule());
}

void linear_cublas(const TensorView& x, const ops::LinearWeight& w, const TensorView& y) {
  check_rows(x, w.in_features(), "linear.cublas.sm90");
  gemm_xwt(x.as<const float>(), x.shape[0], w, y.as<float>(), false);
}

// The shape checks the invariant dense-MLP entries share: x rows of gate's in_features, down
// taking the intermediate size.
void check_mlp(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& down, const char* entry) {
  check_rows(x, gate.in_features(), entry);
  if (down.in_features() != gate.out_features()) {
    throw std::runtime_error(std::string(entry) + ": down in_features != intermediate");
  }
}

void dense_mlp_rowdot(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                      const ops::LinearWeight& down, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t m = x.shape[0], inter = gate.out_features();
  check_mlp(x, gate, down, "dense_mlp.rowdot_invariant_swiglu_oai.sm90");
  if (m == 0) return;
  const int64_t ldh = (inter + 3) / 4 * 4;  // 16-byte rows for the down projection's vector loads
  Scratch h(size_t(m * ldh) * 4);
  rowdot_swiglu(x.as<const float>(), x.shape[1], m, gate, up, act, h.as<float>(), ldh);
  rowdot_linear(h.as<const float>(), ldh, m, down, out.as<float>(), down.out_features());
}

template <bool kWg>
void dense_mlp_mma(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                   const ops::LinearWeight& down, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t m = x.shape[0], inter = gate.out_features();
  check_mlp(x, gate, down,
            kWg ? "dense_mlp.wgmma_hilo_invariant_swiglu_oai.sm90" : "dense_mlp.mma_hilo_invariant_swiglu_oai.sm90");
  if (m == 0) return;
  Scratch g(size_t(m * inter) * 4), u(size_t(m * inter) * 4);
  const ops::LinearWeight* gate_up[2] = {&gate, &up};
  float* gu[2] = {g.as<float>(), u.as<float>()};
  const int64_t ld[2] = {inter, inter};
  mma_linear_group(x.as<const float>(), x.shape[1], m, gate_up, gu, ld, 2, kWg);
  swiglu_oai_kernel<<<blocks_for(m * inter, 256), 256, 0, current_stream()>>>(g.as<float>(), u.as<const float>(),
                                                                               m * inter, rowdot_act(act));
  M3_CUDA_CHECK_LAUNCH();
  mma_linear(g.as<const float>(), inter, m, down, out.as<float>(), down.out_features(), kWg);
}

void dense_mlp_cublas(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                      const ops::LinearWeight& down, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t m = x.shape[0], inter = gate.out_features();
  if (m == 0) return;
  Scratch g(size_t(m * inter) * 4), u(size_t(m * inter) * 4);
  gemm_xwt(x.as<const float>(), m, gate, g.as<float>(), false);
  gemm_xwt(x.as<const float>(), m, up, u.as<float>(), false);
  swiglu_oai_kernel<<<blocks_for(m * inter, 256), 256, 0, current_stream()>>>(g.as<float>(), u.as<const float>(),
                                                                               m * inter, rowdot_act(act));
  M3_CUDA_CHECK_LAUNCH();
  gemm_xwt(g.as<const float>(), m, down, out.as<float>(), false);
}

}  // namespace

void rowdot_linear(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& w, float* y, int64_t ldy) {
  rowdot_run(x, ldx, m, w, nullptr, ops::SwigluParams{}, y, ldy);
}

void rowdot_swiglu(const float* x, int64_t ldx, int64_t m, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                   const ops::SwigluParams& act, float* h, int64_t ldh) {
  rowdot_run(x, ldx, m, gate, &up, act, h, ldh);
}

void gemm_xwt(const float* x, int64_t m, const ops::LinearWeight& w, float* y, bool invariant) {
  const int64_t n = w.out_features(), k = w.in_features();
  if (m == 0 || n == 0) return;
  if (invariant || w.data.dtype == DType::kF8E4M3) {
    rowdot_linear(x, k, m, w, y, n);
    return;
  }
  if (w.data.dtype != DType::kF32 && w.data.dtype != DType::kBF16) {
    throw std::runtime_error("gemm_xwt.sm90: weight dtype " + std::string(dtype_name(w.data.dtype)));
  }
  // Row-major y[m,n] = x[m,k] w[n,k]^T is column-major y^T = w x^T: (op T on w) x (op N on x).
  cublasHandle_t h = cublas_handle();
  const float one = 1.0f, zero = 0.0f;
  if (w.data.dtype == DType::kF32) {
    M3_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
    M3_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, w.data.as<const float>(),
                                int(k), x, int(k), &zero, y, int(n)));
    return;
  }
  Scratch hi(size_t(m * k) * 2), lo(size_t(m * k) * 2);
  split_bf16_kernel<<<blocks_for(m * k, 256), 256, 0, current_stream()>>>(x, hi.as<__nv_bfloat16>(),
                                                                           lo.as<__nv_bfloat16>(), m * k);
  M3_CUDA_CHECK_LAUNCH();
  M3_CUBLAS_CHECK(cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  const float* betas[2] = {&zero, &one};
  const void* parts[2] = {hi.as<const void>(), lo.as<const void>()};
  for (int p = 0; p < 2; ++p) {
    M3_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, w.data.data, CUDA_R_16BF,
                                 int(k), parts[p], CUDA_R_16BF, int(k), betas[p], y, CUDA_R_32F, int(n),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void register_gemm(ops::KernelTable& table) {
  table.linear.add({"linear.wgmma_hilo_invariant.sm90",
                    "as linear.mma_hilo_invariant.sm90 (same bits) for MXFP8 and BF16 weights (BF16: the overlapped form) and calls of > 256 rows "
                    "(prefill chunks), or of >= 96 rows (BF16: 64) for weights of >= 4096 outputs (decode batches; not in "
                    "groups of weights): wgmma m64n128k16 with the weights as A from registers, the x pieces in the "
                    "mma.sync fragments' k order, the next stage's weight fragments built under the current "
                    "stage's wgmmas, persistent CTAs with a producer warpgroup",
                    need_wg, linear_mma<true>, plan_linear<true>});
  table.linear.add({"linear.mma_hilo_invariant.sm90",
                    "device BF16 or MXFP8 weight, in_features >= 1024 (MXFP8: % 128, BF16: % 64); taken where the "
                    "row-dot would be (batch invariance requested, or MXFP8): x split into hi + lo pieces (bf16, or f16 "
                    "with a power of two per row), mma.sync m16n8k16 with fp32 accumulation, weights as A (e4m3 -> f16 "
                    "exact, block scale folded in), fixed K segments (a function of N and K) added in order; no host "
                    "sync",
                    need_mma, linear_mma<false>, plan_linear<false>});
  table.linear_group.add({"linear_group.wgmma_hilo_invariant.sm90",
                          "as linear.wgmma_hilo_invariant.sm90 for each weight, one x split",
                          need_wg_group, linear_group_mma<true>, plan_group<true>});
  table.linear_group.add({"linear_group.mma_hilo_invariant.sm90",
                          "as linear.mma_hilo_invariant.sm90 for each weight (same bits as separate calls), one x "
                          "split and one launch for the group's narrow-tile GEMMs (up to 6; decode batches), so "
                          "small projections stream back to back; where not eligible (also 192-256 rows with a "
                          "wide weight) each weight takes the linear table",
                          need_mma_group, linear_group_mma<false>, plan_group<false>});
  table.linear.add({"linear.rowdot_invariant.sm90",
                    "device F32/BF16/MXFP8 weight (MXFP8: in % 32 == 0, U8 e8m0 scale [out, in/32]); taken when batch "
                    "invariance is requested, and always for MXFP8: tiled warp row-dot (2 weight rows per warp, 16-byte "
                    "loads, rows in tiles of 8/4/2/1), fixed per-output fp32 order, in-register MXFP8 dequant (W8A32), "
                    "fixed K split for narrow outputs; no host sync",
                    need_rowdot, linear_rowdot});
  table.linear.add({"linear.cublas_sgemm.sm90", "device F32 weight: cuBLAS SGEMM, pedantic math (no TF32)",
                    need_cublas_f32, linear_cublas});
  table.linear.add({"linear.cublas_bf16_hilo.sm90",
                    "device BF16 weight: F32 activations split into bf16 hi+lo, two cuBLAS BF16 GEMMs, fp32 accumulate",
                    need_cublas_bf16, linear_cublas});
  table.mlp.add({"dense_mlp.wgmma_hilo_invariant_swiglu_oai.sm90",
                 "as dense_mlp.mma_hilo_invariant_swiglu_oai.sm90 (same bits) with its projections on "
                 "linear.wgmma_hilo_invariant.sm90",
                 need_wg_mlp, dense_mlp_mma<true>, plan_mlp<true>});
  table.mlp.add({"dense_mlp.mma_hilo_invariant_swiglu_oai.sm90",
                 "as linear.mma_hilo_invariant.sm90 for gate, up (x split once) and down, swiglu_oai between them "
                 "in fp32",
                 need_mma_mlp, dense_mlp_mma<false>, plan_mlp<false>});
  table.mlp.add({"dense_mlp.rowdot_invariant_swiglu_oai.sm90",
                 "device F32/BF16/MXFP8 weights (gate and up one dtype); taken when batch invariance is requested, and "
                 "always for MXFP8: fused gate+up row-dot writing swiglu_oai, then the down row-dot; no host sync",
                 need_rowdot, dense_mlp_rowdot});
  table.mlp.add({"dense_mlp.cublas_swiglu_oai.sm90",
                 "device F32 (SGEMM, pedantic) or BF16 (hi+lo BF16 GEMMs, fp32 accumulate) weights",
                 need_cublas_weight, dense_mlp_cublas});
  register_moe(table);
}

}  // namespace m3::cuda
