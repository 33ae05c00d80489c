// GEMM-based entries: linear, dense SwiGLU-OAI MLP, sigmoid router and MoE experts.
// Batch-invariant entries use one fixed-order warp reduction per output element; the others
// use cuBLAS (F32: SGEMM with pedantic math, no TF32; BF16 weights: activations split into
// bf16 hi + lo, two tensor-core GEMMs accumulating in fp32).
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_internal.h"

namespace m3::cuda {
namespace {

void check_cublas(cublasStatus_t st, const char* what, int line) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLAS error in ") + what + " at gemm.cu:" + std::to_string(line) + ": " +
                             cublasGetStatusString(st));
  }
}
#define M3_CUBLAS_CHECK(call) check_cublas((call), #call, __LINE__)

// One handle per host thread (the kernel-entry interface carries no backend state), on the
// legacy default stream like every other launch here.
cublasHandle_t cublas_handle() {
  struct Holder {
    cublasHandle_t h = nullptr;
    ~Holder() {
      if (h) cublasDestroy(h);
    }
  };
  thread_local Holder holder;
  if (!holder.h) M3_CUBLAS_CHECK(cublasCreate(&holder.h));
  return holder.h;
}

__device__ __forceinline__ float load_w(const float* w, int64_t i) { return w[i]; }
__device__ __forceinline__ float load_w(const uint16_t* w, int64_t i) { return __uint_as_float(uint32_t(w[i]) << 16); }

// y[r, n] = sum_k x[r, k] w[n, k]: one warp per output, lanes strided over k, then a fixed
// xor-shuffle tree. Nothing depends on the row count, so results are batch-invariant.
template <class W>
__global__ void rowdot_kernel(const float* x, const W* w, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t out = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (out >= m * n) return;
  const int64_t r = out / n, c = out % n;
  const float* xr = x + r * k;
  const int64_t wrow = c * k;
  float sum = 0.0f;
  for (int64_t i = lane; i < k; i += 32) sum += xr[i] * load_w(w, wrow + i);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) y[out] = sum;
}

__global__ void split_bf16_kernel(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
  hi[i] = h;
  lo[i] = __float2bfloat16_rn(x[i] - __bfloat162float(h));
}

struct Act {
  float alpha, limit, beta;
};

// ops::swiglu_oai on device, in place into g.
__global__ void swiglu_oai_kernel(float* g, const float* u, int64_t n, Act p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gc = fminf(g[i], p.limit);
  const float uc = fminf(fmaxf(u[i], -p.limit), p.limit);
  g[i] = (uc + p.beta) * gc * (1.0f / (1.0f + expf(-p.alpha * gc)));
}

// One thread per token: sigmoid, selection by prob + bias (descending, ties to the lower id),
// then the unbiased probabilities of the chosen experts renormalised and scaled. The i-th
// pick is the best expert strictly after the (i-1)-th in that total order: no scratch.
__global__ void router_select_kernel(const float* logits, const float* bias, int64_t tokens, int experts, int top_k,
                                     float scale, int32_t* ids, float* weights) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float* lg = logits + t * experts;
  float prev_choice = INFINITY;
  int prev_id = -1;
  float sum = 0.0f;
  for (int i = 0; i < top_k; ++i) {
    int best = -1;
    float best_choice = -INFINITY;
    for (int e = 0; e < experts; ++e) {
      const float c = 1.0f / (1.0f + expf(-lg[e])) + (bias ? bias[e] : 0.0f);
      const bool after_prev = c < prev_choice || (c == prev_choice && e > prev_id);
      if (!after_prev) continue;
      if (best < 0 || c > best_choice) {
        best = e;
        best_choice = c;
      }
    }
    ids[t * top_k + i] = best;
    sum += 1.0f / (1.0f + expf(-lg[best]));
    prev_choice = best_choice;
    prev_id = best;
  }
  for (int i = 0; i < top_k; ++i) {
    const float p = 1.0f / (1.0f + expf(-lg[ids[t * top_k + i]]));
    weights[t * top_k + i] = p / sum * scale;
  }
}

__global__ void gather_rows_kernel(const float* x, const int32_t* rows, float* dst, int64_t hidden) {
  const int64_t i = blockIdx.x;
  const float* src = x + int64_t(rows[i]) * hidden;
  for (int64_t d = threadIdx.x; d < hidden; d += blockDim.x) dst[i * hidden + d] = src[d];
}

// out[t] = sum of w[a] * y[a] over token t's assignments, in the CPU's order (expert-major).
__global__ void combine_kernel(const float* y, const float* w, const int32_t* token_start, const int32_t* token_assign,
                               float* out, int64_t hidden) {
  const int64_t t = blockIdx.x;
  const int32_t begin = token_start[t], end = token_start[t + 1];
  for (int64_t d = threadIdx.x; d < hidden; d += blockDim.x) {
    float acc = 0.0f;
    for (int32_t i = begin; i < end; ++i) {
      const int32_t a = token_assign[i];
      acc = __fadd_rn(acc, __fmul_rn(w[a], y[int64_t(a) * hidden + d]));
    }
    out[t * hidden + d] = acc;
  }
}

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

void launch_swiglu(float* g, const float* u, int64_t n, const ops::SwigluParams& act) {
  if (n == 0) return;
  swiglu_oai_kernel<<<blocks_for(n, 256), 256>>>(g, u, n, Act{act.alpha, act.limit, act.beta});
  M3_CUDA_CHECK_LAUNCH();
}

std::string need_cuda_gemm_weight(const ops::Problem& p) {
  if (p.device != Device::kCuda) return "tensors are not in device memory";
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
    return "F32 or BF16 device weights (MXFP8 is dequantised to BF16 at load), got " + std::string(dtype_name(p.dtype));
  }
  return "";
}

std::string need_invariant_gemm(const ops::Problem& p) {
  if (!p.batch_invariant) return "batch invariance not requested (the cuBLAS entry is faster)";
  return need_cuda_gemm_weight(p);
}

std::string need_cublas_f32(const ops::Problem& p) {
  std::string why = need_cuda_gemm_weight(p);
  if (!why.empty()) return why;
  return p.dtype == DType::kF32 ? "" : "F32 weights only";
}

std::string need_cublas_bf16(const ops::Problem& p) {
  std::string why = need_cuda_gemm_weight(p);
  if (!why.empty()) return why;
  return p.dtype == DType::kBF16 ? "" : "BF16 weights only";
}

template <bool kInvariant>
void linear_entry(const TensorView& x, const ops::LinearWeight& w, const TensorView& y) {
  gemm_xwt(x.as<const float>(), x.shape[0], w, y.as<float>(), kInvariant);
}

template <bool kInvariant>
void dense_mlp_entry(const TensorView& x, const ops::LinearWeight& gate, const ops::LinearWeight& up,
                     const ops::LinearWeight& down, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t m = x.shape[0], inter = gate.out_features();
  if (m == 0) return;
  Scratch g(size_t(m * inter) * 4), u(size_t(m * inter) * 4);
  gemm_xwt(x.as<const float>(), m, gate, g.as<float>(), kInvariant);
  gemm_xwt(x.as<const float>(), m, up, u.as<float>(), kInvariant);
  launch_swiglu(g.as<float>(), u.as<const float>(), m * inter, act);
  gemm_xwt(g.as<const float>(), m, down, out.as<float>(), kInvariant);
}

void router_entry(const TensorView& x, const TensorView& router_w, const TensorView& bias,
                  const ops::RouterParams& params, const TensorView& expert_ids, const TensorView& expert_weights) {
  const int64_t tokens = x.shape[0], experts = router_w.shape[0];
  if (tokens == 0) return;
  Scratch logits(size_t(tokens * experts) * 4);
  // Fixed-order reduction: the choice never depends on the batch.
  gemm_xwt(x.as<const float>(), tokens, ops::LinearWeight{router_w, {}}, logits.as<float>(), true);
  const float* b = params.use_bias && bias.data ? bias.as<const float>() : nullptr;
  router_select_kernel<<<blocks_for(tokens, 128), 128>>>(logits.as<const float>(), b, tokens, int(experts),
                                                         params.top_k, params.routed_scale,
                                                         expert_ids.as<int32_t>(), expert_weights.as<float>());
  M3_CUDA_CHECK_LAUNCH();
}

template <bool kInvariant>
void moe_entry(const TensorView& x, const TensorView& expert_ids, const TensorView& expert_weights,
               const ops::ExpertWeights& experts, const ops::SwigluParams& act, const TensorView& out) {
  const int64_t tokens = x.shape[0], hidden = x.shape[1], top_k = expert_ids.shape[1];
  if (tokens == 0) return;
  const int total = experts.num_routed + (experts.has_shared ? 1 : 0);
  // The routing comes back to the host to size each expert's GEMM (a sync; a device-side
  // grouped GEMM is the next step).
  std::vector<int32_t> ids(size_t(tokens * top_k));
  std::vector<float> wts(size_t(tokens * top_k));
  M3_CUDA_CHECK(cudaMemcpy(ids.data(), expert_ids.data, ids.size() * 4, cudaMemcpyDeviceToHost));
  M3_CUDA_CHECK(cudaMemcpy(wts.data(), expert_weights.data, wts.size() * 4, cudaMemcpyDeviceToHost));
  // Permute as the CPU does: per expert, its rows in token order; the shared expert takes all.
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(total));
  std::vector<std::vector<float>> row_w(static_cast<size_t>(total));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < top_k; ++i) {
      const int32_t e = ids[size_t(t * top_k + i)];
      if (e < 0 || e >= experts.num_routed) throw std::runtime_error("moe_experts.sm90: expert id out of range");
      rows[size_t(e)].push_back(int32_t(t));
      row_w[size_t(e)].push_back(wts[size_t(t * top_k + i)]);
    }
    if (experts.has_shared) {
      rows[size_t(experts.num_routed)].push_back(int32_t(t));
      row_w[size_t(experts.num_routed)].push_back(1.0f);
    }
  }
  std::vector<int32_t> perm, expert_start(size_t(total) + 1, 0);
  std::vector<float> perm_w;
  for (int e = 0; e < total; ++e) {
    expert_start[size_t(e)] = int32_t(perm.size());
    perm.insert(perm.end(), rows[size_t(e)].begin(), rows[size_t(e)].end());
    perm_w.insert(perm_w.end(), row_w[size_t(e)].begin(), row_w[size_t(e)].end());
  }
  expert_start[size_t(total)] = int32_t(perm.size());
  // Per token, its assignments in expert order (the order the CPU adds them in).
  std::vector<int32_t> token_start(size_t(tokens) + 1, 0), token_assign(perm.size());
  for (int32_t r : perm) ++token_start[size_t(r) + 1];
  for (int64_t t = 0; t < tokens; ++t) token_start[size_t(t) + 1] += token_start[size_t(t)];
  std::vector<int32_t> fill(token_start.begin(), token_start.end() - 1);
  for (size_t a = 0; a < perm.size(); ++a) token_assign[size_t(fill[size_t(perm[a])]++)] = int32_t(a);

  const int64_t assigned = int64_t(perm.size());
  int64_t inter_max = 0;
  for (int e = 0; e < total; ++e) inter_max = std::max(inter_max, experts.gate[e].out_features());
  Scratch d_perm(perm.size() * 4), d_w(perm_w.size() * 4), d_tstart(token_start.size() * 4),
      d_tassign(token_assign.size() * 4), xg(size_t(assigned * hidden) * 4), yg(size_t(assigned * hidden) * 4),
      g(size_t(assigned * inter_max) * 4), u(size_t(assigned * inter_max) * 4);
  M3_CUDA_CHECK(cudaMemcpy(d_perm.as<void>(), perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  M3_CUDA_CHECK(cudaMemcpy(d_w.as<void>(), perm_w.data(), perm_w.size() * 4, cudaMemcpyHostToDevice));
  M3_CUDA_CHECK(cudaMemcpy(d_tstart.as<void>(), token_start.data(), token_start.size() * 4, cudaMemcpyHostToDevice));
  M3_CUDA_CHECK(cudaMemcpy(d_tassign.as<void>(), token_assign.data(), token_assign.size() * 4, cudaMemcpyHostToDevice));
  gather_rows_kernel<<<unsigned(assigned), 128>>>(x.as<const float>(), d_perm.as<const int32_t>(), xg.as<float>(),
                                                  hidden);
  M3_CUDA_CHECK_LAUNCH();
  for (int e = 0; e < total; ++e) {
    const int64_t begin = expert_start[size_t(e)], n = expert_start[size_t(e) + 1] - begin;
    if (n == 0) continue;
    const int64_t inter = experts.gate[e].out_features();
    const float* xe = xg.as<const float>() + begin * hidden;
    gemm_xwt(xe, n, experts.gate[e], g.as<float>(), kInvariant);
    gemm_xwt(xe, n, experts.up[e], u.as<float>(), kInvariant);
    launch_swiglu(g.as<float>(), u.as<const float>(), n * inter, act);
    gemm_xwt(g.as<const float>(), n, experts.down[e], yg.as<float>() + begin * hidden, kInvariant);
  }
  combine_kernel<<<unsigned(tokens), 128>>>(yg.as<const float>(), d_w.as<const float>(), d_tstart.as<const int32_t>(),
                                            d_tassign.as<const int32_t>(), out.as<float>(), hidden);
  M3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gemm_xwt(const float* x, int64_t m, const ops::LinearWeight& w, float* y, bool invariant) {
  const int64_t n = w.out_features(), k = w.in_features();
  if (m == 0 || n == 0) return;
  if (w.data.dtype != DType::kF32 && w.data.dtype != DType::kBF16) {
    throw std::runtime_error("gemm_xwt.sm90: weight dtype " + std::string(dtype_name(w.data.dtype)));
  }
  const bool bf16 = w.data.dtype == DType::kBF16;
  if (invariant) {
    const int64_t threads = m * n * 32;
    if (bf16) rowdot_kernel<<<blocks_for(threads, 256), 256>>>(x, w.data.as<const uint16_t>(), y, m, n, k);
    else rowdot_kernel<<<blocks_for(threads, 256), 256>>>(x, w.data.as<const float>(), y, m, n, k);
    M3_CUDA_CHECK_LAUNCH();
    return;
  }
  // Row-major y[m,n] = x[m,k] w[n,k]^T is column-major y^T = w x^T: (op T on w) x (op N on x).
  cublasHandle_t h = cublas_handle();
  const float one = 1.0f, zero = 0.0f;
  if (!bf16) {
    M3_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
    M3_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, w.data.as<const float>(),
                                int(k), x, int(k), &zero, y, int(n)));
    return;
  }
  Scratch hi(size_t(m * k) * 2), lo(size_t(m * k) * 2);
  split_bf16_kernel<<<blocks_for(m * k, 256), 256>>>(x, hi.as<__nv_bfloat16>(), lo.as<__nv_bfloat16>(), m * k);
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
  table.linear.add({"linear.rowdot_invariant.sm90",
                    "device F32/BF16 weight, batch-invariant: one warp per output, fixed-order fp32 reduction",
                    need_invariant_gemm, linear_entry<true>});
  table.linear.add({"linear.cublas_sgemm.sm90", "device F32 weight: cuBLAS SGEMM, pedantic math (no TF32)",
                    need_cublas_f32, linear_entry<false>});
  table.linear.add({"linear.cublas_bf16_hilo.sm90",
                    "device BF16 weight: F32 activations split into bf16 hi+lo, two cuBLAS BF16 GEMMs, fp32 accumulate",
                    need_cublas_bf16, linear_entry<false>});
  table.mlp.add({"dense_mlp.rowdot_invariant_swiglu_oai.sm90", "device F32/BF16 weights, batch-invariant",
                 need_invariant_gemm, dense_mlp_entry<true>});
  table.mlp.add({"dense_mlp.cublas_swiglu_oai.sm90",
                 "device F32 (SGEMM, pedantic) or BF16 (hi+lo BF16 GEMMs, fp32 accumulate) weights",
                 need_cuda_gemm_weight, dense_mlp_entry<false>});
  table.router.add({"moe_router.sigmoid_bias_topk.sm90",
                    "device F32 router weight and bias; fixed-order fp32 logits, one thread per token selects",
                    [](const ops::Problem& p) -> std::string {
                      std::string why = need_cuda_f32(p);
                      if (!why.empty()) return why;
                      if (p.extra < 1 || p.extra > p.n) return "top_k must be in [1, experts]";
                      return "";
                    },
                    router_entry});
  table.moe.add({"moe_experts.permuted_rowdot_invariant.sm90",
                 "device F32/BF16 expert weights, batch-invariant; routing read back to the host to permute; "
                 "shared expert as the last expert",
                 need_invariant_gemm, moe_entry<true>});
  table.moe.add({"moe_experts.permuted_cublas.sm90",
                 "device F32/BF16 expert weights via cuBLAS; routing read back to the host to permute; shared expert "
                 "as the last expert",
                 need_cuda_gemm_weight, moe_entry<false>});
}

}  // namespace m3::cuda
